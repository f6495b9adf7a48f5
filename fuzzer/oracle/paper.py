"""The paper scheduler: an idealised FCFS chunked-prefill engine, step by step (ARCHITECTURE.md, "Oracle").

:mod:`fuzzer.oracle.expectation` asks it how a trace would be served under a calibrated step
model and a scheduler assumption. Every step has a token budget; running decodes come
first (one token per sequence), then prefill chunks in first-come-first-served order,
first the partially prefilled running requests, then waiting ones, up to
``max_num_seqs``. A prefix shared with an earlier request of the same trace and API is a
cache hit once that request has computed the prefix's full KV blocks (a chat template's tokens come first
in a chat request's prompt; a slot's cache: until another request is admitted, ``slot_cache``).
Stretches of pure decoding are computed many steps at once, float for float the same as one by one.

A request asking for more choices (``n``) than ``max_num_seqs`` sequences is served in
waves, as an engine that fans the choices out into sequences does: the first
``max_num_seqs`` choices (choice 0 among them: its tokens are the ones a client times)
run as the request, the rest queue behind it as further requests with the same prompt
and arrival, each taking a free slot when there is one; the request ends with its last
wave. A later wave recomputes the prompt (an upper bound: a prefix cache may keep it).

With a KV capacity (``kv_blocks``, read from the server: vLLM's ``cache_config_info``),
the schedule also holds KV blocks, as vLLM v1 does: a request holds the blocks of the
tokens it has computed (each further choice its own output blocks); a waiting request is
admitted only when its chunk's blocks fit with one block of headroom per running
request; when a running request's decode or chunk needs a block that is not free, the
newest running request is preempted (recompute): its blocks are freed, it goes back to
the front of the waiting queue and, re-admitted, recomputes its prompt and the tokens
it had generated before its next token. A prefix group's resident blocks are counted once,
and a member admitted while they are resident needs free blocks only for the rest of its
chunk (:mod:`fuzzer.oracle.kvblocks`): an engine that refuses it for want of blocks it would
share delays it beyond the bound. By-design preemption delays are inside the bound. Without a capacity
the KV cache never runs out."""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from fuzzer.errors import ConfigError
from fuzzer.oracle.decoding import decode_run
from fuzzer.oracle.kvblocks import KVBlocks
from fuzzer.oracle.model import FRONTEND_SLACK_S
from fuzzer.trace import Request

if TYPE_CHECKING:
    from fuzzer.oracle.model import SchedulerAssumption, StepModel

# A trace whose paper schedule needs more steps than this is not a fuzzing input
# (a million steps is hours of decoding); stop rather than spin.
MAX_MODEL_STEPS = 1_000_000
#: A request whose client disconnects leaves the engine at the first step boundary this long after
#: (``SchedulerAssumption.aborts_on_disconnect``): the API server hears of the disconnect and aborts
#: the request, which the engine applies between steps (vLLM: ``with_cancellation``, then the engine
#: core's abort). Generous, so a server that takes a little longer is not held to a faster abort.
ABORT_AFTER_S = 0.05



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
    #: Times the request was preempted for KV blocks (0 without a KV capacity).
    preemptions: int = 0
    #: Further preemptions an engine that re-admits a preempted prompt chunk by chunk may make
    #: of it (see :meth:`fuzzer.oracle.kvblocks.KVBlocks.preempt`): by design, not thrash.
    churn: int = 0
    #: (preemptions + churn) counted per sequence: x n for a request of n choices (per choice already
    #: in the fan-out schedule, where each choice is a job of its own).
    preempted_sequences: int = 0
    #: (start, duration) of each step that computed a chunk of its prompt, in execution time
    #: (not from its send): a step that long happens at that moment.
    chunk_steps: tuple[tuple[float, float], ...] = ()
    #: n in waves (fan-out, or beyond max_num_seqs): the last wave's first token after choice 0's, by design.
    choice_wait_s: float = 0.0

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
    window: float = 1.0,
    kv_blocks: int | None = None,
    **flags: bool,
) -> dict[str, PaperRequest]:
    """Serve ``requests`` (arriving at their ``sent`` times, else their trace times); by id.

    ``kv_blocks``: the KV capacity in blocks of ``assumption.block_size`` (None: unlimited); ``flags``: :func:`schedule`'s.
    """
    jobs = [
        Job(
            id=r.id,
            arrival_s=sent.get(r.id, r.at_ms / 1000.0),
            prompt=r.prompt_tokens,
            # A chat request's prompt starts with its template's tokens: its blocks share nothing with a
            # completion's of the same prefix (heldout10, clean: a chat member of a completions group held
            # to the group's cache hit, 9x its bound), only with other chat requests'.
            group=f"{r.prefix}:{r.api}" if r.prefix else None,
            prefix=prefixes[r.prefix] if r.prefix else 0,
            out=r.cancel_after_tokens or r.max_tokens,
            n=r.n,
            abort_s=(sent.get(r.id, r.at_ms / 1000.0) + r.disconnect_after_ms / 1000.0 + ABORT_AFTER_S
                     if assumption.aborts_on_disconnect and r.disconnect_after_ms is not None else None),
        )
        for r in requests
    ]
    done = schedule(jobs, model, assumption, lookahead=lookahead, window=window, kv_blocks=kv_blocks, **flags)
    return {j.id: j.paper(model) for j in done}


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
    #: When the engine drops it because its client disconnected (serve: ABORT_AFTER_S after the
    #: client leaves); None: it is served to its end.
    abort_s: float | None = None
    cached: int = 0
    computed: int = 0
    admitted: bool = False
    tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    finish_s: float | None = None
    max_step: float = 0.0
    #: When the engine sees it: arrival plus the frontend's per-prompt-token time.
    ready_s: float = 0.0
    #: Generated tokens to recompute after a preemption (prefilled again with the prompt).
    recompute: int = 0
    #: KV blocks held (only with a KV capacity), of them the prefix blocks another request pays for
    #: (fuzzer.oracle.kvblocks), and preemptions suffered.
    held: int = 0
    shared: int = 0
    preemptions: int = 0
    churn: int = 0
    #: (preemptions + churn) x the choices the job held each time: a server counts a preemption per
    #: sequence (vLLM v1 splits n into child requests).
    preempted_sequences: int = 0
    chunk_steps: list[tuple[float, float]] = field(default_factory=list)
    last_choice: float = -math.inf  # its last wave's first token (PaperRequest.choice_wait_s)

    @property
    def prefilled(self) -> bool:
        return self.admitted and self.computed >= self.prompt + self.recompute

    def paper(self, model: StepModel) -> PaperRequest:
        assert self.finish_s is not None and (self.token_times or self.abort_s is not None)
        shift = model.request_overhead_s - self.arrival_s
        times = (np.array(self.token_times or [self.finish_s]) + shift).tolist()  # aborted before a token: none came
        return PaperRequest(
            request_id=self.id,
            arrival_s=self.arrival_s,
            token_times_s=tuple(times),
            e2e_s=self.finish_s + shift,
            cached_tokens=self.cached,
            max_step_s=self.max_step,
            preemptions=self.preemptions,
            churn=self.churn,
            preempted_sequences=self.preempted_sequences,
            chunk_steps=tuple(self.chunk_steps), choice_wait_s=max(0.0, (self.last_choice + shift) - times[0]),
        )


def _cacheable(job: Job, block: int) -> int:
    """Prompt tokens a prefix hit can cover: the prefix's full blocks, never the whole prompt."""
    full = (job.prefix // block) * block
    return min(full, ((job.prompt - 1) // block) * block)


def schedule(
    jobs: list[Job],
    model: StepModel,
    a: SchedulerAssumption,
    *,
    lookahead: bool = False,
    window: float = 1.0,
    kv_blocks: int | None = None,
    fifo_frontend: bool = False,
    shared_frontend: bool = False,
    sends_only: bool = False,
    one_long: bool = False,
    fanout: bool = False,
    forks: bool = False,
    primes: bool = False,
    partial_hits: bool = False,
    whole: bool = False,
    cap_alone: bool = False,
) -> list[Job]:
    """Run the jobs through the paper scheduler; fills token times and finish times in place.

    With ``lookahead``, each step boundary of a busy engine that an arrival is due within
    one step of falls later, just after the arrivals of ``window`` step-lengths from the
    first of them, which then share the step: ``window=1`` is the most unlucky alignment
    for a request that a later arrival's chunk joins; ``window=0`` puts the boundary just
    after the first arrival, so one that comes a little later waits out that step.

    Stretches of pure decoding (nothing to prefill, nothing admissible, no arrival, no
    request finishing) are computed for many steps at once by :func:`fuzzer.oracle.decoding.decode_run`; the
    result is the same, float for float, as stepping them one by one.

    ``kv_blocks``: the KV capacity (see the module's docstring); None, unlimited.

    ``fifo_frontend``: the frontend tokenizes one request at a time in arrival order (a request
    reaches the engine after those sent before it, plus its own tokenization), as vLLM's API
    server was measured to: four 4096-token prompts and then four 64-token ones sent within
    1 ms reached its engine in that order. Otherwise each request's tokenization delays only
    itself, and a short prompt sent a moment after a long one may reach the engine first.

    ``shared_frontend`` (with ``fifo_frontend``): the frontend and the engine share one thread,
    and a step starts only once the frontend has handled every request that reached it: a
    burst's tokenization holds up the steps of the requests before it (the simulator's one
    event loop; a one-process server), and a step ending while it is busy sends its tokens when
    it is done (the held-out server: a first token 2.5x late behind a burst 30 ms after it), and so
    does a step ending up to FRONTEND_SLACK_S before the frontend gets busy (a step's end on paper
    is a little off the engine's).
    Pure decoding is held up as much (a clean held-out server's three streams went 52 ms without a
    token while its thread tokenized a burst of 2k-token prompts).
    ``sends_only`` (with ``shared_frontend``): the engine steps on its own (its process, or a device's time),
    and the frontend's thread holds only the sends (vLLM v1's API server streams what its engine core
    computed): heldout3, clean, served a short prompt sent with another in a step of its own and sent its
    first token 76-128 ms late, held while a 26k-token prompt that came during that step was tokenized.

    With a long-prefill threshold (``a.long_prefill_threshold`` > 0), a request computes at most
    that many prompt tokens in a step while others are running or waiting (vLLM v1's
    ``--long-prefill-token-threshold``). ``one_long`` (with a threshold): at most one prompt
    longer than the threshold is in partial prefill at a time; a waiting one beyond it is passed
    over by shorter ones behind it (vLLM v0's ``--max-long-partial-prefills 1``). ``cap_alone``: the
    cap applies to a request alone too (vLLM v1 caps every request's new tokens so).

    ``fanout``: every choice of a request asking for ``n`` > 1 is a request of its own that
    computes the prompt (waves of one choice, queued behind choice 0), as an engine does that
    splits ``n`` into child requests which share only prefix blocks already computed: the held-out
    vLLM-like server prefilled an n=8 request's 256-token prompt eight times in one step. vLLM v1
    splits ``n`` too, but shares a prompt repeated within a batch. ``forks`` (with ``fanout``): the later
    choices join the queue only when choice 0 gets its first token, behind every request that came
    before, as an engine does that forks ``n`` after choice 0's prefill: on heldout6, clean, a 4-choice
    request's later choices waited for a seat behind a 2048-token prompt sent 0.5 s after them but
    before choice 0's first token (0.45 s gaps in its stream, 3x the bound that queued them at arrival).
    ``primes`` (implies ``forks``): choice 0 too; the prompt is first computed by a request of its own
    (one token, never sent), then all ``n`` choices join the queue, each hitting the prompt's full
    blocks (SGLang, ``SchedulerAssumption.primes_choices``); the stream's first token is its first choice's.

    ``whole``: chunked prefill off (vLLM's ``--no-enable-chunked-prefill``, a budget of at least the
    context): a waiting request is admitted only when its whole uncached prompt fits what the step's
    budget has left, else admissions stop there; a prompt longer than the whole budget is still chunked
    (no engine runs it whole; the schedule must end).
    ``partial_hits``: a prefix group's member admitted while another member is still computing the
    prefix hits the full blocks computed so far and computes the rest itself, as vLLM v1 does (its
    blocks are cached as they are scheduled); otherwise it hits nothing until the whole prefix is
    computed. Under KV pressure the partial hit admits it sooner, as the newest request: on heldout9,
    a prompt sharing a 3888-token prefix sent during its owner's prefill was preempted and got its
    first token 9.7x later than the schedule that held it back until the prefix was complete.
    """
    kv = (KVBlocks(kv_blocks, a.block_size, a.token_budget, whole_readmission=a.prefix_caching,
                   chunk=a.long_prefill_threshold) if kv_blocks is not None else None)
    primed: dict[int, list[Job]] = {}  # ``primes``: id(job) -> its choices, queued once it computed the prompt
    for j in jobs if primes else ():
        if j.n > 1:
            full = (j.prompt - 1) // a.block_size * a.block_size if a.prefix_caching else 0
            primed[id(j)] = [Job(id=j.id, arrival_s=j.arrival_s, prompt=j.prompt, group=None, prefix=0, out=j.out,
                                 n=1, forced_cached=full, abort_s=j.abort_s) for _ in range(j.n)]
            j.n, j.out = 1, 1
    waves = {**_waves(jobs, 1 if fanout else a.max_num_seqs), **primed}
    forks = forks or primes
    forked = dict(waves) if forks else {}  # id(job) -> its later choices not yet forked (``forks``)
    queued = list(jobs) if forks else [w for j in jobs for w in (j, *waves.get(id(j), ()))]
    free = -math.inf
    busy: deque[list[float]] = deque()  # the frontend's busy periods, [start, end], when it shares the engine's thread
    for j in sorted(jobs, key=lambda j: j.arrival_s):  # stable: same-instant requests keep trace order
        start = max(j.arrival_s, free) if fifo_frontend else j.arrival_s
        j.ready_s = start + model.frontend_s(j.prompt)
        if shared_frontend and j.ready_s > start:
            if busy and start <= busy[-1][1]:
                busy[-1][1] = max(busy[-1][1], j.ready_s)
            else:
                busy.append([start, j.ready_s])
        free = j.ready_s
        for w in waves.get(id(j), ()):  # later waves of n: the same prompt, tokenized once
            w.ready_s = j.ready_s
    order = sorted(queued, key=lambda j: j.ready_s)  # stable: same-instant requests keep trace order
    pending = deque(order)
    waiting: deque[Job] = deque()
    running: list[Job] = []
    #: prefix group -> time its full blocks were computed (cache hits from then on).
    ready: dict[str, float] = {}
    #: prefix group -> its full blocks' tokens computed so far by a running member (partial_hits).
    progress: dict[str, int] | None = {} if partial_hits else None
    t = order[0].ready_s if order else 0.0
    steps = 0
    last_dt = 0.0
    held = 0.0  # how long the shared frontend has held the thread since the last step (a stream's gap grows by it)
    aborts = sorted(j.abort_s for j in queued if j.abort_s is not None)

    def too_long(j: Job, left: int) -> bool:  # ``whole``: its uncached prompt does not fit what the step has left
        return whole and left < j.prompt + j.recompute - _hit(j, t, ready, a, kv, progress) <= a.token_budget

    while pending or waiting or running:
        if aborts and aborts[0] <= t:
            _abort(t, pending, waiting, running, kv)
            aborts = [x for x in aborts if x > t]
            if not (pending or waiting or running):
                break
        while busy and busy[0][1] <= t:
            busy.popleft()
        if busy and busy[0][0] <= t and not sends_only:
            end = busy.popleft()[1]  # the frontend holds the thread until it has handled every request it has
            held, t = held + end - t, end
        horizon = t
        if lookahead and running and pending and pending[0].ready_s <= t + last_dt:
            # The boundary may fall up to one step after the first new arrival.
            horizon = max(t, pending[0].ready_s + window * last_dt)
        while pending and pending[0].ready_s <= horizon:
            job = pending.popleft()
            waiting.append(job)
            t = max(t, job.ready_s)  # the step boundary falls after this arrival
        if not waiting and not running:
            t = pending[0].ready_s if not aborts else min(pending[0].ready_s, max(t, aborts[0]))
            continue
        threshold = a.long_prefill_threshold
        limit = threshold if threshold and (cap_alone or len(running) + len(waiting) > 1) else a.token_budget
        room = kv.make_room(running, waiting, a.token_budget, limit) if kv is not None else {}
        decoding = [j for j in running if j.prefilled]
        decode_seqs = sum(j.n for j in decoding)
        context = sum(j.n * (j.prompt + j.tokens) for j in decoding)
        budget = a.token_budget - decode_seqs
        if (
            len(decoding) == len(running)
            and (
                not waiting
                or budget <= 0
                or too_long(waiting[0], budget)
                or decode_seqs + waiting[0].n > a.max_num_seqs
                or (kv is not None and running and kv.admit_blocks(waiting[0], _hit(waiting[0], t, ready, a, kv, progress), budget, len(running)) is None)
            )
            and steps < MAX_MODEL_STEPS
        ):
            # Nothing to prefill and nobody admissible: only decode steps until something changes (a client's
            # abort, or the shared frontend taking the thread: its decodes wait too).
            stops = [x for x in (aborts[0] if aborts else None, busy[0][0] if busy and not sends_only else None)
                     if x is not None]
            t, last_dt, done = decode_run(
                t, last_dt, decoding, decode_seqs, context, waiting, running, pending, model,
                lookahead=lookahead, max_steps=MAX_MODEL_STEPS - steps, kv=kv, stop_at=min(stops, default=None),
                held=held,
            )
            held = 0.0
            steps += done
            _retire(running, t, kv)
            continue
        chunks: list[tuple[Job, int]] = []
        for j in running:
            if not j.prefilled and budget > 0:
                c = min(j.prompt + j.recompute - j.computed, budget, room.get(id(j), budget), limit)
                if c > 0:
                    chunks.append((j, c))
                    budget -= c
        seqs = sum(j.n for j in running)
        one = one_long and threshold > 0  # one long prompt in partial prefill at a time
        long_busy = one and any(not j.prefilled and j.prompt > threshold for j in running)
        i = 0
        while i < len(waiting) and budget > 0 and seqs + waiting[i].n <= a.max_num_seqs:
            if long_busy and waiting[i].prompt > threshold:
                i += 1  # shorter ones pass it
                continue
            if too_long(waiting[i], budget):
                break  # chunked prefill off: computed whole, or it waits and admissions stop there
            if kv is not None and running:
                blocks = kv.admit_blocks(waiting[i], _hit(waiting[i], t, ready, a, kv, progress), min(budget, limit), len(running))
                if blocks is None:
                    break  # its blocks do not fit: head-of-line, as vLLM's FCFS admission
            j = waiting[i]
            del waiting[i]
            _admit(j, t, ready, a, kv, progress)
            running.append(j)
            seqs += j.n
            left = j.prompt + j.recompute - j.computed
            c = min(left, budget, limit)
            chunks.append((j, c))
            budget -= c
            if kv is not None:
                kv.admit(j, kv.admitted_tokens(j, j.computed, min(budget + c, limit)))
            long_busy = long_busy or (one and j.prompt > threshold and c < left)
        prefill = sum(c for _, c in chunks)
        pairs = sum(c * (j.computed + c / 2) for j, c in chunks)  # attention of each chunk over its prompt so far
        dt = model.step_s(prefill, decode_seqs, context, pairs)
        # Every request in the system during this step (or arriving while it runs) was exposed
        # to it: a step this long may sit between two of its tokens.
        for j in (*waiting, *running):
            j.max_step = max(j.max_step, dt + held if j.prefilled else dt)
        held = 0.0
        for j in pending:
            if j.ready_s >= t + dt:
                break
            j.max_step = max(j.max_step, dt)
        t += dt
        last_dt, steps = dt, steps + 1
        if steps > MAX_MODEL_STEPS:
            raise ConfigError(f"the trace needs more than {MAX_MODEL_STEPS} scheduler steps to model; shorten it")
        # One thread: sent once the frontend is done, also when it got busy up to FRONTEND_SLACK_S after the
        # step ends on paper (the engine's step ends that little off the paper's: heldout3 sent a first token
        # 100 ms late behind a burst of long prompts that came 2 ms after its step ended on paper).
        out_t = next((e for s_, e in busy if s_ - FRONTEND_SLACK_S < t < e), t) if busy else t
        for j in decoding:
            j.tokens += 1
            j.token_times.append(out_t)
        for j, c in chunks:
            j.chunk_steps.append((t - dt, dt))
            j.computed += c
            if j.group is not None and j.computed >= (cacheable := _cacheable(j, a.block_size)) > 0:
                ready.setdefault(j.group, t)
                if kv is not None:
                    kv.computed_prefix(j, cacheable)
            elif progress is not None and j.group is not None and a.prefix_caching:
                done = min(j.computed, cacheable) // a.block_size * a.block_size
                if done > progress.get(j.group, 0):
                    progress[j.group] = done
                if kv is not None and done:
                    kv.computed_prefix(j, done)
            if j.computed >= j.prompt + j.recompute:
                j.tokens += 1
                j.token_times.append(out_t)
                for w in forked.pop(id(j), ()):  # ``forks``: its later choices join the queue now
                    w.ready_s = out_t
                    if w.abort_s is not None and w.abort_s <= out_t:
                        w.finish_s = out_t  # its client left before the fork
                        continue
                    pending.insert(next((k for k, p in enumerate(pending) if p.ready_s > out_t), len(pending)), w)
        _retire(running, out_t, kv)
    for j in jobs:
        if id(j) in primed:  # the prompt's own request sent nothing: the stream is its choices'
            j.n, j.out = 0, primed[id(j)][0].out
            j.token_times = min((w.token_times for w in primed[id(j)] if w.token_times), key=lambda ts: ts[0],
                                default=[])
        for w in waves.get(id(j), ()):
            j.n += w.n
            j.finish_s = max(j.finish_s or 0.0, w.finish_s or 0.0)
            j.max_step = max(j.max_step, w.max_step)
            j.preemptions += w.preemptions
            j.churn += w.churn
            j.preempted_sequences += w.preempted_sequences
            j.chunk_steps += w.chunk_steps
            j.last_choice = max(j.last_choice, w.token_times[0]) if w.token_times else j.last_choice
    return jobs


def _waves(jobs: list[Job], max_num_seqs: int) -> dict[int, list[Job]]:
    """Split every job asking for more than ``max_num_seqs`` choices; id(job) -> its later waves.

    The job keeps ``max_num_seqs`` choices while scheduled (its ``n`` is restored after).
    """
    out: dict[int, list[Job]] = {}
    for j in jobs:
        extra = []
        while j.n > max_num_seqs:
            k = min(j.n - max_num_seqs, max_num_seqs)
            extra.append(Job(id=j.id, arrival_s=j.arrival_s, prompt=j.prompt, group=j.group, prefix=j.prefix,
                             out=j.out, n=k, forced_cached=j.forced_cached, abort_s=j.abort_s))
            j.n -= k
        if extra:
            out[id(j)] = extra
    return out


def _retire(running: list[Job], t: float, kv: KVBlocks | None = None) -> None:
    """Finish (at ``t``) and remove the running requests that have all their tokens."""
    for j in [j for j in running if j.prefilled and j.tokens >= j.out]:
        j.finish_s = t
        running.remove(j)
        if kv is not None:
            kv.release(j)


def _abort(t: float, pending: deque[Job], waiting: deque[Job], running: list[Job], kv: KVBlocks | None) -> None:
    """Drop (at the step boundary ``t``) every request whose client's abort has come: its seat and
    blocks are free from now on."""
    for queue in (pending, waiting):
        for j in [j for j in queue if j.abort_s is not None and j.abort_s <= t]:
            queue.remove(j)
            j.finish_s = t
    for j in [j for j in running if j.abort_s is not None and j.abort_s <= t]:
        running.remove(j)
        j.finish_s = t
        if kv is not None:
            kv.release(j)


def _admit(job: Job, t: float, ready: dict[str, float], a: SchedulerAssumption, kv: KVBlocks | None = None,
           progress: Mapping[str, int] | None = None) -> None:
    job.admitted = True
    job.cached = _hit(job, t, ready, a, kv, progress)
    job.computed = job.cached
    for group in [g for g in ready if g != job.group] if a.slot_cache else ():
        del ready[group]  # the slot that kept another group's prefix may be the one this request took


def _hit(job: Job, t: float, ready: Mapping[str, float], a: SchedulerAssumption, kv: KVBlocks | None = None,
         progress: Mapping[str, int] | None = None) -> int:
    """Prompt tokens a job admitted at ``t`` takes from the prefix cache (with the KV cache modelled,
    what the free queue has not handed out since nobody held them: KVBlocks.surviving). With
    ``progress`` (partial hits), the full blocks of its prefix computed so far."""
    if job.forced_cached is not None:
        return job.forced_cached
    if a.prefix_caching and job.group is not None:
        if ready.get(job.group, float("inf")) <= t:
            hit = _cacheable(job, a.block_size)
        elif progress is not None:
            hit = max(job.cached, min(_cacheable(job, a.block_size), progress.get(job.group, 0)))
        else:
            return job.cached
        return hit if kv is None else kv.surviving(job.group, hit)
    return job.cached
