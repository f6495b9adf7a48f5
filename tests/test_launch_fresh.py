"""Fresh-server checks (issue 17): a cold start confirmed by idling is checked again on
freshly started servers when the target can start its server again (a launched one)."""

from __future__ import annotations

import asyncio
import random

import numpy as np

from fuzzer.oracle.calibrate import calibrate
from fuzzer.oracle.confirm import examine
from fuzzer.oracle.kinds import Decision, FindingKind
from fuzzer.oracle.policy import DEFAULT_POLICY
from fuzzer.sim import VirtualTarget

class _Restartable:
    """A virtual simulator whose ``fresh_start`` replaces it by a new one (never ran: cold)."""

    def __init__(self, pathologies: tuple[str, ...], fresh_pathologies: tuple[str, ...]):
        self._fresh_pathologies = fresh_pathologies
        self.sim = VirtualTarget(pathologies=pathologies, seed=3)
        self.name = self.sim.name
        self.fresh_starts = 0

    def idle(self, seconds: float) -> None:
        self.sim.idle(seconds)

    async def execute(self, trace, *, cut_s=None):
        return await self.sim.execute(trace, cut_s=cut_s)

    async def fresh_start(self) -> None:
        self.sim = VirtualTarget(pathologies=self._fresh_pathologies, seed=4 + self.fresh_starts)
        self.fresh_starts += 1


def _check(target, seed_trace):
    """``fuzz replay``'s examination on a never-used server: run 1 cold, the cold arm, then fresh servers."""
    calibration = asyncio.run(calibrate(VirtualTarget(seed=1000), rng=random.Random(0),
                                        max_model_len=target.sim.config.max_model_len))
    exam = asyncio.run(examine(target, seed_trace, calibration, runs=3, rng=np.random.default_rng(3)))
    (found,) = [v for v in exam.findings if v.kind is FindingKind.COLD_START]
    return found


def test_a_cold_start_is_confirmed_on_freshly_started_servers_too(seed_trace):
    target = _Restartable(("cold-start",), ("cold-start",))
    verdict = _check(target, seed_trace)
    assert verdict.kind is FindingKind.COLD_START and verdict.decision is Decision.DIFFERENT
    assert target.fresh_starts == DEFAULT_POLICY.min_runs
    assert f"confirmed on {DEFAULT_POLICY.min_runs} freshly started servers too" in verdict.detail


def test_a_cold_start_a_fresh_server_does_not_show_is_said_to_be_after_idling_only(seed_trace):
    # The fresh servers have no cold start (think: a slowdown from clocks ramping down while idle).
    target = _Restartable(("cold-start",), ())
    verdict = _check(target, seed_trace)
    assert verdict.kind is FindingKind.COLD_START and verdict.is_finding
    assert target.fresh_starts == DEFAULT_POLICY.min_runs
    assert "freshly started servers" in verdict.detail and "after idling only" in verdict.detail


def test_a_target_that_cannot_restart_keeps_the_verdict(seed_trace):
    class Plain(_Restartable):
        fresh_start = None

    target = Plain(("cold-start",), ("cold-start",))
    verdict = _check(target, seed_trace)
    assert verdict.kind is FindingKind.COLD_START and "freshly" not in verdict.detail
