"""A calibration too noisy to judge: measured again, flagged, and every verdict on it says so."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random

import numpy as np
import pytest

from fuzzer.oracle.calibrate import calibrate
from fuzzer.oracle.calibration import UNRELIABLE_NOISE
from fuzzer.oracle.confirm import examine
from fuzzer.oracle.kinds import Metric
from fuzzer.sim import VirtualTarget
from fuzzer.sim.triggers import TRIGGERS

#: Log-scale spread of the host load the wrapper below adds: about 100 % noise, as a CPU
#: llama-server on a loaded 2-core host measured.
LOADED_SIGMA = 1.0


class _LoadedHost:
    """The simulator seen from a loaded host: every request's times stretched at random.

    The first ``loaded`` executions are stretched by exp(N(0, LOADED_SIGMA)) per request;
    later ones come through as they are.
    """

    def __init__(self, loaded: int, seed: int = 0):
        self.inner = VirtualTarget(seed=seed)
        self.name = self.inner.name
        self.loaded = loaded
        self.executions = 0
        self._rng = random.Random(seed)

    async def execute(self, trace, *, cut_s=None):
        result = await self.inner.execute(trace, cut_s=cut_s)
        self.executions += 1
        if self.executions > self.loaded:
            return result
        requests = []
        for r in result.requests:
            k = math.exp(self._rng.gauss(0.0, LOADED_SIGMA))
            requests.append(dataclasses.replace(
                r, ttft_s=None if r.ttft_s is None else r.ttft_s * k,
                token_times_s=tuple(t * k for t in r.token_times_s), e2e_s=None if r.e2e_s is None else r.e2e_s * k,
            ))
        return dataclasses.replace(result, requests=tuple(requests))


def _calibrate(target, **kw):
    # Rounds of probes are counted here; the seat probe before them and the step probes after them (a
    # prompt's step, the token budget, the long-prefill cap) are not.
    return asyncio.run(calibrate(target, rng=random.Random(0), max_model_len=target.inner.config.max_model_len,
                                 measure_cap=False, measure_budget=False, measure_floor=False, measure_seats=False,
                                 **kw))


def _executions_of_one_round() -> tuple[int, int]:
    """(executions of warm-up and pilot, executions of one round of probes) on a quiet target."""
    quiet = _LoadedHost(loaded=0)
    cal = _calibrate(quiet, early_stop=False)
    assert cal.reliable and cal.reliability_note() is None
    pilot = cal.warmup_runs
    return pilot, quiet.executions - pilot


def test_a_noisy_round_is_measured_again_and_the_quieter_one_kept():
    pilot, one_round = _executions_of_one_round()
    host = _LoadedHost(loaded=pilot + one_round)  # the load goes away after the first round
    cal = _calibrate(host, early_stop=False)
    assert host.executions == pilot + 2 * one_round
    assert cal.reliable and cal.judged_noise()[1] < UNRELIABLE_NOISE
    # Without remeasure the first (loaded) round is what comes back.
    host = _LoadedHost(loaded=pilot + one_round)
    first = _calibrate(host, remeasure=False, early_stop=False)
    assert host.executions == pilot + one_round and not first.reliable


def test_a_calibration_that_stays_noisy_is_flagged_after_one_more_round():
    pilot, one_round = _executions_of_one_round()
    host = _LoadedHost(loaded=10**6)
    cal = _calibrate(host, early_stop=False)
    assert host.executions == pilot + 2 * one_round  # measured again once, not forever
    metric, noise = cal.judged_noise()
    assert not cal.reliable and noise >= UNRELIABLE_NOISE and metric is not Metric.MAX_ITL
    note = cal.reliability_note()
    assert f"{noise * 100:.0f} %" in note and "calibrate again" in note


def test_probing_stops_after_half_the_repeats_when_the_fit_is_settled_and_goes_on_when_noisy():
    pilot, one_round = _executions_of_one_round()
    quiet = _LoadedHost(loaded=0)
    cal = _calibrate(quiet)
    # four probe traces a round, each with half the repeats: the fit settled, no second half
    assert quiet.executions == pilot + one_round and "stopped early" in cal.probing
    full = _calibrate(_LoadedHost(loaded=0), early_stop=False)
    assert cal.probes * 2 <= full.probes + 8  # half the probes (+ lead-ins)
    assert cal.reliable and abs(cal.model.prefill_token_s / full.model.prefill_token_s - 1) < 0.1
    assert abs(cal.model.decode_seq_s / full.model.decode_seq_s - 1) < 0.25
    # a noisy first half is not settled: the second half runs (then, still noisy, one more round)
    host = _LoadedHost(loaded=10**6)
    noisy = _calibrate(host, remeasure=False)
    assert host.executions == pilot + 2 * one_round and "noisy after" in noisy.probing


def test_verdicts_on_an_unreliable_calibration_say_so():
    trigger = TRIGGERS["logprobs-batch-cost"]
    target = VirtualTarget(pathologies=("logprobs-batch-cost",), seed=3)
    quiet = asyncio.run(calibrate(target, rng=random.Random(0), max_model_len=target.config.max_model_len))
    noisy = dataclasses.replace(quiet, noise={m: max(v, 2 * UNRELIABLE_NOISE) for m, v in quiet.noise.items()})
    for cal, flagged in ((quiet, False), (noisy, True)):
        exam = asyncio.run(examine(target, trigger.trace, cal, runs=3, rng=np.random.default_rng(0)))
        assert exam.findings, "the planted pathology is confirmed either way"
        latency = [v for v in exam.verdicts if v.metric is not None]
        assert latency and all(("calibrate again on a quiet server" in v.detail) is flagged for v in latency)


def test_replay_and_campaign_warn_in_one_line_when_the_stored_calibration_is_unreliable(tmp_path):
    import json

    from click.testing import CliRunner

    from fuzzer.cli import cli
    from fuzzer.oracle.calibration import calibration_key
    from fuzzer.sim.process import SimProcess
    from fuzzer.store import Store

    target = VirtualTarget(seed=1)
    quiet = asyncio.run(calibrate(target, rng=random.Random(0), max_model_len=target.config.max_model_len))
    noisy = dataclasses.replace(quiet, noise={m: 2 * UNRELIABLE_NOISE for m in quiet.noise})
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    trace = seeds / "one.json"
    trace.write_text(json.dumps({"format": 1, "requests": [{"id": "a", "at_ms": 0, "prompt_tokens": 16, "max_tokens": 4}]}))
    db = tmp_path / "n.db"
    runner = CliRunner()
    with SimProcess(speed=10.0) as sim:
        with Store.open(db) as store:
            store.save_calibration(calibration_key(sim.url, "sim-qwen2.5-0.5b"), noisy.to_dict())
        runs = [
            runner.invoke(cli, ["replay", str(trace), "--target", sim.url, "--db", str(db), "--runs", "1"]),
            runner.invoke(cli, ["campaign", "--target", sim.url, "--db", str(db), "--corpus", str(seeds),
                                "--max-execs", "1", "--seed", "1"]),
        ]
    for result in runs:
        assert result.exit_code in (0, 1), result.output
        warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: the calibration's")]
        assert len(warnings) == 1 and "calibrate again on a quiet server" in warnings[0], result.stderr


class _CountingHost(_LoadedHost):
    """A quiet simulator that records which probe traces ran (their request ids name the plan)."""

    def __init__(self):
        super().__init__(loaded=0)
        self.plans: list[str] = []

    async def execute(self, trace, *, cut_s=None):
        self.plans.append(trace.requests[0].id if trace.requests else "")
        return await super().execute(trace, cut_s=cut_s)


def test_only_an_uncertain_lines_probes_run_again(monkeypatch):
    import fuzzer.oracle.calibrate as calibrate_module

    pilot, one_round = _executions_of_one_round()
    real = calibrate_module.unsettled

    def once(first_answer):
        calls = []

        def answer(cal, probes):
            calls.append(1)
            return first_answer if len(calls) == 1 else real(cal, probes)
        return answer

    monkeypatch.setattr(calibrate_module, "unsettled", once([("prefill", "the prefill line uncertain (11% at 2048)")]))
    host = _CountingHost()
    cal = _calibrate(host)
    # one probe trace more than a round: the uncached prompts again, not the cached, decode and batch probes
    assert host.executions == pilot + one_round + 1
    assert host.plans[-1] == host.plans[pilot]  # the round's first trace, the uncached prompts
    assert "2 of 4 repeats, 4 of the prefill probes (the prefill line uncertain" in cal.probing
    half = _calibrate(_CountingHost(), early_stop=False, repeats=2)
    full = _calibrate(_CountingHost(), early_stop=False)
    assert half.probes < cal.probes < full.probes
    # noise (or too few baseline ratios) still runs every kind again
    monkeypatch.setattr(calibrate_module, "unsettled", once([(None, "noisy")]))
    host = _CountingHost()
    noisy = _calibrate(host)
    assert host.executions == pilot + 2 * one_round and noisy.probes == full.probes


class _OneSlowRequest(_LoadedHost):
    """The simulator, where the first request of execution ``slow`` (1-based) took 5 s longer: a pilot's
    outlier (llama-server's first request of a pilot run took 5.6 s once, the other run's 0.004 s)."""

    def __init__(self, slow: int | None):
        super().__init__(loaded=0)
        self.slow = slow
        self.traces = []

    async def execute(self, trace, *, cut_s=None):
        result = await super().execute(trace, cut_s=cut_s)
        self.traces.append(trace)
        if self.executions != self.slow:
            return result
        first, *rest = result.requests
        first = dataclasses.replace(first, ttft_s=first.ttft_s + 5.0, e2e_s=first.e2e_s + 5.0,
                                    token_times_s=tuple(t + 5.0 for t in first.token_times_s))
        return dataclasses.replace(result, requests=(first, *rest))


def test_one_slow_pilot_request_does_not_pace_the_probes():
    def span_s(slow):
        host = _OneSlowRequest(slow)
        cal = _calibrate(host, repeats=2, early_stop=False)
        rounds = host.traces[cal.warmup_runs:]
        return [t.requests[-1].at_ms for t in rounds]

    quiet = span_s(None)
    for slow in (1, 2):  # in either pilot run
        assert span_s(slow) == pytest.approx(quiet, rel=0.25)  # the slow one paced every probe 7.5 s apart
    assert quiet[0] < 5000  # the uncached prompts' round: well under one slow request's 5 s a probe
