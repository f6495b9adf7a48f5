"""Waiting out a server that went down."""

from __future__ import annotations

import itertools

import pytest

from fuzzer.errors import TargetError
from fuzzer.execute.recovery import BACKOFF_MAX_S, PatientTarget, backoff
from fuzzer.execution import ExecutionResult
from fuzzer.trace import Request, Trace

TRACE = Trace(requests=(Request(id="a", at_ms=0, prompt_tokens=8, max_tokens=1),))


class _Down:
    """Refuses ``down`` times, then answers."""

    name = "fake"

    def __init__(self, down):
        self.down = down
        self.calls = 0

    async def execute(self, trace, *, cut_s=None):
        self.calls += 1
        if self.calls <= self.down:
            raise TargetError("connection refused")
        return ExecutionResult(trace_hash=trace.content_hash(), target="fake", started_at=0.0, duration_s=0.0, requests=())

    async def aclose(self):
        return None


def test_backoff_doubles_up_to_its_cap():
    waits = list(itertools.islice(backoff(), 9))
    assert waits[:4] == [1.0, 2.0, 4.0, 8.0] and waits[-1] == BACKOFF_MAX_S and max(waits) == BACKOFF_MAX_S


async def test_a_patient_target_waits_and_runs_the_trace_again():
    slept, downs = [], []

    async def sleep(s):
        slept.append(s)

    inner = _Down(down=3)
    patient = PatientTarget(inner, sleep=sleep, on_down=downs.append)
    result = await patient.execute(TRACE)
    assert result.trace_hash == TRACE.content_hash() and inner.calls == 4
    assert slept == [1.0, 2.0, 4.0] and downs == ["connection refused"] and patient.outages == 1
    await patient.execute(TRACE)  # up: no wait
    assert slept == [1.0, 2.0, 4.0] and patient.outages == 1


async def test_a_patient_target_gives_up_after_its_patience():
    slept = []

    async def sleep(s):
        slept.append(s)

    patient = PatientTarget(_Down(down=100), sleep=sleep, patience_s=10)
    with pytest.raises(TargetError, match="stayed unreachable for 10 s: connection refused"):
        await patient.execute(TRACE)
    assert slept == [1.0, 2.0, 4.0, 3.0]  # the last wait is cut to the patience left
