"""Mooncake trace JSONL, as AIPerf's ``mooncake_trace`` loader, vLLM's benchmark, GuideLLM and
Dynamo read it: one JSON object a line, ``{"timestamp", "input_length", "output_length",
"hash_ids"}``, timestamps in milliseconds, each hash id naming one block of ``block_size``
prompt tokens (512 in AIPerf and the FAST'25 traces); requests whose ``hash_ids`` start
alike share that many leading blocks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fuzzer.errors import FormatError
from fuzzer.formats._text import read_text
from fuzzer.formats.records import ProductionRequest
from fuzzer.trace import Trace

#: AIPerf's and the FAST'25 traces' block size: one hash id per 512 prompt tokens.
DEFAULT_BLOCK_SIZE = 512

#: Fields of a request Mooncake has no place for: an export drops them and says so.
_NOT_IN_MOONCAKE = ("stream", "api", "ignore_eos", "cancel_after_tokens", "n", "logprobs", "temperature",
                    "disconnect_after_ms", "seed")


def read(path: Path) -> list[ProductionRequest]:
    """Every request of a Mooncake JSONL file, in file order."""
    out = []
    for lineno, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise FormatError(f"{where}: not a JSON object ({e.msg}); Mooncake traces hold one object a line") from None
        out.append(_record(row, where))
    if not out:
        raise FormatError(f"{path}: holds no request")
    return out


def _record(row: Any, where: str) -> ProductionRequest:
    if not isinstance(row, dict):
        raise FormatError(f"{where}: must be a JSON object, got {type(row).__name__}")
    if "input_length" not in row and ("text_input" in row or "messages" in row or "payload" in row):
        raise FormatError(f"{where}: text_input/messages/payload rows are not supported; need input_length")
    timestamp = row.get("timestamp")
    if not _number(timestamp) or timestamp < 0:
        raise FormatError(f"{where}: timestamp must be a number of milliseconds >= 0, got {_show(timestamp)}")
    lengths = []
    for key in ("input_length", "output_length"):
        value = row.get(key)
        if not _integer(value) or value < 0:
            raise FormatError(f"{where}: {key} must be an integer >= 0, got {_show(value)}")
        lengths.append(value)
    hash_ids = row.get("hash_ids") or []
    if not isinstance(hash_ids, list) or not all(_integer(h) for h in hash_ids):
        raise FormatError(f"{where}: hash_ids must be a list of integers, got {_show(row.get('hash_ids'))}")
    return ProductionRequest(float(timestamp), lengths[0], lengths[1], tuple(hash_ids))


def dumps(trace: Trace, *, block_size: int = DEFAULT_BLOCK_SIZE) -> str:
    """The trace as Mooncake JSONL: one line a request, in send order, timestamps in ms from 0.

    A prefix group becomes ceil(prefix / block_size) hash ids that every member starts with;
    the rest of each prompt gets fresh ids, one per block. Importing the output with the same
    block size gives the same lengths, gaps and groups back.
    """
    if block_size < 1:
        raise FormatError(f"--block-size must be >= 1, got {block_size}")
    next_id = 0
    groups: dict[str, list[int]] = {}
    lines = []
    for r in trace.requests:
        blocks = math.ceil(r.prompt_tokens / block_size)
        shared: list[int] = []
        if r.prefix is not None:
            if r.prefix not in groups:
                count = math.ceil(trace.prefixes[r.prefix] / block_size)
                groups[r.prefix] = list(range(next_id, next_id + count))
                next_id += count
            shared = groups[r.prefix][:blocks]
        fresh = list(range(next_id, next_id + blocks - len(shared)))
        next_id += len(fresh)
        row = {"timestamp": _plain(r.at_ms), "input_length": r.prompt_tokens, "output_length": r.max_tokens,
               "hash_ids": shared + fresh}
        lines.append(json.dumps(row))
    return "\n".join(lines) + "\n"


def dropped_fields(trace: Trace) -> list[str]:
    """The request fields set away from their defaults that Mooncake JSONL cannot carry."""
    defaults = {"stream": True, "api": "completions", "ignore_eos": True, "cancel_after_tokens": None, "n": 1,
                "logprobs": None, "temperature": 0.0, "disconnect_after_ms": None, "seed": None}
    return [name for name in _NOT_IN_MOONCAKE if any(getattr(r, name) != defaults[name] for r in trace.requests)]


def _plain(value: float) -> int | float:
    return int(value) if float(value).is_integer() else round(float(value), 3)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: Any) -> str:
    text = json.dumps(value) if value is not None else "nothing"
    return text if len(text) <= 40 else text[:37] + "..."
