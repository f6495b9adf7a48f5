"""Planted pathologies: the registry, and for each one a trace that shows it only when it is on."""

from __future__ import annotations

import asyncio
import statistics

import aiohttp
import pytest

from fuzzer.errors import ConfigError
from fuzzer.sim import VirtualTarget, pathologies
from fuzzer.sim.pathologies import NAMES, describe, parse
from fuzzer.sim.triggers import TRIGGERS
from fuzzer.trace import from_dict

CONTRACT_NAMES = (
    "hol-prefix-burst",
    "unchunked-prefill",
    "logprobs-batch-cost",
    "sticky-batch-full",
    "preemption-thrash",
    "cold-start",
    "serial-tokenizer",
    "kv-reserve-admission",
    "disconnect-leak",
    "lifo-admission",
    "decode-starvation",
    "early-abort-leak",
    "resident-prefix-refusal",
    "seeded-sampling-path",
    "queued-abort-late",
    "head-reserve-admission",
    "logprobs-redetokenize",
    "longest-prefix-first",
    "aborted-blocks-held",
)


def test_names_are_the_contract():
    assert NAMES == CONTRACT_NAMES


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("none", ()),
        ("", ()),
        (None, ()),
        ("all", CONTRACT_NAMES),
        ("cold-start,hol-prefix-burst", ("hol-prefix-burst", "cold-start")),
        (" Cold-Start , cold-start ", ("cold-start",)),
    ],
)
def test_parse(spec, expected):
    assert parse(spec) == expected


def test_parse_unknown_names_the_valid_ones():
    with pytest.raises(ConfigError) as e:
        parse("cold-start,warp-drive")
    message = str(e.value)
    assert "'warp-drive'" in message
    for name in CONTRACT_NAMES:
        assert name in message


def test_every_pathology_is_described_with_its_report_and_trigger():
    infos = describe()
    assert [i.name for i in infos] == list(CONTRACT_NAMES)
    for info in infos:
        assert info.summary and info.trigger and info.effect
        assert any(ch.isdigit() for ch in info.models), f"{info.name} must name the public report it models"
        assert info.kind in {"ttft-outlier", "itl-stall", "e2e-outlier", "cold-start", "leak", "option-slowdown"}
    for cls in pathologies._REGISTRY:  # noqa: SLF001 - each mechanism is documented where it is named
        assert "Models " in cls.__doc__ and "Trigger: " in cls.__doc__, cls.__name__


#: The suffering request's measure must grow at least this much with the pathology on.
MIN_EFFECT = 1.25


def _measure(result, request_id, what):
    r = result.request(request_id)
    if what == "held":  # the KV usage reported at the end, over a floor: none held is 0
        return max(0.01, result.samples[-1].values["kv_usage"])
    return {"ttft": r.ttft_s, "itl": r.max_itl_s, "e2e": r.e2e_s, "drain": result.duration_s}[what]


WARM_UP = from_dict({"requests": [{"id": "warm", "at_ms": 0, "prompt_tokens": 16, "max_tokens": 2}]})


def _warm_run(pathology_names, trace, seed=0):
    """The second execution of a target (the first one warms a cold-start server up)."""
    target = VirtualTarget(pathologies=pathology_names, seed=seed)
    target.run(WARM_UP)
    return target.run(trace)


def _cold_run(pathology_names, trace, seed=0):
    return VirtualTarget(pathologies=pathology_names, seed=seed).run(trace)


def test_every_pathology_has_a_trigger():
    assert sorted(TRIGGERS) == sorted(NAMES)


@pytest.mark.parametrize("name", sorted(TRIGGERS))
def test_trigger_shows_the_pathology_only_when_it_is_on(name):
    trigger = TRIGGERS[name]
    trace, victim, what = trigger.trace, trigger.victim, trigger.measure
    run = _cold_run if trigger.cold else _warm_run
    off = run((), trace)
    on = run((name,), trace)
    assert _measure(on, victim, what) > MIN_EFFECT * _measure(off, victim, what)
    assert name in on.ground_truth[victim]
    assert all(not names for names in off.ground_truth.values())
    # Other pathologies do not claim this trace's damage when they are the only ones on.
    others = tuple(n for n in NAMES if n not in (name, "cold-start"))
    assert name not in set().union(*(set(v) for v in run(others, trace).ground_truth.values()))


def test_each_trigger_is_specific_enough_to_stay_quiet_on_a_clean_server():
    # The triggers are ordinary traffic: a clean server finishes them all.
    for trigger in TRIGGERS.values():
        result = _warm_run((), trigger.trace)
        assert not result.failures


def test_preemption_thrash_multiplies_preemptions():
    trace = TRIGGERS["preemption-thrash"].trace
    off = _warm_run((), trace).samples[-1].values["preemptions"]
    on = _warm_run(("preemption-thrash",), trace).samples[-1].values["preemptions"]
    assert on > 10 * max(off, 1)


def test_cold_start_slows_only_the_first_run_after_idle(seed_trace):
    target = VirtualTarget(pathologies=("cold-start",))
    first, second = target.run(seed_trace), target.run(seed_trace)
    assert first.request("r08").ttft_s > 10 * second.request("r08").ttft_s
    assert "cold-start" in first.ground_truth["r08"] and second.ground_truth["r08"] == ()
    target.idle(30.0)
    again = target.run(seed_trace)
    assert again.request("r08").ttft_s > 10 * second.request("r08").ttft_s
    assert again.idle_before_s >= 30.0

    clean = VirtualTarget()
    assert clean.run(seed_trace).request("r08").ttft_s < 2 * second.request("r08").ttft_s


def test_kv_reserve_admission_stalls_the_queue_while_kv_usage_looks_low():
    trace = TRIGGERS["kv-reserve-admission"].trace
    on = _warm_run(("kv-reserve-admission",), trace)
    stalled = [s.values for s in on.samples if s.values["waiting"] > 0 and s.t_s > 0.5]
    assert stalled, "V waits while the long outputs run"
    # The reservations are not written: the cache looks far from full while V waits.
    assert max(v["kv_usage"] for v in stalled) < 0.9
    assert on.request("V").ttft_s > 10 * _warm_run((), trace).request("V").ttft_s


def test_kv_reserve_admission_leaves_short_outputs_alone():
    # Requests whose prompts and outputs fit together are admitted as without the pathology.
    trace = from_dict({"requests": [
        {"id": f"r{i}", "at_ms": 5 * i, "prompt_tokens": 1024, "max_tokens": 256} for i in range(8)
    ]})
    on = _warm_run(("kv-reserve-admission",), trace)
    off = _warm_run((), trace)
    assert [r.ttft_s for r in on.requests] == [r.ttft_s for r in off.requests]
    assert all(not names for names in on.ground_truth.values())


def test_disconnect_leak_keeps_the_server_busy_after_the_client_left():
    trace = TRIGGERS["disconnect-leak"].trace
    off, on = _warm_run((), trace), _warm_run(("disconnect-leak",), trace)
    assert off.idle_after and not on.idle_after
    # The client saw the same cancelled stream either way.
    assert on.request("Z").outcome == off.request("Z").outcome
    assert on.request("Z").token_times_s == off.request("Z").token_times_s
    assert on.samples[-2].values["running"] >= 1 and off.samples[-1].values["running"] == 0


def test_early_abort_leak_loses_only_the_abort_of_a_client_gone_before_its_first_token():
    trace = TRIGGERS["early-abort-leak"].trace
    off, on = _warm_run((), trace), _warm_run(("early-abort-leak",), trace)
    assert off.idle_after and not on.idle_after
    assert on.request("Z").outcome.value == "cancelled" and on.request("Z").ttft_s is None
    assert "early-abort-leak" in on.ground_truth["Z"] and not off.ground_truth["Z"]
    # Control: a client that leaves after its first tokens is aborted (disconnect-leak's trigger).
    after_first = _warm_run(("early-abort-leak",), TRIGGERS["disconnect-leak"].trace)
    assert after_first.idle_after and not any(after_first.ground_truth.values())


def test_resident_prefix_refusal_holds_back_only_a_request_whose_prefix_blocks_are_resident():
    trigger = TRIGGERS["resident-prefix-refusal"]
    off, on = _warm_run((), trigger.trace), _warm_run(("resident-prefix-refusal",), trigger.trace)
    assert on.request("V").ttft_s > 10 * off.request("V").ttft_s
    assert on.ground_truth["V"] == ("resident-prefix-refusal",) and not any(off.ground_truth.values())
    # Control: without the shared prefix V needs its whole prompt in free blocks, on either engine.
    alone = from_dict({**trigger.trace.to_dict(), "requests": [
        {k: v for k, v in r.items() if k != "prefix"} for r in trigger.trace.to_dict()["requests"]]})
    assert not any(_warm_run(("resident-prefix-refusal",), alone).ground_truth.values())


def test_disconnect_leak_short_leak_is_idle_soon_enough():
    # A leaked request with little left to generate drains within the idle-after window.
    trace = from_dict({"requests": [
        {"id": "Z", "at_ms": 0, "prompt_tokens": 128, "max_tokens": 40, "cancel_after_tokens": 4},
    ]})
    on = _warm_run(("disconnect-leak",), trace)
    assert on.idle_after and on.ground_truth["Z"] == ("disconnect-leak",)


def _streams_and_a_seeded_one(streams, *, seed=1234, temperature=1.0):
    """``streams`` short streams and X, all arriving together; X asks for ``seed`` (None: no seed)."""
    x = {"id": "X", "at_ms": 0, "prompt_tokens": 64, "max_tokens": 128, "temperature": temperature}
    if seed is not None:
        x["seed"] = seed
    return from_dict({"requests": [
        {"id": f"S{i:02d}", "at_ms": 0, "prompt_tokens": 64, "max_tokens": 128} for i in range(streams)
    ] + [x]})


def _median_stream_e2e(result, streams):
    return statistics.median(result.request(f"S{i:02d}").e2e_s for i in range(streams))


@pytest.mark.parametrize("streams", [16, 24])
def test_seeded_sampling_path_slows_every_other_stream_of_the_trace(streams):
    seeded, plain = _streams_and_a_seeded_one(streams), _streams_and_a_seeded_one(streams, seed=None)
    on = ("seeded-sampling-path",)
    on_ratio = _median_stream_e2e(_warm_run(on, seeded), streams) / _median_stream_e2e(_warm_run(on, plain), streams)
    off_ratio = _median_stream_e2e(_warm_run((), seeded), streams) / _median_stream_e2e(_warm_run((), plain), streams)
    assert on_ratio >= 1.6, on_ratio
    assert off_ratio < 1.1, off_ratio
    # Ground truth: every stream the seed slowed (and X itself) names the pathology; nothing without the seed.
    truth = _warm_run(on, seeded).ground_truth
    assert all("seeded-sampling-path" in truth[f"S{i:02d}"] for i in range(streams))
    assert "seeded-sampling-path" in truth["X"]
    assert not any(_warm_run(on, plain).ground_truth.values())
    assert not any(_warm_run((), seeded).ground_truth.values())


def test_a_seed_at_temperature_zero_or_a_lone_seeded_stream_costs_its_row_only():
    on = ("seeded-sampling-path",)
    greedy = _streams_and_a_seeded_one(16, temperature=0.0)
    assert not any(_warm_run(on, greedy).ground_truth.values())
    assert _warm_run(on, greedy).request("S00").e2e_s == _warm_run((), greedy).request("S00").e2e_s
    # After X finishes, the streams go back to the batched sampler: X ends at 8 tokens of 128.
    short = from_dict({"requests": [
        {"id": f"S{i:02d}", "at_ms": 0, "prompt_tokens": 64, "max_tokens": 128} for i in range(16)
    ] + [{"id": "X", "at_ms": 0, "prompt_tokens": 64, "max_tokens": 8, "temperature": 1.0, "seed": 7}]})
    plain = from_dict({**short.to_dict(), "requests": [
        {k: v for k, v in r.items() if k != "seed"} for r in short.to_dict()["requests"]]})
    ratio = _warm_run(on, short).request("S00").e2e_s / _warm_run(on, plain).request("S00").e2e_s
    assert 1.0 < ratio < 1.2, ratio


async def test_seeded_sampling_path_reads_seed_and_temperature_from_the_http_body():
    from fuzzer.sim import SimConfig
    from fuzzer.sim.server import SimServer

    sim = SimServer(SimConfig(speed=10.0), pathologies=("seeded-sampling-path",), seed=1)
    url = await sim.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(base_url=url) as session:
            async def post(rid, **extra):
                body = {"prompt": "one two three " * 4, "max_tokens": 16, "ignore_eos": True, **extra}
                async with session.post("/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
                    assert r.status == 200, await r.text()

            await asyncio.gather(post("seeded", seed=5, temperature=1.0), post("plain", temperature=1.0))
            await asyncio.gather(post("greedy-seeded", seed=5, temperature=0.0), post("greedy", temperature=0.0))
            async with session.post("/v1/completions", json={"prompt": "a", "seed": "x"}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "seed"
    finally:
        await sim.stop()
    truth = {g.request_id: g.pathologies for g in sim.engine.records}
    assert truth["seeded"] == ("seeded-sampling-path",) and truth["plain"] == ("seeded-sampling-path",)
    assert truth["greedy-seeded"] == () and truth["greedy"] == ()


def test_queued_abort_late_prefills_the_abandoned_queue_and_drops_it_at_its_first_token():
    trace = TRIGGERS["queued-abort-late"].trace
    off, on = _warm_run((), trace), _warm_run(("queued-abort-late",), trace)
    assert on.request("V").ttft_s > 5 * off.request("V").ttft_s
    assert "queued-abort-late" in on.ground_truth["V"] and not any(off.ground_truth.values())
    # The clients saw the same: nothing before they left. No leak: the server is idle soon after.
    for i in range(6):
        assert on.request(f"Z{i}").outcome.value == "cancelled" and on.request(f"Z{i}").ttft_s is None
    assert on.idle_after
    # Control: a client that leaves a running request is aborted as without the pathology.
    running = from_dict({"requests": [
        {"id": "Z", "at_ms": 0, "prompt_tokens": 8000, "max_tokens": 16, "disconnect_after_ms": 100},
        {"id": "V", "at_ms": 150, "prompt_tokens": 32, "max_tokens": 16}]})
    assert not any(_warm_run(("queued-abort-late",), running).ground_truth.values())


def test_head_reserve_admission_holds_the_queue_only_while_the_heads_output_does_not_fit():
    trace = TRIGGERS["head-reserve-admission"].trace
    off, on = _warm_run((), trace), _warm_run(("head-reserve-admission",), trace)
    assert on.request("V").ttft_s > 10 * off.request("V").ttft_s
    assert "head-reserve-admission" in on.ground_truth["B"] and "head-reserve-admission" in on.ground_truth["V"]
    assert not any(off.ground_truth.values())
    # Control: the same request on an idle server (its output fits the free cache) is admitted at once.
    alone = from_dict({"requests": [
        {"id": "B", "at_ms": 0, "prompt_tokens": 256, "max_tokens": 30000, "ignore_eos": False},
        {"id": "V", "at_ms": 10, "prompt_tokens": 64, "max_tokens": 16}]})
    assert not any(_warm_run(("head-reserve-admission",), alone).ground_truth.values())


def test_logprobs_redetokenize_delivers_every_stream_behind_the_frontend_s_growing_logprobs_work():
    trace = TRIGGERS["logprobs-redetokenize"].trace
    off, on = _warm_run((), trace), _warm_run(("logprobs-redetokenize",), trace)
    assert on.request("V").ttft_s > 20 * off.request("V").ttft_s
    assert on.request("L0").e2e_s > 2 * off.request("L0").e2e_s
    assert len(on.request("L0").token_times_s) == 350 and len(on.request("V").token_times_s) == 100
    assert "logprobs-redetokenize" in on.ground_truth["V"] and not any(off.ground_truth.values())
    # Controls: without a stream the frontend rebuilds no chunk's logprobs; streams without logprobs cost nothing.
    quiet = trace.to_dict()
    whole = from_dict({**quiet, "requests": [{**r, "stream": False} if r["id"] != "V" else r for r in quiet["requests"]]})
    plain = from_dict({**quiet, "requests": [{k: v for k, v in r.items() if k != "logprobs"} for r in quiet["requests"]]})
    for trace in (whole, plain):
        assert not any(_warm_run(("logprobs-redetokenize",), trace).ground_truth.values())
    # A client that leaves after four tokens reads four, however late they come.
    leaving = from_dict({**quiet, "requests": [*quiet["requests"], {"id": "C", "at_ms": 1000, "prompt_tokens": 64,
                                                                    "max_tokens": 300, "cancel_after_tokens": 4}]})
    late = _warm_run(("logprobs-redetokenize",), leaving).request("C")
    assert len(late.token_times_s) == 4 and late.ttft_s > 1.0 and late.e2e_s >= late.token_times_s[-1]


async def test_logprobs_redetokenize_holds_an_http_stream_s_tokens_until_the_frontend_reaches_them():
    from fuzzer.sim import SimConfig
    from fuzzer.sim.server import SimServer

    async def ttft_and_count(pathologies):
        sim = SimServer(SimConfig(speed=20.0, redetokenize_token_s=1.1e-5), pathologies=pathologies, seed=1)
        url = await sim.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession(base_url=url) as session:
                async def stream(rid, delay_s, max_tokens, **extra):
                    await asyncio.sleep(delay_s)
                    body = {"prompt": "one two three " * 4, "max_tokens": max_tokens, "ignore_eos": True,
                            "stream": True, **extra}
                    start, first, chunks = loop.time(), None, 0
                    async with session.post("/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
                        async for line in r.content:
                            if line.startswith(b"data: {"):
                                first = first if first is not None else loop.time() - start
                                chunks += 1
                    return first, chunks

                loop = asyncio.get_running_loop()
                # At speed 20 the three streams' 300 steps take 0.06 s (0.6 s on a busy host), and ten times the
                # usual work per token makes their frontend work 1.56 s: a stream sent at 0.7 s waits for it.
                *_, plain = await asyncio.gather(*(stream(f"lp{i}", 0.0, 300, logprobs=20) for i in range(3)),
                                                 stream("plain", 0.7, 200))
        finally:
            await sim.stop()
        return plain, {g.request_id: g.pathologies for g in sim.engine.records}

    (off_ttft, off_chunks), off_truth = await ttft_and_count(())
    (on_ttft, on_chunks), on_truth = await ttft_and_count(("logprobs-redetokenize",))
    assert off_chunks == on_chunks == 200  # every token, late
    assert on_ttft > off_ttft + 0.4, (on_ttft, off_ttft)
    assert on_truth["plain"] == ("logprobs-redetokenize",) and not any(off_truth.values())


def test_aborted_blocks_held_keeps_the_kv_of_a_request_left_mid_prefill_until_a_later_step_sweeps_it():
    trace = TRIGGERS["aborted-blocks-held"].trace
    off, on = _warm_run((), trace), _warm_run(("aborted-blocks-held",), trace)
    assert off.idle_after and not on.idle_after  # nothing runs, and the KV is still in use
    assert on.ground_truth["Z"] == ("aborted-blocks-held",) and not any(off.ground_truth.values())
    # The clients saw the same: Z left before a token, W was served.
    assert on.request("Z").ttft_s is None and on.request("W").outcome.value == "ok"
    # A request left once it decodes gives its blocks back at once; a step 30 s on sweeps the held ones.
    decoding = from_dict({"requests": [{"id": "Z", "at_ms": 0, "prompt_tokens": 64, "max_tokens": 400,
                                         "cancel_after_tokens": 4}]})
    assert _warm_run(("aborted-blocks-held",), decoding).idle_after
    target = VirtualTarget(pathologies=("aborted-blocks-held",), seed=0)
    assert not target.run(trace).idle_after and target.engine.kv.usage > 0.05
    target.idle(31.0)
    assert target.run(decoding).idle_after and target.engine.kv.usage == 0.0
