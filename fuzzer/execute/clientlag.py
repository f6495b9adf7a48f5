"""Client lag: how long the client's own event loop was held up during an execution.

Every time the executor stamps is taken when the event loop gets round to a socket.
When the client process is descheduled (a busy machine, another job on the same
cores) or the loop is busy with other streams, events sit in the socket buffer and
are stamped late: the server looks slower than it was. Dispatch lateness shows this
only at the moment a request is sent; a :class:`LagMonitor` shows it for the whole
execution. It is a task that asks to wake up every ``interval_s`` and records by how
much each wake-up overshot. The worst overshoot is an upper bound on how much any one
client-side stall can have added to a measured latency, so the oracle widens its
absolute margin by it (a stall the client cannot tell from server latency is never
blamed on the server, ARCHITECTURE.md, "Execute").
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from fuzzer.execute.periodic import Periodic

#: Wake-up period. asyncio timers have ~1 ms granularity; 5 ms is cheap (200 wake-ups a
#: second) and short enough that a stall worth reporting (tens of ms) is never missed.
DEFAULT_INTERVAL_S = 0.005
#: A stall longer than this gets a harness warning on the execution.
WARN_S = 0.020
#: A stall longer than this is a client short of CPU, not the event loop's own jitter: a campaign
#: counts such executions and says what to do about them (the fuzzer on cores the server does
#: not use; measured on vLLM's CPU build sharing 2 cores with the client, benchmarks/README.md).
STARVED_S = 0.100


class LagMonitor(Periodic):
    """Measures the worst event-loop stall between :meth:`start` and :meth:`stop`."""

    def __init__(
        self,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        super().__init__(interval_s=interval_s, clock=clock, sleep=sleep)
        self.worst_s = 0.0
        self.ticks = 0

    def start(self, tasks: asyncio.TaskGroup) -> None:
        """Start measuring, in a task of ``tasks``."""
        self._launch(tasks)

    async def _run(self) -> None:
        while True:
            due = self._clock() + self._interval_s
            await self._sleep(self._interval_s)
            self.ticks += 1
            self.worst_s = max(self.worst_s, self._clock() - due)

    async def stop(self) -> float:
        """Stop measuring; the worst stall seen, in seconds (0.0 when none was measured)."""
        await self._cancel()
        return self.worst_s


def warning(lag_s: float | None) -> str | None:
    """The harness warning for an execution whose client stalled this long, if it deserves one."""
    if lag_s is None or lag_s <= WARN_S:
        return None
    return (f"the client's event loop stalled up to {lag_s * 1000:.0f} ms during the execution "
            "(a busy or descheduled client): latencies within that are not held against the server")
