"""Server adapters: what each inference engine exposes and how to read it (ARCHITECTURE.md, "Execute").

An :class:`Adapter` knows an engine's endpoints (health, tokenize, info), maps its
Prometheus metric names onto the fuzzer's common names, and carries the engine's
documented scheduler defaults, which the oracle reads as assumptions.

Telling engines apart (``detect`` on a ``Fingerprint``, ``fingerprint`` to fetch one)
is :mod:`fuzzer.execute.detection`; ``probe_capabilities`` asks the server which
request features it accepts.

Sources: each engine's public docs and sources, summarised in
ARCHITECTURE.md, "Engines" (vLLM ``v1/metrics/loggers.py``, SGLang
``srt/metrics/collector.py``, TGI ``docs/source/reference/metrics.md``, llama.cpp
``tools/server/README.md``).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import aiohttp

from fuzzer.errors import ConfigError, TargetError
from fuzzer.execute.detection import PROBE_TIMEOUT_S
from fuzzer.trace import LOGPROB_VALUES, N_VALUES

KINDS = ("vllm", "sglang", "tgi", "llamacpp", "openai")

#: Request features the capability probe asks about. Mutators avoid what a target rejects.
FEATURES = ("completions", "chat", "stream_options", "ignore_eos", "n", "logprobs", "tokenize")
#: Capability key of the largest ``n`` a server accepts, recorded only when it refuses a
#: larger one (llama-server refuses n above its slot count): an int, not a bool.
MAX_N = "max_n"
#: The ``n`` values tried above 2 when the server accepts n=2: those the mutators draw, so
#: a refusal of any of them is recorded.
N_PROBES = tuple(n for n in N_VALUES if n > 2)
#: Capability key of the largest ``logprobs`` a server accepts, recorded only when it refuses a
#: larger one (vLLM's ``--max-logprobs``, 20 by default; a deployment may set 5): an int.
MAX_LOGPROBS = "max_logprobs"
#: The ``logprobs`` values tried above 1 when the server accepts 1: those the mutators draw.
LOGPROB_PROBES = tuple(v for v in LOGPROB_VALUES if v > 1)


@dataclass(frozen=True)
class MetricSource:
    """Where a common metric comes from: wire sample names in order of preference.

    The first name present in a scrape wins; samples of that name are summed over
    their labels (several engines or models behind one server), or averaged when
    ``mean`` is set (a usage fraction per engine).
    """

    names: tuple[str, ...]
    mean: bool = False


@dataclass(frozen=True)
class Adapter:
    """What the fuzzer needs to know about one kind of server."""

    kind: str
    metrics: Mapping[str, MetricSource]
    #: Documented scheduler defaults of the engine (the oracle's assumptions).
    scheduler_defaults: Mapping[str, Any]
    health_path: str = "/health"
    metrics_path: str | None = "/metrics"
    completions_path: str = "/v1/completions"
    chat_path: str = "/v1/chat/completions"
    #: POST endpoint that counts tokens, or None.
    tokenize_path: str | None = None
    #: Builds the tokenize body: (text, model, chat) -> JSON object, or None when it cannot template chat.
    tokenize_body: Callable[[str, str | None, bool], dict[str, Any] | None] | None = None
    #: Reads the token count out of a tokenize answer.
    tokenize_count: Callable[[Any], int] | None = None
    #: POST endpoint that renders chat messages with the model's template (``{"messages"}`` ->
    #: ``{"prompt"}``), for a tokenize endpoint that cannot template chat itself; or None.
    template_path: str | None = None
    #: GET endpoint describing the server's slots, read for what /metrics lacks (KV pressure); or None.
    slots_path: str | None = None
    #: Reads common metric values (``kv_usage``) out of a slots answer.
    slots_metrics: Callable[[Any], dict[str, float]] | None = None
    #: Whether ``kv_usage`` is brought up to date once the last request is freed (vLLM v1 runs a step for
    #: finished and aborted requests, whose stats count cached blocks nobody holds as free), so that KV still
    #: in use with nothing running is blocks held (``fuzzer.execution.KV_HELD_MARGIN``). SGLang sets its
    #: token usage when it logs a batch, and an idle server logs none; the others are not relied on.
    kv_settles_idle: bool = False

    @property
    def has_metrics(self) -> bool:
        return self.metrics_path is not None and bool(self.metrics)


@dataclass(frozen=True)
class ServerInfo:
    """What the fuzzer learned about a target when it first met it."""

    kind: str
    version: str | None
    model: str | None
    max_model_len: int | None
    #: Feature -> accepted (see FEATURES); a feature never probed is absent. ``max_n``
    #: (an int, see MAX_N) when the server refuses some n > 1 it was probed with.
    capabilities: Mapping[str, bool | int] = field(default_factory=dict)
    #: Scheduler parameters the server itself reports (e.g. llama.cpp's slot count as
    #: ``max_num_seqs``); they override the adapter's documented ``scheduler_defaults``.
    scheduler: Mapping[str, Any] = field(default_factory=dict)

    def accepts(self, feature: str) -> bool:
        """True unless the probe saw the server reject the feature."""
        return bool(self.capabilities.get(feature, True))

    def kv_cache(self) -> tuple[int, int] | None:
        """(KV blocks, tokens per block) the server reported (vLLM's ``cache_config_info``), or None."""
        blocks, size = self.scheduler.get("num_gpu_blocks"), self.scheduler.get("block_size")
        if isinstance(blocks, int) and isinstance(size, int) and blocks > 0 and size > 0:
            return blocks, size
        return None

    @property
    def max_logprobs(self) -> int | None:
        """The largest ``logprobs`` the server accepts; None when no limit was seen (or none accepted)."""
        value = self.capabilities.get(MAX_LOGPROBS)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def max_n(self) -> int | None:
        """The largest ``n`` (choices per request) the server accepts; None when no limit was seen."""
        if not self.accepts("n"):
            return 1
        value = self.capabilities.get(MAX_N)
        return value if isinstance(value, int) and not isinstance(value, bool) else None


# --- tokenize dialects ------------------------------------------------------------------


def _openai_tokenize_body(text: str, model: str | None, chat: bool) -> dict[str, Any]:
    """vLLM and SGLang: ``{"prompt"}`` or ``{"messages", "add_generation_prompt"}``."""
    body: dict[str, Any] = (
        {"messages": [{"role": "user", "content": text}], "add_generation_prompt": True} if chat else {"prompt": text}
    )
    if model:
        body["model"] = model
    return body


def _openai_tokenize_count(answer: Any) -> int:
    if isinstance(answer, dict):
        if isinstance(answer.get("count"), int):
            return answer["count"]
        if isinstance(answer.get("tokens"), list):
            return len(answer["tokens"])
    raise TargetError(f"the /tokenize answer has neither count nor tokens: {str(answer)[:80]}")


def _llamacpp_tokenize_body(text: str, model: str | None, chat: bool) -> dict[str, Any] | None:
    """``{"content"}``, counted as /v1/completions counts a prompt: BOS added, special tokens parsed.

    llama.cpp's /tokenize does not apply the chat template: a chat prompt is rendered
    through /apply-template first (``template_path``) and its text counted here.
    """
    return None if chat else {"content": text, "add_special": True, "parse_special": True}


def _llamacpp_slots_metrics(answer: Any) -> dict[str, float]:
    """``kv_usage`` from llama.cpp's /slots: context tokens held by busy slots over all slots' context.

    A busy slot holds its prompt plus the tokens decoded so far
    (``n_prompt_tokens + next_token[0].n_decoded``). Idle slots are not counted: the
    prompt cache they keep is reused or overwritten by the next request, so it is no
    pressure. Raises :class:`TargetError` when the answer is not a list of slots.
    """
    if not isinstance(answer, list) or not answer:
        raise TargetError(f"the /slots answer is not a list of slots: {str(answer)[:80]}")
    capacity = used = 0
    for slot in answer:
        if not isinstance(slot, dict) or not isinstance(slot.get("n_ctx"), int):
            raise TargetError(f"a /slots entry has no n_ctx: {str(slot)[:80]}")
        capacity += slot["n_ctx"]
        if not slot.get("is_processing"):
            continue
        decoded = 0
        nxt = slot.get("next_token")
        if isinstance(nxt, list) and nxt and isinstance(nxt[0], dict):
            decoded = nxt[0].get("n_decoded") or 0
        elif isinstance(nxt, dict):  # older builds: one object, not a list
            decoded = nxt.get("n_decoded") or 0
        used += int(slot.get("n_prompt_tokens") or 0) + int(decoded)
    return {"kv_usage": min(1.0, used / capacity)} if capacity > 0 else {}


def _tgi_tokenize_body(text: str, model: str | None, chat: bool) -> dict[str, Any] | None:
    return None if chat else {"inputs": text}


def _list_count(answer: Any) -> int:
    if isinstance(answer, list):
        return len(answer)
    if isinstance(answer, dict) and isinstance(answer.get("tokens"), list):
        return len(answer["tokens"])
    raise TargetError(f"the /tokenize answer is not a token list: {str(answer)[:80]}")


# --- the registry -----------------------------------------------------------------------

_VLLM = Adapter(
    kind="vllm",
    metrics={
        "running": MetricSource(("vllm:num_requests_running",)),
        "waiting": MetricSource(("vllm:num_requests_waiting",)),
        "kv_usage": MetricSource(("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), mean=True),
        "preemptions": MetricSource(("vllm:num_preemptions_total",)),
        "prefix_cache_hits": MetricSource(("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")),
        "prefix_cache_queries": MetricSource(("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")),
        "prompt_tokens": MetricSource(("vllm:prompt_tokens_total",)),
        "generation_tokens": MetricSource(("vllm:generation_tokens_total",)),
    },
    # vllm/config/scheduler.py, engine/arg_utils.py (V1): the token budget is 2048 on the
    # API server for GPUs under 70 GiB or A100, 8192 above; 256 running sequences (1024 on
    # H100-class); KV blocks of 16 tokens; chunked prefill and prefix caching on.
    scheduler_defaults={
        "max_num_batched_tokens": (2048, 8192),
        "max_num_seqs": (256, 1024),
        "block_size": 16,
        "chunked_prefill": True,
        "prefix_caching": True,
        "scheduling_policy": "fcfs",
        "preemption": "recompute, newest running request first",
        # v1/core/sched/scheduler.py: the newest running request is popped first and a preempted one
        # is prepended to the waiting queue; nothing waiting is admitted in a step that preempted.
        "preempted_first": True,
        # v1/core/sched/scheduler.py: the waiting loop breaks at the first request without token budget,
        # KV blocks or a seat, and a request admitted with a partial chunk leaves no budget behind it.
        "admission_stops": True,
        # entrypoints/utils.py (with_cancellation): the handler is cancelled when the client
        # disconnects and the request aborted in the engine core, between steps.
        "aborts_on_disconnect": True,
    },
    tokenize_path="/tokenize",
    tokenize_body=_openai_tokenize_body,
    tokenize_count=_openai_tokenize_count,
    kv_settles_idle=True,
)

_SGLANG = Adapter(
    kind="sglang",
    metrics={
        "running": MetricSource(("sglang:num_running_reqs",)),
        "waiting": MetricSource(("sglang:num_queue_reqs",)),
        "kv_usage": MetricSource(("sglang:token_usage",), mean=True),
        "preemptions": MetricSource(("sglang:num_retracted_requests_total",)),
        # SGLang counts prefix-cache hits in tokens as cached_tokens; every prompt token is a query.
        "prefix_cache_hits": MetricSource(("sglang:cached_tokens_total",)),
        "prefix_cache_queries": MetricSource(("sglang:prompt_tokens_total",)),
        "prompt_tokens": MetricSource(("sglang:prompt_tokens_total",)),
        "generation_tokens": MetricSource(("sglang:generation_tokens_total",)),
    },
    # sglang server_args: chunked prefill 8192 typical (GPU dependent, 2048-16384),
    # max prefill 16384, radix cache with page size 1, FCFS, retraction when decode cannot fit.
    scheduler_defaults={
        "chunked_prefill_size": 8192,
        "max_prefill_tokens": 16384,
        "page_size": 1,
        "prefix_caching": True,
        "scheduling_policy": "fcfs",
        "schedule_conservativeness": 1.0,
        "preemption": "retraction",
        # Not assumed: TokenizerManager._wait_one_response notices a client gone before its request's
        # first output only when its 4 s wait for output times out (asyncio.wait_for(..., timeout=4), then
        # request.is_disconnected(), then abort_request), so a queued request stays queued, and may be
        # prefilled, for up to 4 s by design. On paper such a request is served to its end; what the
        # server keeps doing for a client gone shows only as a leak.
        "aborts_on_disconnect": False,
        # TokenizerManager._handle_batch_request (n > 1 is parallel sampling, never a single request): the
        # prompt is sent first as a copy with max_new_tokens=0 and awaited ("Cache the common prefix for
        # parallel sampling"), then the n copies are sent; choice 0 queues twice (SchedulerAssumption.primes_choices).
        "primes_choices": True,
    },
    tokenize_path="/tokenize",
    tokenize_body=_openai_tokenize_body,
    tokenize_count=_openai_tokenize_count,
)

_TGI = Adapter(
    kind="tgi",
    metrics={
        "running": MetricSource(("tgi_batch_current_size",)),
        "waiting": MetricSource(("tgi_queue_size",)),
        "prompt_tokens": MetricSource(("tgi_request_input_length_sum",)),
        "generation_tokens": MetricSource(("tgi_request_generated_tokens_sum",)),
    },
    # TGI launcher defaults: max_batch_prefill_tokens 4096, waiting_served_ratio 0.3,
    # max_waiting_tokens 20; the batch token budget is derived from free memory.
    scheduler_defaults={
        "max_batch_prefill_tokens": 4096,
        "waiting_served_ratio": 0.3,
        "max_waiting_tokens": 20,
        "max_concurrent_requests": 128,
    },
    tokenize_path="/tokenize",
    tokenize_body=_tgi_tokenize_body,
    tokenize_count=_list_count,
)

_LLAMACPP = Adapter(
    kind="llamacpp",
    metrics={
        "running": MetricSource(("llamacpp:requests_processing",)),
        "waiting": MetricSource(("llamacpp:requests_deferred",)),
        "prompt_tokens": MetricSource(("llamacpp:prompt_tokens_total",)),
        "generation_tokens": MetricSource(("llamacpp:tokens_predicted_total",)),
    },
    # llama-server (tools/server/README.md): n_batch 2048 tokens per llama_decode (decoding
    # slots first, then prompt chunks slot by slot), n_ubatch 512, continuous batching on,
    # --parallel -1 = auto = 4 slots (a request beyond them is deferred until one frees),
    # cache_prompt true (per-slot longest-common-prefix reuse, any length: page size 1; a slot keeps only
    # its last prompt, and without --cache-ram a request in between may take it: slot_cache).
    # /props reports the real slot count (total_slots), which overrides max_num_seqs.
    scheduler_defaults={
        "n_batch": 2048,
        "n_ubatch": 512,
        "max_num_seqs": 4,
        "page_size": 1,
        "continuous_batching": True,
        "prefix_caching": True,
        "slot_cache": True,
    },
    tokenize_path="/tokenize",
    tokenize_body=_llamacpp_tokenize_body,
    tokenize_count=_list_count,
    template_path="/apply-template",
    slots_path="/slots",
    slots_metrics=_llamacpp_slots_metrics,
)

_OPENAI = Adapter(
    kind="openai",
    metrics={},
    scheduler_defaults={},
    health_path="/v1/models",
    metrics_path=None,
)

ADAPTERS: Mapping[str, Adapter] = {a.kind: a for a in (_VLLM, _SGLANG, _TGI, _LLAMACPP, _OPENAI)}


def adapter(kind: str) -> Adapter:
    try:
        return ADAPTERS[kind]
    except KeyError:
        raise ConfigError(f"unknown server kind {kind!r}; use one of auto, {', '.join(KINDS)}") from None


# --- capability probe -------------------------------------------------------------------

#: One tiny request per feature: (feature, endpoint key, extra body fields).
_PROBES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("chat", "chat", {}),
    ("stream_options", "completions", {"stream": True, "stream_options": {"include_usage": True}}),
    ("ignore_eos", "completions", {"ignore_eos": True}),
    ("n", "completions", {"n": 2}),
    ("logprobs", "completions", {"logprobs": 1}),
)
_PROBE_PROMPT = "Hello"


async def probe_capabilities(
    session: aiohttp.ClientSession,
    base_url: str,
    adapter: Adapter,
    model: str | None,
    *,
    headers: Mapping[str, str],
) -> dict[str, bool | int]:
    """Which request features the server accepts: a 2xx means yes, a 4xx no.

    A plain completion must work (else :class:`TargetError` with the server's
    answer: a wrong model, a refused API key); a 5xx on a feature probe counts as
    not accepted too, because a mutator should not lean on a feature that breaks.
    When n=2 is accepted, larger n (N_PROBES) are tried: the largest accepted one
    before a refusal is recorded as ``max_n`` (a llama-server with 4 slots refuses n=8). Likewise
    ``logprobs`` above 1 (LOGPROB_PROBES), recorded as ``max_logprobs`` (heldout11 refuses 20).
    """
    caps: dict[str, bool | int] = {}
    status, text = await _post(session, base_url + adapter.completions_path, _probe_body(model, {}), headers)
    if status in (401, 403):
        raise TargetError(f"{base_url} refused the API key (HTTP {status}); set it in the environment variable the CLI names")
    if status == 0:  # no HTTP answer: a timeout (a wedged engine, a setting it cannot run with) or a dropped connection
        raise TargetError(f"{base_url} did not answer a plain completion: {text[:160]}; its log may say why")
    if not 200 <= status < 300:
        raise TargetError(f"{base_url} cannot serve a plain completion (HTTP {status}): {text[:160]}")
    caps["completions"] = True
    for feature, endpoint, extra in _PROBES:
        path = adapter.chat_path if endpoint == "chat" else adapter.completions_path
        body = _probe_body(model, extra, chat=endpoint == "chat")
        status, text = await _post(session, base_url + path, body, headers)
        accepted = 200 <= status < 300
        if accepted and feature == "stream_options":
            # Accepted only if the answer is a stream that carries a usage event.
            accepted = "data:" in text and '"usage"' in text
        caps[feature] = accepted
    if caps["n"]:
        accepted_n = 2
        for n in N_PROBES:
            status, _ = await _post(session, base_url + adapter.completions_path, _probe_body(model, {"n": n}), headers)
            if not 200 <= status < 300:
                caps[MAX_N] = accepted_n
                break
            accepted_n = n
    if caps["logprobs"]:
        accepted_k = 1
        for k in LOGPROB_PROBES:
            status, _ = await _post(session, base_url + adapter.completions_path, _probe_body(model, {"logprobs": k}),
                                    headers)
            if not 200 <= status < 300:
                caps[MAX_LOGPROBS] = accepted_k
                break
            accepted_k = k
    caps["tokenize"] = False
    if adapter.tokenize_path and adapter.tokenize_body and adapter.tokenize_count:
        body = adapter.tokenize_body(_PROBE_PROMPT, model, False)
        status, text = await _post(session, base_url + adapter.tokenize_path, body, headers)
        if 200 <= status < 300:
            try:
                caps["tokenize"] = adapter.tokenize_count(json.loads(text)) > 0
            except (ValueError, TargetError):
                caps["tokenize"] = False
    return caps


def _probe_body(model: str | None, extra: Mapping[str, Any], *, chat: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": 1, "temperature": 0.0, **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": _PROBE_PROMPT}]
    else:
        body["prompt"] = _PROBE_PROMPT
    if model:
        body["model"] = model
    return body


async def _post(
    session: aiohttp.ClientSession, url: str, body: Any, headers: Mapping[str, str]
) -> tuple[int, str]:
    """(status, body text); status 0 when the connection failed."""
    try:
        async with session.post(
            url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        ) as resp:
            return resp.status, (await resp.read()).decode("utf-8", "replace")
    except asyncio.TimeoutError:
        return 0, f"no answer within {PROBE_TIMEOUT_S:g} s"
    except aiohttp.ClientError as e:
        return 0, f"{e.__class__.__name__}: {e}"
