"""Minimizing a stored finding with the oracle as the predicate, on the simulator's virtual time."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import CORPUS
from paper_target import PaperTarget

from fuzzer import trace as tf
from fuzzer.errors import TargetError
from fuzzer.execution import ExecutionResult, Outcome, RequestResult
from fuzzer.oracle.ablation import MIN_OTHERS, without_option
from fuzzer.oracle.calibrate import calibrate
from fuzzer.oracle.confirm import confirm
from fuzzer.oracle.judge import candidates
from fuzzer.oracle.kinds import FindingKind, Metric
from fuzzer.oracle.policy import DEFAULT_POLICY
from fuzzer.oracle.signature import option_signature
from fuzzer.shrink.engine import size_key
from fuzzer.shrink.finding import HYSTERESIS, make_check, minimize_finding
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


# --- option-slowdown: the check runs the trace and the trace without the option --------------------


class SeedSlowsOthers:
    """A fake target: every request's e2e is 10 ms + 1 ms per output token, ``slowdown`` times
    that for the requests without a seed when some request of the trace has one."""

    name = "fake://seed-slows-others"

    def __init__(self, slowdown: float = 2.0):
        self.slowdown = slowdown
        self.traces: list[tf.Trace] = []

    async def execute(self, trace, *, cut_s=None):
        self.traces.append(trace)
        seeded = any(r.seed is not None for r in trace.requests)
        out = []
        for r in trace.requests:
            e2e = (0.010 + 0.001 * r.max_tokens) * (self.slowdown if seeded and r.seed is None else 1.0)
            out.append(RequestResult(request_id=r.id, x_request_id=f"{r.id}-{len(self.traces)}", scheduled_s=r.at_ms / 1000,
                                     sent_s=r.at_ms / 1000, outcome=Outcome.OK, ttft_s=0.005, first_event_s=0.005,
                                     token_times_s=(0.005, e2e), e2e_s=e2e, prompt_tokens=r.prompt_tokens,
                                     completion_tokens=r.max_tokens, http_status=200))
        return ExecutionResult(trace_hash=trace.content_hash(), target=self.name, started_at=float(len(self.traces)),
                               duration_s=0.5, requests=tuple(out), idle_before_s=1.0, idle_after=True)

    async def aclose(self):
        pass


def _seeded(rows=8):
    plain = [{"id": f"r{i}", "at_ms": i, "prompt_tokens": 64, "max_tokens": 32} for i in range(rows)]
    return tf.from_dict({"requests": [*plain, {"id": "carrier", "at_ms": rows, "prompt_tokens": 64, "max_tokens": 32,
                                               "seed": 7, "temperature": 1.0}]})


_CAL = []


async def _paper_calibration():
    if not _CAL:
        _CAL.append(await calibrate(PaperTarget(seed=99), rng=random.Random(0), clock=lambda: 0.0))
    return _CAL[0]


async def test_the_option_check_compares_the_trace_with_itself_without_the_option():
    calibration = await _paper_calibration()
    recorded = []
    trace = _seeded()

    def check_on(target):
        return make_check(target, FindingKind.OPTION_SLOWDOWN, Metric.E2E, "carrier", calibration, sleep=_no_sleep,
                          record=lambda t, r: recorded.append(t), option="seed")

    slow = SeedSlowsOthers(2.0)
    check = check_on(slow)
    strict, final = await check(trace, True), await check(trace, False)
    factor = DEFAULT_POLICY.option_factor
    assert strict.reproduced and final.reproduced  # 2x >= factor x HYSTERESIS while shrinking, >= factor at the end
    assert strict.effect == pytest.approx(2.0 / (factor * HYSTERESIS)) and final.effect is None
    # Each check ran the trace and its ablation (the order alternating), and recorded both.
    assert [sum(r.seed is not None for r in t.requests) for t in slow.traces] == [1, 0, 0, 1]
    assert recorded == slow.traces
    assert not (await check_on(SeedSlowsOthers(1.0))(trace, False)).reproduced  # equal: not ok
    between = check_on(SeedSlowsOthers(factor * (1 + HYSTERESIS) / 2))  # over the report factor, under the shrinking one
    assert (await between(trace, False)).reproduced and not (await between(trace, True)).reproduced
    # A candidate without the option, or with fewer than MIN_OTHERS others, is not this finding: no run.
    runs = len(slow.traces)
    assert not (await check(without_option(trace, "seed"), True)).reproduced
    assert not (await check(trace.with_requests(trace.requests[-3:]), False)).reproduced
    assert len(slow.traces) == runs
    with pytest.raises(ValueError, match="option"):
        make_check(slow, FindingKind.OPTION_SLOWDOWN, Metric.E2E, "carrier", calibration, sleep=_no_sleep)


async def test_an_option_slowdown_is_minimized_to_one_carrier_and_the_fewest_others():
    calibration = await _paper_calibration()
    target, trace = SeedSlowsOthers(2.0), _seeded()
    verdict = confirm_option(trace)
    store = Store.memory()
    fid, _ = store.add_finding(kind=verdict["kind"], signature=verdict["signature"], trace=trace, verdict=verdict,
                               slowdown=2.0, reproduced="3/3")
    reduction = await minimize_finding(store, store.get_finding(fid), target, calibration, sleep=_no_sleep)
    r = reduction.result
    assert [q.id for q in r.minimized.requests if q.seed is not None] == ["carrier"]  # the carrier was kept
    assert len(r.minimized.requests) == 1 + MIN_OTHERS and r.confirmed == 10
    # Both halves of every pair are stored, the ablated trace under its own hash.
    minimized_runs = store.execution_ids(trace_hash=r.minimized.content_hash())
    ablated_runs = store.execution_ids(trace_hash=without_option(r.minimized, "seed").content_hash())
    assert len(minimized_runs) >= 10 and len(ablated_runs) >= 10


def confirm_option(trace):
    """The verdict dict an option-slowdown confirmation stores (fuzzer.oracle.ablation._verdict)."""
    return {"kind": "option-slowdown", "decision": "different", "request_id": "carrier", "metric": "e2e",
            "threshold": DEFAULT_POLICY.option_factor, "observed_s": 0.084, "expected_s": 0.042, "idle_s": 0.042, "effect": 2.0,
            "reproduced": 3, "runs": 3, "ablated": "seed", "signature": option_signature("seed")}
