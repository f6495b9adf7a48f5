"""The model-free order check: a request served after one that arrived later.

Under first-come-first-served admission with a per-step token budget (vLLM's ``fcfs`` policy,
ARCHITECTURE.md, "Engines"), a request A that reached the engine before a request B, and that
needs no more of the engine than B (fewer or as many uncached prompt tokens, no larger
``max_tokens``, no more sequences), is admitted no later than B and finishes its prefill no
later than B's: its first token cannot come after B's. On an engine whose admissions stop at
the first waiting request they cannot schedule (vLLM v1: no budget, KV blocks or seat left
ends them, and a prompt admitted in part takes the rest of the budget;
``SchedulerAssumption.admission_stops``) that holds whatever B's size, as long as A's prefill
is not capped per step (its prompt within ``long_prefill_threshold``, where one is assumed:
a capped long prompt takes several steps while a short one passes it in one) and A has no more
sequences: B is admitted in A's last prefill step at the earliest. When an execution shows A's first
token clearly after B's, the scheduler decided an order FCFS never gives, and A paid for it:
that is what a head-of-line or ordering bug is, whatever the step costs were. No step model
decides it, so machine load and model error cannot be read as a scheduler pathology here.

What keeps the check to what FCFS really guarantees (each a reason not to call an inversion):

- Only engines whose documented policy is FCFS by arrival (``SchedulerAssumption.arrival_order``);
  llama.cpp's slots and TGI's batching are not held to it.
- A surely reached the engine first: sent at least ``policy.order_reach_s`` before B. B, with
  at least A's tokens, takes at least as long in the frontend; a B with fewer is sent that much
  and the calibrated frontend time of A's extra tokens (``StepModel.frontend_s``) later. The client's own stalls do not
  widen this: send times are stamped by the one event loop that then writes the request, and a
  stall holds back every send behind it, so requests leave in the order and at least at the
  spacing stamped (a stall delays what the client *receives*, hence the lead below).
- A B with fewer tokens is sent that much later again while the frontend may still be busy with
  the prompts sent before A (their calibrated frontend times one after another): a frontend that
  works them off first hands A and B to the engine close together, the smaller one first. On the
  built-in simulator six 8192-token prompts (clients gone within 80 ms) held every later request
  in its HTTP frontend: a 4096-token prompt and a 96-token one sent 48 ms apart reached its engine
  1.7 ms apart, the small one tokenized first, and an inversion was confirmed 4/5 (stop 54).
- B's uncached work is counted without its shared prefix (another member of its group may
  have put it in the prefix cache); A's with its whole prompt.
- A's first token came at least the latency margin (``policy.min_margin_s``) plus the client's
  worst stall after B's. Once. A stall cannot make a later event look earlier; it can stamp
  one of two events that were ready together late by its own length (the client descheduled
  between handling the two), and the worst stall the monitor measured bounds that: two first tokens of one step reach the client a few ms apart.
- Every request sent before A got its first token by B's (within that margin): B overtook A,
  not A's predecessors. When B overtook them too, A may have lost nothing (FCFS would have
  served them before A anyway: LIFO's middle request), and the earliest overtaken one is the
  victim. This also makes B's first token a fair bound: by then the engine had done the work
  FCFS puts before A (its predecessors' prefills) and B's, which is no less than A's.
- No preemption was reported and the KV cache never looked full: recompute preemption and
  retraction legitimately send an admitted request back to the queue.
- Both requests streamed (a non-streamed response has no first-token time), neither failed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from fuzzer.execution import ExecutionResult, Outcome, RequestResult
from fuzzer.oracle.calibration import Calibration
from fuzzer.oracle.model import StepModel
from fuzzer.oracle.policy import DEFAULT_POLICY, OraclePolicy
from fuzzer.trace import Request, Trace

#: Above this KV usage (a fraction) the cache counts as full for the order check: a full cache
#: is where engines preempt or retract, and some report it only as usage.
KV_FULL = 0.95
#: Tokens a chat template may add to a prompt (role markers, a system preamble): ChatML adds
#: about 10 to one user message; this leaves room for longer templates.
CHAT_TEMPLATE_TOKENS = 64


@dataclass(frozen=True)
class Inversion:
    """Request ``victim`` got its first token after ``overtakers``, which arrived later with no more work."""

    victim: str
    #: Every request that overtook the victim, earliest first token first.
    overtakers: tuple[str, ...]
    #: The victim's send time and first token, offsets from the execution's t0.
    sent_s: float
    first_token_s: float
    #: First token of the earliest overtaker.
    overtaker_first_s: float
    #: How much later than the victim the overtakers were sent, at the least.
    gap_s: float

    @property
    def lead_s(self) -> float:
        """How long after the earliest overtaker's first token the victim's came."""
        return self.first_token_s - self.overtaker_first_s

    @property
    def bound_s(self) -> float:
        """The victim's TTFT had it been served no later than its earliest overtaker."""
        return self.overtaker_first_s - self.sent_s

    def describe(self) -> str:
        first, *others = self.overtakers
        also = f" (and after {', '.join(others)})" if others else ""
        return (f"first token {self.lead_s * 1000:.0f} ms after that of {first}{also}, sent at least "
                f"{self.gap_s * 1000:.0f} ms later")


def inversions(
    trace: Trace, result: ExecutionResult, calibration: Calibration, preempted: bool,
    policy: OraclePolicy = DEFAULT_POLICY,
) -> dict[str, Inversion]:
    """The requests of ``result`` that FCFS would have served before a request that overtook them.

    ``preempted``: the server reported preemptions during the execution (then nothing is called).
    """
    if not calibration.assumption.arrival_order or preempted or kv_full(result):
        return {}
    planned = {r.id: r for r in trace.requests}
    timed = [(planned[r.request_id], r) for r in result.requests
             if r.request_id in planned and _first_token(r) is not None]
    assumption, model = calibration.assumption, calibration.model
    stops = assumption.admission_stops

    def reach(a_req: Request, b_req: Request) -> float | None:
        """How much later than A request B must be sent to have passed it against FCFS (None: it may pass)."""
        if no_more_work(a_req, b_req, trace.prefixes):
            return policy.order_reach_s
        if stops and first_served(a_req, b_req, assumption.long_prefill_threshold):
            tokens = _template(a_req, b_req) + a_req.prompt_tokens
            return (policy.order_reach_s + held.get(a_req.id, 0.0)
                    + max(0.0, model.frontend_s(tokens) - model.frontend_s(b_req.prompt_tokens)))
        return None

    held = frontend_backlog_s(trace, result, model)
    lead = policy.min_margin_s + (result.client_lag_s or 0.0)
    found: dict[str, Inversion] = {}
    for a_req, a in timed:
        a_first = _first_token(a)
        assert a_first is not None
        # The last first token of a request sent before A: an overtaker must come after it.
        before = max((f for _, p in timed if p.sent_s < a.sent_s and (f := _first_token(p)) is not None),
                     default=-math.inf)
        over = [
            (b_first, b_req.id, b.sent_s - a.sent_s)
            for b_req, b in timed
            if b.sent_s > a.sent_s
            and (b_first := _first_token(b)) is not None
            and a_first - b_first >= lead
            and before <= b_first + lead
            and (need := reach(a_req, b_req)) is not None
            and b.sent_s - a.sent_s >= need
        ]
        if over:
            over.sort()
            found[a_req.id] = Inversion(a_req.id, tuple(name for _, name, _ in over), a.sent_s, a_first,
                                        over[0][0], min(gap for _, _, gap in over))
    return found


def frontend_backlog_s(trace: Trace, result: ExecutionResult, model: StepModel) -> dict[str, float]:
    """How long each sent request of ``result`` may wait for the frontend work of those sent before it, their
    calibrated frontend times (``StepModel.frontend_s``) done one after another from their sends."""
    planned = {r.id: r for r in trace.requests}
    free, held = -math.inf, {}
    for r in sorted((r for r in result.requests if r.request_id in planned and r.sent_s is not None),
                    key=lambda r: r.sent_s):
        start = max(r.sent_s, free)
        held[r.request_id] = start - r.sent_s
        free = start + model.frontend_s(planned[r.request_id].prompt_tokens)
    return held


def no_more_work(a: Request, b: Request, prefixes: Mapping[str, int]) -> bool:
    """Does ``a`` need no more of the engine than ``b`` before and after its first token?

    A chat request's prompt is wrapped in the model's chat template on the server, so against
    a completion it is given CHAT_TEMPLATE_TOKENS more: with a per-request chunk cap (vLLM's
    long_prefill_token_threshold) a few tokens more can cost a whole step more.
    """
    cached = prefixes.get(b.prefix, 0) if b.prefix else 0
    return (a.prompt_tokens + _template(a, b) <= b.prompt_tokens - cached and a.max_tokens <= b.max_tokens
            and a.n <= b.n)


def first_served(a: Request, b: Request, cap: int) -> bool:
    """On an engine whose admissions stop at the first request they cannot schedule, is ``a`` (sent
    first) served its first token no later than ``b``, whatever their sizes?

    Unless a per-step cap on its prompt tokens (``cap``, 0: none) makes its prefill take steps in
    which ``b`` is admitted and prefilled (its whole prompt counted: its cached prefix may not be),
    or it has more sequences than ``b`` (its first choice may wait for seats its others take).
    """
    return a.n <= b.n and not (cap and a.prompt_tokens + _template(a, b) > cap)


def cap_dependent(trace: Trace, inversion: Inversion) -> int | None:
    """The victim's prompt tokens (its chat template's included) when ``inversion`` stands only where prompts of
    that size are not capped per step: every overtaker had less work and passed it only as admissions that stop
    forbid (:func:`first_served`), which a long-prefill cap below the victim's prompt allows by design. None when
    an overtaker had no less work (no cap lets it pass)."""
    planned = {r.id: r for r in trace.requests}
    victim, overtakers = planned[inversion.victim], [planned[b] for b in inversion.overtakers]
    if any(no_more_work(victim, b, trace.prefixes) for b in overtakers):
        return None
    return victim.prompt_tokens + max(_template(victim, b) for b in overtakers)


def _template(a: Request, b: Request) -> int:
    """Tokens ``a``'s chat template may add over ``b``'s prompt (0 unless only ``a`` is a chat request)."""
    return CHAT_TEMPLATE_TOKENS if a.api == "chat" and b.api != "chat" else 0


def kv_full(result: ExecutionResult) -> bool:
    """Did the server report a (nearly) full KV cache at any point of the execution?"""
    return any(s.values.get("kv_usage", 0.0) >= KV_FULL for s in result.samples)


def _first_token(r: RequestResult) -> float | None:
    """When ``r``'s first token arrived (offset from t0), for streamed requests that got one."""
    if r.outcome not in (Outcome.OK, Outcome.CANCELLED) or r.ttft_s is None:
        return None
    return r.sent_s + r.ttft_s
