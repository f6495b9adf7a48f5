"""A cold start confirmed after idling, checked again on freshly started servers (issue 17).

A target that can start its server again (a launched one: ``fresh_start``) runs the trace
``policy.min_runs`` times, each on a server just started; those runs are judged as the cold
arm against the warm runs, and the verdict says whether a fresh server shows it too. A
cold start seen only after idling (clocks ramping down, caches evicted) and one seen on a
fresh server (lazy initialisation, compilation) are both kept; the detail tells them apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from fuzzer.execution import ExecutionResult, Target
from fuzzer.oracle.calibration import Calibration
from fuzzer.oracle.judge import RequestReport, latency_verdict
from fuzzer.oracle.kinds import FindingKind
from fuzzer.oracle.policy import OraclePolicy
from fuzzer.oracle.verdict import Verdict
from fuzzer.trace import Trace


async def on_fresh_servers(
    target: Target, trace: Trace, request_id: str, warm: Sequence[ExecutionResult], verdict: Verdict,
    calibration: Calibration, *, rng: np.random.Generator, policy: OraclePolicy,
    reports: Callable[[Sequence[ExecutionResult]], list[RequestReport]],
) -> Verdict:
    """``verdict`` (a cold-start found by idling) with what freshly started servers showed, when the target can."""
    fresh_start = getattr(target, "fresh_start", None)
    if fresh_start is None or verdict.kind is not FindingKind.COLD_START or not verdict.is_finding:
        return verdict
    fresh: list[ExecutionResult] = []
    for _ in range(policy.min_runs):
        await fresh_start()
        fresh.append(await target.execute(trace))
    every = [*warm, *fresh]
    marks = [False] * len(warm) + [True] * len(fresh)
    checked = latency_verdict(trace, request_id, reports(every), marks, calibration, rng, policy)
    shown = checked.kind is FindingKind.COLD_START and checked.is_finding
    note = (f"confirmed on {len(fresh)} freshly started servers too (p={checked.p_value:.2g})" if shown and
            checked.p_value is not None else
            "confirmed on freshly started servers too" if shown else
            f"not shown by {len(fresh)} freshly started servers ({checked.decision}): a slowdown after idling only")
    return replace(verdict, detail=f"{verdict.detail}; {note}" if verdict.detail else note)
