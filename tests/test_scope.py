"""Task scopes: every task ends before its scope is left, and an error leaves the scope as itself."""

from __future__ import annotations

import asyncio

import pytest

from fuzzer.errors import TargetError
from fuzzer.execute.scope import run_all, task_scope


async def _holds(ended: list[str], name: str) -> None:
    try:
        await asyncio.sleep(3600)
    finally:
        ended.append(name)


async def test_an_error_cancels_the_other_tasks_and_leaves_as_itself():
    ended: list[str] = []

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise TargetError("the server went down")

    with pytest.raises(TargetError, match="went down") as caught:
        async with task_scope() as tasks:
            tasks.create_task(_holds(ended, "sibling"))
            tasks.create_task(fails())
            await _holds(ended, "body")
    assert sorted(ended) == ["body", "sibling"]  # both ended before the error left the scope
    assert not getattr(caught.value, "__notes__", None)


async def test_errors_at_the_same_moment_are_all_told():
    async def fails(message: str) -> None:
        raise ValueError(message)

    with pytest.raises(ValueError, match="first") as caught:
        async with task_scope() as tasks:
            tasks.create_task(fails("first"))
            tasks.create_task(fails("second"))
    assert any("second" in note for note in caught.value.__notes__)


async def test_cancelling_the_owner_cancels_the_tasks_and_waits_for_them():
    ended: list[str] = []

    async def owner() -> None:
        async with task_scope() as tasks:
            tasks.create_task(_holds(ended, "a"))
            tasks.create_task(_holds(ended, "b"))
            await asyncio.sleep(3600)

    task = asyncio.create_task(owner())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(ended) == ["a", "b"]


async def test_run_all_returns_results_in_order_or_stops_everything_on_a_failure():
    async def value(v: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return v

    assert await run_all(value(1, 0.02), value(2, 0.0), value(3, 0.01)) == [1, 2, 3]
    assert await run_all() == []

    ended: list[str] = []

    async def fails() -> int:
        raise TargetError("tokenize refused")

    with pytest.raises(TargetError, match="tokenize refused"):
        await run_all(_holds(ended, "slow"), fails())
    assert ended == ["slow"]
