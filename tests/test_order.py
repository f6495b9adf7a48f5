"""The order evidence (fuzzer.oracle.order): a wait the execution shows was FCFS is excused,
an ordering inversion never is, whatever the step model says (paper timings, virtual time)."""

from __future__ import annotations

import asyncio
import functools
import random
from dataclasses import replace

from paper_target import TRUE_MODEL, PaperTarget

from fuzzer.execution import ExecutionResult, Outcome, RequestResult
from fuzzer.oracle.calibrate import calibrate
from fuzzer.oracle.judge import candidates, observe
from fuzzer.oracle.kinds import Metric
from fuzzer.oracle.model import SchedulerAssumption, StepModel
from fuzzer.oracle.order import MODEL, ORDER, order_bounds
from fuzzer.trace import Request, Trace

BURST = Trace(requests=(
    Request(id="big0", at_ms=0, prompt_tokens=2048, max_tokens=64),
    Request(id="big1", at_ms=2, prompt_tokens=2048, max_tokens=64),
    Request(id="small", at_ms=20, prompt_tokens=128, max_tokens=16),
))


@functools.cache
def _calibration():
    return asyncio.run(calibrate(PaperTarget(seed=99), rng=random.Random(0), clock=lambda: 0.0))


def _warm(target: PaperTarget) -> PaperTarget:
    target._idle_s = target.idle_gap_s
    return target


def test_queueing_behind_slower_prefills_than_calibrated_is_excused_by_the_order():
    # The engine prefills 6x slower than it was calibrated (a busier machine, a cost the
    # linear fit missed): the small request waits out the bigs' prefills, in FCFS order.
    slow = replace(TRUE_MODEL, prefill_token_s=TRUE_MODEL.prefill_token_s * 6)
    result = _warm(PaperTarget(slow, noise=0.0)).run(BURST)
    small = {r.request_id: r for r in observe(BURST, result, _calibration())}["small"].observations[Metric.TTFT]
    assert small.evidence == ORDER and small.waited_for == "big1"
    assert not small.candidate
    # Without the order, the model's bound would have called it slow: the evidence decided.
    paper = {r.request_id: r for r in observe(BURST, result, _calibration())}["small"].expectation.ttft_s
    assert small.observed_s > 2 * paper


def test_an_ordering_inversion_is_not_excused():
    # The small request comes first; a planted stall holds it until after the bigs that
    # arrived later got their first tokens: served out of order, it stays a candidate.
    first = Trace(requests=(
        Request(id="small", at_ms=0, prompt_tokens=128, max_tokens=16),
        Request(id="big0", at_ms=5, prompt_tokens=2048, max_tokens=64),
        Request(id="big1", at_ms=7, prompt_tokens=2048, max_tokens=64),
    ))
    result = _warm(PaperTarget(delay_s={"small": 0.4}, noise=0.0)).run(first)
    small = {r.request_id: r for r in observe(first, result, _calibration())}["small"].observations[Metric.TTFT]
    assert small.evidence == MODEL and small.candidate
    assert [c.request_id for c in candidates(first, result, _calibration())] == ["small"]


def _result(*rows: tuple[str, float, float | None, float | None]) -> ExecutionResult:
    return ExecutionResult(trace_hash="x", target="t", started_at=0.0, duration_s=10.0, requests=tuple(
        RequestResult(request_id=rid, x_request_id=rid, scheduled_s=sent, sent_s=sent, outcome=Outcome.OK,
                      ttft_s=ttft, e2e_s=e2e) for rid, sent, ttft, e2e in rows))


def test_only_requests_that_surely_reached_the_engine_first_count():
    trace = Trace(requests=(Request(id="L", at_ms=0, prompt_tokens=16384, max_tokens=1),
                            Request(id="S", at_ms=1, prompt_tokens=32, max_tokens=8)))
    result = _result(("L", 0.0, 1.0, 1.0), ("S", 0.001, 1.1, 1.2))
    idle = {"L": 0.5, "S": 0.01}
    # A frontend that takes 16 ms to tokenize L: S, sent 1 ms later, reaches the engine first.
    slow_frontend = StepModel(0.004, 30e-6, 20e-6, 1e-8, frontend_token_s=1e-6)
    assert order_bounds(trace, result, slow_frontend, SchedulerAssumption(), idle)["S"].waited_for is None
    # With no frontend time L surely came first, and S may wait for its first token.
    bound = order_bounds(trace, result, replace(slow_frontend, frontend_token_s=0.0), SchedulerAssumption(), idle)["S"]
    assert bound.waited_for == "L" and bound.ttft_s == 1.0 - 0.001 + 0.01


def test_a_full_house_of_slots_makes_a_request_wait_for_the_first_end():
    trace = Trace(requests=tuple(Request(id=f"r{i}", at_ms=i, prompt_tokens=16, max_tokens=100) for i in range(3)))
    result = _result(("r0", 0.000, 0.05, 2.0), ("r1", 0.001, 0.05, 3.0), ("r2", 0.002, 2.1, 4.0))
    two_slots = SchedulerAssumption(max_num_seqs=2)
    bound = order_bounds(trace, result, StepModel(0.004, 30e-6, 20e-6, 1e-8), two_slots, {f"r{i}": 0.01 for i in range(3)})
    assert bound["r2"].waited_for == "r0" and abs(bound["r2"].ttft_s - (2.0 - 0.002 + 0.01)) < 1e-9
    unbounded = order_bounds(trace, result, StepModel(0.004, 30e-6, 20e-6, 1e-8), SchedulerAssumption(),
                             {f"r{i}": 0.01 for i in range(3)})
    assert unbounded["r2"].ttft_s < 0.1  # 256 slots: nothing to wait for but r0/r1's first tokens


def test_a_slower_engine_in_the_speed_check_scales_the_bounds():
    # Every cost 4x the calibrated model (a busy host): the bigs' own first tokens look slow
    # against the calibrated bound, but not against one scaled by the speed check after the run.
    slow = replace(TRUE_MODEL, overhead_s=TRUE_MODEL.overhead_s * 4, prefill_token_s=TRUE_MODEL.prefill_token_s * 4,
                   decode_seq_s=TRUE_MODEL.decode_seq_s * 4, context_token_s=TRUE_MODEL.context_token_s * 4)
    result = _warm(PaperTarget(slow, noise=0.0)).run(BURST)
    unchecked = {r.request_id: r for r in observe(BURST, result, _calibration())}["big0"].observations[Metric.TTFT]
    assert unchecked.candidate and unchecked.load == 1.0
    check = slow.step_s(0, 1, 16 + 4)  # what the engine's speed check measured after the run
    checked_result = replace(result, speed_check_itl_s=check)
    big0 = {r.request_id: r for r in observe(BURST, checked_result, _calibration())}["big0"].observations[Metric.TTFT]
    assert not big0.candidate and 3.5 < big0.load < 4.5
    # Within the check's own noise the calibrated model stands.
    near = replace(result, speed_check_itl_s=TRUE_MODEL.step_s(0, 1, 20) * 1.1)
    assert {r.request_id: r for r in observe(BURST, near, _calibration())}["big0"].observations[Metric.TTFT].load == 1.0
