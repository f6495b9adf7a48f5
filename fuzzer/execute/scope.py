"""Task ownership in the executor: no task outlives the call that started it.

An execution starts tasks of three kinds: one per request, the /metrics sampler and
the client-lag ticker (:mod:`fuzzer.execute.periodic`), and short-lived helpers that
fit prompts or warm connections. Each is started in a :func:`task_scope`, an
:class:`asyncio.TaskGroup`, so when the execution returns, raises or is cancelled, all
of them have ended first: no request goes on streaming into the next execution (its
connection is closed, so the server sees an abort), no sampler goes on scraping.

A request's failure is data (an :class:`~fuzzer.execution.Outcome`), never an
exception. What fails a scope is a target that cannot be used
(:class:`~fuzzer.errors.TargetError`) or a bug; either cancels the scope's other
tasks, waits for them, and leaves the scope as the error itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


@contextlib.asynccontextmanager
async def task_scope() -> AsyncIterator[asyncio.TaskGroup]:
    """An :class:`asyncio.TaskGroup` that fails with its first error, not an ExceptionGroup.

    Callers of an execution catch :class:`~fuzzer.errors.TargetError` (a campaign waits
    out a server that went down), so an error must leave the scope as itself. Errors of
    other tasks that failed at the same moment are added to it as notes, so none is hidden.
    """
    try:
        async with asyncio.TaskGroup() as group:
            yield group
    except BaseExceptionGroup as failed:
        first, *others = _leaves(failed)
        for other in others:
            first.add_note(f"another task failed at the same time: {other!r}")
        raise first from None


async def run_all(*coroutines: Coroutine[Any, Any, T]) -> list[T]:
    """The results of ``coroutines`` run concurrently, in order (as :func:`asyncio.gather`).

    Unlike ``gather``, a failure cancels the other coroutines and waits for them before
    it is raised.
    """
    async with task_scope() as group:
        tasks = [group.create_task(c) for c in coroutines]
    return [t.result() for t in tasks]


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    """The exceptions of a group, nested groups flattened, in the order they were raised."""
    found: list[BaseException] = []
    for e in group.exceptions:
        found.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return found
