"""Server adapters: what each inference engine exposes and how to read it (SPEC §4).

An :class:`Adapter` knows an engine's endpoints (health, tokenize, info), maps its
Prometheus metric names onto the fuzzer's common names, and carries the engine's
documented scheduler defaults, which the oracle reads as assumptions.

``detect`` tells engines apart from the answers of a few GET endpoints (a
:class:`Fingerprint`), so it is a pure function testable against recorded
responses; ``fingerprint`` fetches those answers and ``probe_capabilities`` asks
the server which request features it accepts.

Sources: each engine's public docs and sources, summarised in
``shared/research/servers.md`` (vLLM ``v1/metrics/loggers.py``, SGLang
``srt/metrics/collector.py``, TGI ``docs/source/reference/metrics.md``, llama.cpp
``tools/server/README.md``).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import aiohttp

from fuzzer.errors import ConfigError, TargetError

if TYPE_CHECKING:
    from fuzzer.expectation import SchedulerAssumption

KINDS = ("vllm", "sglang", "tgi", "llamacpp", "openai")

#: The GET endpoints whose answers identify an engine (see :func:`detect`).
FINGERPRINT_PATHS = ("/metrics", "/v1/models", "/version", "/info", "/props", "/get_server_info")

#: Request features the capability probe asks about. Mutators avoid what a target rejects.
FEATURES = ("completions", "chat", "stream_options", "ignore_eos", "n", "logprobs", "tokenize")
#: Capability key of the largest ``n`` a server accepts, recorded only when it refuses a
#: larger one (llama-server refuses n above its slot count): an int, not a bool.
MAX_N = "max_n"
#: The ``n`` values tried above 2 when the server accepts n=2: up to the largest n the
#: mutators draw (fuzzer.mutators), so a refusal below it is recorded.
N_PROBES = (4, 8)

# A fingerprint answer is only read this far: metric pages of busy servers are
# tens of kB, and the names that identify an engine are in the first lines.
_FINGERPRINT_MAX_BYTES = 1 << 20
# Probing a server must not hang the tool: each probe request gets this long.
PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Metric:
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
    metrics: Mapping[str, Metric]
    #: Documented scheduler defaults of the engine (the oracle's assumptions).
    scheduler_defaults: Mapping[str, Any]
    health_path: str = "/health"
    metrics_path: str | None = "/metrics"
    completions_path: str = "/v1/completions"
    chat_path: str = "/v1/chat/completions"
    models_path: str = "/v1/models"
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

    @property
    def max_n(self) -> int | None:
        """The largest ``n`` (choices per request) the server accepts; None when no limit was seen."""
        if not self.accepts("n"):
            return 1
        value = self.capabilities.get(MAX_N)
        return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Fingerprint:
    """Answers of the FINGERPRINT_PATHS: path -> (HTTP status, body text); absent = unreachable."""

    answers: Mapping[str, tuple[int, str]]

    def ok(self, path: str) -> str | None:
        status, body = self.answers.get(path, (0, ""))
        return body if 200 <= status < 300 else None

    def json(self, path: str) -> Any:
        body = self.ok(path)
        if body is None:
            return None
        try:
            return json.loads(body)
        except ValueError:
            return None


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
        "running": Metric(("vllm:num_requests_running",)),
        "waiting": Metric(("vllm:num_requests_waiting",)),
        "kv_usage": Metric(("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), mean=True),
        "preemptions": Metric(("vllm:num_preemptions_total",)),
        "prefix_cache_hits": Metric(("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")),
        "prefix_cache_queries": Metric(("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")),
        "prompt_tokens": Metric(("vllm:prompt_tokens_total",)),
        "generation_tokens": Metric(("vllm:generation_tokens_total",)),
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
    },
    tokenize_path="/tokenize",
    tokenize_body=_openai_tokenize_body,
    tokenize_count=_openai_tokenize_count,
)

_SGLANG = Adapter(
    kind="sglang",
    metrics={
        "running": Metric(("sglang:num_running_reqs",)),
        "waiting": Metric(("sglang:num_queue_reqs",)),
        "kv_usage": Metric(("sglang:token_usage",), mean=True),
        "preemptions": Metric(("sglang:num_retracted_requests_total",)),
        # SGLang counts prefix-cache hits in tokens as cached_tokens; every prompt token is a query.
        "prefix_cache_hits": Metric(("sglang:cached_tokens_total",)),
        "prefix_cache_queries": Metric(("sglang:prompt_tokens_total",)),
        "prompt_tokens": Metric(("sglang:prompt_tokens_total",)),
        "generation_tokens": Metric(("sglang:generation_tokens_total",)),
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
    },
    tokenize_path="/tokenize",
    tokenize_body=_openai_tokenize_body,
    tokenize_count=_openai_tokenize_count,
)

_TGI = Adapter(
    kind="tgi",
    metrics={
        "running": Metric(("tgi_batch_current_size",)),
        "waiting": Metric(("tgi_queue_size",)),
        "prompt_tokens": Metric(("tgi_request_input_length_sum",)),
        "generation_tokens": Metric(("tgi_request_generated_tokens_sum",)),
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
        "running": Metric(("llamacpp:requests_processing",)),
        "waiting": Metric(("llamacpp:requests_deferred",)),
        "prompt_tokens": Metric(("llamacpp:prompt_tokens_total",)),
        "generation_tokens": Metric(("llamacpp:tokens_predicted_total",)),
    },
    # llama-server (tools/server/README.md): n_batch 2048 tokens per llama_decode (decoding
    # slots first, then prompt chunks slot by slot), n_ubatch 512, continuous batching on,
    # --parallel -1 = auto = 4 slots (a request beyond them is deferred until one frees),
    # cache_prompt true (per-slot longest-common-prefix reuse, any length: page size 1).
    # /props reports the real slot count (total_slots), which overrides max_num_seqs.
    scheduler_defaults={
        "n_batch": 2048,
        "n_ubatch": 512,
        "max_num_seqs": 4,
        "page_size": 1,
        "continuous_batching": True,
        "prefix_caching": True,
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


def scheduler_assumption(info: ServerInfo | None, **overrides: int | None) -> SchedulerAssumption:
    """What the oracle assumes of a server's scheduler: its adapter's documented defaults,
    then what the server itself reports (llama.cpp's slot count), then the user's overrides.
    No info (the in-process simulator): vLLM's defaults, which the simulator follows."""
    from fuzzer.expectation import SchedulerAssumption, assumption_for  # noqa: PLC0415 (the model needs no adapters)

    if info is None:
        return assumption_for("vllm", adapter("vllm").scheduler_defaults, **overrides) if overrides else SchedulerAssumption()
    return assumption_for(info.kind, {**adapter(info.kind).scheduler_defaults, **info.scheduler}, **overrides)


# --- detection --------------------------------------------------------------------------

_METRIC_PREFIXES = (("vllm:", "vllm"), ("sglang:", "sglang"), ("llamacpp:", "llamacpp"), ("tgi_", "tgi"))
_OWNED_BY = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp", "text-generation-inference": "tgi"}


def detect(fp: Fingerprint) -> str:
    """The engine kind a fingerprint shows; ``openai`` when nothing specific is recognised.

    Evidence, strongest first: metric name prefixes on /metrics; the engine's own
    info endpoint (TGI /info, llama.cpp /props, SGLang /get_server_info); the
    ``owned_by`` of /v1/models; vLLM's bare /version.
    """
    metrics = fp.ok("/metrics")
    if metrics:
        for line in metrics.splitlines():
            if line.startswith("#"):
                continue
            for prefix, kind in _METRIC_PREFIXES:
                if line.startswith(prefix):
                    return kind
    info = fp.json("/info")
    if isinstance(info, dict) and "model_id" in info and ("max_total_tokens" in info or "docker_label" in info):
        return "tgi"
    props = fp.json("/props")
    if isinstance(props, dict) and ("default_generation_settings" in props or "total_slots" in props):
        return "llamacpp"
    server_info = fp.json("/get_server_info")
    if isinstance(server_info, dict) and ("model_path" in server_info or "tokenizer_path" in server_info):
        return "sglang"
    models = fp.json("/v1/models")
    if isinstance(models, dict) and isinstance(models.get("data"), list):
        for entry in models["data"]:
            owner = entry.get("owned_by") if isinstance(entry, dict) else None
            if owner in _OWNED_BY:
                return _OWNED_BY[owner]
    version = fp.json("/version")
    if isinstance(version, dict) and set(version) == {"version"}:
        return "vllm"
    return "openai"


def reported_scheduler(fp: Fingerprint, kind: str) -> dict[str, Any]:
    """Scheduler parameters the server reports about itself (see :attr:`ServerInfo.scheduler`).

    llama.cpp: /props ``total_slots`` is the number of requests served at once
    (``max_num_seqs``); more wait, deferred, until a slot frees. vLLM (and the built-in
    simulator): the KV cache's size, ``num_gpu_blocks`` blocks of ``block_size`` tokens,
    from the labels of /metrics' ``vllm:cache_config_info``.
    """
    if kind == "vllm":
        return kv_cache_config(fp.ok("/metrics") or "")
    if kind == "llamacpp":
        props = fp.json("/props")
        slots = props.get("total_slots") if isinstance(props, dict) else None
        if isinstance(slots, int) and not isinstance(slots, bool) and slots > 0:
            return {"max_num_seqs": slots}
    return {}


def kv_cache_config(metrics_text: str) -> dict[str, int]:
    """``{"num_gpu_blocks": N, "block_size": B}`` from vLLM's ``vllm:cache_config_info`` line; {} without it."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line[: line.rfind("}")]))
            try:
                blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
            except (KeyError, ValueError):
                return {}
            return {"num_gpu_blocks": blocks, "block_size": size} if blocks > 0 and size > 0 else {}
    return {}


def describe(fp: Fingerprint, kind: str) -> tuple[str | None, str | None, int | None]:
    """(version, first model id, max_model_len) as far as the fingerprint tells."""
    version: str | None = None
    model: str | None = None
    max_len: int | None = None
    models = fp.json("/v1/models")
    if isinstance(models, dict) and isinstance(models.get("data"), list) and models["data"]:
        first = models["data"][0]
        if isinstance(first, dict):
            model = first.get("id") if isinstance(first.get("id"), str) else None
            if isinstance(first.get("max_model_len"), int):
                max_len = first["max_model_len"]
    if kind == "vllm":
        v = fp.json("/version")
        version = v.get("version") if isinstance(v, dict) else None
    elif kind == "tgi":
        info = fp.json("/info") or {}
        version = info.get("version")
        model = model or info.get("model_id")
        max_len = max_len or info.get("max_total_tokens")
    elif kind == "llamacpp":
        props = fp.json("/props") or {}
        version = props.get("build_info")
        settings = props.get("default_generation_settings") or {}
        max_len = max_len or settings.get("n_ctx")
    elif kind == "sglang":
        info = fp.json("/get_server_info") or {}
        version = info.get("version")
        max_len = max_len or info.get("context_length")
    return (version if isinstance(version, str) else None, model, max_len if isinstance(max_len, int) else None)


async def fingerprint(session: aiohttp.ClientSession, base_url: str, *, headers: Mapping[str, str]) -> Fingerprint:
    """GET every FINGERPRINT_PATH (concurrently); unreachable paths are left out."""

    async def get(path: str) -> tuple[str, tuple[int, str] | None]:
        try:
            async with session.get(
                base_url + path, headers=headers, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            ) as resp:
                body = await resp.content.read(_FINGERPRINT_MAX_BYTES)
                return path, (resp.status, body.decode("utf-8", "replace"))
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return path, None

    answers = await asyncio.gather(*(get(p) for p in FINGERPRINT_PATHS))
    if all(a is None for _, a in answers):
        raise TargetError(f"cannot reach {base_url}: no answer on {', '.join(FINGERPRINT_PATHS)}")
    return Fingerprint({p: a for p, a in answers if a is not None})


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
    before a refusal is recorded as ``max_n`` (a llama-server with 4 slots refuses n=8).
    """
    caps: dict[str, bool | int] = {}
    status, text = await _post(session, base_url + adapter.completions_path, _probe_body(model, {}), headers)
    if status in (401, 403):
        raise TargetError(f"{base_url} refused the API key (HTTP {status}); set it in the environment variable the CLI names")
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
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return 0, f"{e.__class__.__name__}: {e}"
