"""The paper scheduler as it was before it was made fast (commit c932925), kept as the reference.

tests/test_expectation.py checks that :func:`fuzzer.oracle.expectation.expect` and
:func:`fuzzer.oracle.expectation.paper_schedule` (:mod:`fuzzer.oracle.paper`) give exactly what this straightforward
step-by-step version gives, on many random traces. Do not optimise this file: its
value is that it is obviously the specification.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from fuzzer.errors import ConfigError
from fuzzer.execution import ExecutionResult
from fuzzer.oracle.expectation import LOOKAHEAD_WINDOW, Expectation
from fuzzer.oracle.model import ENVELOPE_SCALES, SchedulerAssumption, StepModel
from fuzzer.oracle.paper import MAX_MODEL_STEPS, PaperRequest
from fuzzer.trace import Trace


def paper_schedule(
    trace: Trace,
    model: StepModel,
    assumption: SchedulerAssumption,
    result: ExecutionResult | None = None,
    *,
    lookahead: bool = False,
    window: float = 1.0,
) -> dict[str, PaperRequest]:
    sent = {r.request_id: r.sent_s for r in result.requests} if result is not None else {}
    jobs = [
        _Job(
            id=r.id,
            arrival_s=sent.get(r.id, r.at_ms / 1000.0),
            prompt=r.prompt_tokens,
            group=f"{r.prefix}:{r.api}" if r.prefix else None,  # a chat prompt's template comes first
            prefix=trace.prefix_tokens(r),
            out=r.cancel_after_tokens or r.max_tokens,
            n=r.n,
        )
        for r in trace.requests
    ]
    return {j.id: j.paper(model) for j in _schedule(jobs, model, assumption, lookahead=lookahead, window=window)}


def expect(
    trace: Trace,
    model: StepModel,
    assumption: SchedulerAssumption,
    result: ExecutionResult | None = None,
) -> dict[str, Expectation]:
    variants = [paper_schedule(trace, model.scaled(k), assumption, result) for k in ENVELOPE_SCALES]
    variants += [paper_schedule(trace, m, assumption, result, lookahead=True, window=LOOKAHEAD_WINDOW)
                 for m in (model, *(model.scaled(k) for k in ENVELOPE_SCALES))]
    variants.append(paper_schedule(trace, model, assumption, result, lookahead=True, window=0.0))
    variants.append(paper_schedule(trace, model.with_frontend_slack(), assumption, result, lookahead=True, window=0.0))
    if any(r.n > 1 for r in trace.requests):
        variants += [_fanout(trace, m, assumption, result) for m in (model, *(model.scaled(k) for k in ENVELOPE_SCALES))]
        variants.append(_fanout(trace, model, assumption, result, forks=True))
    loaded = paper_schedule(trace, model, assumption, result)
    out: dict[str, Expectation] = {}
    for r in trace.requests:
        done = loaded[r.id]
        out_tokens = r.cancel_after_tokens or r.max_tokens
        alone = _idle(r.prompt_tokens, out_tokens, model, assumption, done.cached_tokens, r.n)
        every = [done, *(v[r.id] for v in variants)]
        out[r.id] = Expectation(
            request_id=r.id,
            idle_ttft_s=alone.idle_ttft_s,
            idle_max_itl_s=alone.idle_max_itl_s,
            idle_e2e_s=alone.idle_e2e_s,
            ttft_s=max(p.ttft_s for p in every),
            max_itl_s=max(max(p.max_step_s, p.max_itl_s or 0.0, p.choice_wait_s if r.stream else 0.0) for p in every)
            if out_tokens > 1 else None,
            e2e_s=max(p.e2e_s for p in every),
            cached_tokens=done.cached_tokens,
        )
    return out


def _fanout(trace: Trace, model: StepModel, assumption: SchedulerAssumption, result: ExecutionResult | None,
            forks: bool = False):
    """Every choice of a request with n > 1 a request of its own, right behind it, that computes the
    prompt (lookahead, window 0); the request ends with its last choice. ``forks``: choices 1.. join the
    queue when choice 0 gets its first token, behind every request that came before."""
    sent = {r.request_id: r.sent_s for r in result.requests} if result is not None else {}
    jobs = [
        _Job(id=r.id if k == 0 else f"{r.id}~{k}", arrival_s=sent.get(r.id, r.at_ms / 1000.0), prompt=r.prompt_tokens,
             group=f"{r.prefix}:{r.api}" if r.prefix else None, prefix=trace.prefix_tokens(r),
             out=r.cancel_after_tokens or r.max_tokens, n=1)
        for r in trace.requests for k in range(r.n)
    ]
    later = {}
    if forks:
        for j in [j for j in jobs if "~" in j.id]:
            later.setdefault(j.id.split("~")[0], []).append(j)
    done = {j.id: j.paper(model) for j in _schedule(jobs, model, assumption, lookahead=True, window=0.0, forks=later)}
    out = {}
    for r in trace.requests:
        first, others = done[r.id], [done[f"{r.id}~{k}"] for k in range(1, r.n)]
        out[r.id] = replace(
            first, e2e_s=max(p.e2e_s for p in (first, *others)), max_step_s=max(p.max_step_s for p in (first, *others)),
            chunk_steps=first.chunk_steps + tuple(s for p in others for s in p.chunk_steps),
            # The last choice's first token after choice 0's: a gap of the stream (n > 1 streamed).
            choice_wait_s=max([0.0] + [p.token_times_s[0] - first.token_times_s[0] for p in others]),
        )
    return out


def _idle(prompt: int, out: int, model: StepModel, assumption: SchedulerAssumption, cached: int, n: int) -> Expectation:
    job = _Job(id="alone", arrival_s=0.0, prompt=prompt, group=None, prefix=0, out=out, n=n, forced_cached=cached)
    done = _schedule([job], model, assumption)[0].paper(model)
    ttft, itl, e2e = done.ttft_s, done.max_itl_s, done.e2e_s
    return Expectation("alone", ttft, itl, e2e, ttft, itl, e2e, cached)


@dataclass
class _Job:
    id: str
    arrival_s: float
    prompt: int
    group: str | None
    prefix: int
    out: int
    n: int
    forced_cached: int | None = None
    cached: int = 0
    computed: int = 0
    admitted: bool = False
    tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    finish_s: float | None = None
    max_step: float = 0.0
    ready_s: float = 0.0
    chunk_steps: list = field(default_factory=list)

    @property
    def prefilled(self) -> bool:
        return self.admitted and self.computed >= self.prompt

    def paper(self, model: StepModel) -> PaperRequest:
        assert self.finish_s is not None and self.token_times
        shift = model.request_overhead_s - self.arrival_s
        return PaperRequest(
            request_id=self.id,
            arrival_s=self.arrival_s,
            token_times_s=tuple(t + shift for t in self.token_times),
            e2e_s=self.finish_s + shift,
            cached_tokens=self.cached,
            max_step_s=self.max_step,
            chunk_steps=tuple(self.chunk_steps),
        )


def _cacheable(job: _Job, block: int) -> int:
    full = (job.prefix // block) * block
    return min(full, ((job.prompt - 1) // block) * block)


def _schedule(
    jobs: list[_Job], model: StepModel, a: SchedulerAssumption, *, lookahead: bool = False, window: float = 1.0,
    forks: Mapping[str, list[_Job]] | None = None,
) -> list[_Job]:
    """``forks``: job id -> jobs that join the queue only when it gets its first token."""
    forks = dict(forks or {})
    for j in jobs:
        j.ready_s = j.arrival_s + model.frontend_s(j.prompt)
    held = [id(w) for ws in forks.values() for w in ws]
    order = sorted([j for j in jobs if id(j) not in held], key=lambda j: j.ready_s)
    pending = deque(order)
    waiting: deque[_Job] = deque()
    running: list[_Job] = []
    ready: dict[str, float] = {}
    t = order[0].ready_s if order else 0.0
    steps = 0
    last_dt = 0.0
    while pending or waiting or running:
        horizon = t
        if lookahead and running and pending and pending[0].ready_s <= t + last_dt:
            horizon = max(t, pending[0].ready_s + window * last_dt)
        while pending and pending[0].ready_s <= horizon:
            job = pending.popleft()
            waiting.append(job)
            t = max(t, job.ready_s)
        if not waiting and not running:
            t = pending[0].ready_s
            continue
        budget = a.token_budget
        decoding = [j for j in running if j.prefilled]
        decode_seqs = sum(j.n for j in decoding)
        context = sum(j.n * (j.prompt + j.tokens) for j in decoding)
        budget -= decode_seqs
        chunks: list[tuple[_Job, int]] = []
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
            j.chunk_steps.append((t - dt, dt))
            j.computed += c
            if j.group is not None and j.group not in ready and j.computed >= _cacheable(j, a.block_size) > 0:
                ready[j.group] = t
            if j.computed >= j.prompt:
                j.tokens = 1
                j.token_times.append(t)
                for w in forks.pop(j.id, []):
                    w.ready_s = t
                    later = [k for k, p in enumerate(pending) if p.ready_s > t]
                    pending.insert(later[0] if later else len(pending), w)
        for j in [j for j in running if j.prefilled and j.tokens >= j.out]:
            j.finish_s = t
            running.remove(j)
    return jobs


def _admit(job: _Job, t: float, ready: Mapping[str, float], a: SchedulerAssumption) -> None:
    job.admitted = True
    if job.forced_cached is not None:
        job.cached = job.forced_cached
    elif a.prefix_caching and job.group is not None and ready.get(job.group, float("inf")) <= t:
        job.cached = _cacheable(job, a.block_size)
    job.computed = job.cached
