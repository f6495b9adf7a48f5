"""Minimizing a stored finding with the oracle as the predicate, on the simulator's virtual time."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import CORPUS

from fuzzer import trace as tf
from fuzzer.errors import TargetError
from fuzzer.oracle.calibrate import calibrate
from fuzzer.oracle.confirm import confirm
from fuzzer.oracle.judge import candidates
from fuzzer.shrink.engine import size_key
from fuzzer.shrink.finding import minimize_finding
from fuzzer.sim import VirtualTarget
from fuzzer.store import Store


async def _no_sleep(seconds):
    return None


async def _finding(store, target, trace):
    calibration = await calibrate(target, rng=random.Random(0))
    result = await target.execute(trace)
    cands = candidates(trace, result, calibration)
    assert cands, "the planted pathology shows no candidate"
    verdict = await confirm(target, trace, cands[0], calibration, rng=np.random.default_rng(0), sleep=_no_sleep)
    assert verdict.is_finding
    fid, _ = store.add_finding(kind=str(verdict.kind), signature=verdict.signature, trace=trace,
                               verdict=verdict.to_dict(), slowdown=verdict.slowdown, reproduced=verdict.reproduction)
    return store.get_finding(fid), calibration


@pytest.fixture
def logprobs_case():
    return VirtualTarget(pathologies=("logprobs-batch-cost",), seed=3), tf.load(CORPUS / "n-logprobs.json")


async def test_minimized_trace_is_smaller_stored_and_still_reproduces(logprobs_case):
    target, trace = logprobs_case
    store = Store.memory()
    finding, calibration = await _finding(store, target, trace)
    reduction = await minimize_finding(store, finding, target, calibration, sleep=_no_sleep)
    r = reduction.result
    assert size_key(r.minimized) < size_key(trace)
    assert len(r.minimized.requests) < len(trace.requests)
    assert any(q.n > 1 or q.logprobs for q in r.minimized.requests)  # the trigger survived
    assert finding.verdict["request_id"] in {q.id for q in r.minimized.requests}  # and so did the victim
    assert r.confirmed >= 7, r.reproduction
    stored = store.get_finding(finding.id)
    assert stored.minimized and store.get_trace(stored.minimized_trace_hash) == r.minimized
    assert stored.details["minimized"]["reproduced"] == r.reproduction
    assert store.minimization_state(finding.id) is None  # done: nothing to resume


def _fail_calls(target, failing, error):
    """Make the target's execute raise ``error`` on the calls (1-based) for which ``failing(n)`` is true."""
    calls = {"n": 0}
    real = target.execute

    async def execute(t, *, cut_s=None):
        calls["n"] += 1
        if failing(calls["n"]):
            raise error
        return await real(t, cut_s=cut_s)

    target.execute = execute
    return real


DOWN = TargetError("POST http://127.0.0.1:1/tokenize failed: ClientConnectorError")


async def test_interrupted_minimization_resumes(logprobs_case):
    target, trace = logprobs_case
    store = Store.memory()
    finding, calibration = await _finding(store, target, trace)
    real = _fail_calls(target, lambda n: n > 12, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        await minimize_finding(store, finding, target, calibration, sleep=_no_sleep)
    saved = store.minimization_state(finding.id)
    assert saved is not None and saved["executions"] > 0
    target.execute = real
    reduction = await minimize_finding(store, finding, target, calibration, sleep=_no_sleep)
    assert reduction.result.executions > saved["executions"]


async def test_a_server_that_goes_down_while_minimizing_is_waited_for(logprobs_case):
    """A crash on the way (connection refused before a trace can start) is waited out with backoff."""
    target, trace = logprobs_case
    store = Store.memory()
    finding, calibration = await _finding(store, target, trace)
    slept = []

    async def sleep(seconds):
        slept.append(seconds)

    _fail_calls(target, lambda n: 5 <= n < 9, DOWN)  # down for four tries in a row
    reduction = await minimize_finding(store, finding, target, calibration, sleep=sleep)
    assert slept[:4] == [1.0, 2.0, 4.0, 8.0]  # the backoff, then the server was back
    assert len(reduction.result.minimized.requests) < len(trace.requests)
    assert store.get_finding(finding.id).minimized


async def test_a_server_that_stays_down_ends_the_minimization_with_a_clear_error_and_its_state_saved(logprobs_case):
    target, trace = logprobs_case
    store = Store.memory()
    finding, calibration = await _finding(store, target, trace)
    _fail_calls(target, lambda n: n >= 6, DOWN)
    with pytest.raises(TargetError, match="stayed unreachable for 30 s"):
        await minimize_finding(store, finding, target, calibration, sleep=_no_sleep, patience_s=30)
    saved = store.minimization_state(finding.id)
    assert saved is not None and saved["tests"] > 0  # the same command resumes from here
