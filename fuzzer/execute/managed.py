"""A target whose server the fuzzer launched: restarted when it dies, its log quoted.

:class:`ManagedTarget` wraps the HTTP target of a :class:`~fuzzer.execute.launch.ManagedServer`.
When an execution ends with the server dead, the execution's warnings say so and carry the
last lines of its log (a ``crash`` finding quotes them); the next execution first starts the
server again, after a backoff. More than ``max_restarts`` deaths within ``window_s`` is a
crash loop: :class:`CrashLoop` stops whatever runs with one clear message.

A server can also live and serve nothing: a held-out vLLM-like server whose planted bug leaked its
KV cache hung every request of its last ten executions (60 s each, a third of a 30-minute campaign).
When no request of an execution got a byte and one timed out, a one-token probe follows; when it
gets no token either (within WEDGE_PROBE_S), the server is *wedged*: the execution's warnings say so
and it is started again, counted as a death (a server that keeps wedging is a crash loop).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Awaitable, Callable

from fuzzer.errors import FuzzError, TargetError
from fuzzer.execute.launch import ManagedServer
from fuzzer.execute.recovery import HEALTH_PROBE, backoff
from fuzzer.execution import SERVER_DIED, ExecutionResult, Outcome, Target
from fuzzer.trace import Trace

#: Deaths within WINDOW_S before the server counts as crash-looping: LaunchSpec.max_restarts.
WINDOW_S = 600.0
#: Log lines quoted in an execution that killed the server.
LOG_LINES = 20
SERVER_WEDGED = "server wedged"
#: How long the probe of a server that may be wedged waits for its one token.
WEDGE_PROBE_S = 15.0


def wedged_run(result: ExecutionResult) -> bool:
    """Whether no request of ``result`` got a byte of its reply and one timed out (the server may be wedged)."""
    return any(r.outcome is Outcome.TIMEOUT for r in result.requests) and not any(
        r.outcome is Outcome.OK or r.first_event_s is not None for r in result.requests)


class CrashLoop(FuzzError):
    """The launched server keeps dying right after it is started again."""


class ManagedTarget:
    """``target`` runs on ``server``; a dead server is started again before the next execution."""

    def __init__(
        self,
        target: Target,
        server: ManagedServer,
        *,
        sleep: Callable[[float], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
        max_restarts: int | None = None,
        window_s: float = WINDOW_S,
        on_restart: Callable[[str], None] = lambda note: None,
    ):
        self._target = target
        self.server = server
        self._sleep = sleep
        self._clock = clock
        self._max_restarts = server.spec.max_restarts if max_restarts is None else max_restarts
        self._window_s = window_s
        self._on_restart = on_restart
        self._deaths: deque[float] = deque()
        self._waits = backoff()
        self.name = target.name
        self.restarts = 0
        self.fresh_starts = 0
        #: The server lives but served nothing (:func:`wedged_run` and a failed probe): restarted next.
        self._wedged = False

    def __getattr__(self, name: str):  # info, kv_cache, ...: the HTTP target's
        return getattr(self._target, name)

    async def execute(self, trace: Trace, *, cut_s: float | None = None) -> ExecutionResult:
        await self.ensure_up()
        try:
            result = await self._target.execute(trace, cut_s=cut_s)
        except TargetError:
            # Nothing was measured (the server could not even be asked): when it died just
            # before, start it again and run the trace once more.
            if not await self._died():
                raise
            await self.ensure_up()
            result = await self._target.execute(trace, cut_s=cut_s)
        if not self.server.alive:
            result = replace(result, warnings=result.warnings + (self.death_note(),))
        elif wedged_run(result) and not await self._answers():
            result = replace(result, warnings=result.warnings + (self._unwedge(),))
        else:
            self._waits = backoff()  # it ran an execution and lives: the next death waits 1 s again
        return result

    async def _answers(self) -> bool:
        """Whether the server serves a one-token request within WEDGE_PROBE_S."""
        try:
            probe = await self._target.execute(HEALTH_PROBE, cut_s=WEDGE_PROBE_S)
        except TargetError:
            return False
        return any(r.outcome is Outcome.OK for r in probe.requests)

    def _unwedge(self) -> str:
        """Mark the live server that serves nothing for a restart (as a death); the execution's note."""
        note = (f"{SERVER_WEDGED}: no request of this execution got a byte and a one-token probe got none in "
                f"{WEDGE_PROBE_S:g} s; the launched server lives but serves nothing, and is started again")
        self._wedged = True
        return note

    def death_note(self) -> str:
        status = self.server.died_with
        how = "was killed by signal %d" % -status if status is not None and status < 0 else f"exited with status {status}"
        tail = self.server.tail(LOG_LINES)
        error = self.server.last_error()
        lines = "\n".join(tail)
        above = f"\nits last error line, above them: {error}" if error and not any(error in ln for ln in tail) else ""
        return f"{SERVER_DIED}: the launched server {how} during this execution; the last lines of its log " \
               f"({self.server.log_path}):\n{lines}{above}"

    async def ensure_up(self) -> None:
        """Start the server again when it died or wedged (backoff); raise CrashLoop when it keeps dying."""
        if self.server.alive and not self._wedged:
            return
        now = self._clock()
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > self._window_s:
            self._deaths.popleft()
        if len(self._deaths) > self._max_restarts:
            last = self.server.tail(1)
            raise CrashLoop(
                f"the launched server died {len(self._deaths)} times within {self._window_s:g} s; stopping "
                f"(last log line: {last[-1] if last else 'none'}; log: {self.server.log_path})"
            )
        wait = next(self._waits)
        why = "serves nothing (wedged)" if self._wedged else f"died (status {self.server.died_with})"
        self._on_restart(f"the launched server {why}; starting it again in {wait:g} s")
        await self._sleep(wait)
        await self.server.restart()
        self._wedged = False
        self.restarts += 1

    def restarts_left(self) -> int:
        """Deaths the server may still have within the window before :meth:`ensure_up` stops on a crash
        loop (a server that is down now counts as one)."""
        now = self._clock()
        recent = sum(now - t <= self._window_s for t in self._deaths) + (0 if self.server.alive and not self._wedged else 1)
        return max(0, self._max_restarts - recent)

    async def fresh_start(self) -> None:
        """Stop the server and start it again (a fresh server for a cold-start check); not a death."""
        await self.server.restart()
        self.fresh_starts += 1

    async def _died(self, grace_s: float = 1.0) -> bool:
        """Whether the server is dead, giving a dying one ``grace_s`` to finish exiting."""
        deadline = self._clock() + grace_s
        while self.server.alive:
            if self._clock() >= deadline:
                return False
            await self._sleep(0.05)
        return True

    async def aclose(self) -> None:  # the caller owns the server and the HTTP target
        return None
