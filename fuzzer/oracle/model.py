"""The oracle's leaf: the calibrated step-time model and the scheduler assumption.

A :class:`StepModel` says what one engine step costs (and what a request spends outside
the engine); a :class:`SchedulerAssumption` says which scheduler parameters the bound
assumes (token budget, sequence slots, KV blocks) and where each came from. Both are
frozen values stored with a calibration; the paper scheduler (:mod:`fuzzer.oracle.paper`)
and the expectations (:mod:`fuzzer.oracle.expectation`) read them, nothing here reads those.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from fuzzer.errors import ConfigError

# vLLM's API server defaults (vllm/config/scheduler.py, ARCHITECTURE.md, "Engines"): a token
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
#: ... and how much more it may take where the frontend shares the engine's thread and holds up its steps and
#: sends: the frontend's per-token cost is the slope of a few cached probes' extra TTFT, small beside their
#: noise. Five calibrations of one clean held-out server (heldout12) read 0.16-0.80 us a token; at the least of
#: them its first request, sent 8 ms before 28 prompts of 3-4k tokens, was a confirmed ttft-outlier of 5.7x
#: (88 ms against a 18 ms bound; its one thread parsed and tokenized the burst in between). Three times the
#: least is the others' median; five times kept a fan-out's control bound (tests/test_expectation.py) from
#: telling a 99 ms first token from FCFS.
FRONTEND_UNCERTAINTY = 3.0

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
    #: Prefill attention, per (prompt token, earlier token of its prompt) pair: a chunk of c
    #: tokens after k computed ones costs c x (k + c/2) pairs, n^2/2 for a whole prompt of n
    #: however it is chunked. Measured on vLLM (CPU, a small model): 2048 tokens 124 ms,
    #: 4096 tokens 420 ms, 8000 tokens 1452 ms; a per-token cost alone put 8000 at ~500 ms.
    prefill_pair_s: float = 0.0
    #: What a step costs more when it computes any prompt tokens, however few: on a mixture-of-experts
    #: model a prompt's tokens route to nearly every expert, so its step reads all the experts' weights
    #: where a decode step reads a few (the third held-out server, a 30B MoE: a 128-token prefill's step
    #: 26 ms, a decode's 5.7 ms). Idle probes cannot tell it from the request overhead (both are in
    #: every TTFT); the step probe beside a stream can (fuzzer.oracle.chunkcap.prefill_step_floor).
    prefill_step_s: float = 0.0
    #: The server's own tokenizer's time per prompt token (/tokenize, timed at calibration; 0: not known).
    #: The least frontend time a prompt costs, where the cached probes' slope is lost in their noise: the
    #: uncertain frontend (with_frontend_uncertainty) starts from it.
    tokenizer_token_s: float = 0.0

    def frontend_s(self, prompt_tokens: int) -> float:
        """Frontend time (tokenization) before the engine sees a request of ``prompt_tokens``."""
        return max(0.0, self.frontend_token_s * prompt_tokens - self.frontend_slack_s)

    def step_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, prefill_pairs: float = 0.0) -> float:
        return (
            self.overhead_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_seq_s * decode_seqs
            + self.context_token_s * context_tokens
            + self.prefill_pair_s * prefill_pairs
            + (self.prefill_step_s if prefill_tokens > 0 else 0.0)
        )

    def scaled(self, factor: float) -> StepModel:
        """The same model with every engine and frontend cost multiplied by ``factor``.

        Scaling the frontend too reorders requests sent within a frontend-time of each
        other: which of them the engine sees first is as uncertain as the fit. The request
        overhead (HTTP, not the engine) and the frontend slack (an allowance, not a cost)
        are kept as they are; the envelope scales only calibrated models, which have no slack.
        """
        return replace(
            self,
            overhead_s=self.overhead_s * factor,
            prefill_token_s=self.prefill_token_s * factor,
            decode_seq_s=self.decode_seq_s * factor,
            context_token_s=self.context_token_s * factor,
            frontend_token_s=self.frontend_token_s * factor,
            prefill_pair_s=self.prefill_pair_s * factor,
            prefill_step_s=self.prefill_step_s * factor,
        )

    def with_frontend_slack(self) -> StepModel:
        """The same model with FRONTEND_SLACK_S less frontend time per request: a long prompt
        sent a moment before a short one may reach the engine first, as over HTTP a
        one-process frontend handles requests in arrival order; one whose tokenization takes
        far longer than the gap between them still comes second."""
        return replace(self, frontend_slack_s=FRONTEND_SLACK_S)

    def with_frontend_uncertainty(self) -> StepModel:
        """The same model with FRONTEND_UNCERTAINTY times the frontend's per-token cost, and at least the
        tokenizer's own: a clean held-out server's calibration fitted no frontend time at all, where its
        /tokenize took 0.66 us a token; its one thread then parsed and tokenized 24 prompts of 2k tokens
        sent 2 ms apart between two steps, and their first tokens were a confirmed ttft-outlier of 14x."""
        return replace(self, frontend_token_s=max(self.frontend_token_s, self.tokenizer_token_s) * FRONTEND_UNCERTAINTY)

    @property
    def has_frontend(self) -> bool:
        """Whether a request costs any frontend time here, or may (the tokenizer's own time)."""
        return self.frontend_token_s > 0 or self.tokenizer_token_s > 0

    def to_dict(self) -> dict[str, float]:
        return {
            "overhead_s": self.overhead_s,
            "prefill_token_s": self.prefill_token_s,
            "decode_seq_s": self.decode_seq_s,
            "context_token_s": self.context_token_s,
            "request_overhead_s": self.request_overhead_s,
            "frontend_token_s": self.frontend_token_s,
            "prefill_pair_s": self.prefill_pair_s,
            "prefill_step_s": self.prefill_step_s,
            "tokenizer_token_s": self.tokenizer_token_s,
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
    #: cache never runs out, and the oracle allows for preemptions (fuzzer.oracle.judge).
    kv_blocks: int | None = None
    #: A prefix is cached in the slot that computed it (llama-server keeps a slot's last prompt): any request
    #: outside its group admitted since may have taken that slot, and the paper schedule gives no hit after one
    #: (fuzzer.oracle.paper._admit; a single slot re-used by a short request between two turns of a
    #: conversation: the next turn recomputed its history, by design).
    slot_cache: bool = False
    #: The engine admits waiting requests in arrival order (its documented policy is FCFS),
    #: so the order check holds it to that (fuzzer.oracle.order). False for engines whose
    #: order depends on slots or batching (llama.cpp, TGI) or on another policy.
    arrival_order: bool = True
    #: The server's frontend hands requests to the engine in arrival order, each after the
    #: tokenization of those sent before it (measured on vLLM's API server: four 4096-token
    #: prompts and four 64-token ones sent within 1 ms reached its engine in that order); the
    #: bound then also holds that schedule (fuzzer.oracle.expectation). True for servers met
    #: over HTTP (assumption_for), False for the in-process simulator, whose frontend
    #: tokenizes every request on its own.
    frontend_fifo: bool = False
    #: A cap on the prompt tokens one request computes in a step while other requests are
    #: running or waiting (vLLM's ``--long-prefill-token-threshold``; 0: none, vLLM's default),
    #: as the user gives it or calibration measures it (:func:`fuzzer.oracle.chunkcap.chunk_cap`).
    #: The paper schedule then caps every chunk so, and its envelope also holds the schedule
    #: that keeps at most one prompt longer than the cap in partial prefill at a time, shorter
    #: ones passing it in the queue (vLLM v0's ``--max-long-partial-prefills 1``): legitimate
    #: policies under which a long prompt is served later than plain FCFS serves it.
    long_prefill_threshold: int = 0
    #: The engine preempts the newest running request first and puts a preempted request back at
    #: the head of its waiting queue (vLLM v1's recompute preemption), so no later request runs
    #: while an earlier one waits for its blocks again (fuzzer.oracle.evidence.passed_while_silent).
    #: False for engines that choose whom to retract otherwise (SGLang) or whose order is not assumed.
    preempted_first: bool = True
    #: The engine aborts a request whose client disconnected (before its first token too), freeing its
    #: seat and KV blocks at a step boundary soon after (vLLM v1: the API server cancels the request on
    #: disconnect; PRs #29987 and #14326 fixed the paths that lost it), so the paper schedule drops it
    #: then (fuzzer.oracle.paper, ABORT_AFTER_S). False where not assumed: a disconnected request is
    #: served to its end on paper, and work a server keeps doing for a client gone shows only as a leak.
    aborts_on_disconnect: bool = True
    #: The engine's admissions of a step stop at the first waiting request it cannot schedule (no
    #: token budget left, no KV blocks, no seat: vLLM v1's FCFS waiting loop breaks there), and
    #: a request admitted with part of its prompt ends them too, so no later request is admitted
    #: before an earlier one, whatever their sizes: a later request gets its first token no
    #: earlier than an earlier one whose prefill is not capped per step
    #: (``long_prefill_threshold``) and has no more sequences (fuzzer.oracle.order). False where
    #: not documented (SGLang's and TGI's admission are not held to it).
    admission_stops: bool = True
    #: A token budget smaller than ``token_budget`` that the server showed (calibration's probe,
    #: :func:`fuzzer.oracle.chunkcap.smaller_budget`; 0: none). The bound's envelope holds schedules
    #: under it beside those under ``token_budget`` (fuzzer.oracle.expectation): the probe reads a budget
    #: only to within a step, and which KV-aware schedule preempts whom moves with it (heldout6, clean,
    #: judged under its 768 alone: two streams' preemption stalls the 2048 schedules held were not).
    low_budget: int = 0
    #: Sequences the seat probe saw run at once when it got every one it sent (0: not probed, or
    #: ``max_num_seqs`` measured or named). The server has at least that many seats and maybe fewer
    #: than ``max_num_seqs``: a request that waited for a seat held by more sequences is bounded by the
    #: observed end that freed one (fuzzer.oracle.evidence.waited_for_slot), as with a measured count.
    #: heldout11 runs 64 of the documented 256.
    seats_seen: int = 0
    #: The engine computes the prompt of a request asking for n > 1 choices once, in a request of its own,
    #: and only then queues the n choices, behind every request that came meanwhile (SGLang's
    #: ``TokenizerManager._handle_batch_request``: a copy with ``max_new_tokens=0`` is sent and awaited, then
    #: n copies are sent, each hitting the prompt's cache). The bound then also holds that schedule
    #: (fuzzer.oracle.paper, ``primes``): choice 0's first token too comes after a second wait in the queue.
    primes_choices: bool = False

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"scheduler assumption {name} must be a positive integer, got {value!r}")
        if not isinstance(self.long_prefill_threshold, int) or self.long_prefill_threshold < 0:
            raise ConfigError("scheduler assumption long_prefill_threshold must be a non-negative integer, "
                              f"got {self.long_prefill_threshold!r}")
        if not isinstance(self.low_budget, int) or not 0 <= self.low_budget < self.token_budget:
            raise ConfigError("scheduler assumption low_budget must be a non-negative integer below token_budget, "
                              f"got {self.low_budget!r}")
        if not isinstance(self.seats_seen, int) or not 0 <= self.seats_seen <= self.max_num_seqs:
            raise ConfigError("scheduler assumption seats_seen must be a non-negative integer up to max_num_seqs, "
                              f"got {self.seats_seen!r}")
        if self.kv_blocks is not None and (not isinstance(self.kv_blocks, int) or self.kv_blocks < 1):
            raise ConfigError(f"scheduler assumption kv_blocks must be a positive integer or None, got {self.kv_blocks!r}")

    def describe(self) -> str:
        kv = f", KV cache {self.kv_blocks} blocks (server-reported)" if self.kv_blocks is not None else ""
        order = "admission in arrival order" if self.arrival_order else "admission order not assumed"
        if self.frontend_fifo:
            order += ", frontend in arrival order"
        if self.arrival_order and self.preempted_first:
            order += ", newest preempted first and re-queued first"
        if self.arrival_order and self.admission_stops:
            order += ", admissions stop at the first request that cannot be scheduled"
        cap = ""
        if self.long_prefill_threshold:
            cap = (f", at most {self.long_prefill_threshold} prompt tokens per request per step beside others "
                   "(long-prefill threshold; one long prompt in partial prefill at a time allowed)")
        return (
            f"max_num_batched_tokens={self.token_budget}"
            f"{f' (or {self.low_budget}, as the server showed)' if self.low_budget else ''}, max_num_seqs={self.max_num_seqs}"
            f"{f' ({self.seats_seen} seen; maybe no more)' if self.seats_seen else ''}, "
            f"block_size={self.block_size}, prefix caching {'on' if self.prefix_caching else 'off'}{kv}{cap}, "
            f"{order}{', an n > 1 prompt computed first, then its choices queued' if self.primes_choices else ''}"
            f" ({self.source})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "token_budget": self.token_budget,
            "max_num_seqs": self.max_num_seqs,
            "block_size": self.block_size,
            "prefix_caching": self.prefix_caching,
            "source": self.source,
            "kv_blocks": self.kv_blocks,
            "slot_cache": self.slot_cache,
            "arrival_order": self.arrival_order,
            "frontend_fifo": self.frontend_fifo,
            "long_prefill_threshold": self.long_prefill_threshold,
            "preempted_first": self.preempted_first,
            "aborts_on_disconnect": self.aborts_on_disconnect,
            "admission_stops": self.admission_stops,
            "low_budget": self.low_budget,
            "seats_seen": self.seats_seen,
            "primes_choices": self.primes_choices,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SchedulerAssumption:
        # A calibration stored before preempted_first (or aborts_on_disconnect, admission_stops) existed
        # does not say: the rule it gates stays off.
        return cls(**{"preempted_first": False, "aborts_on_disconnect": False, "admission_stops": False,
                      **{k: data[k] for k in cls.__dataclass_fields__ if k in data}})


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
    long_prefill_threshold: int | None = None,
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
        # Reported by the server itself (fuzzer.execute.adapters.reported_scheduler), never a documented default.
        found["kv_blocks"] = defaults["num_gpu_blocks"]
    source = f"{kind} default" if found else "no documented default; vLLM's assumed"
    overrides = {
        k: v
        for k, v in (("token_budget", token_budget), ("max_num_seqs", max_num_seqs), ("block_size", block_size),
                     ("long_prefill_threshold", long_prefill_threshold))
        if v is not None
    }
    if overrides:
        source += "; user override of " + ", ".join(sorted(overrides))
    # FCFS by arrival is documented for vLLM and SGLang ("fcfs"); for the others it is not assumed.
    arrival_order = defaults.get("scheduling_policy") == "fcfs"
    preempted_first = arrival_order and bool(defaults.get("preempted_first"))
    return SchedulerAssumption(**{**found, **overrides}, source=source, arrival_order=arrival_order, frontend_fifo=True,
                               preempted_first=preempted_first, slot_cache=bool(defaults.get("slot_cache")),
                               aborts_on_disconnect=bool(defaults.get("aborts_on_disconnect")),
                               admission_stops=arrival_order and bool(defaults.get("admission_stops")),
                               primes_choices=bool(defaults.get("primes_choices")))
