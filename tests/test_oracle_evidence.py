"""What a verdict's bound rests on: an ordering inversion is never excused, a slower engine in
the speed check after an execution scales the bounds (paper timings, virtual time)."""

from __future__ import annotations

import asyncio
import functools
import random
from dataclasses import replace

from paper_target import TRUE_MODEL, PaperTarget

from fuzzer.oracle.calibrate import calibrate
from fuzzer.oracle.judge import candidates, observe
from fuzzer.oracle.kinds import Metric
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
    assert small.candidate
    assert [c.request_id for c in candidates(first, result, _calibration())] == ["small"]


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
