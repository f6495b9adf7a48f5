"""The three-valued test, the Verdict value type and dedup signatures."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from fuzzer.oracle.kinds import Decision, FindingKind, Metric
from fuzzer.oracle.signature import log2_class, request_shape, signature
from fuzzer.oracle.statistics import ALPHA, Interval, compare
from fuzzer.oracle.verdict import Verdict, reproduction_of
from fuzzer.trace import Request, Trace


def _baseline(rng, n=40, noise=0.05):
    return list(np.exp(rng.normal(0.0, noise, n)))


def test_a_large_shift_is_different():
    rng = np.random.default_rng(1)
    base = _baseline(rng)
    sample = [5.0, 5.3, 4.8, 5.1]
    c = compare(sample, base, threshold=2.0, rng=rng)
    assert c.decision is Decision.DIFFERENT
    assert c.p_value <= ALPHA
    assert 4.5 < c.effect < 5.5
    assert c.effect_ci.low <= c.effect <= c.effect_ci.high
    assert (c.n_sample, c.n_baseline) == (4, 40)
    assert c.test in ("mann-whitney-u", "kolmogorov-smirnov")


def test_a_sample_from_the_baseline_is_same():
    rng = np.random.default_rng(2)
    base = _baseline(rng)
    sample = _baseline(rng, n=6)
    c = compare(sample, base, threshold=2.0, rng=rng)
    assert c.decision is Decision.SAME


def test_significant_but_small_effect_is_not_different():
    # 30% slower, clearly significant, but below a 2x practical threshold.
    rng = np.random.default_rng(3)
    base = _baseline(rng, noise=0.02)
    sample = list(1.3 * np.exp(rng.normal(0.0, 0.02, 10)))
    c = compare(sample, base, threshold=2.0, rng=rng)
    assert c.p_value <= ALPHA
    assert c.decision is Decision.SAME  # the whole interval is below 2x


def test_two_samples_that_disagree_are_unknown():
    # One run slow, one normal: neither significant nor clearly the same.
    rng = np.random.default_rng(4)
    base = _baseline(rng)
    c = compare([1.0, 6.0], base, threshold=2.0, rng=rng)
    assert c.decision is Decision.UNKNOWN


def test_too_few_samples_is_insufficient_data():
    rng = np.random.default_rng(5)
    assert compare([3.0], _baseline(rng), threshold=2.0, rng=rng).decision is Decision.INSUFFICIENT_DATA
    assert compare([3.0, 3.1, 3.2], [1.0] * 3, threshold=2.0, rng=rng).decision is Decision.INSUFFICIENT_DATA
    assert compare([float("nan"), 3.0], _baseline(rng), threshold=2.0, rng=rng).n_sample == 1


def test_identical_values_are_same():
    rng = np.random.default_rng(6)
    c = compare([1.0] * 5, [1.0] * 20, threshold=2.0, rng=rng)
    assert c.decision is Decision.SAME and c.effect == 1.0


def test_the_test_is_reproducible_from_the_generator_seed():
    base = _baseline(np.random.default_rng(7))
    a = compare([2.5, 3.0, 2.8], base, threshold=2.0, rng=np.random.default_rng(42))
    b = compare([2.5, 3.0, 2.8], base, threshold=2.0, rng=np.random.default_rng(42))
    assert a == b


def test_verdict_round_trips_through_json():
    v = Verdict(
        kind=FindingKind.TTFT_OUTLIER,
        decision=Decision.DIFFERENT,
        method="min(MWU, KS)",
        request_id="r08",
        metric=Metric.TTFT,
        statistic=12.0,
        p_value=0.001,
        effect=7.5,
        effect_ci=Interval(6.0, float("inf")),
        threshold=2.0,
        n_sample=5,
        n_baseline=40,
        reproduced=5,
        runs=5,
        observed_s=0.7,
        expected_s=0.09,
        idle_s=0.01,
        assumption="max_num_batched_tokens=2048 (vLLM default)",
        signature="ttft-outlier:0123456789ab",
    )
    data = json.loads(json.dumps(v.to_dict()))
    assert (data["reproduced"], data["runs"], data["reproduction"]) == (5, 5, "5/5")
    assert data["effect_ci"][1] is None  # infinity is not JSON
    assert data["slowdown"] == pytest.approx(70.0)
    assert data["excess_s"] == pytest.approx(0.61)
    back = Verdict.from_dict(data)
    assert back == v
    assert back.is_finding


def test_a_verdict_stored_with_the_old_k_of_n_text_still_reads():
    old = {"kind": "error", "decision": "different", "method": "m", "request_id": "r", "reproduced": "3/4"}
    back = Verdict.from_dict(old)
    assert (back.reproduced, back.runs, back.reproduction) == (3, 4, "3/4")
    assert reproduction_of(old) == "3/4" == reproduction_of(back.to_dict())
    assert reproduction_of({"reproduced": 2, "runs": 3}) == "2/3" and reproduction_of({}) is None


def test_verdict_is_frozen_and_only_different_is_a_finding():
    v = Verdict(kind=FindingKind.ITL_STALL, decision=Decision.UNKNOWN, method="m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.decision = Decision.DIFFERENT  # type: ignore[misc]
    assert not v.is_finding
    assert not Verdict(kind=None, decision=Decision.DIFFERENT, method="m").is_finding
    assert Verdict(kind=FindingKind.LEAK, decision=Decision.DIFFERENT, method="m").is_finding


def _trace(*requests, prefixes=None):
    return Trace(requests=tuple(requests), prefixes=prefixes or {})


def test_token_counts_fall_in_log2_classes():
    assert [log2_class(n) for n in (1, 2, 3, 128, 2000, 2048, 4095)] == [0, 1, 1, 7, 10, 11, 11]


def test_signature_is_stable_under_small_changes_and_separates_shapes(seed_trace):
    sig = signature(FindingKind.TTFT_OUTLIER, seed_trace, "r05")
    assert sig.startswith("ttft-outlier:") and len(sig) == len("ttft-outlier:") + 12
    # Same situation, other numbers inside the same classes: same signature.
    nudged = seed_trace.with_requests(
        [dataclasses.replace(r, prompt_tokens=r.prompt_tokens + 20, at_ms=r.at_ms * 1.1) for r in seed_trace.requests]
    )
    assert signature(FindingKind.TTFT_OUTLIER, nudged, "r05") == sig
    # Another kind, another victim shape, or nothing before it: another signature.
    assert signature(FindingKind.E2E_OUTLIER, seed_trace, "r05") != sig
    assert signature(FindingKind.TTFT_OUTLIER, seed_trace, "r04") != sig
    alone = seed_trace.with_requests([seed_trace.request("r05")])
    assert signature(FindingKind.TTFT_OUTLIER, alone, "r05") != sig
    # Extra evidence separates bugs of one kind.
    assert signature(FindingKind.ERROR, seed_trace, "r05", status=500) != signature(
        FindingKind.ERROR, seed_trace, "r05", status=503
    )


def test_request_shape_sees_what_precedes_the_victim():
    a = Request(id="a", at_ms=0, prompt_tokens=4000, max_tokens=10, prefix="p")
    b = Request(id="b", at_ms=0, prompt_tokens=100, max_tokens=10, prefix="p")
    c = Request(id="c", at_ms=5, prompt_tokens=100, max_tokens=10)
    t = _trace(a, b, c, prefixes={"p": 50})
    shape = request_shape(t, t.request("b"))
    assert shape["before"] == "1" and shape["before_max_prompt"] == log2_class(4000)
    assert shape["before_same_prefix"] is True
    assert request_shape(t, t.request("a"))["before"] == "0"
    assert request_shape(t, t.request("c"))["before"] == "2-3"


def test_whole_execution_signature_has_no_victim(seed_trace):
    assert signature(FindingKind.LEAK, seed_trace).startswith("leak:")
    assert signature(FindingKind.LEAK, seed_trace) != signature(FindingKind.CRASH, seed_trace)


def test_a_leak_is_one_bug_whatever_the_traces_size_but_cancelled_or_not_tells_two_apart():
    small = _trace(Request(id="a", at_ms=0, prompt_tokens=100, max_tokens=10, cancel_after_tokens=2))
    big = _trace(*(Request(id=f"r{i}", at_ms=i, prompt_tokens=4000, max_tokens=500, cancel_after_tokens=3)
                   for i in range(9)))
    plain = _trace(Request(id="a", at_ms=0, prompt_tokens=100, max_tokens=10))
    assert signature(FindingKind.LEAK, small) == signature(FindingKind.LEAK, big)
    assert signature(FindingKind.LEAK, small) != signature(FindingKind.LEAK, plain)
    # How the clients leave tells leaks apart (an engine may lose an n > 1 request's abort alone).
    fanned = _trace(*(Request(id=f"r{i}", at_ms=i, prompt_tokens=4000, max_tokens=500, n=2, cancel_after_tokens=3)
                      for i in range(9)))
    assert signature(FindingKind.LEAK, fanned) != signature(FindingKind.LEAK, big)
    # Crashes keep the trace's shape: two traces of different shapes may crash the server differently.
    assert signature(FindingKind.CRASH, small) != signature(FindingKind.CRASH, big)


def test_a_seeded_batch_or_a_timed_out_client_is_a_family_of_its_own_and_old_signatures_stay(seed_trace):
    from dataclasses import replace

    from fuzzer.oracle.kinds import FindingKind
    from fuzzer.oracle.signature import family, signature

    victim = seed_trace.requests[-1].id
    other = seed_trace.requests[0]
    kind = FindingKind.ITL_STALL
    base = (signature(kind, seed_trace, victim), family(kind, seed_trace, victim))
    # Control: the fields unset (None) are the trace as it was: the same keys.
    unset = seed_trace.with_requests([replace(r, seed=None, disconnect_after_ms=None) for r in seed_trace.requests])
    assert (signature(kind, unset, victim), family(kind, unset, victim)) == base
    for change in ({"seed": 5}, {"disconnect_after_ms": 20.0}):
        changed = seed_trace.with_requests([replace(r, **change) if r is other else r for r in seed_trace.requests])
        assert signature(kind, changed, victim) != base[0] and family(kind, changed, victim) != base[1]


def test_a_victim_that_reuses_a_resident_prefix_or_a_burst_beyond_the_kv_is_a_family_of_its_own():
    # With every bug on, the held-out server's bug6 (admission counting resident prefix blocks as new)
    # and bug7 (a preempted request re-queued last) shared one ttft/itl family with bug5's stalls
    # beside long prompts, whose findings had doubled the family's back-off before either was confirmed.
    from fuzzer.oracle.kinds import FindingKind
    from fuzzer.oracle.signature import burst_kv, family
    from fuzzer.trace import Request, Trace

    kind = FindingKind.TTFT_OUTLIER
    owner = Request(id="owner", at_ms=0, prompt_tokens=4032, max_tokens=400, prefix="sys")
    plain = Trace(requests=(Request(id="o", at_ms=0, prompt_tokens=4032, max_tokens=400),
                            Request(id="v", at_ms=500, prompt_tokens=4032, max_tokens=32)))
    shared = Trace(requests=(owner, Request(id="v", at_ms=500, prompt_tokens=4032, max_tokens=32, prefix="sys")),
                   prefixes={"sys": 4000})
    first = Trace(requests=(Request(id="v", at_ms=0, prompt_tokens=4032, max_tokens=32, prefix="sys"),
                            Request(id="o", at_ms=500, prompt_tokens=4032, max_tokens=400, prefix="sys")),
                  prefixes={"sys": 4000})
    assert family(kind, shared, "v") != family(kind, plain, "v")
    assert family(kind, first, "v") == family(kind, plain, "v")  # the victim computes the prefix itself
    # The prefix counts once: 4032 + 400 + 32 + 32 tokens, not 8000 more.
    assert burst_kv(shared) == 4032 + 400 + 32 + 32
    assert family(kind, plain, "v", kv_tokens=4000) != family(kind, plain, "v")
    assert family(kind, plain, "v", kv_tokens=64000) == family(kind, plain, "v")
    # Requests further apart than a burst do not add up.
    apart = Trace(requests=(plain.requests[0], Request(id="v", at_ms=5000, prompt_tokens=4032, max_tokens=32)))
    assert burst_kv(apart) == 4432 and family(kind, apart, "v", kv_tokens=8000) == family(kind, apart, "v")
