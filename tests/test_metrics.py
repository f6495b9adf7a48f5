"""/metrics: parsing onto common names, the idle barrier, the sampler."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fuzzer.errors import TargetError
from fuzzer.execute import adapters, metrics

DATA = Path(__file__).parent / "data" / "servers"


def test_vllm_metrics_map_onto_common_names():
    values = metrics.parse((DATA / "vllm" / "metrics.txt").read_text(), adapters.adapter("vllm"))
    assert values == {
        "running": 3.0,
        "waiting": 2.0,
        "kv_usage": 0.25,
        "preemptions": 7.0,
        "prefix_cache_hits": 4096.0,
        "prefix_cache_queries": 10240.0,
        "prompt_tokens": 12000.0,
        "generation_tokens": 900.0,
    }


def test_sglang_tgi_llamacpp_metrics_map_onto_common_names():
    sg = metrics.parse((DATA / "sglang" / "metrics.txt").read_text(), adapters.adapter("sglang"))
    assert sg["running"] == 4 and sg["waiting"] == 1 and sg["kv_usage"] == 0.5 and sg["preemptions"] == 2
    assert sg["prefix_cache_hits"] == 1500 and sg["prefix_cache_queries"] == 5000
    tgi = metrics.parse((DATA / "tgi" / "metrics.txt").read_text(), adapters.adapter("tgi"))
    assert tgi == {"running": 5, "waiting": 3, "prompt_tokens": 20480, "generation_tokens": 1280}
    ll = metrics.parse((DATA / "llamacpp" / "metrics.txt").read_text(), adapters.adapter("llamacpp"))
    assert ll == {"running": 2, "waiting": 1, "prompt_tokens": 2048, "generation_tokens": 512}


def test_samples_are_summed_over_engines_and_usage_is_averaged():
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0"} 2\n'
        'vllm:num_requests_running{engine="1"} 3\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0"} 0.2\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.6\n'
    )
    values = metrics.parse(text, adapters.adapter("vllm"))
    assert values["running"] == 5
    assert values["kv_usage"] == pytest.approx(0.4)


def test_deprecated_vllm_names_are_read_when_the_new_ones_are_absent():
    text = "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.75\n"
    assert metrics.parse(text, adapters.adapter("vllm")) == {"kv_usage": 0.75}


def test_text_that_is_not_prometheus_is_a_target_error():
    with pytest.raises(TargetError, match="not Prometheus text"):
        metrics.parse('vllm:num_requests_running{engine="0" 1\n', adapters.adapter("vllm"))


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    async def sleep(self, s):
        self.now += s
        await asyncio.sleep(0)  # let other tasks run, as a real sleep does


def scripted(values):
    """A scrape returning the given pages in turn (the last one forever); an exception is raised."""
    pages = list(values)

    async def scrape():
        page = pages.pop(0) if len(pages) > 1 else pages[0]
        if isinstance(page, Exception):
            raise page
        return page

    return scrape


async def test_idle_barrier_waits_for_running_and_waiting_to_reach_zero():
    clock = FakeClock()
    scrape = scripted([{"running": 2, "waiting": 1}, {"running": 1, "waiting": 0}, {"running": 0, "waiting": 0}])
    report = await metrics.wait_idle(scrape, timeout_s=10, clock=clock, sleep=clock.sleep, poll_s=0.1)
    assert report.reached
    # Idle first seen at the third scrape (t = 0.2), confirmed at the fourth (t = 0.3).
    assert clock.now == pytest.approx(0.3)
    assert report.idle_s == pytest.approx(0.1)


async def test_a_failed_scrape_resets_the_idle_confirmation():
    clock = FakeClock()
    scrape = scripted([{"running": 0}, TargetError("down"), {"running": 0}, {"running": 0}])
    report = await metrics.wait_idle(scrape, timeout_s=10, clock=clock, sleep=clock.sleep, poll_s=0.1)
    assert report.reached and clock.now == pytest.approx(0.3)


async def test_idle_barrier_gives_up_after_its_timeout():
    clock = FakeClock()
    report = await metrics.wait_idle(scripted([{"running": 1}]), timeout_s=1.0, clock=clock, sleep=clock.sleep, poll_s=0.1)
    assert not report.reached and report.idle_s is None and report.last == {"running": 1}
    assert 1.0 <= clock.now <= 1.2


async def test_without_metrics_the_barrier_waits_a_quiet_period():
    clock = FakeClock()
    report = await metrics.wait_idle(None, timeout_s=10, clock=clock, sleep=clock.sleep, quiet_s=0.25)
    assert report.reached and report.idle_s is None and clock.now == 0.25
    # Metrics without running/waiting gauges: the same quiet period.
    clock = FakeClock()
    report = await metrics.wait_idle(scripted([{"prompt_tokens": 5}]), timeout_s=10, clock=clock, sleep=clock.sleep, quiet_s=0.25)
    assert report.reached and report.idle_s is None


async def test_settles_idle_tells_a_leak_from_a_drain():
    clock = FakeClock()
    assert await metrics.settles_idle(scripted([{"running": 1}, {"running": 0}]), timeout_s=2, clock=clock, sleep=clock.sleep)
    clock = FakeClock()
    assert not await metrics.settles_idle(scripted([{"running": 1}]), timeout_s=2, clock=clock, sleep=clock.sleep)
    assert await metrics.settles_idle(None, timeout_s=2) is None
    assert await metrics.settles_idle(scripted([{"prompt_tokens": 1}]), timeout_s=2, clock=clock, sleep=clock.sleep) is None


async def test_sampler_polls_on_an_absolute_schedule_and_counts_failures():
    calls = []

    async def scrape():
        calls.append(1)
        if len(calls) == 3:
            raise TargetError("flaky")
        return {"running": float(len(calls))}

    sampler = metrics.Sampler(scrape, interval_s=0.02)
    t0 = asyncio.get_running_loop().time()
    import time

    async with asyncio.TaskGroup() as tasks:
        sampler.start(tasks, time.perf_counter())
        await asyncio.sleep(0.21)
        samples, failed = await sampler.stop()
    assert failed == 1
    assert 8 <= len(samples) + failed <= 12  # about 0.21 / 0.02 ticks
    times = [s.t_s for s in samples]
    assert times == sorted(times) and times[0] >= 0
    assert all(b - a >= 0.015 for a, b in zip(times, times[1:]))
    assert samples[0].values == {"running": 1.0}
    assert asyncio.get_running_loop().time() - t0 < 1


async def test_sampler_skips_ticks_instead_of_bursting_after_a_slow_scrape():
    clock = FakeClock()
    calls = []

    async def scrape():
        calls.append(clock.now)
        if len(calls) == 1:
            clock.now += 0.35  # the first scrape takes 7 intervals
        return {"running": 0.0}

    sampler = metrics.Sampler(scrape, interval_s=0.05, clock=clock, sleep=clock.sleep)
    async with asyncio.TaskGroup() as tasks:
        sampler.start(tasks, 0.0)
        for _ in range(10):
            await asyncio.sleep(0)
        await sampler.stop()
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert gaps and all(g >= 0.05 - 1e-9 for g in gaps)


def test_sampler_rejects_a_nonpositive_interval():
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        metrics.Sampler(scripted([{}]), interval_s=0)


async def _slots_server(slots_status: int):
    from aiohttp import web

    live = DATA / "llamacpp" / "live"

    async def page(request):
        return web.Response(text=(live / "metrics_busy.txt").read_text())

    async def slots(request):
        if slots_status != 200:
            return web.json_response({"error": {"code": 501, "message": "slots endpoint is disabled"}}, status=501)
        return web.Response(text=(live / "slots_busy.json").read_text(), content_type="application/json")

    app = web.Application()
    app.router.add_get("/metrics", page)
    app.router.add_get("/slots", slots)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def test_a_real_llama_server_page_maps_processing_and_deferred_onto_running_and_waiting():
    values = metrics.parse((DATA / "llamacpp" / "live" / "metrics_busy.txt").read_text(), adapters.adapter("llamacpp"))
    assert values == {"running": 4, "waiting": 2, "prompt_tokens": 60, "generation_tokens": 24}


async def test_llamacpp_scrape_adds_kv_usage_from_slots():
    import aiohttp

    runner, url = await _slots_server(200)
    try:
        async with aiohttp.ClientSession() as session:
            scrape = metrics.Scraper(session, url, adapters.adapter("llamacpp"), headers={})
            values = await scrape()
    finally:
        await runner.cleanup()
    assert values["running"] == 4 and values["waiting"] == 2
    assert values["kv_usage"] == pytest.approx(36 / 16384)
    assert scrape.slots_disabled is None


async def test_a_disabled_slots_endpoint_is_dropped_and_metrics_still_read():
    import aiohttp

    runner, url = await _slots_server(501)
    try:
        async with aiohttp.ClientSession() as session:
            scrape = metrics.Scraper(session, url, adapters.adapter("llamacpp"), headers={})
            first = await scrape()
            second = await scrape()
    finally:
        await runner.cleanup()
    assert "kv_usage" not in first and first == second
    assert first["running"] == 4
    assert "HTTP 501" in (scrape.slots_disabled or "")
