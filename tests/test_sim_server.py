"""The simulator over HTTP, checked by an independent client (raw aiohttp, hand-parsed SSE)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from timing import holds_in_some_attempt

from fuzzer.sim import SimConfig, VirtualTarget
from fuzzer.sim.server import SimServer, running_server

#: Ten times faster than real: HTTP tests stay short in wall time.
FAST = SimConfig(speed=10.0)


def _events(raw: bytes) -> list:
    """Split an SSE body into decoded events, checking the framing on the way."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-80:]
    out = []
    for block in raw.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: "), block[:80]
        assert b"\n" not in block
        payload = block[len(b"data: "):]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1]
    return out[:-1]


@pytest.fixture
async def server():
    sim = SimServer(FAST, seed=1)
    url = await sim.start("127.0.0.1", 0)
    assert url.startswith("http://127.0.0.1:")
    async with aiohttp.ClientSession(base_url=url) as session:
        yield sim, session
    await sim.stop()


async def _post(session, path, body, **kw):
    async with session.post(path, json=body, **kw) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.read()


async def test_completions_stream_framing_usage_and_done(server):
    sim, session = server
    body = {"prompt": "one two three " * 10, "max_tokens": 6, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    status, ctype, raw = await _post(session, "/v1/completions", body, headers={"X-Request-Id": "req-1"})
    assert status == 200 and ctype.startswith("text/event-stream")
    events = _events(raw)
    content, usage = events[:-1], events[-1]
    assert [e["object"] for e in events] == ["text_completion"] * len(events)
    assert len(content) == 6 and all(e["choices"][0]["text"] for e in content)
    assert [e["choices"][0]["finish_reason"] for e in content] == [None] * 5 + ["length"]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 30
    assert usage["usage"]["completion_tokens"] == 6 and usage["usage"]["total_tokens"] == 36
    assert all("usage" not in e for e in content)
    assert content[0]["id"] == "cmpl-req-1"
    (record,) = sim.ground_truth
    assert record.request_id == "req-1" and record.completion_tokens == 6
    assert record.arrival_s <= record.first_token_s <= record.finish_s


async def test_chat_stream_role_chunk_first_then_content(server):
    _, session = server
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, "stream": True,
            "ignore_eos": True}
    status, _, raw = await _post(session, "/v1/chat/completions", body)
    events = _events(raw)
    assert status == 200 and all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(set(e["choices"][0]["delta"]) == {"content"} for e in events[1:])
    assert len(events) == 5 and events[-1]["choices"][0]["finish_reason"] == "length"


async def test_non_stream_bodies(server):
    _, session = server
    status, _, raw = await _post(session, "/v1/completions", {"prompt": "a b c", "max_tokens": 5, "ignore_eos": True})
    body = json.loads(raw)
    assert status == 200 and body["object"] == "text_completion"
    assert len(body["choices"][0]["text"].split()) == 5 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 8, "completion_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    status, _, raw = await _post(
        session, "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "n": 2, "ignore_eos": True},
    )
    body = json.loads(raw)
    assert body["object"] == "chat.completion" and [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"]["role"] == "assistant" and body["usage"]["completion_tokens"] == 6


async def test_n_and_logprobs_in_a_stream(server):
    _, session = server
    body = {"prompt": "p q", "max_tokens": 3, "n": 2, "logprobs": 2, "stream": True, "ignore_eos": True}
    events = _events((await _post(session, "/v1/completions", body))[2])
    assert len(events) == 3
    for e in events:
        assert [c["index"] for c in e["choices"]] == [0, 1]
        lp = e["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == 1 and len(lp["top_logprobs"][0]) == 2


async def test_stop_string_and_min_tokens(server):
    _, session = server
    _, _, raw = await _post(session, "/v1/completions", {"prompt": "z", "max_tokens": 8, "ignore_eos": True})
    words = json.loads(raw)["choices"][0]["text"].split()
    body = {"prompt": "z", "max_tokens": 8, "stop": [words[3]], "ignore_eos": True}
    _, _, raw = await _post(session, "/v1/completions", body)
    choice = json.loads(raw)["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"].split() == words[:3]
    _, _, raw = await _post(session, "/v1/completions", {"prompt": "z", "max_tokens": 30, "min_tokens": 30})
    assert len(json.loads(raw)["choices"][0]["text"].split()) == 30


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 40000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "model": "gpt-9"}, 404, "model"),
        ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 3}, 400,
         "top_logprobs"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ],
)
async def test_bad_requests_get_vllm_error_json(server, path, body, status, param):
    _, session = server
    got, ctype, raw = await _post(session, path, body)
    assert got == status and ctype.startswith("application/json")
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param and error["message"]
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


async def test_invalid_json_body(server):
    _, session = server
    async with session.post("/v1/completions", data=b"{nope") as r:
        assert r.status == 400 and (await r.json())["error"]["code"] == 400


async def test_tokenize_detokenize_models_health(server):
    _, session = server
    _, _, raw = await _post(session, "/tokenize", {"prompt": "alpha beta gamma", "return_token_strs": True})
    tok = json.loads(raw)
    assert tok["count"] == 3 and tok["max_model_len"] == FAST.max_model_len
    assert tok["token_strs"] == ["alpha", "beta", "gamma"]
    _, _, raw = await _post(session, "/detokenize", {"tokens": tok["tokens"]})
    assert json.loads(raw) == {"prompt": "alpha beta gamma"}
    messages = [{"role": "user", "content": "hi there"}]
    _, _, raw = await _post(session, "/tokenize", {"messages": messages})
    count = json.loads(raw)["count"]
    _, _, raw = await _post(session, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert json.loads(raw)["usage"]["prompt_tokens"] == count  # /tokenize predicts the chat prompt exactly
    async with session.get("/v1/models") as r:
        card = (await r.json())["data"][0]
        assert card["id"] == FAST.model_name and card["max_model_len"] == FAST.max_model_len
    async with session.get("/health") as r:
        assert r.status == 200
    async with session.get("/ground_truth") as r:
        assert r.status == 404  # ground truth never goes over HTTP


async def test_metrics_parse_with_vllm_names(server):
    _, session = server
    await _post(session, "/v1/completions", {"prompt": "a b c d", "max_tokens": 3, "stream": True, "ignore_eos": True})
    async with session.get("/metrics") as r:
        text = await r.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                 "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):
        assert name in families, name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    model = (("model_name", FAST.model_name),)
    assert samples[("vllm:generation_tokens_total", model)] == 3
    assert samples[("vllm:prompt_tokens_total", model)] == 4
    assert samples[("vllm:time_to_first_token_seconds_count", model)] == 1
    assert samples[("vllm:inter_token_latency_seconds_count", model)] == 2
    assert samples[("vllm:request_success_total", (("finished_reason", "length"),) + model)] == 1
    assert all(s.labels.get("model_name") == FAST.model_name
               for f in families.values() if f.name.startswith("vllm:") and f.name != "vllm:cache_config_info"
               for s in f.samples)


async def _leave_a_stream(url: str, words: int, max_tokens: int, request_id: str, while_open=None) -> None:
    """A client that reads the first event of a stream and disconnects (``while_open`` runs before it leaves)."""
    async with aiohttp.ClientSession() as session:
        body = {"prompt": "w " * words, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        async with session.post(url + "/v1/completions", json=body, headers={"X-Request-Id": request_id}) as r:
            await r.content.readuntil(b"\n\n")
            if while_open:
                while_open()


async def _wait_idle(sim: SimServer, tries: int) -> None:
    for _ in range(tries):
        if sim.engine.idle:
            return
        await asyncio.sleep(0.01)


async def test_client_disconnect_aborts_and_frees_kv(tmp_path):
    path = tmp_path / "gt.jsonl"
    sim = SimServer(SimConfig(), seed=0, ground_truth_path=path)
    url = await sim.start()
    try:
        def holds_kv():
            assert sim.engine.kv.num_used > 0

        await _leave_a_stream(url, 1000, 2000, "gone", holds_kv)
        await _wait_idle(sim, 200)
        assert sim.engine.idle and sim.engine.kv.num_used == 0
        assert sim.engine.stats.finished["abort"] == 1
    finally:
        await sim.stop()
    (line,) = path.read_text().splitlines()
    record = json.loads(line)
    assert record["request_id"] == "gone" and record["finish_reason"] == "abort"
    assert record["completion_tokens"] < 2000 and record["pathologies"] == []


async def test_a_leaking_server_runs_a_disconnected_stream_to_its_length(tmp_path):
    path = tmp_path / "gt.jsonl"
    sim = SimServer(SimConfig(speed=20.0), ("disconnect-leak",), seed=0, ground_truth_path=path)
    url = await sim.start()
    try:
        await _leave_a_stream(url, 100, 400, "left")
        await asyncio.sleep(0.05)
        assert sim.engine.num_running == 1 and sim.engine.kv.num_used > 0  # the client is gone, its request is not
        await _wait_idle(sim, 500)
        assert sim.engine.idle and sim.engine.stats.finished["abort"] == 0
    finally:
        await sim.stop()
    (line,) = path.read_text().splitlines()
    record = json.loads(line)
    assert record["request_id"] == "left" and record["finish_reason"] == "length"
    assert record["completion_tokens"] == 400 and record["pathologies"] == ["disconnect-leak"]


async def test_running_server_context_manager_stops():
    async with running_server(FAST, pathologies=("cold-start",)) as url:
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/health") as r:
                assert r.status == 200
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)):
                pass


async def _replay(url: str, trace, salt: str = "") -> dict[str, tuple[float | None, float]]:
    """A minimal open-loop client: TTFT (first non-empty text) and E2E per request, from its send time.

    Bodies are built before the clock starts (private words: no prefix-cache hits), so
    dispatch is not delayed by prompt construction.
    """
    bodies = {
        r.id: json.dumps(
            {"prompt": " ".join(f"{salt}{r.id}w{i}" for i in range(r.prompt_tokens)), "max_tokens": r.max_tokens,
             "ignore_eos": True, "stream": r.stream}
        ).encode()
        for r in trace.requests
    }
    out = {}
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(base_url=url) as session:
        async with session.get("/health"):
            pass  # open a connection before the clock starts
        t0 = time.perf_counter() + 0.05

        async def one(r):
            await asyncio.sleep(max(0.0, t0 + r.at_ms / 1000 - time.perf_counter()))
            sent = time.perf_counter()
            ttft = None
            async with session.post("/v1/completions", data=bodies[r.id], headers=headers) as resp:
                async for line in resp.content:
                    if ttft is None and line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                        ttft = time.perf_counter() - sent
            out[r.id] = (ttft, time.perf_counter() - sent)

        await asyncio.gather(*(one(r) for r in trace.requests))
    return out


async def test_http_and_virtual_runs_agree_within_noise(seed_trace):
    """The same trace, same engine: the HTTP timings track the virtual ones (warm server, no prefix sharing)."""
    trace = seed_trace.with_requests([r.__class__(**{**r.to_dict(), "prefix": None}) for r in seed_trace.requests])
    config = SimConfig(speed=2.0)  # the server runs twice as fast; the client keeps the trace's schedule
    virtual = VirtualTarget(config).run(trace)

    def apart(http) -> list[str]:
        bad = []
        for r in trace.requests:
            v = virtual.request(r.id)
            ttft, e2e = http[r.id]
            if e2e != pytest.approx(v.e2e_s, rel=0.1, abs=0.04):  # a shared, loaded loop: a few ms of jitter
                bad.append(f"{r.id} e2e: http {e2e * 1000:.1f} ms, virtual {v.e2e_s * 1000:.1f} ms")
            if r.stream and ttft != pytest.approx(v.ttft_s, rel=0.3, abs=0.04):
                bad.append(f"{r.id} ttft: http {ttft * 1000:.1f} ms, virtual {v.ttft_s * 1000:.1f} ms")
        return bad

    attempts = iter(range(100))
    async with running_server(config) as url:  # each attempt with words of its own: nothing cached
        await holds_in_some_attempt(lambda: _replay(url, trace, salt=f"a{next(attempts)}"), apart)
