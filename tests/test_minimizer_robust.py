"""The minimizer's acceptance rule, its final confirmation and what it remembers (issue 7).

A graded predicate reports the effect of every run; with one, a candidate must
reproduce in every run while shrinking, a miss rejects it at once, and a result that
fails its 10-run confirmation is replaced by the trace accepted before it.
"""

from __future__ import annotations

import random

from fuzzer.shrink.engine import Check, Minimizer, size_key
from fuzzer.shrink.memory import RETRY_AT, FailureMemory
from fuzzer.trace import from_dict


def _trace(n=6, victim="V"):
    reqs = [{"id": victim, "at_ms": 0, "prompt_tokens": 64, "max_tokens": 8}]
    reqs += [{"id": f"R{i}", "at_ms": 10 * (i + 1), "prompt_tokens": 512, "max_tokens": 8} for i in range(n - 1)]
    return from_dict({"name": "t", "requests": reqs})


def scripted(outcomes, graded=True):
    """A predicate whose strict runs return the given outcomes in turn, then True; it logs every call."""
    calls = []
    it = iter(outcomes)

    async def check(trace, strict):
        calls.append((tuple(r.id for r in trace.requests), strict))
        ok = next(it, True) if strict else True
        return Check(ok, effect=(1.5 if ok else 0.5) if graded else None)

    return check, calls


async def test_graded_candidate_must_reproduce_in_every_run_and_a_miss_rejects_at_once():
    trace = _trace(2)
    # first candidate (delete R0): hit, hit, miss -> rejected after exactly 3 runs
    check, calls = scripted([True, True, False])
    m = Minimizer(check, final_runs=1, max_executions=3)
    r = await m.run(trace)
    assert [c for c in calls if c[1]] == [(("V",), True)] * 3
    assert r.minimized == trace
    # the same runs under a plain predicate: 2 of 3 accepts after two
    check, calls = scripted([True, True, False], graded=False)
    r = await Minimizer(check, final_runs=1, max_executions=2).run(trace)
    assert [q.id for q in r.minimized.requests] == ["V"]
    # a first miss costs one execution
    check, calls = scripted([False])
    m = Minimizer(check, final_runs=0, max_executions=1)
    await m.run(trace)
    assert m.executions == 1 and m.tests == 1


async def test_a_border_line_shrink_is_rarely_accepted():
    """Deleting R1 leaves a trace that reproduces 45% of the time; the rest can go freely."""
    trace = _trace(6)

    def make(rng):
        async def check(trace, strict):
            ids = {r.id for r in trace.requests}
            p = 1.0 if "R1" in ids else 0.45
            ok = rng.random() < p
            return Check(ok, effect=(1.6 if ok else 0.4) if strict else None)
        return check

    kept = 0
    for seed in range(20):
        r = await Minimizer(make(random.Random(seed))).run(trace)
        kept += "R1" in {q.id for q in r.minimized.requests}
        assert r.confirmed >= 8 or "R1" not in {q.id for q in r.minimized.requests}
    # 2 of 3 accepts such a candidate 43% of the time it is tested; all of 3, 9%
    assert kept >= 16, kept


async def test_a_result_that_fails_its_confirmation_is_replaced_by_the_one_before():
    """The smallest trace passes its runs while shrinking but not the final confirmation."""
    trace = _trace(3)

    async def check(trace, strict):
        ids = {r.id for r in trace.requests}
        if ids == {"V"}:  # lucky while shrinking, unreliable in fact
            return Check(strict, effect=1.2 if strict else None)
        return Check(True, effect=1.5 if strict else None)

    r = await Minimizer(check, keep={"V"}).run(trace)
    assert len(r.minimized.requests) == 2 and "V" in {q.id for q in r.minimized.requests}
    assert r.confirmed == 10  # the k/10 of the trace returned, not of the one that failed
    assert size_key(r.minimized) < size_key(trace)


async def test_the_kept_request_is_never_deleted_nor_a_candidate_without_it_run():
    trace = _trace(5)
    seen = []

    async def check(trace, strict):
        seen.append({r.id for r in trace.requests})
        return Check(True, effect=2.0 if strict else None)  # anything reproduces

    r = await Minimizer(check, keep={"V"}).run(trace)
    assert [q.id for q in r.minimized.requests] == ["V"]
    assert all("V" in ids for ids in seen)


async def test_resume_with_a_graded_predicate_reaches_the_same_result():
    trace = _trace(6)

    async def exact(trace, strict):
        big = sum(r.prompt_tokens for r in trace.requests if r.id != "V")
        effect = big / 600
        return Check(effect >= 1.0 if strict else effect >= 0.8, effect=effect if strict else None)

    reference = await Minimizer(exact, keep={"V"}).run(trace)
    saved = {}
    calls = {"n": 0}

    async def dies(trace, strict):
        calls["n"] += 1
        if calls["n"] > 9:
            raise KeyboardInterrupt
        return await exact(trace, strict)

    try:
        await Minimizer(dies, keep={"V"}, on_state=saved.update).run(trace)
    except KeyboardInterrupt:
        pass
    assert saved["tests"] > 0 and saved["failed"]["values"]
    resumed = Minimizer(exact, keep={"V"}, state=saved)
    result = await resumed.run(trace)
    assert result.minimized == reference.minimized
    assert resumed.tests <= reference.tests


def test_a_failure_is_retried_only_when_the_trace_got_strong_enough_or_its_request_changed():
    memory = FailureMemory()
    # deleting R1 kept 60% of the effect (1.5 -> 0.9): it failed
    memory.fail("R1 delete", 1, current="a", candidate_effect=0.9, effect=1.5)
    assert memory.known("R1 delete", "a", 3.0) == 1  # same trace: no retry
    assert memory.known("R1 delete", "b", 1.5) == 1  # 0.6 x 1.5 = 0.9: still short
    assert memory.retry_due(" delete", "b", RETRY_AT / 0.6 + 0.01)
    assert memory.known("R1 delete", "b", RETRY_AT / 0.6 + 0.01) is None  # strong enough now
    memory.fail("R1 prompt_tokens", 100, current="b", candidate_effect=0.5, effect=1.5)
    old = _trace(3)
    lowered = old.with_requests([r if r.id != "R1" else r.__class__(**{**r.__dict__, "prompt_tokens": 300})
                                 for r in old.requests])
    memory.forget(old, lowered, measured=True)
    assert "R1 prompt_tokens" not in memory
    restored = FailureMemory(memory.state())
    assert restored.state() == memory.state()
