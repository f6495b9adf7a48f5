"""Mutators only produce valid traces, record how, and stay within the target's limits."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import traces

from fuzzer import trace as tf
from fuzzer.search.mutators import (
    OPERATORS,
    Limits,
    Mutator,
    NullMutator,
    OperatorStats,
    generate,
    splice,
)

LIMITS = Limits(max_model_len=16384, max_output_tokens=512)


@settings(max_examples=150, deadline=None)
@given(traces(max_prompt_tokens=8192, max_output_tokens=512, leaving=True), st.sampled_from(sorted(OPERATORS)), st.integers(0, 2**32))
def test_every_operator_yields_a_valid_trace_or_none(trace, name, seed):
    out = OPERATORS[name](trace, random.Random(seed), LIMITS)
    if out is not None:
        assert tf.validate(out) == out
        assert len(out.requests) <= LIMITS.max_requests or len(out.requests) <= len(trace.requests)


@settings(max_examples=100, deadline=None)
@given(traces(max_prompt_tokens=8192, max_output_tokens=512), traces(max_prompt_tokens=8192), st.integers(0, 2**32))
def test_havoc_and_splice_children_are_valid_and_new(parent, other, seed):
    rng = random.Random(seed)
    child = Mutator(LIMITS, splice_rate=0.5).mutate(parent, rng, other)
    assert tf.validate(child.trace) == child.trace
    assert child.operators
    assert child.trace.content_hash() != parent.content_hash()
    assert set(child.operators) <= set(OPERATORS) | {"splice", "generate"}


@settings(max_examples=60, deadline=None)
@given(traces(), traces(), st.integers(0, 2**32))
def test_splice_keeps_ids_unique(a, b, seed):
    out = splice(a, b, random.Random(seed), LIMITS)
    if out is not None:
        ids = [r.id for r in out.requests]
        assert len(ids) == len(set(ids))
        assert tf.validate(out) == out


def test_generation_is_reproducible_from_the_seed():
    a = [generate(random.Random(7), LIMITS).content_hash() for _ in range(3)]
    assert len(set(a)) == 1
    assert generate(random.Random(8), LIMITS).content_hash() != a[0]


def test_null_mutator_ignores_its_parent(seed_trace):
    other = seed_trace.with_requests(seed_trace.requests[:1])
    for s in range(20):
        a = NullMutator(LIMITS).mutate(seed_trace, random.Random(s)).trace
        b = NullMutator(LIMITS).mutate(other, random.Random(s)).trace
        assert a == b and a.name == "generated"


def test_unsupported_features_are_avoided(seed_trace):
    limits = Limits(unsupported=frozenset({"chat", "n", "logprobs"}))
    m = Mutator(limits)
    rng = random.Random(3)
    for _ in range(300):
        child = m.mutate(seed_trace, rng).trace
        assert all(r.api == "completions" and r.n == 1 and r.logprobs is None for r in child.requests)


def test_n_stays_within_what_the_probe_saw_accepted(seed_trace):
    """A 4-slot llama-server refuses n=8: the mutators draw only n <= max_n, and still draw n > 1."""
    m = Mutator(Limits(max_n=4))
    rng = random.Random(5)
    seen = set()
    for _ in range(400):
        seen.update(r.n for r in m.mutate(seed_trace, rng).trace.requests)
    assert max(seen) <= 4 and seen & {2, 4}


def test_logprobs_stay_within_what_the_probe_saw_accepted(seed_trace):
    m = Mutator(Limits(max_logprobs=5))
    rng = random.Random(5)
    seen = set()
    for _ in range(400):
        seen.update(r.logprobs for r in m.mutate(seed_trace, rng).trace.requests if r.logprobs is not None)
    assert seen and max(seen) <= 5


def test_snap_prompt_reaches_block_and_budget_boundaries(seed_trace):
    rng = random.Random(1)
    seen = set()
    for _ in range(400):
        out = OPERATORS["snap_prompt"](seed_trace, rng, LIMITS)
        seen.update(r.prompt_tokens for r in out.requests)
    assert {2047, 2048, 2049} <= seen
    assert {127, 128, 129} <= seen


def test_operator_choice_learns_from_success():
    stats = OperatorStats()
    for _ in range(50):
        stats.record(("storm",), True)
        stats.record(("reorder",), False)
    rng = random.Random(0)
    picks = [stats.choose(["storm", "reorder"], rng) for _ in range(1000)]
    assert picks.count("storm") > 3 * picks.count("reorder")
    assert picks.count("reorder") > 0  # never starved
    assert OperatorStats.from_dict(stats.to_dict()).to_dict() == stats.to_dict()


@pytest.mark.parametrize("name", ["storm", "fill", "squeeze", "duplicate_request", "add_request", "cancel_and_retry",
                                  "long_outputs", "long_prompt_beside_stream", "prefix_burst"])
def test_growing_operators_respect_max_requests(seed_trace, name):
    limits = Limits(max_requests=6)
    assert OPERATORS[name](seed_trace, random.Random(0), limits) is None


def test_without_cancellations_serves_what_each_leaving_client_read_not_its_max_tokens():
    from fuzzer.search.mutators import KEPT_AFTER_TIMEOUT, without_cancellations
    from fuzzer.trace import from_dict

    t = from_dict({"requests": [
        {"id": "cut", "at_ms": 0, "prompt_tokens": 64, "max_tokens": 3072, "cancel_after_tokens": 4},
        {"id": "gone", "at_ms": 1, "prompt_tokens": 2000, "max_tokens": 3072, "disconnect_after_ms": 30},
        {"id": "stay", "at_ms": 2, "prompt_tokens": 64, "max_tokens": 3072},
    ]})
    out = without_cancellations(t)
    assert [(r.id, r.max_tokens, r.cancel_after_tokens, r.disconnect_after_ms) for r in out.requests] == [
        ("cut", 4, None, None), ("gone", KEPT_AFTER_TIMEOUT, None, None), ("stay", 3072, None, None)]
    assert without_cancellations(out) is out  # nothing left to take away


def test_a_confirmed_leak_strips_only_the_disconnects_that_leave_its_way():
    """After a single request's disconnect leak is confirmed, an n > 1 request that leaves keeps its
    disconnect (vLLM PR #14326's leak is another bug); once that is confirmed too, nothing leaves."""
    from fuzzer.oracle.signature import leak_signature, leaving_clients
    from fuzzer.search.mutators import without_found_leaks
    from fuzzer.trace import from_dict

    t = from_dict({"requests": [
        {"id": "gone", "at_ms": 0, "prompt_tokens": 2000, "max_tokens": 3072, "disconnect_after_ms": 30},
        {"id": "fan", "at_ms": 1, "prompt_tokens": 64, "max_tokens": 3072, "n": 4, "temperature": 1.0,
         "cancel_after_tokens": 8},
    ]})
    assert leaving_clients(t) == {"timeout", "fanout"}
    assert without_found_leaks(t, set()) is t
    single = without_found_leaks(t, {leak_signature({"timeout"})})
    assert [(r.id, r.disconnect_after_ms, r.cancel_after_tokens) for r in single.requests] == [
        ("gone", None, None), ("fan", None, 8)]
    assert leaving_clients(without_found_leaks(t, {leak_signature({"timeout"}), leak_signature({"fanout"})})) == set()
    # The trace's own combination confirmed: the campaign cannot tell which leaves leak, so none stays.
    assert leaving_clients(without_found_leaks(t, {leak_signature({"timeout", "fanout"})})) == set()


def test_leak_signatures_tell_the_ways_of_leaving_apart_and_keep_the_first_releases():
    import hashlib

    from fuzzer.oracle.kinds import FindingKind
    from fuzzer.oracle.signature import leak_signature, signature
    from fuzzer.trace import canonical_json, from_dict

    def first_release(cancel: bool) -> str:
        shape = {"kind": "leak", "trace": {"cancel": cancel}}
        return "leak:" + hashlib.sha256(canonical_json(shape).encode()).hexdigest()[:12]

    assert leak_signature() == first_release(False)
    assert leak_signature({"cancel"}) == first_release(True)
    assert len({leak_signature(w) for w in ({"timeout"}, {"fanout"}, {"cancel"}, {"cancel", "fanout"})}) == 4
    t = from_dict({"requests": [{"id": "a", "at_ms": 0, "prompt_tokens": 64, "max_tokens": 64, "n": 2,
                                 "temperature": 1.0, "disconnect_after_ms": 10}]})
    assert signature(FindingKind.LEAK, t) == leak_signature({"fanout"})


def test_splice_never_gives_a_prefix_name_of_the_first_trace_to_the_seconds_group():
    from fuzzer.search.mutators import splice
    from fuzzer.trace import from_dict, validate

    # ``a`` already holds a group named b_burst (an earlier splice); ``b`` brings its own "burst" of another size.
    a = from_dict({"prefixes": {"b_burst": 32}, "requests": [
        {"id": "x", "at_ms": 0, "prompt_tokens": 97, "max_tokens": 4, "prefix": "b_burst"}]})
    b = from_dict({"prefixes": {"burst": 256}, "requests": [
        {"id": "y", "at_ms": 50, "prompt_tokens": 300, "max_tokens": 4, "prefix": "burst"}]})
    for i in range(20):
        child = splice(a, b, random.Random(i), Limits())
        if child is not None:
            validate(child)
            assert child.prefixes.get("b_burst") in (None, 32)
