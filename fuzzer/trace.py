"""Traces: the fuzzer's input (ARCHITECTURE.md, "Traces").

A trace is a small JSON document: named shared-prefix groups and a list of
requests with arrival offsets. This module holds the frozen value types, their
validation (every error names a JSON path, the bad value and the rule), the
canonical JSON form and the content hash that identifies a trace in the store.

Format history:
    1 - first version: prefixes, requests with id, at_ms, prompt_tokens, prefix,
        max_tokens, stream, api, ignore_eos, cancel_after_tokens, n, logprobs,
        temperature.
    1 (extended, stop 29) - optional disconnect_after_ms (a client that goes away after a
        time, before its first token if the server is slower) and seed (a sampling
        parameter). Absent means what it meant before, and the canonical form omits them
        when absent, so every earlier trace keeps its content hash.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from fuzzer.errors import NO_VALUE, TraceError

FORMAT_VERSION = 1

#: Request ids travel in the X-Request-Id header and in file names: keep them plain.
ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")

APIS = ("completions", "chat")

# Bounds that catch nonsense without limiting real use. A trace longer than an
# hour is a soak test, not a fuzzing input; 1 Mi tokens is above every served
# max_model_len we know of; vLLM caps n and logprobs at these values by default.
MAX_AT_MS = 3_600_000
MAX_PROMPT_TOKENS = 1 << 20
MAX_OUTPUT_TOKENS = 1 << 20
MAX_N = 16
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
MAX_REQUESTS = 4096
#: The n (and logprobs) values the mutators draw and the capability probe asks a server about
#: (vLLM 37343 used n=8, logprobs=20; small values cost nothing).
N_VALUES = (2, 4, 8)
LOGPROB_VALUES = (1, 5, MAX_LOGPROBS)


@dataclass(frozen=True)
class Request:
    """One request of a trace. Only id, at_ms, prompt_tokens and max_tokens are required."""

    id: str
    at_ms: float
    prompt_tokens: int
    max_tokens: int
    prefix: str | None = None
    stream: bool = True
    api: str = "completions"
    ignore_eos: bool = True
    cancel_after_tokens: int | None = None
    n: int = 1
    logprobs: int | None = None
    temperature: float = 0.0
    #: The client closes its connection this long after sending, whatever it has received
    #: (a client or proxy timeout): before the first token when the server is slower.
    disconnect_after_ms: float | None = None
    #: The sampling seed sent with the request (engines take a per-request generator path).
    seed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _OMITTED_WHEN_ABSENT and value is None:
                continue  # fields added after format 1: absent keeps earlier content hashes
            if f.name == "disconnect_after_ms":
                value = _plain_number(value)
            if f.name == "at_ms":
                value = _plain_number(value)
            elif f.name == "temperature":
                value = float(value)
            out[f.name] = value
        return out


#: Request fields the canonical form leaves out when they are None (added after format 1).
_OMITTED_WHEN_ABSENT = frozenset({"disconnect_after_ms", "seed"})
#: The largest seed vLLM and the OpenAI API take (a signed 64-bit integer).
MAX_SEED = (1 << 63) - 1


def disconnects(request: "Request") -> bool:
    """Whether the trace has the client of ``request`` go away before its answer ends."""
    return request.cancel_after_tokens is not None or request.disconnect_after_ms is not None


@dataclass(frozen=True)
class Trace:
    """A set of requests with arrival offsets and named shared-prefix groups.

    Requests are kept sorted by ``at_ms`` (stable: requests planned for the same
    instant keep the order they were given in, which is their send order).
    """

    requests: tuple[Request, ...]
    prefixes: Mapping[str, int] = field(default_factory=dict)
    name: str = ""
    format: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.requests, key=lambda r: r.at_ms))
        object.__setattr__(self, "requests", ordered)
        object.__setattr__(self, "prefixes", dict(sorted(self.prefixes.items())))

    # --- identity -----------------------------------------------------------------

    def content(self) -> dict[str, Any]:
        """What the trace *does*: everything but its name."""
        return {
            "format": self.format,
            "prefixes": dict(self.prefixes),
            "requests": [r.to_dict() for r in self.requests],
        }

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.content()}

    def content_hash(self) -> str:
        """sha256 of the canonical JSON of the trace's content (the name is not part of it)."""
        return hashlib.sha256(canonical_json(self.content()).encode()).hexdigest()

    # --- convenience ----------------------------------------------------------------

    def request(self, request_id: str) -> Request:
        for r in self.requests:
            if r.id == request_id:
                return r
        raise KeyError(request_id)

    def prefix_tokens(self, request: Request) -> int:
        return self.prefixes[request.prefix] if request.prefix else 0

    def duration_ms(self) -> float:
        return self.requests[-1].at_ms - self.requests[0].at_ms if self.requests else 0.0

    def with_requests(self, requests: tuple[Request, ...] | list[Request]) -> "Trace":
        """The same trace with other requests; prefixes no request uses are dropped."""
        used = {r.prefix for r in requests if r.prefix}
        return replace(
            self,
            requests=tuple(requests),
            prefixes={k: v for k, v in self.prefixes.items() if k in used},
        )


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` in exact integer arithmetic: how many blocks of ``b`` tokens hold ``a`` tokens.

    Plain operators only, so it also works elementwise on numpy integer arrays.
    """
    return -(-a // b)


def canonical_json(data: Any) -> str:
    """Sorted keys, no whitespace: equal content gives equal text."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def dumps(trace: Trace, *, indent: int | None = 1) -> str:
    """JSON text of a trace with every field written out (defaults included; fields added after format 1 only when set)."""
    if indent is None:
        return canonical_json(trace.to_dict())
    data = trace.to_dict()
    # One request per line reads best in a diff and in a bug report.
    head = {k: v for k, v in data.items() if k != "requests"}
    lines = ["{" + json.dumps(head, sort_keys=True)[1:-1] + ', "requests": [']
    rows = [json.dumps(r, sort_keys=False) for r in data["requests"]]
    lines.append(",\n".join("  " + row for row in rows))
    lines.append("]}")
    return "\n".join(lines) + "\n"


def dump(trace: Trace, path: str | Path) -> None:
    Path(path).write_text(dumps(trace))


def loads(text: str, *, source: str | None = None) -> Trace:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError("$", f"must be valid JSON ({e.msg} at line {e.lineno} column {e.colno})", NO_VALUE, source=source) from None
    return from_dict(data, source=source)


def load(path: str | Path) -> Trace:
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise TraceError("$", "file does not exist", NO_VALUE, source=str(p)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError("$", f"cannot be read ({e.__class__.__name__})", NO_VALUE, source=str(p)) from None
    return loads(text, source=str(p))


# --- validation ---------------------------------------------------------------------

_TRACE_KEYS = {"format", "name", "prefixes", "requests"}
_REQUEST_KEYS = {f.name for f in fields(Request)}
_REQUIRED = ("id", "at_ms", "prompt_tokens", "max_tokens")


def from_dict(data: Any, *, source: str | None = None) -> Trace:
    """Validate a decoded JSON document and build a :class:`Trace`.

    Raises :class:`TraceError` naming the JSON path, the rule and the bad value.
    """

    def fail(path: str, rule: str, value: Any = NO_VALUE) -> TraceError:
        return TraceError(path, rule, value, source=source)

    if not isinstance(data, dict):
        raise fail("$", "must be a JSON object", data)
    for key in data:
        if key not in _TRACE_KEYS:
            raise fail(key, f"unknown field (expected one of {', '.join(sorted(_TRACE_KEYS))})")

    fmt = data.get("format", FORMAT_VERSION)
    if not _is_int(fmt) or fmt < 1:
        raise fail("format", "must be a positive integer", fmt)
    if fmt > FORMAT_VERSION:
        raise fail("format", f"is newer than this fuzzer understands (<= {FORMAT_VERSION}); upgrade the fuzzer", fmt)

    name = data.get("name", "")
    if not isinstance(name, str):
        raise fail("name", "must be a string", name)

    prefixes_raw = data.get("prefixes", {})
    if prefixes_raw is None:
        prefixes_raw = {}
    if not isinstance(prefixes_raw, dict):
        raise fail("prefixes", "must be an object mapping a group name to its token count", prefixes_raw)
    prefixes: dict[str, int] = {}
    for key, tokens in prefixes_raw.items():
        path = f"prefixes.{key}"
        if not ID_PATTERN.match(key):
            raise fail(path, "group name must be 1-64 letters, digits or _.:- starting with a letter or digit", key)
        if not _is_int(tokens) or tokens < 1:
            raise fail(path, "must be an integer >= 1", tokens)
        if tokens > MAX_PROMPT_TOKENS:
            raise fail(path, f"must be <= {MAX_PROMPT_TOKENS}", tokens)
        prefixes[key] = tokens

    if "requests" not in data:
        raise fail("requests", "is required")
    raw_requests = data["requests"]
    if not isinstance(raw_requests, list):
        raise fail("requests", "must be a list", raw_requests)
    if not raw_requests:
        raise fail("requests", "must hold at least one request", raw_requests)
    if len(raw_requests) > MAX_REQUESTS:
        raise fail("requests", f"must hold at most {MAX_REQUESTS} requests", len(raw_requests))

    requests = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(raw_requests):
        req = _request_from_dict(raw, f"requests[{i}]", prefixes, fail)
        if req.id in seen:
            raise fail(f"requests[{i}].id", f"must be unique (also used by requests[{seen[req.id]}])", req.id)
        seen[req.id] = i
        requests.append(req)

    return Trace(requests=tuple(requests), prefixes=prefixes, name=name, format=FORMAT_VERSION)


def _request_from_dict(raw: Any, path: str, prefixes: Mapping[str, int], fail) -> Request:
    if not isinstance(raw, dict):
        raise fail(path, "must be a JSON object", raw)
    for key in raw:
        if key not in _REQUEST_KEYS:
            raise fail(f"{path}.{key}", f"unknown field (expected one of {', '.join(sorted(_REQUEST_KEYS))})")
    for key in _REQUIRED:
        if key not in raw:
            raise fail(f"{path}.{key}", "is required")

    def at(key: str) -> str:
        return f"{path}.{key}"

    rid = raw["id"]
    if not isinstance(rid, str) or not ID_PATTERN.match(rid):
        raise fail(at("id"), "must be 1-64 letters, digits or _.:- starting with a letter or digit", rid)

    at_ms = raw["at_ms"]
    if not _is_number(at_ms) or not math.isfinite(at_ms) or at_ms < 0:
        raise fail(at("at_ms"), "must be a number >= 0", at_ms)
    if at_ms > MAX_AT_MS:
        raise fail(at("at_ms"), f"must be <= {MAX_AT_MS} (one hour)", at_ms)

    prompt_tokens = _int_in(raw["prompt_tokens"], at("prompt_tokens"), 1, MAX_PROMPT_TOKENS, fail)
    max_tokens = _int_in(raw["max_tokens"], at("max_tokens"), 1, MAX_OUTPUT_TOKENS, fail)

    prefix = raw.get("prefix")
    if prefix is not None:
        if not isinstance(prefix, str):
            raise fail(at("prefix"), "must be the name of a group in prefixes, or null", prefix)
        if prefix not in prefixes:
            known = ", ".join(sorted(prefixes)) or "none defined"
            raise fail(at("prefix"), f"must name a group in prefixes ({known})", prefix)
        if prompt_tokens < prefixes[prefix]:
            raise fail(
                at("prompt_tokens"),
                f"must be >= the {prefixes[prefix]} tokens of prefix {prefix!r} it includes",
                prompt_tokens,
            )

    stream = _bool(raw.get("stream", True), at("stream"), fail)
    api = raw.get("api", "completions")
    if api not in APIS:
        raise fail(at("api"), f"must be one of {', '.join(APIS)}", api)
    ignore_eos = _bool(raw.get("ignore_eos", True), at("ignore_eos"), fail)

    cancel = raw.get("cancel_after_tokens")
    if cancel is not None:
        cancel = _int_in(cancel, at("cancel_after_tokens"), 1, MAX_OUTPUT_TOKENS, fail)
        if cancel >= max_tokens:
            raise fail(at("cancel_after_tokens"), f"must be < max_tokens ({max_tokens}) or null", cancel)
        if not stream:
            raise fail(at("cancel_after_tokens"), "requires stream: true (tokens are only seen in a stream)", cancel)

    disconnect = raw.get("disconnect_after_ms")
    if disconnect is not None:
        if not _is_number(disconnect) or not math.isfinite(disconnect) or disconnect <= 0:
            raise fail(at("disconnect_after_ms"), "must be a number > 0 (ms after sending) or null", disconnect)
        if disconnect > MAX_AT_MS:
            raise fail(at("disconnect_after_ms"), f"must be <= {MAX_AT_MS} (one hour)", disconnect)
        disconnect = float(disconnect)
    seed = raw.get("seed")
    if seed is not None:
        seed = _int_in(seed, at("seed"), 0, MAX_SEED, fail)

    n = _int_in(raw.get("n", 1), at("n"), 1, MAX_N, fail)
    logprobs = raw.get("logprobs")
    if logprobs is not None:
        logprobs = _int_in(logprobs, at("logprobs"), 0, MAX_LOGPROBS, fail)
    temperature = raw.get("temperature", 0.0)
    if not _is_number(temperature) or not math.isfinite(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise fail(at("temperature"), f"must be a number between 0 and {MAX_TEMPERATURE}", temperature)

    return Request(
        id=rid,
        at_ms=float(at_ms),
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        prefix=prefix,
        stream=stream,
        api=api,
        ignore_eos=ignore_eos,
        cancel_after_tokens=cancel,
        n=n,
        logprobs=logprobs,
        temperature=float(temperature),
        disconnect_after_ms=disconnect,
        seed=seed,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_in(value: Any, path: str, low: int, high: int, fail) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise fail(path, "must be an integer", value)
    if value < low:
        raise fail(path, f"must be >= {low}", value)
    if value > high:
        raise fail(path, f"must be <= {high}", value)
    return value


def _bool(value: Any, path: str, fail) -> bool:
    if not isinstance(value, bool):
        raise fail(path, "must be true or false", value)
    return value


def _plain_number(value: float) -> int | float:
    """12.0 -> 12 so canonical JSON does not depend on how a number was typed."""
    return int(value) if float(value).is_integer() else float(value)


def validate(trace: Trace) -> Trace:
    """Check a trace built in code (by a mutator, say) against the same rules as a loaded one."""
    return from_dict(trace.to_dict())
