"""Detection: which inference engine a target runs, from the answers of a few GET endpoints.

A :class:`Fingerprint` holds those answers; ``detect`` tells engines apart from it
and ``describe``/``reported_scheduler`` read the version, model, context length and
scheduler parameters the server reports about itself. All are pure functions,
testable against recorded responses; only ``fingerprint`` talks to the server.
:mod:`fuzzer.execute.adapters` holds what is known of each engine (its :class:`~fuzzer.execute.adapters.Adapter`).

Sources: each engine's public docs and sources, summarised in
ARCHITECTURE.md, "Engines".
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from fuzzer.errors import TargetError
from fuzzer.execute import scope

#: The GET endpoints whose answers identify an engine (see :func:`detect`).
FINGERPRINT_PATHS = ("/metrics", "/v1/models", "/version", "/info", "/props", "/get_server_info")

# A fingerprint answer is only read this far: metric pages of busy servers are
# tens of kB, and the names that identify an engine are in the first lines.
_FINGERPRINT_MAX_BYTES = 1 << 20
# Probing a server must not hang the tool: each probe request gets this long.
PROBE_TIMEOUT_S = 30.0


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


#: Scheduler parameters a vLLM-like server may report among its cache_config_info labels.
_SCHEDULER_LABELS = ("max_num_batched_tokens", "max_num_seqs")


def reported_scheduler(fp: Fingerprint, kind: str) -> dict[str, Any]:
    """Scheduler parameters the server reports about itself (see :attr:`fuzzer.execute.adapters.ServerInfo.scheduler`).

    llama.cpp: /props ``total_slots`` is the number of requests served at once
    (``max_num_seqs``); more wait, deferred, until a slot frees. vLLM (and the built-in
    simulator): the KV cache's size, ``num_gpu_blocks`` blocks of ``block_size`` tokens,
    from the labels of /metrics' ``vllm:cache_config_info``, and the token budget and seats where
    those labels report them (:func:`cache_config_labels`).
    """
    if kind == "vllm":
        return cache_config_labels(fp.ok("/metrics") or "")
    if kind == "llamacpp":
        props = fp.json("/props")
        slots = props.get("total_slots") if isinstance(props, dict) else None
        if isinstance(slots, int) and not isinstance(slots, bool) and slots > 0:
            return {"max_num_seqs": slots}
    return {}


def cache_config_labels(metrics_text: str) -> dict[str, int]:
    """What vLLM's ``vllm:cache_config_info`` line reports: ``num_gpu_blocks`` with ``block_size`` (the KV
    cache's size), and ``max_num_batched_tokens`` and ``max_num_seqs`` where a server adds them to
    those labels (vLLM's own line has only its cache config; vLLM-like servers of benchmarks/ report
    their scheduler's too). Positive integers only; {} without the line."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line[: line.rfind("}")]))
            found = {k: int(v) for k, v in labels.items()
                     if k in ("num_gpu_blocks", "block_size", *_SCHEDULER_LABELS) and v.isdigit() and int(v) > 0}
            if not {"num_gpu_blocks", "block_size"} <= found.keys():  # a KV cache's size needs both
                found = {k: v for k, v in found.items() if k in _SCHEDULER_LABELS}
            return found
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

    answers = await scope.run_all(*(get(p) for p in FINGERPRINT_PATHS))
    if all(a is None for _, a in answers):
        raise TargetError(f"cannot reach {base_url}: no answer on {', '.join(FINGERPRINT_PATHS)}")
    return Fingerprint({p: a for p, a in answers if a is not None})
