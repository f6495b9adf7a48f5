"""The registry of fault modes of the simulated server (issue 8).

Pathologies (``fuzzer.sim.pathologies``) make a healthy server slow; faults make it
misbehave the way flaky servers do overnight: 5xx answers, connections reset mid-stream,
streams that hang past the client's timeout, malformed or truncated SSE, and a crash that
takes the whole server down until it restarts. Each is off unless named
(``fuzz sim --faults http-500,crash`` or ``all``), documented below by a class whose
docstring says what it models and what a client sees, and tagged with the finding kind
(ARCHITECTURE.md, "Oracle") a campaign must record for it.

Which request a fault hits is deterministic: a hash of the simulator's seed, the fault's
name and the request's shape (prompt tokens, max_tokens) falls under the fault rate. The
executor salts prompt *text* per execution but keeps prompt *lengths* exact, so running
the same trace again hits the same requests: a fault reproduces, and can be confirmed
and minimized like any other finding. At most one fault hits a request (the first one,
in registry order).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from typing import ClassVar

from fuzzer.errors import ConfigError
from fuzzer.sim.config import select

HTTP_500 = "http-500"
RESET = "reset"
HANG = "hang"
MALFORMED_SSE = "malformed-sse"
TRUNCATED_SSE = "truncated-sse"
CRASH = "crash"

#: Share of requests each switched-on fault hits. One in twenty: a campaign meets every
#: fault within a few dozen executions, and most executions still run clean.
DEFAULT_RATE = 0.05
#: Requests a fresh simulator serves before faults begin, when asked for a grace period: a
#: calibration sends ~420 fixed-shape probes and fails on the first failed one (a server
#: that fails from its first request is broken, not flaky), so twice that.
CALIBRATION_GRACE_REQUESTS = 1000
#: How long a crashed simulator stays down before it restarts (scaled by --speed). Real
#: servers restart in tens of seconds under a supervisor; two seconds keeps the tests short
#: while still several client backoff steps long.
CRASH_DOWN_S = 2.0


@dataclass(frozen=True)
class FaultInfo:
    """What ``fuzz sim --list`` shows about one fault."""

    name: str
    summary: str
    client_sees: str
    #: The finding kind (ARCHITECTURE.md, "Oracle") a campaign should record for it.
    kind: str


class _Fault:
    name: ClassVar[str]
    client_sees: ClassVar[str]
    kind: ClassVar[str]

    @classmethod
    def info(cls) -> FaultInfo:
        summary = (cls.__doc__ or "").strip().splitlines()[0]
        return FaultInfo(cls.name, summary, cls.client_sees, cls.kind)


class Http500(_Fault):
    """The server answers 500 Internal Server Error instead of generating.

    Models an engine exception surfacing in the OpenAI front end (vLLM answers
    ``{"error": {..., "code": 500}}`` when the engine core raises).
    """

    name = HTTP_500
    client_sees = "HTTP 500 with an OpenAI-style error body, no tokens"
    kind = "error"


class Reset(_Fault):
    """The connection is reset after the first chunk (a worker dying mid-response).

    Streaming requests get their headers and one chunk; non-streaming requests get
    nothing. Then the TCP connection is aborted.
    """

    name = RESET
    client_sees = "a connection reset before the response ended"
    kind = "error"


class Hang(_Fault):
    """The response never comes: headers (streaming) or nothing (non-streaming), then silence.

    Models a stuck engine loop behind a live front end. The server holds the connection
    until the client gives up; only the client's read timeout ends the request.
    """

    name = HANG
    client_sees = "no byte after the headers until the client's timeout fires"
    kind = "hang"


class MalformedSse(_Fault):
    """A stream event that is not JSON (``data: {not json``), then ``[DONE]``.

    Non-streaming requests get a 200 whose body is not valid JSON.
    """

    name = MALFORMED_SSE
    client_sees = "an SSE event whose data is not JSON (or a body that is not JSON)"
    kind = "protocol"


class TruncatedSse(_Fault):
    """The stream stops in the middle of an event and closes cleanly, without ``[DONE]``.

    Models a front end that drops the rest of a response on an internal error.
    Non-streaming requests get a JSON body cut off in the middle.
    """

    name = TRUNCATED_SSE
    client_sees = "a stream that ends mid-event without data: [DONE] (or a cut-off JSON body)"
    kind = "protocol"


class Crash(_Fault):
    """The whole server goes down (every connection reset, port closed), then restarts cold.

    Models an engine crash (CUDA error, OOM kill) under a supervisor that restarts it:
    in-flight requests are reset, new connections are refused for ``CRASH_DOWN_S``
    (divided by --speed), then the server listens again on the same port with an empty
    engine (no KV, no prefix cache, cold).
    """

    name = CRASH
    client_sees = "connection resets, then connection refused until the restart"
    kind = "crash"


_REGISTRY: tuple[type[_Fault], ...] = (Crash, Hang, Reset, Http500, MalformedSse, TruncatedSse)

#: Every fault name, in the order ``--list`` shows them (and the order they are tried in).
NAMES: tuple[str, ...] = tuple(f.name for f in _REGISTRY)
#: Finding kind per fault name.
KIND: dict[str, str] = {f.name: f.kind for f in _REGISTRY}


def describe() -> tuple[FaultInfo, ...]:
    """What each fault models and what a client sees."""
    return tuple(f.info() for f in _REGISTRY)


def parse(spec: str | None) -> tuple[str, ...]:
    """``"all"``, ``"none"`` (or empty) or comma-separated names -> names in registry order.

    Raises :class:`ConfigError` naming the valid choices for an unknown name.
    """
    return select(spec, NAMES, "fault")


def validate(names: tuple[str, ...] | list[str] | str) -> tuple[str, ...]:
    """Normalize a fault selection given in code (a tuple of names or a spec string)."""
    return select(names, NAMES, "fault")


def check_rate(rate: float) -> float:
    if not 0.0 <= rate <= 1.0:
        raise ConfigError(f"--fault-rate must be between 0 and 1 (0.05: one request in twenty), got {rate}")
    return rate


@dataclass(frozen=True)
class FaultPlan:
    """Which faults are on, how often they hit, and the seed that picks the requests."""

    names: tuple[str, ...] = ()
    rate: float = DEFAULT_RATE
    seed: int = 0
    #: Generation requests served fault-free first (counted over restarts after a crash).
    grace_requests: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", validate(self.names))
        check_rate(self.rate)
        if self.grace_requests < 0:
            raise ConfigError(f"--fault-grace must be >= 0 requests, got {self.grace_requests}")

    def choose(self, prompt_tokens: int, max_tokens: int, served: int = 0) -> str | None:
        """The fault that hits a request of this shape, or None: the same answer every time.

        ``served``: generation requests the server answered before this one (the grace period).
        """
        if served < self.grace_requests:
            return None
        for name in self.names:
            if _uniform(f"{self.seed}:{name}:{prompt_tokens}:{max_tokens}") < self.rate:
                return name
        return None


def _uniform(key: str) -> float:
    """A number in [0, 1) fixed by ``key`` (the same in every process, unlike hash())."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


# --- what a faulty response looks like on the wire ------------------------------------------------


async def respond(fault: str, request, *, stream: bool, chat: bool, response_id: str, model: str):
    """Answer ``request`` (an aiohttp request) the way ``fault`` misbehaves; crash is the server's job.

    A reset or a hang never returns: the handler is cancelled when the connection goes.
    """
    from aiohttp import web  # noqa: PLC0415 - the registry above stays importable without aiohttp

    if fault == HTTP_500:
        body = {"error": {"message": "simulated internal server error (fault http-500)",
                          "type": "InternalServerError", "param": None, "code": 500}}
        return web.json_response(body, status=500)
    if not stream:
        if fault == HANG:
            await asyncio.Event().wait()  # until the client goes away and the handler is cancelled
        if fault == RESET:
            await _abort(request)
        whole = json.dumps({"id": response_id, "object": "text_completion", "model": model, "choices": []})
        text = "{not json" if fault == MALFORMED_SSE else whole[: len(whole) // 2]
        return web.Response(text=text, content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    if fault == HANG:
        await asyncio.Event().wait()
    first = _chunk(chat, response_id, model)
    await response.write(first)
    if fault == RESET:
        await _abort(request)
    if fault == MALFORMED_SSE:
        await response.write(b"data: {not json\n\ndata: [DONE]\n\n")
    elif fault == TRUNCATED_SSE:
        await response.write(first[: len(first) // 2])
    await response.write_eof()
    return response


def _chunk(chat: bool, response_id: str, model: str) -> bytes:
    if chat:
        choice = {"index": 0, "delta": {"role": "assistant", "content": " the"}, "logprobs": None, "finish_reason": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": " the", "logprobs": None, "finish_reason": None}
        obj = "text_completion"
    event = {"id": response_id, "object": obj, "model": model, "choices": [choice]}
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


async def _abort(request) -> None:
    """Reset the connection; the server then cancels this handler (it never returns)."""
    if request.transport is not None:
        request.transport.abort()
    await asyncio.Event().wait()
