"""The campaign's SLO check (``fuzz campaign --goodput``): an execution's worst request over the
user's SLO is re-run a bounded number of times and judged by :mod:`fuzzer.oracle.slo`.

It runs only when the execution left no scheduler-pathology candidate to confirm and none is
pending (:class:`fuzzer.search.confirming.Confirmer`), so SLO findings come beside the
scheduler kinds, never in their place. The execution that showed the miss is not counted:
MIN_SLO_RUNS fresh runs, then one more at a time while undecided, up to MAX_SLO_RUNS.
"""

from __future__ import annotations

from collections.abc import Callable

from fuzzer.execution import ExecutionResult, Target
from fuzzer.oracle.kinds import Decision, FindingKind
from fuzzer.oracle.signature import signature
from fuzzer.oracle.slo import MAX_SLO_RUNS, MIN_MISSES, Slo, verdicts
from fuzzer.oracle.verdict import Verdict
from fuzzer.trace import Trace

#: Fresh runs before the first judgement: the fewest that can make a violation.
MIN_SLO_RUNS = MIN_MISSES


def slo_candidates(trace: Trace, result: ExecutionResult, slo: Slo) -> list[tuple[str, str]]:
    """(request id, pre-signature) of every request over the SLO in ``result``, the furthest over first."""
    over = []
    for r in result.requests:
        name, ratio = slo.worst(r)
        if name is not None and ratio > 1.0:
            over.append((ratio, r.request_id, signature(FindingKind.SLO_VIOLATION, trace, r.request_id, slo=name)))
    return [(rid, key) for _, rid, key in sorted(over, key=lambda o: -o[0])]


async def confirm_slo(target: Target, trace: Trace, request_id: str, slo: Slo) -> Verdict | None:
    """Re-run ``trace`` (bounded) and judge ``request_id`` against the SLO; None when no run missed it."""
    results: list[ExecutionResult] = []
    verdict = None
    while len(results) < MAX_SLO_RUNS:
        want = MIN_SLO_RUNS if not results else 1
        for _ in range(want):
            results.append(await target.execute(trace))
        verdict = next((v for v in verdicts(trace, results, slo) if v.request_id == request_id), None)
        if verdict is None or verdict.decision is not Decision.UNKNOWN:
            break
    return verdict


def first_eligible(candidates: list[tuple[str, str]], skip: Callable[[str], bool]) -> tuple[str, str] | None:
    return next(((rid, key) for rid, key in candidates if not skip(key)), None)
