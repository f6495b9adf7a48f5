"""The simulated engine: properties of continuous batching (Hypothesis) and a few exact cases."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzzer.sim.config import SimConfig
from fuzzer.sim.engine import Engine
from fuzzer.sim.request import State
from fuzzer.sim.steptime import StepLoad, base_time_s

#: A small server, so random traffic reaches KV exhaustion, preemption and the seat limit.
SMALL = SimConfig(num_kv_blocks=96, max_model_len=1536, max_num_batched_tokens=256, max_num_seqs=6, noise_sigma=0.0)


def _prompt(group: int, private: int, length: int, prefix_len: int) -> list[int]:
    shared = [10_000 * (group + 1) + i for i in range(min(prefix_len, length))]
    return shared + [1_000_000 * (private + 1) + i for i in range(length - len(shared))]


requests_st = st.lists(
    st.fixed_dictionaries(
        {
            "at_s": st.floats(0, 0.3, allow_nan=False),
            "prompt": st.integers(1, 700),
            "max_tokens": st.integers(1, 60),
            "n": st.integers(1, 3),
            "group": st.integers(0, 2),
            "ignore_eos": st.booleans(),
            "abort_after_s": st.one_of(st.none(), st.floats(0, 0.5, allow_nan=False)),
        }
    ),
    min_size=1,
    max_size=14,
)


def _drive(engine: Engine, specs: list[dict]) -> list:
    """Run the engine step by step like the virtual runner, checking invariants after every step."""
    cfg = engine.config
    arrivals = sorted(enumerate(specs), key=lambda p: p[1]["at_s"])
    handles = {}
    aborts = []
    t, i = 0.0, 0
    for _ in range(100_000):
        while i < len(arrivals) and arrivals[i][1]["at_s"] <= t:
            k, s = arrivals[i]
            handles[k] = engine.add_request(
                f"r{k}", _prompt(s["group"], k, s["prompt"], 48), s["max_tokens"], now_s=s["at_s"], n=s["n"],
                ignore_eos=s["ignore_eos"],
            )
            if s["abort_after_s"] is not None:
                aborts.append((s["at_s"] + s["abort_after_s"], handles[k]))
            i += 1
        for when, h in list(aborts):
            if when <= t:
                used = engine.kv.num_used
                engine.abort(h, t)
                if h.leaked:  # disconnect-leak: the engine never hears of it and runs it to its length
                    assert h.leaked in engine.pathologies and not h.finished
                    assert h.leaked == "disconnect-leak" or h.generated == 0  # early-abort-leak: before any output
                else:
                    assert h.blocks == [] and h.state is State.FINISHED
                    assert engine.kv.num_used <= used
                aborts.remove((when, h))
        # What the engine charges a request is decided when it schedules it: a decode costs its n sequences, a
        # prompt chunk its tokens (a prompt whose last token is all that is left after a cache hit is a chunk
        # of one, though it decodes once the step is done).
        decoding_before = {id(r): r.decoding for r in engine._running}
        step = engine.step(t)
        if step is None:
            upcoming = [a[1]["at_s"] for a in arrivals[i:i + 1]] + [w for w, _ in aborts]
            if engine.next_ready_s() is not None:
                upcoming.append(engine.next_ready_s())
            if not upcoming:
                break
            t = max(t, min(upcoming))
            continue
        cost = sum(r.n if decoding_before.get(id(r), False) else tokens for r, tokens in step.scheduled)
        assert cost <= cfg.max_num_batched_tokens
        assert engine.num_running <= cfg.max_num_seqs
        assert len({id(r) for r, _ in step.scheduled}) == len(step.scheduled)
        engine.complete(step)
        assert engine.kv.num_used <= cfg.num_kv_blocks
        engine.kv.check_invariants()
        t = step.end_s
    else:  # pragma: no cover - the loop must end
        raise AssertionError("the engine never drained")
    return [handles[k] for k in range(len(specs))]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests_st)
def test_no_request_lost_or_duplicated_and_every_token_delivered(specs):
    engine = Engine(SMALL, seed=1)
    handles = _drive(engine, specs)
    ids = [r.request_id for r in engine.records]
    assert sorted(ids) == sorted(f"r{k}" for k in range(len(specs)))  # each finished exactly once
    for spec, h in zip(specs, handles):
        assert h.finished
        if h.finish_reason == "abort":
            assert spec["abort_after_s"] is not None
            continue
        assert h.generated == h.output_len
        if spec["ignore_eos"]:
            assert h.generated == spec["max_tokens"] and h.finish_reason == "length"
        assert len(h.token_times_s) == h.generated
        assert h.token_times_s == sorted(h.token_times_s)
        assert h.arrival_s <= h.ready_s <= h.admitted_s <= h.first_token_s <= h.finish_s
    assert engine.idle and engine.kv.num_used == 0  # everything freed at the end


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests_st)
def test_fcfs_admission_without_pathologies(specs):
    engine = Engine(SMALL, seed=2)
    handles = _drive(engine, [dict(s, abort_after_s=None) for s in specs])
    admitted = sorted(handles, key=lambda h: h.admit_seq)
    ready = [(h.ready_s, h.request_id) for h in admitted]
    assert [r for r, _ in ready] == sorted(r for r, _ in ready)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests_st, st.sampled_from(["all", "hol-prefix-burst,sticky-batch-full", "preemption-thrash",
                                      "kv-reserve-admission", "disconnect-leak", "lifo-admission",
                                      "decode-starvation", "early-abort-leak",
                                      "resident-prefix-refusal"]))
def test_pathologies_never_lose_requests_or_overfill_kv(specs, spec):
    from fuzzer.sim.pathologies import parse

    engine = Engine(SMALL, parse(spec), seed=3)
    handles = _drive(engine, specs)
    assert all(h.finished for h in handles)
    assert engine.kv.num_used == 0


def test_abort_frees_kv_at_once():
    engine = Engine(SMALL)
    h = engine.add_request("a", list(range(600)), 50, now_s=0.0)
    t = engine.next_ready_s()
    while h.first_token_s is None:
        step = engine.step(t)
        engine.complete(step)
        t = step.end_s
    assert engine.kv.num_used == len(h.blocks) > 0
    engine.abort(h, t)
    assert engine.kv.num_used == 0 and h.finish_reason == "abort"
    assert engine.stats.finished["abort"] == 1


def test_prefix_cache_hits_full_blocks_of_a_shared_prefix():
    engine = Engine(SimConfig(noise_sigma=0.0))
    shared = list(range(100))  # 6 full blocks of 16 + 4 tokens
    first = engine.add_request("a", shared + [1000 + i for i in range(50)], 1, now_s=0.0)
    _run_until_idle(engine)
    second = engine.add_request("b", shared + [5000 + i for i in range(50)], 1, now_s=10.0)
    _run_until_idle(engine, 10.0)
    assert first.cached_tokens == 0
    assert second.cached_tokens == 96
    assert engine.stats.prefix_cache_hits == 96
    same = engine.add_request("c", shared + [1000 + i for i in range(50)], 1, now_s=20.0)
    _run_until_idle(engine, 20.0)
    assert same.cached_tokens == 144  # all 9 full blocks; the last token is always recomputed


def test_preemption_takes_the_most_recently_admitted_request():
    cfg = SimConfig(num_kv_blocks=40, max_model_len=640, noise_sigma=0.0, admission_headroom_blocks_per_seq=0)
    engine = Engine(cfg)
    a = engine.add_request("a", list(range(300)), 300, now_s=0.0)
    b = engine.add_request("b", list(range(1000, 1300)), 300, now_s=0.0)
    _run_until_idle(engine)
    assert b.preemptions >= 1 and a.preemptions == 0
    assert engine.stats.preemptions >= 1
    assert a.generated == 300 and b.generated == 300


def test_step_time_matches_the_model():
    cfg = SimConfig(noise_sigma=0.0)
    engine = Engine(cfg)
    engine.add_request("a", list(range(2048)), 2, now_s=0.0)
    step = engine.step(engine.next_ready_s())
    expected = base_time_s(cfg, StepLoad(prefill_tokens=2048))
    assert step.end_s - step.start_s == pytest.approx(expected)
    assert 0.055 < expected < 0.1  # a 2048-token prefill: roughly 60-100 ms
    engine.complete(step)
    decode = engine.step(step.end_s)
    assert 0.003 <= decode.end_s - decode.start_s <= 0.006  # a decode step: ~3-6 ms


def test_speed_divides_every_time():
    slow, fast = Engine(SimConfig(noise_sigma=0.0)), Engine(SimConfig(noise_sigma=0.0, speed=4.0))
    for e in (slow, fast):
        e.add_request("a", list(range(500)), 20, now_s=0.0)
        _run_until_idle(e)
    (a,), (b,) = slow.records, fast.records
    assert b.finish_s == pytest.approx(a.finish_s / 4)


def test_noise_is_small_and_seeded():
    def durations(seed):
        e = Engine(SimConfig(), seed=seed)
        e.add_request("a", list(range(64)), 200, now_s=0.0)
        _run_until_idle(e)
        times = e.records[0]
        return times

    assert durations(5) == durations(5)
    assert durations(5) != durations(6)
    e = Engine(SimConfig(), seed=7)
    h = e.add_request("a", list(range(64)), 400, now_s=0.0)
    _run_until_idle(e)
    gaps = [b - a for a, b in zip(h.token_times_s, h.token_times_s[1:])]
    mean = sum(gaps) / len(gaps)
    assert max(gaps) < 1.2 * mean and min(gaps) > 0.8 * mean


def test_request_too_big_for_the_cache_is_refused():
    engine = Engine(SMALL)
    from fuzzer.errors import ConfigError

    with pytest.raises(ConfigError):
        engine.add_request("big", list(range(1000)), 600, now_s=0.0, n=3)


def _run_until_idle(engine: Engine, t: float = 0.0) -> float:
    while True:
        step = engine.step(t)
        if step is None:
            ready = engine.next_ready_s()
            if ready is None:
                return t
            t = ready
            continue
        engine.complete(step)
        t = step.end_s


def test_decode_starvation_never_deadlocks_when_the_prefill_finds_no_kv():
    # B's later chunks do not fit beside A's KV: B preempts itself; A must still decode and finish.
    from fuzzer.sim.pathologies import DECODE_STARVATION

    specs = [
        {"at_s": 0.0, "prompt": 1000, "max_tokens": 60, "n": 1, "group": 0, "ignore_eos": True, "abort_after_s": None},
        {"at_s": 0.2, "prompt": 600, "max_tokens": 10, "n": 1, "group": 1, "ignore_eos": True, "abort_after_s": None},
    ]
    engine = Engine(SMALL, (DECODE_STARVATION,), seed=4)
    handles = _drive(engine, specs)
    assert all(h.finished for h in handles) and engine.idle


@pytest.mark.parametrize("fast_path", [False, True])
def test_seeded_sampling_path_charges_every_sampled_row_of_a_step_with_a_seed(fast_path):
    # Three plain streams and one seeded (temperature 1, n=2): each decode step samples 5 rows.
    from fuzzer.sim.pathologies import SEEDED_SAMPLING_PATH

    cfg = SimConfig(noise_sigma=0.0)

    def decode_gaps(pathologies, seed):
        engine = Engine(cfg, pathologies)
        handles = [engine.add_request(f"s{i}", [100 * i + k for k in range(32)], 6, now_s=0.0) for i in range(3)]
        handles.append(engine.add_request("x", list(range(5000, 5032)), 6, now_s=0.0, n=2, seed=seed, temperature=1.0))
        t = engine.next_ready_s()
        engine.complete(prefill := engine.step(t))
        t = prefill.end_s
        if fast_path:
            t, _ = engine.decode_run(t, 10.0, 5)
        else:
            _run_until_idle(engine, t)
        return [b - a for a, b in zip(handles[0].token_times_s, handles[0].token_times_s[1:])], handles

    plain, _ = decode_gaps((SEEDED_SAMPLING_PATH,), None)
    seeded, handles = decode_gaps((SEEDED_SAMPLING_PATH,), 42)
    off, off_handles = decode_gaps((), 42)
    assert len(plain) == len(seeded) == 5
    for p, s in zip(plain, seeded):
        assert s - p == pytest.approx(5 * cfg.seeded_row_sample_s)
    assert off == plain and not any(h.delayed_by for h in off_handles)
    assert all(h.delayed_by == {SEEDED_SAMPLING_PATH} for h in handles)
