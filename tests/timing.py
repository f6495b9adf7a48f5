"""Timing checks on a shared machine.

A measurement of wall-clock latency on a 2-core machine shared with other jobs (a CI
host, another engineer's build) can be disturbed: a process descheduled for a
timeslice adds tens or hundreds of milliseconds that neither the client nor the
server caused. Such disturbances only ever add time, at random moments, so a
property of the code shows in an undisturbed attempt while a real defect shows in
every attempt. :func:`holds_in_some_attempt` measures again (a bounded number of
times) and keeps every bound as tight as before; when no attempt meets them it
fails with every attempt's violations and the machine's load.
"""

from __future__ import annotations

import os
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")

ATTEMPTS = 3


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


async def holds_in_some_attempt(
    measure: Callable[[], Awaitable[T]],
    violations: Callable[[T], list[str]],
    *,
    attempts: int = ATTEMPTS,
) -> T:
    """The first measurement with no violation; AssertionError with all of them when none is clean."""
    seen = []
    for attempt in range(1, attempts + 1):
        result = await measure()
        found = violations(result)
        if not found:
            return result
        seen.append(f"attempt {attempt}: " + "; ".join(found[:6]) + (" ..." if len(found) > 6 else ""))
    raise AssertionError(f"no attempt of {attempts} met the timing bounds ({load()}):\n" + "\n".join(seen))
