"""Minimizing the hol-prefix-burst finding on the simulator's virtual time (issue 7).

The trigger has nine requests; the pathology needs a short member of a prefix group
held behind longer members that arrive while it waits. These tests fail if the
minimizer stops finding a small trace, needs many more executions, or returns a
trace that does not reproduce reliably. Executions are counted, not timed.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from fuzzer.oracle import judge as oracle
from fuzzer.oracle.calibrate import calibrate
from fuzzer.oracle.confirm import examine
from fuzzer.oracle.kinds import Metric
from fuzzer.shrink.finding import minimize_finding
from fuzzer.sim import VirtualTarget
from fuzzer.sim import pathologies as P
from fuzzer.sim.triggers import TRIGGERS
from fuzzer.store import Store

TRIGGER = TRIGGERS[P.HOL_PREFIX_BURST]
# Measured on seeds 0-19 (benchmarks/README.md, Minimization): 4 requests in 76-100
# executions, the final confirmation included. The bounds leave room for small changes
# elsewhere (calibration, oracle) without letting the old behaviour (5 requests in
# 177-214 executions, 3/10) pass.
MAX_REQUESTS = 4
MAX_EXECUTIONS = 120


async def _no_sleep(seconds):
    return None


async def _minimized(seed):
    target = VirtualTarget(pathologies=(P.HOL_PREFIX_BURST,), seed=seed)
    calibration = await calibrate(target, rng=random.Random(seed))
    exam = await examine(target, TRIGGER.trace, calibration, rng=np.random.default_rng(seed), sleep=_no_sleep)
    verdict = next(v for v in exam.findings if v.request_id == TRIGGER.victim)
    store = Store.memory()
    fid, _ = store.add_finding(kind=str(verdict.kind), signature=verdict.signature, trace=TRIGGER.trace,
                               verdict=verdict.to_dict(), slowdown=verdict.slowdown,
                               reproduced=verdict.reproduction, details={"request_id": verdict.request_id})
    reduction = await minimize_finding(store, store.get_finding(fid), target, calibration, sleep=_no_sleep)
    return target, calibration, reduction.result


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_the_hol_trigger_shrinks_to_a_few_requests_in_few_executions(seed):
    target, calibration, r = await _minimized(seed)
    ids = [q.id for q in r.minimized.requests]
    assert TRIGGER.victim in ids
    assert len(ids) <= MAX_REQUESTS, ids
    assert r.executions <= MAX_EXECUTIONS, r.executions
    assert r.confirmed >= 8, r.reproduction
    # what the pathology needs is still there: the victim and a longer member of its group
    victim = r.minimized.request(TRIGGER.victim)
    assert victim.prefix and any(q.prefix == victim.prefix and q.prompt_tokens > victim.prompt_tokens
                                 for q in r.minimized.requests)
    # and the result holds in fresh runs the search never saw, at the report threshold
    fresh = 0
    for _ in range(10):
        result = await target.execute(r.minimized)
        rep = next(x for x in oracle.observe(r.minimized, result, calibration) if x.request_id == TRIGGER.victim)
        fresh += rep.observations[Metric.TTFT].candidate
    assert fresh >= 8


async def test_without_the_pathology_the_minimized_trace_is_not_slow():
    """The shrunk trace shows the planted pathology, not an artefact of the oracle's bound."""
    _, _, r = await _minimized(0)
    plain = VirtualTarget(pathologies=(), seed=0)
    calibration = await calibrate(plain, rng=random.Random(0))
    for _ in range(5):
        result = await plain.execute(r.minimized)
        rep = next(x for x in oracle.observe(r.minimized, result, calibration) if x.request_id == TRIGGER.victim)
        assert not rep.observations[Metric.TTFT].candidate
