"""Known scheduling bugs planted into the real vLLM engine, for testing the fuzzer against ground truth.

Each class is a subclass of vLLM's V1 ``Scheduler`` (the one the CPU platform uses: it turns
async scheduling off) that changes only *which* requests the stock ``schedule()`` gets to
see in a step: it reorders or hides entries of ``self.waiting`` / ``self.running`` for the
duration of the call and puts them back afterwards. No vLLM code is copied; the engine, its
token budget, chunked prefill, KV cache and preemption are the real ones. Each bug is
deterministic (a function of the queue state at the start of a step) and mirrors one of the
simulator's pathologies (``fuzzer/sim/pathologies.py``).

Select one by its qualified name; the module must be importable by the server process, e.g.

    PYTHONPATH=tests/vllm_cpu python -m vllm.entrypoints.openai.api_server --model DIR \\
        --scheduler-cls planted.HolLongestFirst ...

(vLLM resolves ``--scheduler-cls`` with ``resolve_obj_by_qualname`` in the engine-core process,
which inherits PYTHONPATH.) The classes assume the default ``fcfs`` policy.

============================  ==================================================================
class                          bug (victim)
============================  ==================================================================
``HolLongestFirst``            vLLM #37308 / sim ``hol-prefix-burst``: inside a burst of requests
                               sharing a prompt prefix, the longest is admitted first and every
                               shorter member (and everything queued behind it) is held until no
                               longer member is waiting or in prefill. Victim: the short requests
                               of the burst (their TTFT grows by the longer members' prefills).
``DecodeStarvation``           sim ``unchunked-prefill`` (vLLM PR #10235, llama.cpp #4216): while a
                               prefill is pending (a request waits or is part-way through its
                               prompt) running decodes are left out of the step, at most
                               ``MAX_STARVED_STEPS`` steps in a row. Victim: every running stream
                               (an inter-token gap as long as the whole prefill).
``LifoAdmission``              an ordering inversion: requests that wait together are admitted
                               newest first (LIFO instead of FCFS). Victim: the earliest arrival
                               of a group that queued together (admitted last).
============================  ==================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

__all__ = ["DecodeStarvation", "HolLongestFirst", "LifoAdmission", "PLANTED"]

# Requests whose first PREFIX_KEY_TOKENS prompt tokens are equal belong to one prefix group.
PREFIX_KEY_TOKENS = 16
# DecodeStarvation skips running decodes for at most this many consecutive steps.
MAX_STARVED_STEPS = 32


def _prefilling(request: Request) -> bool:
    """True while the request has prompt tokens left to compute."""
    return request.num_computed_tokens < request.num_prompt_tokens


class _Planted(Scheduler):
    """The stock scheduler, with helpers to show ``schedule()`` a planted view of its queues."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.policy is not SchedulingPolicy.FCFS:
            raise ValueError(f"{type(self).__name__} plants its bug into the fcfs policy, not {self.policy}")

    def _schedule_waiting_as(self, arrange: Callable[[list[Request]], tuple[list[Request], list[Request]]], *args, **kwargs):
        """Run the stock ``schedule()`` with ``self.waiting`` arranged by ``arrange``.

        ``arrange(waiting)`` returns (shown, held): the requests the step may admit, in the
        order it sees them, and those it may not. Afterwards the queue is restored: requests
        the step put into it (preempted ones, at the front as vLLM puts them), then the
        step's leftovers and the held ones, in their order before the step.
        """
        before = list(self.waiting)
        shown, held = arrange(before)
        assert sorted(map(id, shown + held)) == sorted(map(id, before)), "arrange must partition the queue"
        self._replace_waiting(shown)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            rank = {id(r): i for i, r in enumerate(before)}
            after = list(self.waiting)
            new = [r for r in after if id(r) not in rank]
            old = sorted((r for r in after if id(r) in rank), key=lambda r: rank[id(r)])
            old = sorted(old + held, key=lambda r: rank[id(r)])
            self._replace_waiting(new + old)

    def _replace_waiting(self, requests: Iterable[Request]) -> None:
        # FCFSRequestQueue is a deque: refill it in place (other code holds no other reference).
        self.waiting.clear()
        self.waiting.extend(requests)


class HolLongestFirst(_Planted):
    """Longest-first admission inside a shared-prefix burst; shorter members are held (vLLM #37308).

    At every step the waiting queue is shown to the stock scheduler with each prefix group
    (equal first ``PREFIX_KEY_TOKENS`` prompt tokens) ordered longest prompt first, in the
    places its members held. A waiting request is held while a longer member of its group is
    waiting or running with prompt tokens still to compute; admission stops at the first held
    request (the queue is cut there), as FCFS stops at a request that does not fit.
    """

    def schedule(self, *args, **kwargs):
        return self._schedule_waiting_as(self._arrange, *args, **kwargs)

    def _arrange(self, waiting: list[Request]) -> tuple[list[Request], list[Request]]:
        def key(r: Request) -> tuple[int, ...]:
            return tuple(r.prompt_token_ids[:PREFIX_KEY_TOKENS]) if r.prompt_token_ids is not None else (id(r),)

        groups: dict[tuple[int, ...], list[Request]] = {}
        for r in waiting:
            groups.setdefault(key(r), []).append(r)
        # Each group's slots in the queue, refilled longest first (stable among equal lengths).
        longest_first = {k: iter(sorted(g, key=lambda r: -r.num_prompt_tokens)) for k, g in groups.items()}
        ordered = [next(longest_first[key(r)]) for r in waiting]
        prefilling = [r for r in self.running if _prefilling(r)]
        for index, r in enumerate(ordered):
            rivals = [o for o in (*groups[key(r)], *prefilling) if o is not r and key(o) == key(r)]
            if any(o.num_prompt_tokens > r.num_prompt_tokens for o in rivals):
                return ordered[:index], ordered[index:]
        return ordered, []


class LifoAdmission(_Planted):
    """Requests that wait together are admitted newest first (an ordering inversion).

    At every step the waiting queue is shown to the stock scheduler in reverse arrival order
    (latest ``arrival_time`` first). Preempted requests are waiting too and are ordered the
    same way. A request arriving alone is served as before; the earliest of several requests
    that queued together (behind a long prefill, or a full batch) is admitted last.
    """

    def schedule(self, *args, **kwargs):
        return self._schedule_waiting_as(
            lambda waiting: (sorted(waiting, key=lambda r: (-r.arrival_time, r.request_id)), []), *args, **kwargs
        )


class DecodeStarvation(_Planted):
    """Running decodes are left out of every step while a prefill is pending (a stalled stream).

    At the start of a step, if any request is waiting or is running with prompt tokens still
    to compute, the running requests that are past their prompt (decoding) are taken out of
    ``self.running`` for the stock ``schedule()`` call and put back, in their places, after it:
    the step's budget goes to prefills only. A stream is starved for at most
    ``MAX_STARVED_STEPS`` consecutive steps, and never while hiding it could let the batch
    grow past ``max_num_seqs``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._starved_steps = 0

    def schedule(self, *args, **kwargs):
        decoding = [r for r in self.running if not _prefilling(r)]
        prefill_pending = bool(self.waiting) or any(_prefilling(r) for r in self.running)
        fits = len(self.running) + len(self.waiting) <= self.max_num_running_reqs
        if not (decoding and prefill_pending and fits and self._starved_steps < MAX_STARVED_STEPS):
            self._starved_steps = 0
            return super().schedule(*args, **kwargs)
        self._starved_steps += 1
        before = list(self.running)
        hidden = {id(r) for r in decoding}
        self.running[:] = [r for r in before if id(r) not in hidden]
        try:
            return super().schedule(*args, **kwargs)
        finally:
            rank = {id(r): i for i, r in enumerate(before)}
            still = {id(r) for r in self.running}
            kept = [r for r in before if id(r) in hidden or id(r) in still]
            added = [r for r in self.running if id(r) not in rank]
            self.running[:] = kept + added


#: The planted classes by name (for ``--scheduler-cls planted.NAME``).
PLANTED = {cls.__name__: cls for cls in (HolLongestFirst, DecodeStarvation, LifoAdmission)}
