"""Order evidence: what one execution itself shows about the order the engine served requests in.

The FCFS bound of :mod:`fuzzer.oracle.expectation` is a model: it knows the engine's costs only
as well as the calibration measured them, on a machine that may be busier now. A first token
that came late because the engine was working, in order, on requests that reached it first is
by-design queueing whatever the model says those requests should have cost. The execution shows
when each of them got its first token, so that wait can be bounded without the model:

    a request that reached the engine after every request in ``ahead`` is admitted, by a
    first-come-first-served scheduler, no later than the step in which the last of them
    finishes its prefill (their first tokens), and no later than a slot frees when they
    hold every slot (their ends); its own first token follows within its own idle time.

``ahead`` holds the requests that surely reached the engine first: sent earlier by more than
the frontend's (tokenization) time could reorder them. Requests whose first token was not
observed (not streamed, failed) are left out of it, so the evidence never excuses a wait it
did not see. A request served after one that reached the engine later gets no excuse from it:
that is the ordering inversion a head-of-line bug is.

The observed bound only ever raises the FCFS bound: it can excuse a delay the model does not
explain, never create a candidate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fuzzer.execution import ExecutionResult, Outcome
from fuzzer.oracle.model import ENVELOPE_SCALES, FRONTEND_SLACK_S, SchedulerAssumption, StepModel
from fuzzer.trace import Trace

#: The evidence names a verdict reports.
MODEL = "fcfs-model"
ORDER = "observed-order"


@dataclass(frozen=True)
class OrderBound:
    """The observed FCFS bound of one request's TTFT, from the first tokens of those ahead of it."""

    request_id: str
    #: Seconds from the request's send: when FCFS would have given it its first token at the
    #: latest, given what the requests ahead of it observably got.
    ttft_s: float
    #: The request whose first token (or end, for a slot) the bound waited for; None when
    #: nothing ahead of it was still being served (the bound is its own idle time).
    waited_for: str | None = None


def order_bounds(
    trace: Trace,
    result: ExecutionResult,
    model: StepModel,
    assumption: SchedulerAssumption,
    idle_ttft_s: Mapping[str, float],
) -> dict[str, OrderBound]:
    """The observed FCFS bound of every request's TTFT (those with an idle expectation)."""
    requests = {r.id: r for r in trace.requests}
    seen = [r for r in result.requests if r.request_id in requests]
    scale_lo, scale_hi = min(ENVELOPE_SCALES), max(ENVELOPE_SCALES)

    def reached_by_latest(rid: str, sent_s: float) -> float:
        return sent_s + model.frontend_token_s * requests[rid].prompt_tokens * scale_hi

    def reached_at_earliest(rid: str, sent_s: float) -> float:
        return sent_s + max(0.0, model.frontend_token_s * requests[rid].prompt_tokens * scale_lo - FRONTEND_SLACK_S)

    # First token and end of every request whose first token was observed, as absolute offsets.
    observed = {
        r.request_id: (r.sent_s, r.sent_s + r.ttft_s, r.sent_s + r.e2e_s if r.e2e_s is not None else None)
        for r in seen
        if r.outcome is Outcome.OK and r.ttft_s is not None
    }
    out: dict[str, OrderBound] = {}
    for r in seen:
        idle = idle_ttft_s.get(r.request_id)
        if idle is None:
            continue
        arrival = reached_at_earliest(r.request_id, r.sent_s)
        ahead = [
            rid for rid, (sent, _, _) in observed.items()
            if rid != r.request_id and reached_by_latest(rid, sent) <= arrival
        ]
        start, waited_for = r.sent_s, None
        # Admission waits for every prefill ahead of it (FCFS admits in arrival order) ...
        for rid in ahead:
            first = observed[rid][1]
            if first > start:
                start, waited_for = first, rid
        # ... and for a free slot while those ahead hold every one of them.
        held = sorted(((observed[rid][2], rid) for rid in ahead if observed[rid][2] is not None and
                       observed[rid][2] > r.sent_s), key=lambda x: x[0])
        slots = assumption.max_num_seqs
        need = sum(requests[rid].n for _, rid in held) + requests[r.request_id].n - slots
        if need > 0:
            freed = 0
            for end, rid in held:
                freed += requests[rid].n
                if freed >= need:
                    if end > start:
                        start, waited_for = end, rid
                    break
        out[r.request_id] = OrderBound(r.request_id, start - r.sent_s + idle, waited_for)
    return out
