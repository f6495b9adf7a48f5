"""Background work that runs while an execution runs: the /metrics sampler, the client lag monitor."""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable


class Periodic:
    """A task woken every ``interval_s`` between ``_launch`` and ``_cancel``; subclasses write ``_run``."""

    def __init__(
        self,
        *,
        interval_s: float,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        raise NotImplementedError

    def _launch(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
