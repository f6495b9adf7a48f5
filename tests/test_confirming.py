"""The campaign's confirmer: one bug met in many trace shapes is not confirmed over and over."""

from __future__ import annotations

import asyncio
import contextlib
import random

import numpy as np
from paper_target import PaperTarget

from fuzzer.oracle.calibrate import calibrate
from fuzzer.oracle.policy import OraclePolicy
from fuzzer.oracle.signature import family, signature
from fuzzer.search.confirming import FAMILY_EVERY, Confirmer, family_gap
from fuzzer.store import Store
from fuzzer.trace import Request, Trace


_CALIBRATION = []


async def _calibration():
    if not _CALIBRATION:
        _CALIBRATION.append(await calibrate(PaperTarget(seed=99), rng=random.Random(0), clock=lambda: 0.0))
    return _CALIBRATION[0]


def _shapes(count):
    """Traces in which a stream ``v`` follows k = 0, 1, 2, ... other requests of growing prompts:
    a new signature each (what arrived before the victim differs), one family (the victim's kind)."""
    out = []
    for k in range(count):
        j, lap = k % 9, k // 9  # past 9 the victim's output class tells the shapes apart
        before = tuple(Request(id=f"o{i}", at_ms=i, prompt_tokens=16 << j, max_tokens=8) for i in range(j))
        out.append(Trace(requests=(*before, Request(id="v", at_ms=20, prompt_tokens=256, max_tokens=32 << lap))))
    return out


def _confirmer(store, target):
    campaign_id = store.start_campaign(seed=1, target="paper", settings={})

    async def recover():
        return None

    return Confirmer(target, store, OraclePolicy(), campaign_id=campaign_id, target_id=None,
                     rng=np.random.default_rng(0), sleep=asyncio.sleep, checkpoint=lambda: None, clock=lambda: 0.0,
                     in_phase=lambda phase: contextlib.nullcontext(), recover=recover, on_finding=lambda i, v: None)


async def test_a_found_family_is_confirmed_once_in_family_every_sightings():
    traces = _shapes(2 + FAMILY_EVERY)
    kinds = {(signature(k, t, "v"), family(k, t, "v")) for t in traces for k in [_stall_kind()]}
    assert len({s for s, _ in kinds}) == len(traces) and len({f for _, f in kinds}) == 1
    store = Store.memory()
    target = PaperTarget(stall_s={"v": 0.4}, seed=1)
    target._idle_s = 0.5  # warm
    confirmer = _confirmer(store, target)
    runs = []
    for t in traces:
        before = target.executions
        first = await target.execute(t)
        await confirmer.examine(t, first, await _calibration())
        runs.append(target.executions - before - 1)  # confirmation runs only
    findings = store.list_findings()
    # The first sighting is confirmed (3 runs); the next FAMILY_EVERY - 1 new signatures cost nothing;
    # the FAMILY_EVERY-th is confirmed again, so a second bug of the family would still be found.
    assert runs[0] >= 3 and runs[1:FAMILY_EVERY] == [0] * (FAMILY_EVERY - 1) and runs[FAMILY_EVERY] >= 3
    assert len(findings) == 2 and {f.details["family"] for f in findings} == {family(_stall_kind(), traces[0], "v")}
    assert [f.details["request_id"] for f in findings] == ["v", "v"]
    # and the count starts again: the sighting after costs nothing. A checkpoint keeps the count.
    assert runs[FAMILY_EVERY + 1] == 0
    assert confirmer.to_state()["family_seen"] == {findings[0].details["family"]: 1}


async def test_an_execution_is_one_sighting_of_a_family_however_many_victims_show_it():
    # With every bug on, the held-out server's bug5 stalls every stream beside a long prompt: one
    # execution of ten streams counted ten sightings and spent the family's gap at once (4 findings of
    # one family in a 30-minute campaign).
    store = Store.memory()
    victims = [f"w{i}" for i in range(2 * FAMILY_EVERY)]
    target = PaperTarget(stall_s={"v": 0.4, **{w: 0.4 for w in victims}}, seed=1)
    target._idle_s = 0.5
    confirmer = _confirmer(store, target)
    first = _shapes(1)[0]
    await confirmer.examine(first, await target.execute(first), await _calibration())
    assert len(store.list_findings()) == 1
    # Streams of growing prompts one after another: each a new signature of the found family.
    many = Trace(requests=tuple(Request(id=w, at_ms=i, prompt_tokens=16 << i, max_tokens=32)
                                for i, w in enumerate(victims)))
    assert len({signature(_stall_kind(), many, w) for w in victims}) == len(victims)
    assert {family(_stall_kind(), many, w) for w in victims} == {family(_stall_kind(), first, "v")}
    before = target.executions
    await confirmer.examine(many, await target.execute(many), await _calibration())
    assert target.executions - before == 1  # passed over: one sighting, not ten
    assert confirmer.to_state()["family_seen"] == {store.list_findings()[0].details["family"]: 1}


async def test_each_finding_of_a_family_doubles_the_sightings_before_the_next_confirmation():
    # With every bug on, the held-out vLLM-like server's campaign confirmed one bug under 26
    # signatures at one in 5: the gap doubles per finding (5, then 10, ...).
    assert [family_gap(k) for k in (1, 2, 3)] == [FAMILY_EVERY, 2 * FAMILY_EVERY, 4 * FAMILY_EVERY]
    traces = _shapes(2 + 3 * FAMILY_EVERY)
    assert len({signature(_stall_kind(), t, "v") for t in traces}) == len(traces)
    store = Store.memory()
    target = PaperTarget(stall_s={"v": 0.4}, seed=1)
    target._idle_s = 0.5
    confirmer = _confirmer(store, target)
    confirmed = []
    for i, t in enumerate(traces):
        before = target.executions
        await confirmer.examine(t, await target.execute(t), await _calibration())
        if target.executions - before - 1:
            confirmed.append(i)
    second = FAMILY_EVERY
    third = second + 2 * FAMILY_EVERY
    assert confirmed == [0, second, third]
    assert len(store.list_findings()) == 3


async def test_without_a_found_family_every_new_signature_is_confirmed():
    # The control: the same sightings with nothing of the family found before each (a fresh store each time).
    for t in _shapes(3):
        store = Store.memory()
        target = PaperTarget(stall_s={"v": 0.4}, seed=1)
        target._idle_s = 0.5
        confirmer = _confirmer(store, target)
        await confirmer.examine(t, await target.execute(t), await _calibration())
        assert target.executions >= 4 and len(store.list_findings()) == 1


def _stall_kind():
    from fuzzer.oracle.kinds import FindingKind

    return FindingKind.ITL_STALL


# --- the confirmation share: candidates wait, ranked ---------------------------------------------


def _sharing_confirmer(store, target, due, state=None):
    campaign_id = store.start_campaign(seed=1, target="paper", settings={})

    async def recover():
        return None

    return Confirmer(target, store, OraclePolicy(), campaign_id=campaign_id, target_id=None,
                     rng=np.random.default_rng(0), sleep=asyncio.sleep, checkpoint=lambda: None, clock=lambda: 0.0,
                     in_phase=lambda phase: contextlib.nullcontext(), recover=recover, on_finding=lambda i, v: None,
                     due=due, state=state)


def _delayed(victim, before):
    """A trace whose request ``victim`` follows ``before`` short requests (its first token is delayed)."""
    others = tuple(Request(id=f"o{i}", at_ms=i, prompt_tokens=16 << i, max_tokens=8) for i in range(before))
    return Trace(requests=(*others, Request(id=victim, at_ms=20, prompt_tokens=256, max_tokens=32)))


async def test_over_the_share_a_found_kinds_candidate_waits_and_a_new_kinds_does_not():
    # With every bug on, confirmation took 44% of a 30-minute campaign on the held-out server, 12 of
    # its 21 findings one bug's: past the share, a candidate of a kind already found waits.
    store = Store.memory()
    target = PaperTarget(stall_s={"v": 0.4}, delay_s={"d": 0.6}, seed=1)
    target._idle_s = 0.5
    allowed = [False]
    confirmer = _sharing_confirmer(store, target, lambda: allowed[0])
    stall, delay = _shapes(1)[0], _delayed("d", 2)
    # A kind never found is confirmed at once, whatever the share.
    await confirmer.examine(stall, await target.execute(stall), await _calibration())
    assert [f.kind for f in store.list_findings()] == ["itl-stall"]
    # A second itl-stall of another family (a trace with a client that times out; a seeded one is confirmed
    # without its seed, here the first trace again) waits while the share says no ...
    seeded = Trace(requests=(*stall.requests, Request(id="s", at_ms=30, prompt_tokens=8, max_tokens=4,
                                                      disconnect_after_ms=5000.0)))
    assert family(_stall_kind(), seeded, "v") != family(_stall_kind(), stall, "v")
    before = target.executions
    store.put_trace(seeded)  # the campaign stores every execution's trace before examining it
    await confirmer.examine(seeded, await target.execute(seeded), await _calibration())
    assert target.executions - before == 1 and len(confirmer.waiting) == 1
    # ... and a ttft-outlier, a kind never found, is confirmed at once beside it.
    await confirmer.examine(delay, await target.execute(delay), await _calibration())
    assert sorted(f.kind for f in store.list_findings()) == ["itl-stall", "ttft-outlier"]
    # The checkpoint keeps what waits; a confirmer taken up from it confirms it once the share allows.
    state = confirmer.to_state()
    assert [w["key"] for w in state["waiting"]] == [signature(_stall_kind(), seeded, "v")]
    resumed = _sharing_confirmer(store, target, lambda: False, state=state)
    assert not resumed.waiting_due()
    allowed[0] = True
    resumed = _sharing_confirmer(store, target, lambda: allowed[0], state=state)
    assert resumed.waiting_due()
    verdict = await resumed.confirm_waiting(await _calibration())
    assert verdict is not None and verdict.is_finding and not resumed.waiting
    assert len(store.list_findings()) == 3


async def test_waiting_candidates_are_confirmed_new_family_first_then_the_worst():
    store = Store.memory()
    victims = {"v": 0.4, "w": 1.2, "x": 0.3}
    target = PaperTarget(stall_s=victims, seed=1)
    target._idle_s = 0.5
    confirmer = _sharing_confirmer(store, target, lambda: False)
    first = _shapes(1)[0]
    await confirmer.examine(first, await target.execute(first), await _calibration())
    found_family = store.list_findings()[0].details["family"]
    # Three more stalls wait: two of the found family (w stalls three times as long as x), one of a
    # new family (a client that times out; a seeded trace is judged without its seed), seen last and
    # stalled least.
    same_w = Trace(requests=(Request(id="o", at_ms=0, prompt_tokens=64, max_tokens=8),
                             Request(id="w", at_ms=5, prompt_tokens=256, max_tokens=32)))
    same_x = Trace(requests=(Request(id="o", at_ms=0, prompt_tokens=512, max_tokens=8),
                             Request(id="x", at_ms=5, prompt_tokens=256, max_tokens=32)))
    new_x = Trace(requests=(*same_x.requests, Request(id="s", at_ms=9, prompt_tokens=8, max_tokens=4,
                                                      disconnect_after_ms=5000.0)))
    assert family(_stall_kind(), same_w, "w") == family(_stall_kind(), same_x, "x") == found_family
    assert family(_stall_kind(), new_x, "x") != found_family
    confirmer.families.pass_over = lambda fam, sighted: False  # no back-off in this test: only the ranking
    for t in (same_x, same_w, new_x):
        await confirmer.examine(t, await target.execute(t), await _calibration())
    assert len(confirmer.waiting) == 3
    order = []
    while confirmer.waiting:
        order.append(min(confirmer.waiting, key=confirmer._rank).trace)
        await confirmer.confirm_waiting(await _calibration())
    assert order == [new_x, same_w, same_x]


def test_the_confirmation_share_counts_confirmation_runs_against_all_server_time():
    from fuzzer.search.pacing import ServerTime

    t = ServerTime()
    assert t.confirm_due(0.2)  # nothing spent yet
    t.record("fuzz", 10.0)
    t.record("confirm", 3.0)
    assert not t.confirm_due(0.2)  # 3 of 13 s
    t.record("fuzz", 2.0)
    assert t.confirm_due(0.2)  # 3 of 15 s
    assert ServerTime.from_dict(t.to_dict()) == t
    assert ServerTime.from_dict({"seed_s": 1.0, "total_s": 2.0}).confirm_s == 0.0  # a checkpoint from before
    t.record("confirm", 100.0)
    assert t.confirm_due(1.0)  # a share of 1: every candidate at once


def test_a_candidate_confirmed_as_another_kind_leaves_its_own_kind_unfound():
    # On the vLLM-like server written for issue 16 an itl-stall candidate was confirmed as a
    # ttft-outlier; its pre-signature made every later itl-stall (127x) wait as a "found kind".
    from fuzzer.oracle.judge import Candidate
    from fuzzer.oracle.kinds import FindingKind, Metric

    store = Store.memory()
    t = _shapes(1)[0]
    store.put_trace(t)
    confirmer = _sharing_confirmer(store, PaperTarget(seed=1), lambda: False)
    store.add_finding(kind="ttft-outlier", signature="ttft-outlier:aaaaaaaaaaaa", trace=t, verdict={}, slowdown=9.0,
                      reproduced="3/3", campaign_id=1, target_id=None,
                      details={"request_id": "v", "pre_signature": "itl-stall:bbbbbbbbbbbb"})
    again = _sharing_confirmer(store, PaperTarget(seed=1), lambda: False)
    assert again._new_kind(Candidate(FindingKind.ITL_STALL, "v", Metric.MAX_ITL, 127.0))
    assert not again._new_kind(Candidate(FindingKind.TTFT_OUTLIER, "v", Metric.TTFT, 3.0))
    assert confirmer.found_kinds == set()  # taken up from the store when built


def test_waiting_candidates_are_ranked_by_how_far_their_traits_are_from_every_finding_of_their_kind():
    from fuzzer.oracle.judge import Candidate
    from fuzzer.oracle.kinds import FindingKind, Metric
    from fuzzer.search.confirming import Waiting

    store = Store.memory()
    base = Trace(requests=(Request(id="o", at_ms=0, prompt_tokens=64, max_tokens=8),
                           Request(id="v", at_ms=5, prompt_tokens=256, max_tokens=32)))
    store.put_trace(base)
    store.add_finding(kind="ttft-outlier", signature="ttft-outlier:cccccccccccc", trace=base, verdict={},
                      slowdown=9.0, reproduced="3/3", campaign_id=1, target_id=None, details={"request_id": "v"})
    confirmer = _sharing_confirmer(store, PaperTarget(seed=1), lambda: False)
    seeded = Trace(requests=(*base.requests, Request(id="s", at_ms=9, prompt_tokens=8, max_tokens=4, seed=1)))
    seeded_timeout = Trace(requests=(*seeded.requests,
                                     Request(id="t", at_ms=9, prompt_tokens=8, max_tokens=64, disconnect_after_ms=5)))

    def waiting(trace, ratio, kind=FindingKind.TTFT_OUTLIER):
        return Waiting(trace, Candidate(kind, "v", Metric.TTFT, ratio), f"k{ratio}", None)

    ranked = sorted([waiting(base, 50.0), waiting(seeded, 20.0), waiting(seeded_timeout, 3.0),
                     waiting(base, 2.5, FindingKind.E2E_OUTLIER)], key=confirmer._rank)
    # A kind never found first, then two traits away from the finding, one away, and its own family last.
    assert [(w.candidate.kind, w.candidate.ratio) for w in ranked] == [
        (FindingKind.E2E_OUTLIER, 2.5), (FindingKind.TTFT_OUTLIER, 3.0), (FindingKind.TTFT_OUTLIER, 20.0),
        (FindingKind.TTFT_OUTLIER, 50.0)]


async def test_another_victim_of_a_found_trace_and_kind_is_not_confirmed_again():
    # A 3-minute campaign confirmed the simulator's logprobs batch cost twice on one trace, for two
    # of the streams it delayed: the same report to a maintainer, 3 runs of 8.5 s each.
    store = Store.memory()
    t = Trace(requests=(Request(id="v", at_ms=0, prompt_tokens=256, max_tokens=32),
                        Request(id="w", at_ms=5, prompt_tokens=64, max_tokens=32, n=2)))
    kind = _stall_kind()
    assert family(kind, t, "v") != family(kind, t, "w")  # the family back-off alone would confirm both
    target = PaperTarget(stall_s={"v": 0.5, "w": 0.4}, seed=1)
    target._idle_s = 0.5
    confirmer = _confirmer(store, target)
    await confirmer.examine(t, await target.execute(t), await _calibration())
    (found,) = store.list_findings()
    before = target.executions
    for cold in (False, True):
        await confirmer.examine(t, await target.execute(t), await _calibration(), cold=cold)
    assert target.executions - before == 2 and len(store.list_findings()) == 1  # no confirmation run
    # A resumed campaign's confirmer knows it from the store.
    assert (found.trace_hash, found.kind) in _confirmer(store, target).found_on


async def test_over_the_share_a_failure_of_a_found_kind_waits_and_a_leak_does_not():
    # A held-out server's planted bug hung requests in many traces: each new trace it hung cost three runs
    # of 73-100 s at once, and confirming took 58% of the campaign.
    from fuzzer.execution import Outcome
    from fuzzer.search.confirming import AT_ONCE
    from fuzzer.oracle.kinds import FindingKind

    store = Store.memory()
    target = PaperTarget(fail={"v": Outcome.TIMEOUT}, fail_every_run=True, seed=1)
    target._idle_s = 0.5
    confirmer = _sharing_confirmer(store, target, lambda: False)
    first, second = _shapes(2)
    await confirmer.examine(first, await target.execute(first), await _calibration())
    assert [f.kind for f in store.list_findings()] == ["hang"]  # a kind never found: at once
    before = target.executions
    store.put_trace(second)
    await confirmer.examine(second, await target.execute(second), await _calibration())
    assert target.executions - before == 1 and [w.candidate.kind for w in confirmer.waiting] == [FindingKind.HANG]
    assert {FindingKind.LEAK, FindingKind.CRASH} <= AT_ONCE and FindingKind.HANG not in AT_ONCE


async def test_a_kind_never_found_is_confirmed_though_the_same_execution_shows_a_found_failure():
    # heldout5 (every bug): a seed's hang of a found kind waited, and its itl-stall and ttft-outliers, kinds
    # never found, were never confirmed: the execution's one candidate had been the failure.
    from fuzzer.execution import Outcome

    store = Store.memory()
    target = PaperTarget(fail={"h": Outcome.TIMEOUT}, fail_every_run=True, stall_s={"v": 0.4}, seed=1)
    target._idle_s = 0.5
    confirmer = _sharing_confirmer(store, target, lambda: False)
    hang_only = Trace(requests=(Request(id="h", at_ms=0, prompt_tokens=64, max_tokens=8),))
    await confirmer.examine(hang_only, await target.execute(hang_only), await _calibration())
    assert [f.kind for f in store.list_findings()] == ["hang"]
    both = Trace(requests=(Request(id="o", at_ms=0, prompt_tokens=32, max_tokens=8),
                           Request(id="h", at_ms=2, prompt_tokens=64, max_tokens=8), *_shapes(1)[0].requests))
    store.put_trace(both)
    await confirmer.examine(both, await target.execute(both), await _calibration())
    assert sorted(f.kind for f in store.list_findings()) == ["hang", "itl-stall"]
