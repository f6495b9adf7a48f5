"""Waiting out a server that went down (crashed, restarting, refusing connections).

A request that fails is data; a target that cannot even be asked (its /tokenize or
/metrics refused before the trace starts) raises :class:`~fuzzer.errors.TargetError`
and nothing was measured. A campaign then waits with backoff for as long as it runs
(:mod:`fuzzer.search.campaign`); an interactive command such as ``fuzz minimize`` wraps its
target in a :class:`PatientTarget`, which waits a bounded time and then gives up with
one clear error (its progress is already saved, so the same command resumes).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, Callable, Iterator

from yarl import URL

from fuzzer.errors import TargetError
from fuzzer.execution import ExecutionResult, Target
from fuzzer.trace import Request, Trace

#: How long the check that a server still listens (:func:`refuses_connections`) waits for a connection.
REFUSED_PROBE_S = 2.0
#: Waiting for a server that went down: first wait, growth factor, longest wait.
BACKOFF_FIRST_S = 1.0
BACKOFF_FACTOR = 2.0
BACKOFF_MAX_S = 60.0
#: How long a :class:`PatientTarget` waits for its server before giving up. A supervised
#: server restarts in tens of seconds; a large model takes minutes to load.
DEFAULT_PATIENCE_S = 300.0
#: One token for an 8-token prompt: whether a server serves at all (after a crash, or when it may be wedged).
HEALTH_PROBE = Trace(requests=(Request(id="health", at_ms=0, prompt_tokens=8, max_tokens=1),), name="health-probe")


def backoff() -> Iterator[float]:
    """The waits between tries: 1, 2, 4, ... seconds, capped at :data:`BACKOFF_MAX_S`."""
    wait = BACKOFF_FIRST_S
    while True:
        yield wait
        wait = min(BACKOFF_MAX_S, wait * BACKOFF_FACTOR)


class PatientTarget:
    """A target that, when its server cannot be reached, waits for it and runs the trace again."""

    def __init__(
        self,
        target: Target,
        *,
        sleep: Callable[[float], Awaitable[None]],
        patience_s: float = DEFAULT_PATIENCE_S,
        on_down: Callable[[str], None] = lambda reason: None,
    ):
        self._target = target
        self._sleep = sleep
        self._patience_s = patience_s
        self._on_down = on_down
        self.name = target.name
        idle = getattr(target, "idle", None)
        if idle is not None:
            self.idle = idle
        #: How many times the server was found down.
        self.outages = 0

    async def execute(self, trace: Trace, *, cut_s: float | None = None) -> ExecutionResult:
        waited = 0.0
        waits = backoff()
        while True:
            try:
                return await self._target.execute(trace, cut_s=cut_s)
            except TargetError as e:
                if waited == 0.0:
                    self.outages += 1
                    self._on_down(str(e))
                if waited >= self._patience_s:
                    raise TargetError(f"the server stayed unreachable for {waited:.0f} s: {e}") from None
                wait = min(next(waits), self._patience_s - waited)
                await self._sleep(wait)
                waited += wait

    async def aclose(self) -> None:  # the caller owns the wrapped target
        return None


async def refuses_connections(base_url: str) -> str | None:
    """Why a new connection to the server at ``base_url`` was refused (it no longer listens: it went down), or
    None: one it accepts, or does not answer within REFUSED_PROBE_S (busy, wedged), is still there."""
    url = URL(base_url)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(url.host, url.port), REFUSED_PROBE_S)
    except (ConnectionRefusedError, ConnectionResetError) as error:
        return f"{type(error).__name__}: {error}"
    except (OSError, asyncio.TimeoutError):
        return None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None
