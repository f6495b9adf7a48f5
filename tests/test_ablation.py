"""Option-slowdowns: one request's sampling option slowing the others, against the trace without it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from paper_target import PaperTarget
from test_confirming import _calibration, _confirmer

from fuzzer.execution import ExecutionResult, Outcome, RequestResult
from fuzzer.oracle.ablation import (
    beside,
    confirm_option,
    decide,
    option_size,
    option_work,
    options_of,
    others_e2e,
    others_itl,
    statistic_of,
    suspects,
    without_option,
)
from fuzzer.oracle.judge import candidates
from fuzzer.oracle.kinds import Decision, FindingKind
from fuzzer.oracle.policy import OraclePolicy
from fuzzer.oracle.signature import option_signature
from fuzzer.store import Store
from fuzzer.trace import Request, Trace


def _seeded_batch(rows=16, out=64, option="seed"):
    rows_ = [Request(id=f"row{i}", at_ms=float(i), prompt_tokens=64, max_tokens=out) for i in range(rows)]
    extra = {"seed": 7, "temperature": 1.0} if option == "seed" else {"logprobs": 5}
    carrier = Request(id="carrier", at_ms=float(rows + 10), prompt_tokens=64, max_tokens=out, **extra)
    return Trace(requests=(*rows_, carrier))


#: The sampling work of _seeded_batch's carrier (64 tokens, one choice): a test's size is the overlap times it.
WORK = 64


def test_the_ablation_removes_the_option_from_every_request_and_nothing_else():
    trace = _seeded_batch()
    two = trace.with_requests([*trace.requests, Request(id="c2", at_ms=40.0, prompt_tokens=8, max_tokens=8, seed=3)])
    ablated = without_option(two, "seed")
    assert all(r.seed is None for r in ablated.requests)
    assert [(r.id, r.prompt_tokens, r.max_tokens, r.at_ms, r.temperature) for r in ablated.requests] == \
        [(r.id, r.prompt_tokens, r.max_tokens, r.at_ms, r.temperature) for r in two.requests]
    assert options_of(trace) == ("seed",) and options_of(_seeded_batch(option="logprobs")) == ("logprobs",)
    assert options_of(_seeded_batch(rows=2)) == ()  # too few others to speak of "everyone"


def test_decide_needs_significance_and_the_factor_and_stops_early_when_far_below():
    policy = OraclePolicy()
    assert decide([2.0, 1.97, 2.03], policy)[0] is Decision.DIFFERENT
    assert decide([2.0, 1.97], policy)[0] is Decision.UNKNOWN  # fewer pairs than MIN_RUNS
    assert decide([1.02], policy)[0] is Decision.SAME  # one pair far below the factor (futility)
    assert decide([1.15], policy)[0] is Decision.UNKNOWN  # not far enough below to stop at one pair
    assert decide([1.1, 1.12, 1.11], policy)[0] is Decision.SAME  # surely below 1.25x, though significant
    assert decide([1.6, 1.1, 2.4], policy)[0] is Decision.UNKNOWN  # too noisy to say
    # Significant and 1.4x on average, but only two of five pairs at the factor: a few wild pairs.
    assert decide([1.7, 1.7, 1.22, 1.22, 1.22], policy)[:2] == (Decision.UNKNOWN, pytest.approx(0.0075, abs=0.002))
    decision, p, effect = decide([1.55, 1.56, 1.54], policy)
    assert decision is Decision.DIFFERENT and p < 0.01 and 1.5 < effect < 1.6


async def test_a_seed_that_slows_the_batch_is_an_option_slowdown_and_a_harmless_one_costs_one_pair():
    trace = _seeded_batch()
    slow = PaperTarget(seeded_slowdown=1.8, seed=1)
    verdict = await confirm_option(slow, trace, "seed")
    assert verdict.is_finding and verdict.kind is FindingKind.OPTION_SLOWDOWN and verdict.ablated == "seed"
    assert 1.7 < verdict.effect < 1.9 and verdict.runs == 3 and verdict.reproduced == 3
    assert verdict.request_id == "carrier" and verdict.signature == option_signature("seed")
    # Three pairs, and after the first one carrier row alone with and without its seed, twice (its own
    # cost: none here).
    assert verdict.observed_s > verdict.expected_s and slow.executions == 6 + 4
    harmless = PaperTarget(seeded_slowdown=1.0, seed=1)
    same = await confirm_option(harmless, trace, "seed")
    assert not same.is_finding and same.decision is Decision.SAME and harmless.executions == 2


async def test_an_option_that_slows_its_own_rows_as_much_as_the_batch_is_its_real_cost():
    # heldout7 (stop 42), clean: its sampler charges each logprob to its row, and eight rows of 20
    # logprobs made every shared step, so the others' e2e, 1.95x: the carriers' own work, which FCFS
    # with the engine's real costs gives everyone who shares their steps. Their cost alone sets the bar.
    trace = _seeded_batch()
    per_row = PaperTarget(seeded_row_s=0.005, seed=1)
    verdict = await confirm_option(per_row, trace, "seed")
    assert not verdict.is_finding and verdict.decision is Decision.SAME, verdict.detail
    assert verdict.compared == "itl" and "median ITL" in verdict.detail
    # One row's added seconds over the others' token gap: what the carrier's row adds to each of their steps.
    assert "own rows explain 1.9" in verdict.detail and verdict.effect == pytest.approx(1.92, abs=0.08)
    assert verdict.threshold == pytest.approx(1.25 * verdict.effect, rel=0.06)
    assert decide([1.95, 1.93, 1.97], OraclePolicy(), own=1.8)[0] is Decision.SAME
    assert decide([3.0, 2.9, 3.1], OraclePolicy(), own=1.8)[0] is Decision.DIFFERENT  # beyond it: the batch pays


async def test_a_cost_of_every_row_of_the_batch_shows_in_the_others_token_gaps_where_their_e2e_dilutes_it():
    # heldout12's bug5 (stop 50): with one request asking for logprobs the sampler computed them for every
    # row of the batch. Its carrier (n=8) alone paid its own row; beside 1000-token prompts the others'
    # e2e, mostly prefill, grew 1.3x where their token gaps grew 1.66x, and the bar over e2e (the row's
    # ratio over its own short steps, times eight rows) was 5x: missed. The same others' gaps from eight
    # rows that each cost their own steps are the carriers' own work.
    rows = [Request(id=f"row{i}", at_ms=float(i), prompt_tokens=4000, max_tokens=16) for i in range(16)]
    carrier = Request(id="carrier", at_ms=0.0, prompt_tokens=64, max_tokens=64, n=8, seed=7, temperature=1.0)
    trace = Trace(requests=(carrier, *rows))
    batch_wide = await confirm_option(PaperTarget(seeded_batch_s=0.002, seed=1), trace, "seed")
    assert batch_wide.is_finding and batch_wide.compared == "itl", batch_wide.detail
    assert 1.55 < batch_wide.effect < 1.75 and batch_wide.threshold < 1.6
    pair = PaperTarget(seeded_batch_s=0.002, noise=0.0)
    with_it, without_it = pair.run(trace), pair.run(without_option(trace, "seed"))
    assert others_e2e(trace, with_it, "seed") < 1.35 * others_e2e(trace, without_it, "seed")
    per_row = await confirm_option(PaperTarget(seeded_row_s=0.002 * 24 / 8, seed=1), trace, "seed")
    assert not per_row.is_finding and per_row.decision is Decision.SAME, per_row.detail
    assert per_row.effect == pytest.approx(batch_wide.effect, rel=0.05)


def test_the_others_token_gaps_are_compared_when_most_of_them_stream():
    trace = _seeded_batch()
    assert statistic_of(trace, "seed") == "itl"
    quiet = trace.with_requests([replace(r, stream=False) if r.seed is None and i % 2 else r
                                 for i, r in enumerate(trace.requests)])
    assert statistic_of(quiet, "seed") == "e2e"  # half of the others do not stream: no majority
    result = PaperTarget(noise=0.0).run(trace)
    gaps = sorted((r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1)
                  for r in result.requests if r.request_id != "carrier")
    assert others_itl(trace, result, "seed") == pytest.approx(gaps[len(gaps) // 2])
    # A request the cap closed: without ``at_least`` the statistic is unknown; with it, its gaps so far,
    # the open one to the cap included, are a lower bound of its mean.
    first = result.requests[0]
    cut = replace(first, outcome=Outcome.CUT, token_times_s=first.token_times_s[:3], e2e_s=first.token_times_s[2] + 1.0)
    closed = replace(result, requests=(cut, *result.requests[1:]))
    assert others_itl(trace, closed, "seed") is None
    assert others_itl(trace, closed, "seed", at_least=True) >= others_itl(trace, result, "seed")


async def test_a_slowdown_below_the_candidate_factor_is_tested_and_found_once_by_the_campaign():
    calibration = await _calibration()
    trace = _seeded_batch()
    target = PaperTarget(seeded_slowdown=1.8, seed=2)
    first = target.run(trace)
    assert others_e2e(trace, first, "seed") is not None
    assert suspects(trace, first) == {"seed": 16}
    apart = Trace(requests=tuple(replace(r, at_ms=2000.0 * i) for i, r in enumerate(trace.requests)))
    assert suspects(apart, target.run(apart)) == {}  # nothing ran beside the seeded request
    # A short seeded request among long streams: they ran mostly without it, and a test would be
    # diluted (held-out servers: 1.12x and 1.18x for planted 2x and 1.5x samplers).
    short = trace.with_requests([*(replace(r, max_tokens=1024) for r in trace.requests[:-1]),
                                 replace(trace.requests[-1], max_tokens=16)])
    assert suspects(short, target.run(short)) == {}
    store = Store.memory()
    confirmer = _confirmer(store, target)
    verdict = await confirmer.examine(trace, first, calibration)
    assert verdict is not None and verdict.is_finding
    [finding] = store.list_findings()
    assert finding.kind == "option-slowdown" and finding.signature == option_signature("seed")
    assert confirmer.option_tests == {"seed": (1, 16 * WORK)}
    # Found: another seeded trace, however large its batch, is not tested again.
    other = _seeded_batch(rows=40, out=48)
    await confirmer.examine(other, target.run(other), calibration)
    assert confirmer.option_tests == {"seed": (1, 16 * WORK)} and len(store.list_findings()) == 1


async def test_a_harmless_option_is_tested_on_growing_batches_at_most_option_tests_times():
    calibration = await _calibration()
    policy = OraclePolicy()
    target = PaperTarget(seed=3)
    store = Store.memory()
    confirmer = _confirmer(store, target)
    runs = []
    for rows in (16, 16, 24, 32, 40, 64):
        trace = _seeded_batch(rows=rows)
        before = target.executions
        await confirmer.examine(trace, target.run(trace), calibration)
        runs.append(target.executions - before - 1)
    # One pair each (futility); again only on 1.5x the largest batch tested; three tests in all.
    assert policy.option_tests == 3 and policy.option_growth == 1.5
    assert runs == [2, 0, 2, 0, 2, 0] and not store.list_findings()
    assert confirmer.to_state()["option_tests"] == {"seed": [3, 40 * WORK]}


def test_a_tests_size_is_the_requests_beside_a_carrier_times_the_carriers_sampling_work():
    assert option_work(_seeded_batch(), "seed") == WORK
    trace = _seeded_batch(out=512, option="logprobs")
    lp = Request(id="lp2", at_ms=0.0, prompt_tokens=8, max_tokens=300, n=2, logprobs=20, cancel_after_tokens=100)
    two = trace.with_requests([*trace.requests, lp])
    # Each carrier's token rows (to its cancellation, times its choices), times its logprobs plus one.
    assert option_work(two, "logprobs") == 512 * (5 + 1) + 100 * 2 * (20 + 1)
    assert option_size(two, "logprobs", 10) == 10 * option_work(two, "logprobs")
    assert option_work(two, "seed") == 0 and option_size(two, "seed", 3) == 3


async def test_a_harmless_option_is_tested_again_on_as_many_requests_beside_carriers_of_more_work():
    """A frontend cost that grows with a carrier's output shows only beside long carriers: a SAME beside short ones
    says little of them, whatever the batch (the size, not the overlap alone, must grow)."""
    calibration = await _calibration()
    target = PaperTarget(seed=3)
    store = Store.memory()
    confirmer = _confirmer(store, target)
    runs = []
    for out in (64, 64, 80, 128, 256):
        trace = _seeded_batch(rows=16, out=out)
        first = target.run(trace)
        assert suspects(trace, first) == {"seed": 16}
        before = target.executions
        await confirmer.examine(trace, first, calibration)
        runs.append(target.executions - before)
    # 64 tokens: tested; again: not; 80 (1.25x the work): not; 128 (2x): tested; 256 (2x again): tested.
    assert runs == [2, 0, 0, 2, 2] and not store.list_findings()
    assert confirmer.option_tests == {"seed": (3, 16 * 256)}


class _Recording(PaperTarget):
    """A PaperTarget that remembers which traces it ran."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.traces = []

    def run(self, trace):
        self.traces.append(trace)
        return super().run(trace)


async def test_an_option_is_tested_before_its_victims_and_explains_them_once_found():
    # 2.5x: the other requests are over their bounds too, and would be confirmed as e2e outliers
    # of whichever stream the judge ranks first, the seed nowhere in the finding.
    calibration = await _calibration()
    target = _Recording(seeded_slowdown=2.5, seed=4)
    store = Store.memory()
    confirmer = _confirmer(store, target)
    trace = _seeded_batch()
    first = target.run(trace)
    assert any(c.metric is not None for c in candidates(trace, first, calibration))
    verdict = await confirmer.examine(trace, first, calibration)
    assert verdict.kind is FindingKind.OPTION_SLOWDOWN
    assert [f.kind for f in store.list_findings()] == ["option-slowdown"]
    # Another seeded trace: its slow streams are confirmed on the trace without the seed, where they
    # are not slow: no e2e-outlier of the seed's doing.
    other = _seeded_batch(rows=20, out=80)
    before = len(target.traces)
    first = target.run(other)
    assert any(c.metric is not None for c in candidates(other, first, calibration))
    await confirmer.examine(other, first, calibration)
    reruns = target.traces[before + 1:]
    assert reruns and all(r.seed is None for t in reruns for r in t.requests)
    assert [f.kind for f in store.list_findings()] == ["option-slowdown"]


async def test_the_carriers_own_cost_is_one_rows_times_their_rows_so_a_batch_wide_cost_still_shows():
    # The README's main job (stop 42): the simulator's logprobs-batch-cost charges every sequence of the
    # batch for the logprobs of n > 1 requests, so the seed trace's carrier (eight choices, 20 logprobs)
    # alone ran 20x slower with them: its own choices pay the batch-wide cost too. One row alone shows
    # what the option costs a row; the carrier's eight rows may add eight times that to a step.
    from pathlib import Path

    from fuzzer.oracle.ablation import own_ratio
    from fuzzer.sim import VirtualTarget
    from fuzzer.trace import load

    trace = load(Path(__file__).resolve().parent.parent / "corpus" / "n-logprobs.json")
    assert [(r.n, r.logprobs) for r in trace.requests if r.logprobs] == [(8, 20)]
    buggy = VirtualTarget(pathologies=("logprobs-batch-cost",), seed=3)
    assert await own_ratio(buggy, trace, "logprobs") < 1.25
    verdict = await confirm_option(buggy, trace, "logprobs")
    assert verdict.is_finding and verdict.kind is FindingKind.OPTION_SLOWDOWN, verdict.detail
    clean = VirtualTarget(seed=3)
    assert not (await confirm_option(clean, trace, "logprobs")).is_finding
    # A per-row cost: one row 1.2x alone, three rows may make a step 1.6x.
    rows = _seeded_batch().with_requests([*_seeded_batch().requests[:-1],
                                         replace(_seeded_batch().requests[-1], n=3)])
    assert await own_ratio(PaperTarget(seeded_slowdown=1.2, seeded_alone=True, noise=0.0), rows, "seed") \
        == pytest.approx(1.6, rel=0.05)


class _Stalling:
    """A server on which a seeded request keeps every other request from its first token for 10 s (vllm#37343:
    76-423x TTFT): the runs with the seed are capped (``cut_s``) before any other request streams a token."""

    def __init__(self):
        self.cuts = []

    async def execute(self, trace, *, cut_s=None):
        self.cuts.append(cut_s)
        seeded = any(r.seed is not None for r in trace.requests)
        results = []
        for r in trace.requests:
            alone = len(trace.requests) == 1
            if seeded and not alone and r.seed is None:
                end = min(cut_s or 10.0, 10.0)
                results.append(RequestResult(r.id, r.id, 0.0, 0.0, Outcome.CUT, e2e_s=end))
                continue
            gap = 0.011 if seeded else 0.010
            times = tuple(0.05 + gap * i for i in range(8))
            results.append(RequestResult(r.id, r.id, 0.0, 0.0, Outcome.OK, ttft_s=times[0], first_event_s=times[0],
                                         token_times_s=times, e2e_s=times[-1]))
        return ExecutionResult(trace_hash=trace.content_hash(), target="stalling", started_at=0.0,
                               duration_s=max(x.e2e_s for x in results), requests=tuple(results))


async def test_others_closed_before_their_second_token_are_judged_on_their_e2e_so_far():
    # The others' token gaps say nothing when the cap closed them before two tokens came: the test falls back
    # to their e2e so far, a lower bound (CAP_FACTOR x their end without the seed), and finds the slowdown.
    stalling = _Stalling()
    verdict = await confirm_option(stalling, _seeded_batch(), "seed")
    assert statistic_of(_seeded_batch(), "seed") == "itl"
    assert verdict.is_finding and verdict.compared == "e2e", verdict.detail
    assert verdict.effect >= 3.5 and "lower bound" in verdict.detail
    assert any(cut is not None for cut in stalling.cuts)  # the runs with the seed were capped


def test_a_carrier_is_beside_the_others_while_it_samples_not_while_it_prefills():
    # The built-in simulator's seeded-sampling-path, a 30-minute HTTP campaign (stop 54): its three tests of the
    # seed went to carriers of 32 tokens that waited and prefilled beside the others, or sampled while the others
    # waited for their first tokens; the others' token gaps moved by nothing, and the seed was never found.
    from fuzzer.sim import SimConfig, VirtualTarget

    def run(carrier_prompt, carrier_out, rows_prompt=64):
        carrier = Request(id="carrier", at_ms=0.0, prompt_tokens=carrier_prompt, max_tokens=carrier_out, seed=7,
                          temperature=1.0)
        rows = [Request(id=f"row{i}", at_ms=1.0 + i, prompt_tokens=rows_prompt, max_tokens=48) for i in range(12)]
        trace = Trace(requests=(carrier, *rows))
        return trace, VirtualTarget(SimConfig(), seed=1).run(trace)

    # A 30000-token prompt prefills in long chunk steps beside the rows' decodes, then samples 16 tokens.
    prefilling = run(30000, 16)
    assert beside(*prefilling, "seed")[0] < 4 and "seed" not in suspects(*prefilling)
    # A short carrier first, sampling while the rows wait for their prefills of 8000 tokens each.
    early = run(64, 16, rows_prompt=8000)
    assert beside(*early, "seed")[0] < 4 and "seed" not in suspects(*early)
    # The control: a carrier sampling while the rows decode is beside every one of them.
    sampling = run(64, 256)
    assert beside(*sampling, "seed") == (12, 12) and suspects(*sampling) == {"seed": 12}
