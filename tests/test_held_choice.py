"""A stall only in a stream's later choices is one family, whatever the batch (fuzzer.oracle.judge.later_choice_stall).

heldout12's bug4 held an n > 1 stream's choices after the first back until choice 0 finished: one bug, met in
six families of batch traits (seeded, timeouts, prefix reuse, KV pressure), ten confirmed findings in one
30-minute campaign.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from fuzzer.execution import ExecutionResult
from fuzzer.oracle.calibrate import calibrate
from fuzzer.oracle.judge import Candidate, candidates
from fuzzer.oracle.kinds import FindingKind
from fuzzer.oracle.signature import family
from fuzzer.search.confirming import Families, candidate_from_dict, candidate_to_dict
from fuzzer.sim import VirtualTarget
from fuzzer.trace import Request, Trace

TRACE = Trace(requests=(Request(id="o", at_ms=0, prompt_tokens=256, max_tokens=64, stream=True),
                        Request(id="v", at_ms=5, prompt_tokens=128, max_tokens=64, n=2, stream=True)))


@pytest.fixture(scope="module")
def calibration():
    return asyncio.run(calibrate(VirtualTarget(seed=0), rng=random.Random(0)))


def _victim(result: ExecutionResult, **change) -> ExecutionResult:
    return replace(result, requests=tuple(replace(r, **change) if r.request_id == "v" else r for r in result.requests))


def test_a_later_choice_held_back_is_a_held_choice_candidate_and_a_stalled_choice_0_is_not(calibration):
    result = VirtualTarget(seed=1).run(TRACE)
    assert candidates(TRACE, result, calibration) == []  # control: the simulator is clean here
    held = candidates(TRACE, _victim(result, choice_gap_s=0.5), calibration)
    assert [(c.kind, c.request_id, c.held_choice) for c in held] == [(FindingKind.ITL_STALL, "v", True)]
    # Choice 0 itself went silent 0.4 s: a stall a client times, whatever the other choice did.
    v = next(r for r in result.requests if r.request_id == "v")
    times = v.token_times_s
    stalled = (*times[:3], *(t + 0.4 for t in times[3:]))
    both = candidates(TRACE, _victim(result, token_times_s=stalled, choice_gap_s=0.5), calibration)
    assert [(c.kind, c.held_choice) for c in both] == [(FindingKind.ITL_STALL, False)]


def test_a_held_choice_family_leaves_the_batch_traits_out_and_is_not_the_victims_usual_family():
    kind = FindingKind.ITL_STALL
    seeded = TRACE.with_requests([*TRACE.requests, Request(id="s", at_ms=9, prompt_tokens=8, max_tokens=4, seed=1)])
    timeout = TRACE.with_requests([*TRACE.requests,
                                   Request(id="t", at_ms=9, prompt_tokens=8, max_tokens=64, disconnect_after_ms=5)])
    assert len({family(kind, t, "v") for t in (TRACE, seeded, timeout)}) == 3  # control: three families otherwise
    held = {family(kind, t, "v", held_choice=True) for t in (TRACE, seeded, timeout)}
    assert len(held) == 1 and held.isdisjoint({family(kind, t, "v") for t in (TRACE, seeded, timeout)})
    # One finding of it: the next new signature of the family waits out the back-off.
    families = Families()
    families.record(held.pop())
    assert families.pass_over(family(kind, seeded, "v", held_choice=True), set())
    assert not families.pass_over(family(kind, seeded, "v"), set())


def test_the_held_choice_mark_survives_a_checkpoint_and_a_fleet_task():
    c = Candidate(FindingKind.ITL_STALL, "v", None, 9.0, held_choice=True)
    assert candidate_from_dict(candidate_to_dict(c)) == c
    old = {k: v for k, v in candidate_to_dict(c).items() if k != "held_choice"}  # a checkpoint from before
    assert candidate_from_dict(old).held_choice is False
