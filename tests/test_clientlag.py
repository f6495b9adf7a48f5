"""The client lag monitor: the worst stall of the client's own event loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from fuzzer.execute import clientlag
from fuzzer.execute.clientlag import LagMonitor


class _FakeTime:
    """A clock that each sleep advances by the interval plus a scripted overshoot."""

    def __init__(self, overshoots):
        self.now = 100.0
        self._overshoots = list(overshoots)

    def clock(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.now += s + (self._overshoots.pop(0) if self._overshoots else 0.0)
        await asyncio.sleep(0)


async def test_the_worst_overshoot_is_the_lag():
    fake = _FakeTime([0.001, 0.250, 0.003, 0.0])
    monitor = LagMonitor(interval_s=0.005, clock=fake.clock, sleep=fake.sleep)
    async with asyncio.TaskGroup() as tasks:
        monitor.start(tasks)
        while monitor.ticks < 4:
            await asyncio.sleep(0)
        assert await monitor.stop() == pytest.approx(0.250)


async def test_a_blocked_loop_is_measured_and_stop_ends_the_task():
    monitor = LagMonitor()
    async with asyncio.TaskGroup() as tasks:
        monitor.start(tasks)
        await asyncio.sleep(0.02)
        time.sleep(0.15)  # the loop cannot run: every stamp taken now would be late
        await asyncio.sleep(0.02)
        lag = await monitor.stop()
    assert lag >= 0.14
    ticks = monitor.ticks
    await asyncio.sleep(0.02)
    assert monitor.ticks == ticks  # stopped


async def test_the_ticker_ends_with_the_task_group_that_owns_it():
    monitor = LagMonitor()
    with pytest.raises(ExceptionGroup):
        async with asyncio.TaskGroup() as tasks:
            monitor.start(tasks)
            await asyncio.sleep(0.01)
            raise RuntimeError("the execution failed")
    ticks = monitor.ticks
    await asyncio.sleep(0.02)
    assert monitor.ticks == ticks and ticks > 0


async def test_stop_without_start_is_zero():
    assert await LagMonitor().stop() == 0.0


def test_a_bad_interval_is_refused():
    with pytest.raises(ValueError, match="interval_s"):
        LagMonitor(interval_s=0)


def test_only_a_stall_above_the_threshold_is_a_warning():
    assert clientlag.warning(None) is None
    assert clientlag.warning(clientlag.WARN_S / 2) is None
    text = clientlag.warning(0.3)
    assert text is not None and "300 ms" in text and "not held against the server" in text
