"""A discrete-event model of a vLLM v1 engine: continuous batching on any clock.

The engine does not own a clock. Its driver (the HTTP front end on the event
loop's clock, or the virtual runner on a virtual one) calls :meth:`Engine.step`
with the current time, waits until the returned step's ``end_s``, then calls
:meth:`Engine.complete`. Requests arrive with :meth:`Engine.add_request` and
leave by finishing or :meth:`Engine.abort`.

One step, as vLLM v1's scheduler (ARCHITECTURE.md, "Engines"):

1. running requests first, in admission order: a decode takes one token per
   choice, a partial prefill the rest of its prompt up to the token budget; when
   KV blocks run out the most recently admitted request is preempted (its blocks
   freed, recomputed later);
2. then waiting requests in FCFS order while budget and seats remain: a prefix
   cache lookup, a chunk of the prompt, and admission stops at the first request
   whose blocks do not fit (head-of-line, by design).

With ``long_prefill_token_threshold`` a request computes at most that many prompt tokens in a
step while others are running or waiting, and with ``max_long_partial_prefills`` at most that
many prompts longer than the threshold are in partial prefill at a time (shorter ones pass a
waiting long one): legitimate policies of vLLM (v1 and v0), off by default.

Planted pathologies (``fuzzer.sim.pathologies``) change this when enabled and
tag the requests they delay.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from fuzzer.errors import ConfigError
from fuzzer.sim import pathologies as P
from fuzzer.sim.config import SimConfig
from fuzzer.sim.kv import KVCache, block_hashes
from fuzzer.sim.mechanisms import Mechanisms
from fuzzer.sim.request import GroundTruth, SimRequest, State
from fuzzer.sim.steptime import StepLoad, StepTimer
from fuzzer.trace import ceil_div

#: Finished requests whose ground truth the engine keeps in memory (a day-long
#: campaign sends ~10^5 requests; older records are only in the JSON-lines file).
MAX_RECORDS = 100_000
#: A tokenizer-queue wait longer than this (simulated seconds) counts as a delay.
_SERIAL_TOKENIZER_MIN_WAIT_S = 0.001
#: Mean length of a natural (EOS) completion when ignore_eos is false.
_MEAN_NATURAL_OUTPUT_TOKENS = 128


@dataclass
class EngineStats:
    """Cumulative counters, as the server's /metrics reports them."""

    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    finished: Counter = field(default_factory=Counter)


@dataclass(frozen=True)
class Step:
    """One planned step: what it computes and when it ends."""

    start_s: float
    end_s: float
    scheduled: tuple[tuple[SimRequest, int], ...]
    load: StepLoad


class Engine(Mechanisms):
    """Continuous batching with chunked prefill, KV blocks, prefix caching and preemption."""

    def __init__(self, config: SimConfig | None = None, pathologies: Iterable[str] = (), seed: int = 0) -> None:
        self.config = config or SimConfig()
        self.pathologies = frozenset(P.validate(tuple(pathologies)))
        self._timer = StepTimer(self.config, random.Random(seed))
        self._eos_rng = random.Random(f"eos-{seed}")
        self.kv = KVCache(self.config.num_kv_blocks, self.config.block_size)
        self.stats = EngineStats()
        self.records: deque[GroundTruth] = deque(maxlen=MAX_RECORDS)
        self._pending: list[tuple[float, int, SimRequest]] = []
        self._waiting: list[SimRequest] = []
        self._running: list[SimRequest] = []
        self._seq = itertools.count()
        self._admit_seq = itertools.count()
        self._tokenizer_free_s = -math.inf
        self._delivery_free_s = -math.inf
        #: End of the last step; None: never ran (a fresh server is cold).
        self._last_step_end_s: float | None = None
        self._cold_extra_s: list[float] = []
        #: aborted-blocks-held: (when they are swept, blocks) of requests aborted mid-prefill.
        self._held: list[tuple[float, list[int]]] = []
        self._batch_full = False
        #: Prompt tokens one request may compute in the current step (the long-prefill cap).
        self._chunk_cap = self.config.max_num_batched_tokens
        #: Called with the ground truth of every request as it finishes (the server's JSON-lines file).
        self.on_finish: Callable[[GroundTruth], None] | None = None

    # --- state ------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def busy(self) -> bool:
        """Whether a step can run now (requests waiting or running)."""
        return bool(self._waiting or self._running)

    @property
    def idle(self) -> bool:
        """No request anywhere in the server."""
        return not (self._waiting or self._running or self._pending)

    @property
    def last_step_end_s(self) -> float | None:
        """When the last step ended; None if the engine never ran."""
        return self._last_step_end_s

    def next_ready_s(self) -> float | None:
        """When the next request leaves the tokenizer queue, if any is in it."""
        return self._pending[0][0] if self._pending else None

    def running(self) -> tuple[SimRequest, ...]:
        return tuple(self._running)

    def waiting(self) -> tuple[SimRequest, ...]:
        return tuple(self._waiting)

    def max_request_tokens(self, prompt_len: int, n: int) -> int:
        """The most tokens per choice a request can generate and still fit the KV cache alone."""
        cap = self.config.kv_capacity_tokens
        b = self.config.block_size
        prompt_blocks = ceil_div(prompt_len, b)
        spare_blocks = self.config.num_kv_blocks - prompt_blocks
        if spare_blocks <= 0:
            return 0
        return min(cap - prompt_len, (spare_blocks // n) * b)

    # --- arrivals and aborts -------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        max_tokens: int,
        *,
        now_s: float,
        n: int = 1,
        logprobs: int | None = None,
        ignore_eos: bool = True,
        min_tokens: int = 0,
        seed: int | None = None,
        temperature: float = 0.0,
        stream: bool = False,
    ) -> SimRequest:
        """A request arrives at ``now_s``; it reaches the scheduler after tokenization."""
        cfg = self.config
        if not prompt_ids:
            raise ConfigError("a request needs at least one prompt token")
        if n < 1 or max_tokens < 1:
            raise ConfigError(f"n and max_tokens must be >= 1, got n={n}, max_tokens={max_tokens}")
        if max_tokens > self.max_request_tokens(len(prompt_ids), n):
            raise ConfigError(f"request {request_id!r} cannot fit the KV cache even alone")
        if ignore_eos:
            output_len = max_tokens
        else:
            natural = 1 + int(self._eos_rng.expovariate(1.0 / _MEAN_NATURAL_OUTPUT_TOKENS))
            output_len = min(max_tokens, max(min_tokens, natural))
        prompt = list(prompt_ids)
        hashes = block_hashes(prompt, cfg.block_size)
        req = SimRequest(
            request_id=request_id,
            prompt_ids=prompt,
            max_tokens=max_tokens,
            n=n,
            logprobs=logprobs,
            output_len=output_len,
            arrival_s=now_s,
            ready_s=now_s,
            hashes=hashes,
            group_key=hashes[0] if hashes else None,
            seed=seed,
            temperature=temperature,
            stream=stream,
        )
        if P.SERIAL_TOKENIZER in self.pathologies:
            start = max(now_s, self._tokenizer_free_s)
            req.ready_s = start + len(prompt) * cfg.serial_tokenize_token_s / cfg.speed
            self._tokenizer_free_s = req.ready_s
            if (start - now_s) * cfg.speed > _SERIAL_TOKENIZER_MIN_WAIT_S:
                req.delayed_by.add(P.SERIAL_TOKENIZER)
        else:
            req.ready_s = now_s + len(prompt) * cfg.tokenize_token_s / cfg.speed
        heapq.heappush(self._pending, (req.ready_s, next(self._seq), req))
        return req

    def abort(self, req: SimRequest, now_s: float) -> None:
        """The client went away: free the request's KV at once (unless disconnect-leak loses the abort)."""
        if req.state is State.FINISHED or self._leaks_abort(req):
            return
        if req.state is State.PENDING:
            self._pending = [item for item in self._pending if item[2] is not req]
            heapq.heapify(self._pending)
        elif req.state is State.WAITING:
            self._waiting.remove(req)
        else:
            self._running.remove(req)
            self._hold_blocks(req, now_s)
        self._finish(req, now_s, "abort")

    # --- one step ----------------------------------------------------------------------

    def step(self, now_s: float) -> Step | None:
        """Plan the step that starts at ``now_s``; None when there is nothing to compute."""
        self._promote(now_s)
        if not self.busy:
            return None
        cfg = self.config
        extra_s = self._cold_start_extra(now_s)
        scheduled = self._schedule(now_s)
        if not scheduled:
            return None
        prefill = decode_seqs = context = logprob_units = 0
        costly_logprobs = 0
        thrash = P.PREEMPTION_THRASH in self.pathologies
        resuming = False
        for req, tokens in scheduled:
            resuming = resuming or (thrash and req.preemptions > 0 and not req.decoding)
            if req.decoding:
                decode_seqs += req.n
                context += req.num_computed * req.n
            else:
                prefill += tokens
            if req.logprobs:
                logprob_units += req.n * req.logprobs
                if req.n > 1:
                    costly_logprobs += req.n * req.logprobs
        load = StepLoad(prefill, decode_seqs, context, logprob_units)
        duration = self._timer.time_s(load) + extra_s + self._seeded_sampling_extra(scheduled)
        if costly_logprobs and P.LOGPROBS_BATCH_COST in self.pathologies:
            batch_seqs = decode_seqs + sum(1 for req, _ in scheduled if not req.decoding)
            duration += cfg.logprobs_batch_cost_s * batch_seqs * costly_logprobs
            self._tag(P.LOGPROBS_BATCH_COST, (r for r, _ in scheduled), self._waiting)
        self._tag_leak_company(req for req, _ in scheduled)
        if resuming:  # a thrashing victim's recompute chunk slows the whole batch
            self._tag(P.PREEMPTION_THRASH, (r for r, _ in scheduled))
        if extra_s:
            self._tag(P.COLD_START, (r for r, _ in scheduled), self._waiting)
        self.stats.steps += 1
        end_s = now_s + duration / cfg.speed
        self._last_step_end_s = end_s
        return Step(now_s, end_s, tuple(scheduled), load)

    def complete(self, step: Step) -> list[SimRequest]:
        """Apply a step at its end: computed tokens, sampled tokens, finished requests.

        Returns the requests that got a new token (finished ones included).
        """
        end = step.end_s
        sampled = []
        for req, tokens in step.scheduled:
            if req.state is not State.RUNNING:
                continue  # aborted or preempted while the step ran
            req.num_computed += tokens
            self._commit_blocks(req)
            if req.num_computed < req.num_tokens:
                continue
            if req.leaked == P.QUEUED_ABORT_LATE:  # its abort takes effect as it comes out of the model
                self._running.remove(req)
                self._finish(req, end, "abort")
                continue
            sampled.append(req)
        # When this step's tokens reach their clients (later than ``end`` only with logprobs-redetokenize).
        delivered = self._delivered_s(sampled, end)
        for req in sampled:
            req.generated += 1
            self.stats.generation_tokens += req.n
            req.token_times_s.append(delivered)
            if req.first_token_s is None:
                req.first_token_s = delivered
                self.stats.prompt_tokens += req.prompt_len
            if req.generated >= req.output_len:
                self._running.remove(req)
                self._finish(req, end, "length" if req.generated >= req.max_tokens else "stop")
        if self._last_step_end_s is None or end > self._last_step_end_s:
            self._last_step_end_s = end
        return sampled

    def decode_run(self, now_s: float, until_s: float, max_steps: int) -> tuple[float, list[SimRequest]] | None:
        """Run consecutive decode-only steps at once (the virtual runner's fast path).

        Applies when nothing waits and every running request decodes: then each
        step schedules the same batch and only the context grows, so up to
        ``max_steps`` steps (each starting before ``until_s``, the next arrival)
        are computed in one go, with the same per-step noise as :meth:`step`.
        Returns (end of the last step, requests that got tokens), or None when
        the general path must run (waiting requests, a cold start, KV running short).
        """
        self._promote(now_s)
        if self._waiting or not self._running or self._cold_extra_s or max_steps < 1 or now_s >= until_s:
            return None
        if P.COLD_START in self.pathologies and self._cold_start_due(now_s):
            return None
        cfg = self.config
        running = self._running
        seqs = 0
        for req in running:
            if not req.decoding:
                return None
            seqs += req.n
        if seqs > cfg.max_num_batched_tokens:
            return None
        steps = min(max_steps, min(r.output_len - r.generated for r in running))
        need = sum(self._blocks_for(r, r.num_computed + steps) - len(r.blocks) for r in running)
        if need > self.kv.num_free:
            return None
        logprob_units = sum(r.n * r.logprobs for r in running if r.logprobs)
        costly = sum(r.n * r.logprobs for r in running if r.logprobs and r.n > 1)
        extra = cfg.logprobs_batch_cost_s * seqs * costly if P.LOGPROBS_BATCH_COST in self.pathologies else 0.0
        seeded = self._seeded_sampling_extra((r, 1) for r in running)  # every decode samples
        context = sum(r.num_computed * r.n for r in running)
        fixed = cfg.step_overhead_s + seqs * cfg.decode_seq_s + logprob_units * cfg.logprob_s
        lags = P.LOGPROBS_REDETOKENIZE in self.pathologies  # the fast path pays nothing for it otherwise
        t = now_s
        times = []
        done = 0
        while done < steps and t < until_s:
            load_s = fixed + (context + done * seqs) * cfg.context_token_s
            t += (load_s * self._timer.noise() + extra + seeded) / cfg.speed
            done += 1
            times.append(self._delivered_s(running, t, done) if lags else t)
        for req in running:
            grow = self._blocks_for(req, req.num_computed + done) - len(req.blocks)
            if grow > 0:
                req.blocks.extend(self.kv.allocate(grow))
            req.num_computed += done
            req.generated += done
            req.token_times_s.extend(times)
        if extra:
            self._tag(P.LOGPROBS_BATCH_COST, running)
        self._tag_leak_company(running)
        self.stats.generation_tokens += done * seqs
        self.stats.steps += done
        self._last_step_end_s = t
        progressed = list(running)
        for req in progressed:
            if req.generated >= req.output_len:
                self._running.remove(req)
                self._finish(req, t, "length" if req.generated >= req.max_tokens else "stop")
        return t, progressed

    def finish_early(self, req: SimRequest, now_s: float, reason: str = "stop") -> None:
        """The front end ends a request before its length (a stop string matched)."""
        if req.state is State.RUNNING:
            self._running.remove(req)
            self._finish(req, now_s, reason)
        elif req.state is not State.FINISHED:
            self.abort(req, now_s)

    # --- scheduling -----------------------------------------------------------------------

    def _schedule(self, now_s: float) -> list[tuple[SimRequest, int]]:
        cfg = self.config
        on = self.pathologies
        if P.UNCHUNKED_PREFILL in on and self._waiting and not self._sticky_blocks():
            head = self._waiting[0]
            if self._is_unchunked(head) and len(self._running) < cfg.max_num_seqs:
                tokens = self._admit(head, cfg.max_num_batched_tokens, now_s, unchunked=True)
                if tokens is not None:
                    self._tag(P.UNCHUNKED_PREFILL, (r for r in self._running if r is not head))
                    return [(head, tokens)]

        threshold = cfg.long_prefill_token_threshold
        self._chunk_cap = threshold if threshold and len(self._running) + len(self._waiting) > 1 else cfg.max_num_batched_tokens
        starve = self._prefill_first()
        scheduled, budget = self._schedule_running(cfg.max_num_batched_tokens, skip_decodes=starve)
        if starve and not scheduled:  # the prefill found no KV: decodes go on rather than deadlock
            scheduled, budget = self._schedule_running(budget, skip_decodes=False)
        elif starve:
            self._tag(P.DECODE_STARVATION, (r for r in self._running if r.decoding))

        if self._sticky_blocks():
            if budget > 0 and self._waiting and len(self._running) < cfg.max_num_seqs:
                self._tag(P.STICKY_BATCH_FULL, self._waiting)
            return scheduled
        if P.HOL_PREFIX_BURST in on:
            self._reorder_bursts()
        if P.LIFO_ADMISSION in on:
            self._newest_first()
        if P.LONGEST_PREFIX_FIRST in on:
            self._longest_prefix_first()
        reordered = [name for name in (P.LIFO_ADMISSION, P.LONGEST_PREFIX_FIRST) if name in on]
        passed = 0  # waiting prompts passed over by the long-partial-prefill limit
        while len(self._waiting) > passed and budget > 0 and len(self._running) < cfg.max_num_seqs:
            req = self._waiting[passed]
            if self._long_limited(req):
                passed += 1
                continue
            if P.UNCHUNKED_PREFILL in on and self._is_unchunked(req):
                break  # it gets a step of its own next time
            if P.HOL_PREFIX_BURST in on and self._held_by_burst(req):
                self._tag(P.HOL_PREFIX_BURST, self._waiting)
                break
            tokens = self._admit(req, budget, now_s)
            if tokens is None:
                if P.STICKY_BATCH_FULL in on:
                    self._batch_full = True
                break
            scheduled.append((req, tokens))
            budget -= tokens
            for name in reordered:  # the earlier requests it overtook
                self._tag(name, (r for r in self._waiting if r.ready_s < req.ready_s))
        if P.STICKY_BATCH_FULL in on and self._waiting and budget <= 0:
            self._batch_full = True
        return scheduled

    def _long_limited(self, req: SimRequest) -> bool:
        """Is ``req`` a long prompt that the long-partial-prefill limit keeps waiting this step?"""
        cfg = self.config
        threshold, limit = cfg.long_prefill_token_threshold, cfg.max_long_partial_prefills
        if not (threshold and limit and req.prompt_len > threshold):
            return False
        partial = sum(1 for r in self._running
                      if r.prompt_len > threshold and not r.decoding and r.num_computed < r.num_tokens)
        return partial >= limit

    def _schedule_running(self, budget: int, *, skip_decodes: bool) -> tuple[list[tuple[SimRequest, int]], int]:
        """Running requests first, in admission order: (what they compute, the budget left)."""
        scheduled: list[tuple[SimRequest, int]] = []
        i = 0
        while i < len(self._running) and budget > 0:
            req = self._running[i]
            if req.decoding and skip_decodes:
                i += 1
                continue
            if req.decoding:
                tokens, cost = 1, req.n
            else:
                tokens = min(req.num_tokens - req.num_computed, budget, self._chunk_cap)
                cost = tokens
            if cost > budget:
                i += 1
                continue
            need = self._blocks_for(req, req.num_computed + tokens) - len(req.blocks)
            while need > self.kv.num_free:
                victim = self._running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.state is not State.RUNNING:
                break
            if need > 0:
                req.blocks.extend(self.kv.allocate(need))
            scheduled.append((req, tokens))
            budget -= cost
            i += 1
        return scheduled, budget

    def _admit(self, req: SimRequest, budget: int, now_s: float, *, unchunked: bool = False) -> int | None:
        """Move the head of the waiting queue to running with its first chunk; None if KV is short."""
        cfg = self.config
        hits: list[int] = []
        if req.num_computed == 0:
            # vLLM always recomputes the last prompt token, so a hit covers at most num_tokens - 1.
            hits = self.kv.lookup(req.hashes, (req.num_tokens - 1) // cfg.block_size)
        cached = len(hits) * cfg.block_size
        remaining = req.num_tokens - cached
        tokens = remaining if unchunked else min(remaining, budget, self._chunk_cap)
        thrash = P.PREEMPTION_THRASH in self.pathologies
        if thrash and req.preemptions:
            tokens = min(tokens, cfg.thrash_resume_chunk_tokens)
        required = self._blocks_for(req, cached + tokens)
        headroom = 0 if thrash else len(self._running) * cfg.admission_headroom_blocks_per_seq
        need = self.kv.blocks_needed(0, required, hits) + headroom
        if need > self.kv.num_free:
            self._tag_held_refusal(need)
        if (need > self.kv.num_free or self._reservation_refuses(req, need, required)
                or self._head_reservation_refuses(req, need, required)
                or self._resident_prefix_refuses(required, headroom)):
            return None
        self.kv.acquire(hits)
        req.blocks = hits + self.kv.allocate(required - len(hits))
        req.num_computed = cached
        self.stats.prefix_cache_queries += req.num_tokens
        self.stats.prefix_cache_hits += cached
        if req.admit_seq is None:
            req.admit_seq = next(self._admit_seq)
            req.admitted_s = now_s
            req.cached_tokens = cached
        self._waiting.remove(req)
        req.state = State.RUNNING
        self._running.append(req)
        return tokens

    def _preempt(self, victim: SimRequest) -> None:
        thrash = P.PREEMPTION_THRASH in self.pathologies
        self._running.remove(victim)
        self.kv.release(victim.blocks, keep_cached=not thrash)
        victim.blocks = []
        victim.committed_blocks = 0
        victim.num_computed = 0
        victim.state = State.WAITING
        victim.preemptions += 1
        self._waiting.insert(0, victim)
        self.stats.preemptions += 1
        if thrash:
            victim.delayed_by.add(P.PREEMPTION_THRASH)

    def _blocks_for(self, req: SimRequest, tokens: int) -> int:
        """Blocks a request needs to hold ``tokens`` of its sequence (each extra choice has its own output)."""
        b = self.config.block_size
        blocks = ceil_div(tokens, b)
        if req.n > 1:
            blocks += (req.n - 1) * ceil_div(max(0, tokens - req.prompt_len), b)
        return blocks

    def _commit_blocks(self, req: SimRequest) -> None:
        full = min(req.num_computed // self.config.block_size, len(req.hashes), len(req.blocks))
        for i in range(req.committed_blocks, full):
            self.kv.commit(req.blocks[i], req.hashes[i])
        req.committed_blocks = max(req.committed_blocks, full)

    def _finish(self, req: SimRequest, now_s: float, reason: str) -> None:
        if req.blocks:
            self.kv.release(req.blocks)
            req.blocks = []
        req.state = State.FINISHED
        req.finish_s = now_s
        req.finish_reason = reason
        self.stats.finished[reason] += 1
        self._batch_full = False  # the batch shrank
        record = req.record()
        self.records.append(record)
        if self.on_finish is not None:
            self.on_finish(record)

    def _promote(self, now_s: float) -> None:
        self._sweep_held(now_s)
        while self._pending and self._pending[0][0] <= now_s:
            _, _, req = heapq.heappop(self._pending)
            req.state = State.WAITING
            self._waiting.append(req)

