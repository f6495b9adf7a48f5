"""The paper scheduler: an idealised FCFS chunked-prefill engine, step by step (SPEC §7).

:mod:`fuzzer.expectation` asks it how a trace would be served under a calibrated step
model and a scheduler assumption. Every step has a token budget; running decodes come
first (one token per sequence), then prefill chunks in first-come-first-served order,
first the partially prefilled running requests, then waiting ones, up to
``max_num_seqs``. A prefix shared with an earlier request of the same trace is a cache
hit once that request has computed the prefix's full KV blocks. Stretches of pure
decoding are computed many steps at once, float for float the same as one by one.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from fuzzer.errors import ConfigError
from fuzzer.trace import Request

if TYPE_CHECKING:
    from fuzzer.expectation import SchedulerAssumption, StepModel

# A trace whose paper schedule needs more steps than this is not a fuzzing input
# (a million steps is hours of decoding); stop rather than spin.
MAX_MODEL_STEPS = 1_000_000

# A stretch of pure decode steps with no end in sight (nobody decoding, a request that can
# never be admitted) is computed this many steps at a time, so memory stays small.
_DECODE_RUN_MAX = 65_536


@dataclass(frozen=True)
class PaperRequest:
    """One request as the paper scheduler serves it; times from its send, like a client's."""

    request_id: str
    #: When it arrived, offset from the start of the execution.
    arrival_s: float
    #: Arrival of each token (choice 0), measured from the request's send.
    token_times_s: tuple[float, ...]
    e2e_s: float
    cached_tokens: int
    #: The longest engine step while the request was in the system.
    max_step_s: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0]

    @functools.cached_property
    def max_itl_s(self) -> float | None:
        t = self.token_times_s
        return float(np.diff(np.array(t)).max()) if len(t) > 1 else None


def serve(
    requests: tuple[Request, ...],
    prefixes: Mapping[str, int],
    sent: Mapping[str, float],
    model: StepModel,
    assumption: SchedulerAssumption,
    lookahead: bool,
) -> dict[str, PaperRequest]:
    """Serve ``requests`` (arriving at their ``sent`` times, else their trace times); by id."""
    jobs = [
        Job(
            id=r.id,
            arrival_s=sent.get(r.id, r.at_ms / 1000.0),
            prompt=r.prompt_tokens,
            group=r.prefix,
            prefix=prefixes[r.prefix] if r.prefix else 0,
            out=r.cancel_after_tokens or r.max_tokens,
            n=r.n,
        )
        for r in requests
    ]
    return {j.id: j.paper(model) for j in schedule(jobs, model, assumption, lookahead=lookahead)}


@dataclass
class Job:
    """Mutable bookkeeping of one request inside the paper schedule."""

    id: str
    arrival_s: float
    prompt: int
    group: str | None
    prefix: int
    out: int
    n: int
    #: Cached tokens forced from outside (idle replay of a request that had hits); None = decide.
    forced_cached: int | None = None
    cached: int = 0
    computed: int = 0
    admitted: bool = False
    tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    finish_s: float | None = None
    max_step: float = 0.0
    #: When the engine sees it: arrival plus the frontend's per-prompt-token time.
    ready_s: float = 0.0

    @property
    def prefilled(self) -> bool:
        return self.admitted and self.computed >= self.prompt

    def paper(self, model: StepModel) -> PaperRequest:
        assert self.finish_s is not None and self.token_times
        shift = model.request_overhead_s - self.arrival_s
        return PaperRequest(
            request_id=self.id,
            arrival_s=self.arrival_s,
            token_times_s=tuple((np.array(self.token_times) + shift).tolist()),
            e2e_s=self.finish_s + shift,
            cached_tokens=self.cached,
            max_step_s=self.max_step,
        )


def _cacheable(job: Job, block: int) -> int:
    """Prompt tokens a prefix hit can cover: the prefix's full blocks, never the whole prompt."""
    full = (job.prefix // block) * block
    return min(full, ((job.prompt - 1) // block) * block)


def schedule(jobs: list[Job], model: StepModel, a: SchedulerAssumption, *, lookahead: bool = False) -> list[Job]:
    """Run the jobs through the paper scheduler; fills token times and finish times in place.

    With ``lookahead``, each step boundary of a busy engine falls up to one step-length
    later, just after the arrivals of that window, which then share the step: the most
    unlucky alignment a real engine's drifting boundaries can give.

    Stretches of pure decoding (nothing to prefill, nothing admissible, no arrival, no
    request finishing) are computed for many steps at once by :func:`_decode_run`; the
    result is the same, float for float, as stepping them one by one.
    """
    for j in jobs:
        j.ready_s = j.arrival_s + model.frontend_token_s * j.prompt
    order = sorted(jobs, key=lambda j: j.ready_s)  # stable: same-instant requests keep trace order
    pending = deque(order)
    waiting: deque[Job] = deque()
    running: list[Job] = []
    #: prefix group -> time its full blocks were computed (cache hits from then on).
    ready: dict[str, float] = {}
    t = order[0].ready_s if order else 0.0
    steps = 0
    last_dt = 0.0
    while pending or waiting or running:
        horizon = t
        if lookahead and running and pending and pending[0].ready_s <= t + last_dt:
            # The boundary may fall up to one step after the first new arrival.
            horizon = max(t, pending[0].ready_s + last_dt)
        while pending and pending[0].ready_s <= horizon:
            job = pending.popleft()
            waiting.append(job)
            t = max(t, job.ready_s)  # the step boundary falls after this arrival
        if not waiting and not running:
            t = pending[0].ready_s
            continue
        decoding = [j for j in running if j.prefilled]
        decode_seqs = sum(j.n for j in decoding)
        context = sum(j.n * (j.prompt + j.tokens) for j in decoding)
        budget = a.token_budget - decode_seqs
        if (
            len(decoding) == len(running)
            and (not waiting or budget <= 0 or decode_seqs + waiting[0].n > a.max_num_seqs)
            and steps < MAX_MODEL_STEPS
        ):
            # Nothing to prefill and nobody admissible: only decode steps until something changes.
            t, last_dt, done = _decode_run(
                t, last_dt, decoding, decode_seqs, context, waiting, running, pending, model,
                lookahead=lookahead, max_steps=MAX_MODEL_STEPS - steps,
            )
            steps += done
            _retire(running, t)
            continue
        chunks: list[tuple[Job, int]] = []
        for j in running:
            if not j.prefilled and budget > 0:
                c = min(j.prompt - j.computed, budget)
                chunks.append((j, c))
                budget -= c
        seqs = sum(j.n for j in running)
        while waiting and budget > 0 and seqs + waiting[0].n <= a.max_num_seqs:
            j = waiting.popleft()
            _admit(j, t, ready, a)
            running.append(j)
            seqs += j.n
            c = min(j.prompt - j.computed, budget)
            chunks.append((j, c))
            budget -= c
        prefill = sum(c for _, c in chunks)
        dt = model.step_s(prefill, decode_seqs, context)
        # Every request in the system during this step (or arriving while it runs) was exposed
        # to it: a step this long may sit between two of its tokens.
        for j in (*waiting, *running):
            j.max_step = max(j.max_step, dt)
        for j in pending:
            if j.ready_s >= t + dt:
                break
            j.max_step = max(j.max_step, dt)
        t += dt
        last_dt = dt
        steps += 1
        if steps > MAX_MODEL_STEPS:
            raise ConfigError(f"the trace needs more than {MAX_MODEL_STEPS} scheduler steps to model; shorten it")
        for j in decoding:
            j.tokens += 1
            j.token_times.append(t)
        for j, c in chunks:
            j.computed += c
            if j.group is not None and j.group not in ready and j.computed >= _cacheable(j, a.block_size) > 0:
                ready[j.group] = t
            if j.computed >= j.prompt:
                j.tokens = 1
                j.token_times.append(t)
        _retire(running, t)
    return jobs


def _retire(running: list[Job], t: float) -> None:
    """Finish (at ``t``) and remove the running requests that have all their tokens."""
    for j in [j for j in running if j.prefilled and j.tokens >= j.out]:
        j.finish_s = t
        running.remove(j)


def _decode_run(
    t: float,
    last_dt: float,
    decoding: list[Job],
    decode_seqs: int,
    context: int,
    waiting: deque[Job],
    running: list[Job],
    pending: deque[Job],
    model: StepModel,
    *,
    lookahead: bool,
    max_steps: int,
) -> tuple[float, float, int]:
    """Take the pure-decode steps from ``t`` on at once; returns (t, last_dt, steps taken).

    The run stops after the step in which the first decoding request gets its last
    token, or before the step at whose start the next arrival would be admitted to the
    waiting queue, whichever comes first (at least one step is taken: the caller found
    none admissible at ``t``). Step k has the context of step 0 plus k tokens of every
    decoding sequence; the times are accumulated in order, exactly as step-by-step.
    """
    left = min((j.out - j.tokens for j in decoding), default=None)
    count = min(max_steps, _DECODE_RUN_MAX if left is None else left)
    # overhead + prefill x 0 + decode: the same float operations, in the same order, as step_s.
    base = model.overhead_s + model.prefill_token_s * 0 + model.decode_seq_s * decode_seqs
    contexts = np.arange(count, dtype=np.float64)
    contexts *= decode_seqs
    contexts += context
    dts = base + model.context_token_s * contexts
    ends = np.cumsum(np.concatenate(([t], dts)))[1:]  # sequential: ends[k] = ends[k-1] + dts[k]
    if pending:
        # Step k >= 1 starts at ends[k-1]; the next arrival joins the queue there when it is
        # due (with lookahead: due within the previous step's length).
        due = ends[:-1] + dts[:-1] if lookahead and running else ends[:-1]
        late = np.flatnonzero(pending[0].ready_s <= due)
        if late.size:
            count = int(late[0]) + 1
            dts, ends = dts[:count], ends[:count]
    longest = float(dts.max())
    for j in (*waiting, *running):
        j.max_step = max(j.max_step, longest)
    if pending:
        # An arrival is exposed to every step that ends after it arrives.
        rising = bool(dts.min() > 0)
        tail_max = np.maximum.accumulate(dts[::-1])[::-1]
        for j in pending:
            if rising:
                k = int(np.searchsorted(ends, j.ready_s, side="right"))
                exposed = float(tail_max[k]) if k < count else None
            else:  # a fitted model with negative costs: step ends need not rise
                mask = ends > j.ready_s
                exposed = float(dts[mask].max()) if mask.any() else None
            if exposed is None:
                break
            j.max_step = max(j.max_step, exposed)
    times = ends.tolist()
    for j in decoding:
        j.tokens += count
        j.token_times.extend(times)
    return times[-1], float(dts[-1]), count


def _admit(job: Job, t: float, ready: Mapping[str, float], a: SchedulerAssumption) -> None:
    job.admitted = True
    if job.forced_cached is not None:
        job.cached = job.forced_cached
    elif a.prefix_caching and job.group is not None and ready.get(job.group, float("inf")) <= t:
        job.cached = _cacheable(job, a.block_size)
    job.computed = job.cached
