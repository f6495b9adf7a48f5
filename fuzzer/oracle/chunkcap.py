"""The long-prefill cap probe: how many prompt tokens a server computes for one request per step beside others.

vLLM's ``--long-prefill-token-threshold`` (off by default; the knob its maintainers answer
head-of-line reports with) caps the prompt tokens one request computes in a step while other
requests are running or waiting, so a long prompt takes more steps than the token budget
implies. Calibration's idle probes run one request at a time and never see it; this probe runs
a long prompt beside a decoding stream (ARCHITECTURE.md, "Oracle"). A cap it measures goes into
the scheduler assumption (``SchedulerAssumption.long_prefill_threshold``), which the paper
schedule then follows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from fuzzer.execution import Target
from fuzzer.oracle.calibration import Calibration
from fuzzer.oracle.expectation import idle_expectation
from fuzzer.oracle.kinds import Metric
from fuzzer.oracle.model import SchedulerAssumption, StepModel
from fuzzer.oracle.paper import serve
from fuzzer.oracle.policy import CANDIDATE_FACTOR, NOISE_MARGINS
from fuzzer.trace import Request, Trace

#: The probe: a prompt of this many token budgets (where the model length allows; at least 2)
#: sent while a short stream decodes, CAP_REPEATS times.
CAP_PROBE_BUDGETS = 3
CAP_REPEATS = 2
#: A cap is measured only when every run counts at least this many times the steps an uncapped
#: engine needs, and CAP_EXTRA_STEPS more (steps of the stream may fall between the prompt's send
#: and its arrival at the engine: a busy API server hands it over late) ...
CAP_EVIDENCE = 2.0
CAP_EXTRA_STEPS = 3
#: ... and the prompt's TTFT is the oracle's candidate factor times what the uncapped schedule
#: gives it, and the noise margin more: a cap that costs less than that makes no candidate either.
#: Caps below this many tokens a step are not looked for (the stream would be long).
MIN_CAP_TOKENS = 64


async def chunk_cap(target: Target, cal: Calibration, longest: int) -> int:
    """The long-prefill cap the target applies: prompt tokens per request per step beside others (0: none seen).

    A short stream decodes, then a prompt of CAP_PROBE_BUDGETS token budgets arrives, CAP_REPEATS
    times. A cap shows twice: every step gives the stream a token, so its tokens between the
    prompt's arrival at the engine (its send plus the modelled frontend time) and the prompt's
    first token count the prefill's steps, and the prompt's TTFT exceeds what the calibrated
    model gives it beside the stream. A cap is measured only when every run counts CAP_EVIDENCE
    times the steps an uncapped engine needs and CAP_EXTRA_STEPS more, and its TTFT is the
    candidate factor times the uncapped schedule's and the noise margin more; it is then the largest
    cap under which the schedule explains the quicker run's TTFT (no larger than the prompt
    over the steps counted). Where a cap costs little (prefill time dominated by tokens, not
    steps) it is not measured, and it changes the bounds little either.
    """
    model, assumption = cal.model, cal.assumption
    budget = assumption.token_budget
    prompt = min(CAP_PROBE_BUDGETS * budget, longest)
    if prompt < 2 * budget:
        return 0  # the model is too short for a prompt of several chunks
    uncapped = math.ceil(prompt / max(1, budget - 1))
    stream_tokens = math.ceil(prompt / MIN_CAP_TOKENS) + 32
    step = model.step_s(0, 1, 16)
    lead_s = idle_expectation(16, 2, model, assumption).ttft_s + 8 * step
    margin_s = NOISE_MARGINS * cal.noise_s.get(Metric.TTFT, 0.0)
    runs: list[tuple[float, int, dict[str, float], Trace]] = []
    for run in range(CAP_REPEATS):
        trace = Trace(requests=(
            Request(id="cs", at_ms=0.0, prompt_tokens=16, max_tokens=stream_tokens),
            Request(id="cl", at_ms=round(lead_s * 1000.0, 3), prompt_tokens=prompt, max_tokens=2),
        ), name=f"calibration-cap-{run}")
        result = await target.execute(trace)
        got = {r.request_id: r for r in result.requests}
        s, p = got.get("cs"), got.get("cl")
        if s is None or p is None or s.outcome.failed or p.outcome.failed or p.ttft_s is None or not s.token_times_s:
            return 0
        arrived = p.sent_s + model.frontend_s(prompt)
        first = p.sent_s + p.ttft_s + step / 2.0
        steps = sum(1 for t in s.token_times_s if arrived < s.sent_s + t <= first)
        if s.sent_s + s.token_times_s[-1] < first or steps < max(CAP_EVIDENCE * uncapped, uncapped + CAP_EXTRA_STEPS):
            return 0  # the stream ended first (no count), or no more steps than an uncapped engine's
        sent = {"cs": s.sent_s, "cl": p.sent_s}
        if p.ttft_s < CANDIDATE_FACTOR * _probe_ttft(trace, sent, model, assumption, 0) + margin_s:
            return 0  # no slower than an uncapped engine serves it
        runs.append((p.ttft_s, steps, sent, trace))
    ttft, _, sent, trace = min(runs, key=lambda run: run[0])  # the quicker run (tuples of dicts do not compare)
    # Counted steps are at most the prefill's (one may precede its arrival): the cap is at least prompt / fewest.
    lo, hi = max(MIN_CAP_TOKENS, prompt // min(r[1] for r in runs)), budget - 1
    if _probe_ttft(trace, sent, model, assumption, lo) < ttft - margin_s:
        return 0  # even the smallest cap the steps allow does not explain it: not a cap
    while hi - lo > 1:  # the schedule's TTFT falls as the cap grows
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _probe_ttft(trace, sent, model, assumption, mid) >= ttft - margin_s else (lo, mid)
    return lo


def _probe_ttft(trace: Trace, sent: Mapping[str, float], model: StepModel, assumption: SchedulerAssumption,
                cap: int) -> float:
    """The cap probe's long prompt's TTFT in the paper schedule under a cap (0: none)."""
    capped = replace(assumption, long_prefill_threshold=cap, kv_blocks=None)
    return serve(trace.requests, {}, sent, model, capped, False)["cl"].ttft_s
