"""Background work that runs while an execution runs: the /metrics sampler, the client lag monitor."""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable


class Periodic:
    """A task woken every ``interval_s`` between ``_launch`` and ``_cancel``; subclasses write ``_run``.

    The task belongs to the :class:`asyncio.TaskGroup` it is launched in (the execution's
    :func:`~fuzzer.execute.scope.task_scope`), so it never outlives the execution, even
    one that raised or was cancelled before it could stop the task itself.
    """

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

    def _launch(self, tasks: asyncio.TaskGroup) -> None:
        if self._task is None:
            self._task = tasks.create_task(self._run())

    async def _cancel(self) -> None:
        """Cancel the task and wait until it has ended.

        ``asyncio.wait`` neither raises the task's CancelledError nor swallows one meant
        for the caller; an error of the task itself is the task group's to raise.
        """
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
