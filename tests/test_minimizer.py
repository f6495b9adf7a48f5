"""The minimizer over a noisy predicate: never grows, still reproduces, resumes, reports others."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import traces

from fuzzer.search.mutators import generate
from fuzzer.shrink.engine import Check, Minimizer, Stop, size_key


def hol(trace) -> bool:
    """The 37308 shape: a long prompt arrives no later than a short streaming request."""
    longs = [r.at_ms for r in trace.requests if r.prompt_tokens >= 1000]
    return any(r.stream and r.prompt_tokens <= 200 and longs and min(longs) <= r.at_ms for r in trace.requests)


def noisy(condition, rng, flake=0.15, other_on=None):
    async def check(trace, strict):
        truth = condition(trace)
        seen = truth if rng.random() > flake else not truth
        other = "protocol:x" if other_on and other_on(trace) else None
        return Check(reproduced=seen, other_signature=other)

    return check


async def test_shrinks_the_37308_trace_and_keeps_reproducing(seed_trace):
    rng = random.Random(1)
    m = Minimizer(noisy(hol, rng))
    result = await m.run(seed_trace)
    assert hol(result.minimized)
    assert len(result.minimized.requests) <= 2
    assert size_key(result.minimized) < size_key(seed_trace)
    assert result.confirm_runs == 10 and result.confirmed >= 6
    assert result.stop in (Stop.FIXED_POINT, Stop.STALLED)
    assert result.executions == m.executions
    short = [r for r in result.minimized.requests if r.prompt_tokens <= 200]
    assert short and short[0].max_tokens == 1  # numbers were lowered too


@settings(max_examples=25, deadline=None)
@given(traces(max_requests=8, max_prompt_tokens=4096), st.integers(0, 1000))
async def test_never_grows_and_result_holds_when_exact(trace, seed):
    condition = lambda t: sum(r.prompt_tokens for r in t.requests) >= 300  # noqa: E731
    if not condition(trace):
        return
    result = await Minimizer(noisy(condition, random.Random(seed), flake=0.0), max_executions=300).run(trace)
    assert size_key(result.minimized) <= size_key(trace)
    assert condition(result.minimized)
    assert result.confirmed == 10


async def test_resume_after_interrupt_reaches_the_same_result(seed_trace):
    exact = noisy(hol, random.Random(0), flake=0.0)
    reference = await Minimizer(exact).run(seed_trace)

    saved = {}
    calls = {"n": 0}

    async def dies_after_seven(trace, strict):
        calls["n"] += 1
        if calls["n"] > 7:
            raise KeyboardInterrupt
        return await exact(trace, strict)

    with pytest.raises(KeyboardInterrupt):
        await Minimizer(dies_after_seven, on_state=saved.update).run(seed_trace)
    assert saved["tests"] > 0
    resumed = Minimizer(exact, state=saved)
    result = await resumed.run(seed_trace)
    assert result.minimized == reference.minimized
    assert result.executions >= saved["executions"]
    # the cache carried over: the resumed run did not redo the tests already done
    assert resumed.tests <= reference.tests


async def test_budget_and_stall_stop_the_search(seed_trace):
    never = noisy(lambda t: False, random.Random(0), flake=0.0)
    result = await Minimizer(never, stall_budget=5, final_runs=3).run(seed_trace)
    assert result.stop is Stop.STALLED and result.minimized == seed_trace and result.confirmed == 0
    tight = await Minimizer(noisy(hol, random.Random(0), flake=0.0), max_executions=6, final_runs=1).run(seed_trace)
    assert tight.stop is Stop.BUDGET and tight.executions <= 6 + 2 + 1


async def test_other_findings_are_reported(seed_trace):
    others = []
    check = noisy(hol, random.Random(0), flake=0.0, other_on=lambda t: len(t.requests) == 3)
    await Minimizer(check, on_other=lambda t, s: others.append((len(t.requests), s))).run(seed_trace)
    assert others and all(n == 3 and s == "protocol:x" for n, s in others)


def test_required_must_fit_runs():
    with pytest.raises(ValueError):
        Minimizer(noisy(hol, random.Random(0)), runs=3, required=4)


def test_size_key_orders_requests_first():
    rng = random.Random(3)
    a = generate(rng)
    smaller = a.with_requests(a.requests[:-1]) if len(a.requests) > 1 else a
    assert size_key(smaller) <= size_key(a)
