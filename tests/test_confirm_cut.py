"""A latency candidate's re-runs end soon after its request (fuzzer.search.cuts, CONFIRM_CUT_FACTOR)."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import numpy as np
import pytest

from fuzzer.execution import Outcome
from fuzzer.oracle import judge
from fuzzer.oracle.calibrate import calibrate
from fuzzer.oracle.confirm import confirm
from fuzzer.oracle.kinds import Metric
from fuzzer.search.confirming import candidate_from_dict, candidate_to_dict
from fuzzer.search.cuts import CONFIRM_CUT_FACTOR, CONFIRM_CUT_SLACK_S, LEAKY_CUTS, ConfirmationTarget, confirmation_cut_s
from fuzzer.sim import VirtualTarget
from fuzzer.sim.triggers import TRIGGERS
from fuzzer.trace import Trace


class _Recording:
    def __init__(self, inner):
        self.inner, self.name, self.results, self.cuts, self.traces = inner, inner.name, [], [], []

    async def execute(self, trace, *, cut_s=None):
        self.cuts.append(cut_s)
        self.traces.append(trace)
        result = await self.inner.execute(trace, cut_s=cut_s)
        self.results.append(result)
        return result

    def paired(self):
        """(cuts, results) of an option test's pairs: its runs of one carrier row alone (its own cost,
        fuzzer.oracle.ablation.own_ratio) left out."""
        keep = [i for i, t in enumerate(self.traces) if len(t.requests) > 1]
        return [self.cuts[i] for i in keep], [self.results[i] for i in keep]


def _with_a_late_long_stream(trace: Trace) -> Trace:
    """``trace`` and a stream sent after its last request ends, which runs for seconds more."""
    last = trace.requests[-1]
    late = dataclasses.replace(last, id="late", at_ms=600.0, prompt_tokens=64, max_tokens=2000, prefix=None)
    return dataclasses.replace(trace, requests=(*trace.requests, late))


def _setup(pathology: str = "hol-prefix-burst"):
    target = VirtualTarget(pathologies=(pathology,), seed=3)
    cal = asyncio.run(calibrate(target, rng=random.Random(0), max_model_len=target.config.max_model_len))
    trace = _with_a_late_long_stream(TRIGGERS[pathology].trace)
    first = asyncio.run(target.execute(trace))
    latency = [c for c in judge.candidates(trace, first, cal) if c.metric is not None]
    return target, cal, trace, first, latency[0]


def test_a_latency_candidate_knows_when_its_request_ended():
    _, _, trace, first, candidate = _setup()
    request = next(r for r in first.requests if r.request_id == candidate.request_id)
    # a TTFT's re-runs need only reach its first token; another latency's, its end
    assert candidate.until_s == request.sent_s + (request.ttft_s if candidate.metric is Metric.TTFT else request.e2e_s)
    assert confirmation_cut_s(candidate) == CONFIRM_CUT_FACTOR * candidate.until_s + CONFIRM_CUT_SLACK_S
    assert confirmation_cut_s(candidate) < first.duration_s / 2  # the trace runs on long after it
    # a checkpoint keeps it (a pending candidate is re-run with the same cut)
    assert candidate_from_dict(candidate_to_dict(candidate)) == candidate
    assert confirmation_cut_s(dataclasses.replace(candidate, until_s=None)) is None


def test_cut_reruns_reach_the_verdict_the_whole_reruns_reach():
    target, cal, trace, first, candidate = _setup()
    cut = _Recording(target)
    whole = _Recording(VirtualTarget(pathologies=("hol-prefix-burst",), seed=3))
    asyncio.run(whole.execute(trace))  # the same history as the target the candidate came from
    whole.results.clear()
    v_cut = asyncio.run(confirm(cut, trace, candidate, cal, rng=np.random.default_rng(0),
                                cut_s=confirmation_cut_s(candidate)))
    v_whole = asyncio.run(confirm(whole, trace, candidate, cal, rng=np.random.default_rng(0)))
    assert v_cut.is_finding and (v_cut.kind, v_cut.decision) == (v_whole.kind, v_whole.decision)
    assert v_cut.reproduced == v_whole.reproduced
    assert all(any(r.outcome is Outcome.CUT for r in res.requests) for res in cut.results)
    assert sum(r.duration_s for r in cut.results) < sum(r.duration_s for r in whole.results) / 2


def test_the_confirmation_target_stops_cutting_a_trace_whose_cut_left_the_server_busy():
    target = VirtualTarget(seed=3)
    trace = TRIGGERS["kv-reserve-admission"].trace
    other = TRIGGERS["hol-prefix-burst"].trace
    third = TRIGGERS["lifo-admission"].trace
    seen, leaving_busy = [], {trace.content_hash(), other.content_hash()}

    async def run(t, cut_s):
        seen.append(cut_s)
        result = await target.execute(t, cut_s=cut_s)
        return dataclasses.replace(result, idle_after=t.content_hash() not in leaving_busy)

    confirming = ConfirmationTarget(target, run)
    for t in (trace, trace, other, third, other):
        asyncio.run(confirming.execute(t, cut_s=0.5))
    # that trace is re-run whole; another is still cut, until LEAKY_CUTS traces left it busy: then none
    assert LEAKY_CUTS == 2 and seen == [0.5, None, 0.5, None, None]
    assert confirming.cuts.leaky == leaving_busy and not confirming.cuts.allowed(third.content_hash())
    # a cut run that found the server idle again leaves cutting on
    seen.clear()
    quiet = ConfirmationTarget(target, lambda t, cut_s: (seen.append(cut_s), target.execute(t, cut_s=cut_s))[1])
    asyncio.run(quiet.execute(trace, cut_s=0.5))
    asyncio.run(quiet.execute(trace, cut_s=0.5))
    assert seen == [0.5, 0.5] and quiet.cuts.allowed(trace.content_hash())


async def test_a_campaigns_confirmation_reruns_are_cut_and_stored_so():
    from fuzzer.search.campaign import Campaign
    from fuzzer.search.settings import Settings
    from fuzzer.store import Store

    store = Store.memory()
    target = VirtualTarget(pathologies=("hol-prefix-burst",), seed=3)
    trace = _with_a_late_long_stream(TRIGGERS["hol-prefix-burst"].trace)
    await Campaign(target, store, Settings(seed=5, max_execs=4, idle_share=0.0), seeds=[trace],
                   target_key="sim:test").run()
    findings = store.list_findings()
    assert findings and findings[0].kind == "ttft-outlier"
    confirms = [store.get_execution(i) for i in store.execution_ids(trace_hash=trace.content_hash())]
    runs = [r for r in confirms if any(q.outcome is Outcome.CUT for q in r.requests)]
    assert len(runs) == len(confirms) - 1  # every run but the seed's own: the confirmation's re-runs
    late = [q for r in runs for q in r.requests if q.request_id == "late"]
    assert late and all(q.outcome is Outcome.CUT for q in late)


def test_a_fleet_workers_confirmation_reruns_are_cut_as_a_campaigns():
    from test_fleet_option import _Virtual, _Worker

    from fuzzer.fleet.targets import FleetTarget

    target = _Virtual(pathologies=("hol-prefix-burst",), seed=3)
    worker = _Worker(FleetTarget("a", url="http://127.0.0.1:1"), target, seed=1)
    try:
        worker.start()
        trace = _with_a_late_long_stream(TRIGGERS["hol-prefix-burst"].trace)
        candidates = [c for c in worker.execute(trace).candidates if c["metric"] is not None]
        assert candidates and candidates[0]["until_s"] is not None
        done = worker.confirm(trace, candidates[0])
        assert done.verdict["decision"] == "different" and done.runs
        cut = confirmation_cut_s(candidate_from_dict(candidates[0]))
        assert all(r.duration_s <= cut + 0.05 and any(q.outcome is Outcome.CUT for q in r.requests) for r in done.runs)
    finally:
        worker.stop()


def _seeded_long_carrier() -> Trace:
    """The seeded-sampling-path trigger with its carrier streaming long after the batch it slows."""
    trace = TRIGGERS["seeded-sampling-path"].trace
    return trace.with_requests([dataclasses.replace(r, max_tokens=1500) if r.seed is not None else r
                                for r in trace.requests])


async def test_an_option_tests_runs_close_when_the_other_requests_have_ended():
    from fuzzer.oracle.ablation import confirm_option, others_end_s
    from fuzzer.search.confirming import option_candidate

    trace = _seeded_long_carrier()
    first = await VirtualTarget(pathologies=("seeded-sampling-path",), seed=3).execute(trace)
    candidate = option_candidate(trace, "seed", first)
    others = [r for r in first.requests if r.request_id != "X"]
    assert candidate.until_s == max(r.sent_s + r.e2e_s for r in others)
    cut_s = confirmation_cut_s(candidate)
    assert cut_s < first.duration_s / 2  # the carrier streams on long after the batch
    cut = _Recording(VirtualTarget(pathologies=("seeded-sampling-path",), seed=3))
    whole = _Recording(VirtualTarget(pathologies=("seeded-sampling-path",), seed=3))
    v_cut = await confirm_option(cut, trace, "seed", cut_s=cut_s)
    v_whole = await confirm_option(whole, trace, "seed")
    assert v_cut.is_finding and v_whole.is_finding and v_cut.runs == v_whole.runs == 3
    assert v_cut.effect == pytest.approx(v_whole.effect, rel=0.05)
    # pairs (without, with), (with, without), (without, with): each run with it is capped at cut_s, or at
    # CAP_FACTOR x when the batch ended without it where that is earlier (a 2x slowdown does not reach it)
    with_it = (1, 2, 5)
    (cuts, results), (whole_cuts, _) = cut.paired(), whole.paired()
    assert [cuts[i] for i in (0, 3, 4)] == [cut_s] * 3 and max(cuts[i] for i in with_it) <= cut_s
    assert [whole_cuts[i] for i in (0, 3, 4)] == [None] * 3 and None not in [whole_cuts[i] for i in with_it]
    assert all(results[i].duration_s <= cut_s + 0.01 for i in with_it) and first.duration_s > 2 * cut_s
    # the carrier row alone (its own cost) runs whole: at most OWN_TOKENS tokens, not its long stream
    assert all(len(t.requests) == 1 and t.requests[0].max_tokens <= 64 for t, c in zip(cut.traces, cut.cuts)
               if c is None and len(t.requests) == 1)
    # a carrier that ends with the batch, or a request without the option that did not complete: no cut
    short = trace.with_requests([dataclasses.replace(r, max_tokens=128) for r in trace.requests])
    assert others_end_s(short, await VirtualTarget(seed=3).execute(short), "seed") is None
    failed = dataclasses.replace(first, requests=tuple(
        dataclasses.replace(r, outcome=Outcome.TIMEOUT, e2e_s=None) if r.request_id == "S03" else r
        for r in first.requests))
    assert option_candidate(trace, "seed", failed).until_s is None
    assert option_candidate(trace, "seed").until_s is None  # a pending test of old: whole runs


async def test_an_option_test_whose_run_without_the_option_was_cut_runs_whole_from_then_on():
    from fuzzer.oracle.ablation import confirm_option

    trace = _seeded_long_carrier()
    target = _Recording(VirtualTarget(pathologies=("seeded-sampling-path",), seed=3))
    # So short a cap that the batch is still running: the run without the option says nothing.
    verdict = await confirm_option(target, trace, "seed", cut_s=0.05)
    cuts, _ = target.paired()
    assert cuts[:2] == [0.05, 0.05] and cuts[2:5] == [None] * 3
    assert verdict.is_finding and verdict.runs == 3  # the first pair is no pair


async def test_an_option_tests_runs_with_it_close_at_four_times_the_batch_without_it():
    from fuzzer.oracle.ablation import CAP_FACTOR, confirm_option, ended_s, others_itl, without_option
    from fuzzer.sim.config import SimConfig

    trace = TRIGGERS["seeded-sampling-path"].trace
    def target():
        return _Recording(VirtualTarget(config=SimConfig(seeded_row_sample_s=4e-3), pathologies=("seeded-sampling-path",), seed=3))
    capped, alone = target(), target()
    verdict = await confirm_option(capped, trace, "seed")
    first = await alone.execute(trace)
    without = await alone.execute(without_option(trace, "seed"))
    ended = ended_s(trace, without, "seed")
    # each run with the seed takes far more than 4x the batch without it: those after a run without it close
    assert first.duration_s > 2 * CAP_FACTOR * ended
    # pairs (without, with), (with, without), (without, with): every run with it closes
    cuts, results = capped.paired()
    assert [cuts[i] for i in (0, 3, 4)] == [None] * 3
    assert [cuts[i] for i in (1, 2, 5)] == [pytest.approx(CAP_FACTOR * ended, rel=0.2)] * 3
    assert all(results[i].duration_s < first.duration_s / 2 for i in (1, 2, 5))
    assert verdict.is_finding and verdict.runs == 3 and verdict.reproduced == 3
    assert "lower bound" in verdict.detail and "in 3 pair(s)" in verdict.detail
    # A lower bound of the others' token gaps' slowdown in a run that nothing closed.
    assert verdict.compared == "itl" and 0.9 * CAP_FACTOR <= verdict.effect
    assert verdict.effect < 1.05 * others_itl(trace, first, "seed") / others_itl(trace, without, "seed")


async def test_a_campaigns_option_test_runs_are_cut_after_the_batch():
    from fuzzer.search.campaign import Campaign
    from fuzzer.search.settings import Settings
    from fuzzer.store import Store

    store = Store.memory()
    trace = _seeded_long_carrier()
    await Campaign(VirtualTarget(pathologies=("seeded-sampling-path",), seed=3), store,
                   Settings(seed=5, max_execs=7, idle_share=0.0), seeds=[trace], target_key="sim:test").run()
    finding = store.list_findings()[0]
    assert finding.kind == "option-slowdown" and finding.verdict["ablated"] == "seed"
    rows = store.execution_rows()
    # Three pairs, and the carrier row alone twice with and without its seed (its own cost, 64 tokens).
    assert [r["purpose"] for r in rows] == ["seed"] + ["confirm"] * (6 + 4)
    runs = [store.get_execution(r["id"]) for r in rows[1:]]
    tests = [run for run in runs if len(run.requests) > 1]
    carrier = [q for run in tests for q in run.requests if q.request_id == "X"]
    assert len(carrier) == 6 and all(q.outcome is Outcome.CUT for q in carrier)
    assert all(run.duration_s < store.get_execution(rows[0]["id"]).duration_s / 2 for run in tests)


def test_a_ttft_victims_reruns_close_after_its_first_token_not_its_long_output():
    # heldout5 with every bug on: a TTFT victim's first token came at 21 s, and its three re-runs ran to its
    # end and the trace's, 39-51 s each.
    target = VirtualTarget(pathologies=("hol-prefix-burst",), seed=3)
    cal = asyncio.run(calibrate(target, rng=random.Random(0), max_model_len=target.config.max_model_len))
    burst = TRIGGERS["hol-prefix-burst"].trace
    probe = next(c for c in judge.candidates(burst, asyncio.run(target.execute(burst)), cal) if c.metric is Metric.TTFT)
    trace = burst.with_requests([dataclasses.replace(r, max_tokens=1500) if r.id == probe.request_id else r
                                 for r in burst.requests])
    first = asyncio.run(target.execute(trace))
    candidate = next(c for c in judge.candidates(trace, first, cal) if c.request_id == probe.request_id)
    victim = next(r for r in first.requests if r.request_id == candidate.request_id)
    assert candidate.metric is Metric.TTFT and candidate.until_s == victim.sent_s + victim.ttft_s
    assert confirmation_cut_s(candidate) < (victim.sent_s + victim.e2e_s) / 2  # its output runs on for long
    cut, whole = _Recording(target), _Recording(VirtualTarget(pathologies=("hol-prefix-burst",), seed=3))
    asyncio.run(whole.execute(trace))
    whole.results.clear()
    v_cut = asyncio.run(confirm(cut, trace, candidate, cal, rng=np.random.default_rng(0),
                                cut_s=confirmation_cut_s(candidate)))
    v_whole = asyncio.run(confirm(whole, trace, candidate, cal, rng=np.random.default_rng(0)))
    assert v_cut.is_finding and (v_cut.kind, v_cut.metric) == (v_whole.kind, v_whole.metric) == (probe.kind, Metric.TTFT)
    assert sum(r.duration_s for r in cut.results) < sum(r.duration_s for r in whole.results) / 2
