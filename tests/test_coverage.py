"""Coverage features: deterministic, bucketed, and sensitive to what matters."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzer.execution import ExecutionResult, MetricSample, Outcome, RequestResult
from fuzzer.search.coverage import hit_class, log2_bucket, measure, request_class


def _execution(trace, ttft=0.02, samples=(), outcome=Outcome.OK, itl=0.005):
    reqs = []
    for r in trace.requests:
        times = tuple(ttft + itl * i for i in range(4)) if r.stream else ()
        reqs.append(RequestResult(
            request_id=r.id, x_request_id=r.id, scheduled_s=r.at_ms / 1000, sent_s=r.at_ms / 1000,
            outcome=outcome, ttft_s=ttft if r.stream else None, token_times_s=times, e2e_s=ttft + 0.2,
        ))
    return ExecutionResult(trace_hash=trace.content_hash(), target="t", started_at=0.0, duration_s=1.0,
                           requests=tuple(reqs), samples=tuple(samples))


def _samples(*states):
    return [MetricSample(t_s=i * 0.05, values=v) for i, v in enumerate(states)]


def test_same_execution_same_features(seed_trace):
    result = _execution(seed_trace, samples=_samples({"running": 2, "waiting": 4, "kv_usage": 0.35}))
    idle = {r.id: 0.01 for r in seed_trace.requests}
    assert measure(result, seed_trace, idle) == measure(result, seed_trace, dict(idle))


def test_hit_count_classes_follow_afl():
    assert [hit_class(n) for n in (1, 2, 3, 4, 7, 8, 16, 31, 32, 127, 128, 999)] == [
        "1", "2", "3", "4", "4", "8", "16", "16", "32", "32", "128+", "128+"]


@given(st.floats(min_value=0, max_value=1e9, allow_nan=False))
def test_log2_bucket_is_monotonic(x):
    assert log2_bucket(x) <= log2_bucket(x * 2 + 1)


def test_server_state_and_transitions(seed_trace):
    states = _samples(
        {"running": 0, "waiting": 0, "kv_usage": 0.0, "preemptions": 0},
        {"running": 4, "waiting": 2, "kv_usage": 0.93, "preemptions": 0},
        {"running": 4, "waiting": 2, "kv_usage": 0.93, "preemptions": 3},
    )
    features = measure(_execution(seed_trace, samples=states), seed_trace).features
    assert "kv:9#2" in features and "kv:0#1" in features
    assert "preempt#1" in features
    assert "tr:r0w0k0>r3w2k9#1" in features
    assert "tr:r3w2k9>r3w2k9P#1" in features


def test_prefix_hit_ratio_uses_counter_deltas(seed_trace):
    states = _samples(
        {"prefix_cache_queries": 100, "prefix_cache_hits": 0},
        {"prefix_cache_queries": 200, "prefix_cache_hits": 100},
    )
    assert "hit:4#1" in measure(_execution(seed_trace, samples=states), seed_trace).features


def test_slowdown_buckets_and_scores(seed_trace):
    idle = {r.id: 0.01 for r in seed_trace.requests}
    fast = measure(_execution(seed_trace, ttft=0.012), seed_trace, idle)
    slow = measure(_execution(seed_trace, ttft=0.5), seed_trace, idle)
    assert fast.features != slow.features
    cls = request_class(seed_trace.requests[0], 0)
    assert slow.scores[cls] == pytest.approx(50.0) and fast.scores[cls] == pytest.approx(1.2)
    assert f"c:{cls}:slow:{log2_bucket(50)}#1" in slow.features


def test_small_noise_stays_in_the_same_bucket(seed_trace):
    idle = {r.id: 0.01 for r in seed_trace.requests}
    a = measure(_execution(seed_trace, ttft=0.050), seed_trace, idle)
    b = measure(_execution(seed_trace, ttft=0.053), seed_trace, idle)
    assert a.features == b.features


def test_failures_are_features(seed_trace):
    failed = measure(_execution(seed_trace, outcome=Outcome.TIMEOUT), seed_trace)
    assert any(":err:timeout#" in f for f in failed.features)
    assert failed.scores == {}


def test_request_classes_separate_shape(seed_trace):
    short, long_ = seed_trace.requests[0], seed_trace.requests[2]
    assert request_class(short, 0) != request_class(long_, 0)
    assert request_class(short, 0) != request_class(replace(short, stream=False), 0)
    assert request_class(short, 0) != request_class(short, 5)
