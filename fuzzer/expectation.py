"""Expectations: what a reasonable FCFS chunked-prefill scheduler would give each request (SPEC §7).

"Slow" means nothing without a model. Given the calibrated step-time model of a
target and the scheduler parameters it is assumed to run with, this module replays
a trace through an idealised continuous-batching scheduler on paper (:mod:`fuzzer.paper`):

- every step has a token budget; running decodes are scheduled first (one token per
  sequence), then prefill chunks in first-come-first-served order, first the
  partially prefilled running requests, then waiting ones, up to ``max_num_seqs``;
- a step takes ``overhead + prefill tokens x cost + decode sequences x cost +
  context tokens x cost`` (the calibrated :class:`StepModel`);
- the first token of a request comes out at the end of the step that finishes its
  prefill; a prefix shared with an earlier request of the same trace is a cache hit
  once that request has computed the prefix's full KV blocks.

For every request it gives two expectations: *idle* (the request alone on an idle
server: what the user would call normal) and the *FCFS bound* (given the work that
arrived before it). Slowdown versus idle is what users feel; excess over the FCFS
bound is what by-design queueing does not explain.

The scheduler parameters the server does not expose (the per-step token budget,
above all) come from the server adapter's documented defaults and can be overridden
by the user; :meth:`SchedulerAssumption.describe` says in every verdict which were used.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from fuzzer.errors import ConfigError
from fuzzer.execution import ExecutionResult
from fuzzer.paper import Job, PaperRequest, schedule, serve
from fuzzer.trace import Request, Trace
from fuzzer.verdict import Metric

# vLLM's API server defaults (vllm/config/scheduler.py, research/servers.md §3): a token
# budget of 2048 per step on GPUs under 70 GiB (8192 above), 256 running sequences, KV
# blocks of 16 tokens. The budget cannot be read from a server, so it is an assumption.
DEFAULT_TOKEN_BUDGET = 2048
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_BLOCK_SIZE = 16

# The FCFS bound is taken over the calibrated step model and these scalings of it. A real
# server's step boundaries drift from the model's (noise, calibration error); +-15% covers
# the drift of a busy period of a few hundred steps at the few-percent noise measured on
# GPUs, so a request that merely missed a step boundary is not called slow.
ENVELOPE_SCALES = (0.85, 1.15)
#: Frontend time a request may save against the calibrated per-token cost (JSON parsing,
#: event-loop turns, tokenizer warm caches): over HTTP a clean simulator let a 1024-token
#: prompt sent 0.2 ms before a 1-token one reach its engine first, against a calibrated
#: 2.3 ms of frontend time; 16,000-token prompts (36 ms) still came second.
FRONTEND_SLACK_S = 0.005

# Campaigns hold each execution against its expectations twice (coverage, then the oracle)
# and confirmations re-run the same trace; results are kept for this many recent
# (trace, send times, model, assumption) keys. An entry is a few KB.
_EXPECT_CACHE_SIZE = 512


@dataclass(frozen=True)
class StepModel:
    """Calibrated cost of one engine step, plus the latency outside the engine."""

    overhead_s: float
    prefill_token_s: float
    decode_seq_s: float
    context_token_s: float
    #: Send-to-engine and engine-to-client time of a request that does not grow with it (HTTP).
    request_overhead_s: float = 0.0
    #: Frontend time per prompt token before the engine sees a request (tokenization). It
    #: also decides the engine's order of requests sent at the same instant.
    frontend_token_s: float = 0.0
    #: How much sooner than ``frontend_token_s`` x prompt a request may reach the engine (a
    #: variant of the envelope, never stored): the frontend's time is uncertain by a few ms.
    frontend_slack_s: float = 0.0

    def frontend_s(self, prompt_tokens: int) -> float:
        """Frontend time (tokenization) before the engine sees a request of ``prompt_tokens``."""
        return max(0.0, self.frontend_token_s * prompt_tokens - self.frontend_slack_s)

    def step_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        return (
            self.overhead_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_seq_s * decode_seqs
            + self.context_token_s * context_tokens
        )

    def scaled(self, factor: float) -> StepModel:
        """The same model with every engine and frontend cost multiplied by ``factor``.

        Scaling the frontend too reorders requests sent within a frontend-time of each
        other: which of them the engine sees first is as uncertain as the fit.
        """
        return StepModel(
            self.overhead_s * factor,
            self.prefill_token_s * factor,
            self.decode_seq_s * factor,
            self.context_token_s * factor,
            self.request_overhead_s,
            self.frontend_token_s * factor,
        )

    def with_frontend_slack(self) -> StepModel:
        """The same model with FRONTEND_SLACK_S less frontend time per request: a long prompt
        sent a moment before a short one may reach the engine first, as over HTTP a
        one-process frontend handles requests in arrival order; one whose tokenization takes
        far longer than the gap between them still comes second."""
        return replace(self, frontend_slack_s=FRONTEND_SLACK_S)

    def to_dict(self) -> dict[str, float]:
        return {
            "overhead_s": self.overhead_s,
            "prefill_token_s": self.prefill_token_s,
            "decode_seq_s": self.decode_seq_s,
            "context_token_s": self.context_token_s,
            "request_overhead_s": self.request_overhead_s,
            "frontend_token_s": self.frontend_token_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepModel:
        return cls(**{k: float(data[k]) for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class SchedulerAssumption:
    """Scheduler parameters the expectation needs and the server does not expose."""

    token_budget: int = DEFAULT_TOKEN_BUDGET
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    block_size: int = DEFAULT_BLOCK_SIZE
    prefix_caching: bool = True
    #: Where the values come from, for the verdict ("vLLM default", "user override").
    source: str = "vLLM API-server default"
    #: KV cache capacity in blocks of ``block_size``, as the server reports it (vLLM's
    #: ``cache_config_info`` num_gpu_blocks); None when unknown: the bound assumes the KV
    #: cache never runs out, and the oracle allows for preemptions (fuzzer.oracle).
    kv_blocks: int | None = None

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"scheduler assumption {name} must be a positive integer, got {value!r}")
        if self.kv_blocks is not None and (not isinstance(self.kv_blocks, int) or self.kv_blocks < 1):
            raise ConfigError(f"scheduler assumption kv_blocks must be a positive integer or None, got {self.kv_blocks!r}")

    def describe(self) -> str:
        kv = f", KV cache {self.kv_blocks} blocks (server-reported)" if self.kv_blocks is not None else ""
        return (
            f"max_num_batched_tokens={self.token_budget}, max_num_seqs={self.max_num_seqs}, "
            f"block_size={self.block_size}, prefix caching {'on' if self.prefix_caching else 'off'}{kv} ({self.source})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "token_budget": self.token_budget,
            "max_num_seqs": self.max_num_seqs,
            "block_size": self.block_size,
            "prefix_caching": self.prefix_caching,
            "source": self.source,
            "kv_blocks": self.kv_blocks,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SchedulerAssumption:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


#: Names under which engines document the per-step token budget (server adapters'
#: ``scheduler_defaults``). A tuple value lists the documented choices; the first (the
#: smaller GPU's default) is taken, and the verdict says so.
_BUDGET_KEYS = ("max_num_batched_tokens", "chunked_prefill_size", "max_batch_prefill_tokens", "n_batch")
_SEQS_KEYS = ("max_num_seqs", "max_concurrent_requests")


def assumption_for(
    kind: str,
    defaults: Mapping[str, Any],
    *,
    token_budget: int | None = None,
    max_num_seqs: int | None = None,
    block_size: int | None = None,
) -> SchedulerAssumption:
    """The assumption for a server kind, from its adapter's documented defaults and user overrides."""
    found: dict[str, Any] = {}
    notes = []
    for key in _BUDGET_KEYS:
        if key in defaults:
            value = defaults[key]
            found["token_budget"] = value[0] if isinstance(value, (tuple, list)) else value
            notes.append(f"{key} documented default")
            break
    for key in _SEQS_KEYS:
        if key in defaults:
            value = defaults[key]
            found["max_num_seqs"] = value[0] if isinstance(value, (tuple, list)) else value
            break
    for key in ("block_size", "page_size"):
        if key in defaults:
            found["block_size"] = defaults[key]
            break
    if "prefix_caching" in defaults:
        found["prefix_caching"] = bool(defaults["prefix_caching"])
    if isinstance(defaults.get("num_gpu_blocks"), int) and defaults["num_gpu_blocks"] > 0:
        # Reported by the server itself (fuzzer.servers.reported_scheduler), never a documented default.
        found["kv_blocks"] = defaults["num_gpu_blocks"]
    source = f"{kind} default" if found else "no documented default; vLLM's assumed"
    overrides = {
        k: v
        for k, v in (("token_budget", token_budget), ("max_num_seqs", max_num_seqs), ("block_size", block_size))
        if v is not None
    }
    if overrides:
        source += "; user override of " + ", ".join(sorted(overrides))
    return SchedulerAssumption(**{**found, **overrides}, source=source)


@dataclass(frozen=True)
class Expectation:
    """What one request should have seen: alone on an idle server, and under FCFS."""

    request_id: str
    idle_ttft_s: float
    idle_max_itl_s: float | None
    idle_e2e_s: float
    #: The FCFS chunked-prefill bound given the work that arrived before it.
    ttft_s: float
    max_itl_s: float | None
    e2e_s: float
    #: Prompt tokens the paper schedule took from the prefix cache.
    cached_tokens: int = 0

    def bound(self, metric: Metric) -> float | None:
        return {Metric.TTFT: self.ttft_s, Metric.MAX_ITL: self.max_itl_s, Metric.E2E: self.e2e_s}[metric]

    def idle(self, metric: Metric) -> float | None:
        return {Metric.TTFT: self.idle_ttft_s, Metric.MAX_ITL: self.idle_max_itl_s, Metric.E2E: self.idle_e2e_s}[
            metric
        ]


def paper_schedule(
    trace: Trace,
    model: StepModel,
    assumption: SchedulerAssumption,
    result: ExecutionResult | None = None,
    *,
    lookahead: bool = False,
    window: float = 1.0,
) -> dict[str, PaperRequest]:
    """Serve ``trace`` with the paper FCFS chunked-prefill scheduler; by request id.

    With ``result``, requests arrive when they were actually sent (``sent_s``), so the
    client's own lateness is never counted against the server. ``lookahead`` and
    ``window``: see :func:`fuzzer.paper.schedule`.
    """
    return serve(trace.requests, trace.prefixes, _sent(result), model, assumption, lookahead, window)


def _sent(result: ExecutionResult | None) -> dict[str, float]:
    return {r.request_id: r.sent_s for r in result.requests} if result is not None else {}


def expect(
    trace: Trace,
    model: StepModel,
    assumption: SchedulerAssumption,
    result: ExecutionResult | None = None,
    *,
    kv: bool = True,
) -> dict[str, Expectation]:
    """Idle and FCFS expectations of every request of ``trace``, by request id.

    The FCFS bound is an envelope: the trace is scheduled under the calibrated model,
    under the model scaled by each of ENVELOPE_SCALES, with one step of admission
    lookahead (a boundary just after a window of arrivals: they share a step), and with
    a boundary just after the first arrival of a busy engine (who came a little later
    waits out that step, then shares the next with later arrivals' chunks); each request
    gets the largest value. Which step a request lands in (and which later arrivals'
    chunks share that step) depends on step boundaries that drift with noise; the
    envelope keeps a request that merely met an unlucky boundary from looking slow. The
    max-ITL bound is the longest step the request was exposed to.

    With ``kv`` and a known KV capacity (``assumption.kv_blocks``), the envelope also holds
    the same variants with the KV cache modelled (:mod:`fuzzer.paper`: recompute preemption
    of the newest request), unless the whole trace fits the cache at once: a request
    preempted by design is bounded by when the paper engine, short of blocks too, serves it.
    """
    return dict(_expect(*_key(trace, result), model, assumption, kv)[0])


def expected_preemptions(
    trace: Trace, model: StepModel, assumption: SchedulerAssumption, result: ExecutionResult | None = None
) -> int:
    """The most preemptions any KV-aware variant of the envelope makes (0 without a KV capacity)."""
    return _expect(*_key(trace, result), model, assumption, True)[1]


def _key(trace: Trace, result: ExecutionResult | None) -> tuple:
    sent = tuple((r.request_id, r.sent_s) for r in result.requests) if result is not None else ()
    return trace.requests, tuple(trace.prefixes.items()), sent


# The expectations depend on nothing but these arguments (all immutable); an execution is
# held against them more than once, and a confirmation re-runs the same trace.
@functools.lru_cache(maxsize=_EXPECT_CACHE_SIZE)
def _expect(
    requests: tuple[Request, ...],
    prefix_items: tuple[tuple[str, int], ...],
    sent_items: tuple[tuple[str, float], ...],
    model: StepModel,
    assumption: SchedulerAssumption,
    kv: bool,
) -> tuple[dict[str, Expectation], int]:
    prefixes, sent = dict(prefix_items), dict(sent_items)
    capacities: list[int | None] = [None]
    if kv and assumption.kv_blocks is not None and not _fits(requests, assumption):
        capacities.append(assumption.kv_blocks)
    variants = []
    for cap in capacities:
        variants += [serve(requests, prefixes, sent, model.scaled(k), assumption, False, kv_blocks=cap)
                     for k in ENVELOPE_SCALES]
        variants.append(serve(requests, prefixes, sent, model, assumption, True, kv_blocks=cap))
        variants.append(serve(requests, prefixes, sent, model, assumption, True, window=0.0, kv_blocks=cap))
        if model.frontend_token_s > 0:  # without frontend time the slack changes nothing
            variants.append(serve(requests, prefixes, sent, model.with_frontend_slack(), assumption, True,
                                  window=0.0, kv_blocks=cap))
        if cap is not None:
            variants.append(serve(requests, prefixes, sent, model, assumption, False, kv_blocks=cap))
    loaded = serve(requests, prefixes, sent, model, assumption, False)
    preempted = max((sum(p.preemptions for p in v.values()) for v in variants), default=0)
    stalls = _preemption_stalls(variants) if preempted else {}
    out: dict[str, Expectation] = {}
    for r in requests:
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
            max_itl_s=max(stalls.get(r.id, 0.0), *(max(p.max_step_s, p.max_itl_s or 0.0) for p in every))
            if out_tokens > 1 else None,
            e2e_s=max(p.e2e_s for p in every),
            cached_tokens=done.cached_tokens,
        )
    return out, preempted


def _preemption_stalls(variants: list[dict[str, PaperRequest]]) -> dict[str, float]:
    """Request id -> the longest preemption stall of a schedule that it was in the system during.

    Which running request is the newest when blocks run out depends on admission order and
    step boundaries that drift: a request streaming while the paper engine stalls another
    one by preemption could be that one on a real engine. Its max-ITL bound takes the stall.
    """
    out: dict[str, float] = {}
    for v in variants:
        gaps = []
        for p in v.values():
            if p.preemptions and len(p.token_times_s) > 1:
                i = int(np.argmax(np.diff(p.token_times_s)))
                gaps.append((p.arrival_s + p.token_times_s[i], p.arrival_s + p.token_times_s[i + 1]))
        for p in v.values():
            lo, hi = p.arrival_s, p.arrival_s + p.e2e_s
            for start, end in gaps:
                if lo < end and hi > start:
                    out[p.request_id] = max(out.get(p.request_id, 0.0), end - start)
    return out


def _fits(requests: tuple[Request, ...], a: SchedulerAssumption) -> bool:
    """Whether every request's prompt and output fit the KV cache at once, with admission headroom."""
    assert a.kv_blocks is not None
    b = a.block_size
    need = sum(-(-(r.prompt_tokens + r.max_tokens) // b) + (r.n - 1) * -(-r.max_tokens // b) + 1 for r in requests)
    return need <= a.kv_blocks


def idle_expectation(
    prompt_tokens: int,
    max_tokens: int,
    model: StepModel,
    assumption: SchedulerAssumption,
    *,
    cached_tokens: int = 0,
    n: int = 1,
) -> Expectation:
    """The expectation of one request alone on an idle server (calibration uses it for residuals)."""
    return _idle(prompt_tokens, max_tokens, model, assumption, cached_tokens, n)


# Campaigns judge thousands of executions of similar requests; the idle schedule of a
# (prompt, output, cache hit, n) shape under one model is computed once.
@functools.lru_cache(maxsize=4096)
def _idle(prompt: int, out: int, model: StepModel, assumption: SchedulerAssumption, cached: int, n: int) -> Expectation:
    job = Job(id="alone", arrival_s=0.0, prompt=prompt, group=None, prefix=0, out=out, n=n, forced_cached=cached)
    done = schedule([job], model, assumption)[0].paper(model)
    ttft, itl, e2e = done.ttft_s, done.max_itl_s, done.e2e_s
    return Expectation("alone", ttft, itl, e2e, ttft, itl, e2e, cached)


