"""The corpus keeps what is new, favours the slowest per key, ignores unstable features, resumes."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuzzer.search.corpus import MIN_SCORE_GAIN, STALE_AFTER, Corpus
from fuzzer.search.coverage import Coverage
from fuzzer.search.mutators import generate


def cov(*features, **scores):
    return Coverage(features=frozenset(features), scores=scores)


def test_new_features_are_kept_and_known_ones_are_not():
    c = Corpus()
    t1, t2, t3 = (generate(random.Random(i)) for i in range(3))
    assert c.add(t1, [cov("a", "b")]) is not None
    assert c.add(t2, [cov("a")]) is None
    assert c.add(t3, [cov("a", "c")]) is not None
    assert len(c) == 2
    c._check_invariants()


def test_unstable_features_are_ignored_and_lower_stability():
    c = Corpus()
    t1, t2 = generate(random.Random(1)), generate(random.Random(2))
    entry = c.add(t1, [cov("a", "flaky1"), cov("a", "flaky2"), cov("a")])
    assert entry.features == frozenset({"a"})
    assert c.stability == pytest.approx(1 / 3)  # 1 stable of 3 observed
    # a trace whose only novelty is a known-unstable feature is not kept
    assert c.add(t2, [cov("a", "flaky1")]) is None
    c._check_invariants()


def test_top_rated_keeps_the_slowest_per_key_with_a_margin():
    c = Corpus()
    ts = [generate(random.Random(i)) for i in range(4)]
    first = c.add(ts[0], [cov("a", k=2.0)])
    assert c.top_rated == {"k": first.id}
    assert c.add(ts[1], [cov("a", k=2.0 * MIN_SCORE_GAIN * 0.99)]) is None
    better = c.add(ts[2], [cov("a", k=2.0 * MIN_SCORE_GAIN * 1.5)])
    assert better is not None and c.top_rated == {"k": better.id}
    assert c.favoured == frozenset({better.id})
    # the stable score is the minimum over the calibration runs
    assert c.add(ts[3], [cov("a", k=100.0), cov("a", k=1.0)]) is None
    c._check_invariants()


def test_the_same_trace_is_not_kept_twice():
    c = Corpus()
    t = generate(random.Random(5))
    assert c.add(t, [cov("a")]) is not None
    assert c.add(t, [cov("b")]) is None


def test_scheduling_prefers_favoured_and_fresh_entries():
    c = Corpus()
    fav = c.add(generate(random.Random(1)), [cov("a", k=50.0)])
    plain = c.add(generate(random.Random(2)), [cov("b")])
    rng = random.Random(0)
    picks = [c.choose(rng).id for _ in range(300)]
    assert picks.count(fav.id) > picks.count(plain.id)
    stale = c.entries[fav.id]
    stale.since_find = STALE_AFTER
    assert c.energy(stale) < c.energy(c.entries[fav.id]) * 1.01
    assert c.energy(stale) < 4.0 / (1 + 8)  # favoured but stale: damped


def test_scheduling_prefers_entries_that_cost_less_server_time():
    c = Corpus()
    slow = c.add(generate(random.Random(1)), [cov("a")])
    fast = c.add(generate(random.Random(2)), [cov("b")])
    costs = {slow.id: 45.0, fast.id: 1.0}
    assert c.energy(fast, 1.0) > 4 * c.energy(slow, 45.0) and c.energy(fast, 0.0) == c.energy(slow, 0.0)
    picks = []
    for i in range(400):
        picks.append(c.choose(random.Random(i), cost=lambda e: costs[e.id]).id)
        slow.n_fuzz = fast.n_fuzz = 0  # the cost alone, not how often each was fuzzed
    assert picks.count(fast.id) > 3 * picks.count(slow.id)
    # Control: the same two entries without costs are picked about as often.
    c2 = Corpus()
    a, b = c2.add(generate(random.Random(1)), [cov("a")]), c2.add(generate(random.Random(2)), [cov("b")])
    plain = [c2.choose(random.Random(i)).id for i in range(400)]
    assert 0.6 < plain.count(a.id) / plain.count(b.id) < 1.6


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sets(st.sampled_from("abcdefgh"), max_size=4),
                          st.floats(0, 100)), min_size=1, max_size=25))
def test_invariants_hold_and_resume_round_trips(steps):
    c = Corpus()
    traces = {}
    for i, (seed, feats, score) in enumerate(steps):
        t = generate(random.Random(seed * 1000 + i))
        traces[t.content_hash()] = t
        parent = max(c.entries) if c.entries and i % 2 else None
        c.add(t, [cov(*feats, k=score), cov(*feats, k=score * 1.01)], parent=parent, found_at_exec=i)
        c._check_invariants()
    again = Corpus.from_dict(c.to_dict(), traces)
    again._check_invariants()
    assert again.to_dict() == c.to_dict()


def test_seeds_are_kept_even_without_novelty():
    c = Corpus()
    t1, t2 = generate(random.Random(1)), generate(random.Random(2))
    c.add(t1, [cov("a")])
    assert c.add(t2, [cov("a")]) is None
    seed = c.add_forced(t2, [cov("a")])
    assert seed is not None and len(c) == 2
    assert c.add_forced(t2, [cov("a")]) is None  # never twice
    c._check_invariants()


def test_a_short_campaign_weighs_server_time_against_its_execution_budget():
    from fuzzer.search.corpus import CHEAP_S
    from fuzzer.search.pacing import cheap_s, execution_budget_s

    # A 90-second job: a 4.5 s budget, so 1.5 s is cheap; the README's 3-minute job and longer keep CHEAP_S.
    assert cheap_s(90.0) == execution_budget_s(90.0) / 3 == 1.5
    assert cheap_s(180.0) == cheap_s(600.0) == cheap_s(1800.0) == cheap_s(None) == CHEAP_S == 3.0
    c = Corpus()
    slow = c.add(generate(random.Random(1)), [cov("a")])
    fast = c.add(generate(random.Random(2)), [cov("b")])
    costs = {slow.id: 6.0, fast.id: 1.0}

    def fast_share(cheap: float) -> float:
        picks = []
        for i in range(600):
            picks.append(c.choose(random.Random(i), cost=lambda e: costs[e.id], cheap_s=cheap).id)
            slow.n_fuzz = fast.n_fuzz = 0
        return picks.count(fast.id) / len(picks)

    # 6 s against 1 s: (1 + 0.6) / (1 + 0.1) at 10 s, (1 + 2) / (1 + 1/3) at 3 s, (1 + 4) / (1 + 2/3) at 1.5 s.
    assert c.energy(fast, 1.0, 10.0) / c.energy(slow, 6.0, 10.0) < 1.5 < 2.2 < c.energy(fast, 1.0) / c.energy(slow, 6.0)
    assert c.energy(fast, 1.0, 1.5) / c.energy(slow, 6.0, 1.5) > 2.9
    assert fast_share(cheap_s(90.0)) > fast_share(cheap_s(1800.0)) + 0.02
