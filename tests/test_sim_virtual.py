"""VirtualTarget: the simulator on virtual time, measured as a client would measure it."""

from __future__ import annotations

import pytest

from fuzzer.execution import Outcome, Target
from fuzzer.sim import DEFAULT_IDLE_GAP_S, SimConfig, VirtualTarget
from fuzzer.trace import from_dict


def _trace(requests, prefixes=None):
    return from_dict({"prefixes": prefixes or {}, "requests": requests})


def test_it_is_a_target():
    target = VirtualTarget()
    assert isinstance(target, Target)
    assert target.name.startswith("sim+virtual://sim-qwen2.5-0.5b")


async def test_execute_is_run(seed_trace):
    a, b = VirtualTarget(seed=3), VirtualTarget(seed=3)
    assert await a.execute(seed_trace) == b.run(seed_trace)
    await a.aclose()


def test_short_requests_of_37308_get_the_fcfs_chunked_prefill_ttft(seed_trace):
    """Without pathologies the simulator is a good scheduler: no head-of-line blocking."""
    cfg = SimConfig()
    target = VirtualTarget(cfg)
    target.run(seed_trace)  # a warm server, as a careful tool measures
    result = target.run(seed_trace)
    decode_step_s = cfg.step_overhead_s + 6 * cfg.decode_seq_s
    for rid in ("r08", "r05"):
        r = result.request(rid)
        # FCFS with chunked prefill: at most one running step to wait for, then its own prefill step.
        bound = decode_step_s + cfg.step_overhead_s + 128 * cfg.prefill_token_s
        assert r.ttft_s <= 2 * bound, rid
        assert r.completion_tokens == seed_trace.request(rid).max_tokens
    assert result.ground_truth == {r.id: () for r in seed_trace.requests}


def test_deterministic_for_a_seed(seed_trace):
    def runs(seed):
        target = VirtualTarget(pathologies="all", seed=seed)
        return [target.run(seed_trace) for _ in range(3)]

    assert runs(11) == runs(11)
    assert runs(11)[1].request("r08").ttft_s != runs(12)[1].request("r08").ttft_s


def test_fast_decode_path_matches_step_by_step(seed_trace, monkeypatch):
    trace = _trace(
        [
            {"id": "a", "at_ms": 0, "prompt_tokens": 300, "max_tokens": 120},
            {"id": "b", "at_ms": 30, "prompt_tokens": 900, "max_tokens": 90, "n": 2, "logprobs": 3},
            {"id": "c", "at_ms": 95, "prompt_tokens": 40, "max_tokens": 60, "cancel_after_tokens": 17},
        ]
    )
    fast = VirtualTarget(pathologies="logprobs-batch-cost", seed=4)
    slow = VirtualTarget(pathologies="logprobs-batch-cost", seed=4)
    monkeypatch.setattr(slow.engine, "decode_run", lambda *a, **k: None)
    for tr in (seed_trace, trace):
        f, s = fast.run(tr), slow.run(tr)
        for rf, rs in zip(f.requests, s.requests):
            assert rf.outcome == rs.outcome and rf.completion_tokens == rs.completion_tokens
            assert rf.token_times_s == pytest.approx(rs.token_times_s, rel=1e-9)
            assert rf.e2e_s == pytest.approx(rs.e2e_s, rel=1e-9)
        assert f.ground_truth == s.ground_truth




def test_prefix_cache_within_an_execution_but_never_across(seed_trace):
    target = VirtualTarget()
    for _ in range(2):
        result = target.run(seed_trace)
        assert result.request("r08").cached_tokens == 0  # salted: the first of the group misses
        assert result.request("r05").cached_tokens == 32  # the 32-token prefix (2 blocks) is shared


def test_idle_clock_between_executions(seed_trace):
    target = VirtualTarget()
    first = target.run(seed_trace)
    assert first.idle_before_s is None  # a fresh server: nothing is known about before
    second = target.run(seed_trace)
    assert second.idle_before_s == pytest.approx(DEFAULT_IDLE_GAP_S)
    target.idle(5.0)
    third = target.run(seed_trace)
    assert third.idle_before_s == pytest.approx(DEFAULT_IDLE_GAP_S + 5.0)
    assert third.started_at > second.started_at + second.duration_s
    assert all(r.idle_after for r in (first, second, third))


def test_the_time_cap_closes_what_still_runs_on_virtual_time():
    trace = _trace([
        {"id": "long", "at_ms": 0, "prompt_tokens": 64, "max_tokens": 4000},
        {"id": "short", "at_ms": 0, "prompt_tokens": 64, "max_tokens": 4},
        {"id": "late", "at_ms": 60_000, "prompt_tokens": 64, "max_tokens": 4},
    ])
    whole = VirtualTarget(seed=1).run(trace)
    target = VirtualTarget(seed=1)
    cut = target.run(trace, cut_s=2.0)
    assert whole.duration_s > 60 and cut.duration_s == pytest.approx(2.0, abs=0.1)
    long = cut.request("long")
    assert long.outcome is Outcome.CUT and long.e2e_s == pytest.approx(2.0)
    assert long.token_times_s == whole.request("long").token_times_s[: len(long.token_times_s)]
    assert all(t <= 2.0 for t in long.token_times_s) and len(long.token_times_s) > 10
    assert cut.request("short") == whole.request("short")
    late = cut.request("late")
    assert late.outcome is Outcome.CUT and late.e2e_s is None and "not sent" in late.detail
    assert cut.idle_after and target.run(trace).request("long").outcome is Outcome.OK  # nothing left behind


def test_what_the_client_sees():
    trace = _trace(
        [
            {"id": "s", "at_ms": 0, "prompt_tokens": 100, "max_tokens": 20},
            {"id": "ns", "at_ms": 5, "prompt_tokens": 100, "max_tokens": 20, "stream": False},
            {"id": "nn", "at_ms": 5, "prompt_tokens": 100, "max_tokens": 7, "n": 3},
            {"id": "cx", "at_ms": 10, "prompt_tokens": 100, "max_tokens": 50, "cancel_after_tokens": 5},
            {"id": "big", "at_ms": 10, "prompt_tokens": 30000, "max_tokens": 5000},
            {"id": "eos", "at_ms": 10, "prompt_tokens": 10, "max_tokens": 4000, "ignore_eos": False},
        ]
    )
    target = VirtualTarget()
    result = target.run(trace)
    s = result.request("s")
    assert s.outcome is Outcome.OK and s.finish_reason == "length"
    assert len(s.token_times_s) == 20 and s.ttft_s == s.token_times_s[0] == s.first_event_s
    assert s.e2e_s == pytest.approx(s.token_times_s[-1])
    assert (s.prompt_tokens, s.completion_tokens) == (100, 20)
    ns = result.request("ns")
    assert ns.ttft_s is None and ns.token_times_s == () and ns.first_event_s == ns.e2e_s > 0
    assert result.request("nn").completion_tokens == 21
    cx = result.request("cx")
    assert cx.outcome is Outcome.CANCELLED and len(cx.token_times_s) == 5
    assert cx.e2e_s == pytest.approx(cx.token_times_s[-1]) and cx.finish_reason is None
    big = result.request("big")
    assert big.outcome is Outcome.REJECTED and big.http_status == 400 and "maximum context length" in big.detail
    eos = result.request("eos")
    assert eos.finish_reason in ("stop", "length") and eos.completion_tokens <= 4000
    assert target.engine.kv.num_used == 0  # the cancel freed its blocks
    assert target.engine.records[-1].finish_reason in ("stop", "length", "abort")
    assert {r.finish_reason for r in target.engine.records if r.request_id.startswith("cx")} == {"abort"}


def test_metric_samples_follow_the_execution(seed_trace):
    result = VirtualTarget(sample_interval_s=0.05).run(seed_trace)
    times = [s.t_s for s in result.samples]
    assert times == sorted(times) and times[-1] == pytest.approx(result.duration_s)
    assert len(result.samples) >= result.duration_s / 0.05
    assert max(s.values["running"] for s in result.samples) >= 4
    assert max(s.values["kv_usage"] for s in result.samples) > 0
    last = result.samples[-1].values
    assert last["generation_tokens"] == sum(r.max_tokens for r in seed_trace.requests)
    assert last["prefix_cache_hits"] == 5 * 32
    assert last["running"] == last["waiting"] == 0 and last["kv_usage"] == 0


def test_bad_arguments_are_config_errors():
    from fuzzer.errors import ConfigError

    with pytest.raises(ConfigError):
        VirtualTarget(pathologies="nope")
    with pytest.raises(ConfigError):
        VirtualTarget(idle_gap_s=-1)
    with pytest.raises(ConfigError):
        VirtualTarget().idle(-2)
    with pytest.raises(ConfigError):
        SimConfig(speed=0)
    with pytest.raises(ConfigError):
        SimConfig(max_model_len=10**6)


def test_public_surface():
    import fuzzer.sim as sim

    for name in sim.__all__:
        assert hasattr(sim, name), name
    assert {"SimConfig", "VirtualTarget", "PATHOLOGIES", "parse", "describe"} <= set(sim.__all__)
