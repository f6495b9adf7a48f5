"""Executor fidelity: how much TTFT and dispatch lateness the client itself adds (ARCHITECTURE.md, "Performance").

An instant SSE server runs in its own process (raw asyncio protocol, HTTP/1.1
keep-alive, chunked SSE). For every completion it logs, on the shared
CLOCK_MONOTONIC, when it had read the whole request and when it had written the
first event. A client's TTFT minus that server-side TTFT is the TTFT the client
adds. C streaming requests are planned for the same instant (C = 1, 64, 256,
1024); four clients run interleaved in the same run:

  raw    hand-written HTTP on asyncio streams, connections opened in advance:
         the floor on this machine;
  ours   fuzzer.execute.http.HttpTarget.execute (the real thing: idle barrier,
         prompts, warm-up and the /metrics sampler included; only the send and
         receive path is timed), on its hot path (fuzzer.execute.fastpath);
  aiohttp the same executor with FUZZ_HTTP_CLIENT=aiohttp (completion requests
         through aiohttp's ClientSession, as before issue 19);
  vllm   a reimplementation, from its documented behaviour, of the request
         function `vllm bench serve` uses (the benchmark clients' documented behaviour): one
         ClientSession(trust_env=True), TCPConnector(limit=0), no warm-up, the
         clock started inside the request function, iter_any() + an incremental
         UTF-8 decoder + split on "\\n\\n", first chunk with choices = TTFT.
         vLLM is not installed here; no vLLM code was copied.

Per cell: added TTFT and dispatch lateness (p50 / p99) and SSE events per second of
client CPU (time.process_time around each burst: C x (8 tokens + usage + [DONE]) events;
ours includes its idle barrier, prompt building and /metrics sampler). Then events per
CPU-second on long streams, end to end.

    .venv/bin/python benchmarks/executor_fidelity.py [--quick] [--profile C] [--uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import contextlib

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fuzzer import trace as tf  # noqa: E402
from fuzzer.execute import fastpath  # noqa: E402
from fuzzer.execute.http import HttpTarget  # noqa: E402

CLIENTS = ("raw", "ours", "aiohttp", "vllm")

CONCURRENCIES = (1, 64, 256, 1024)
#: Bursts per client and concurrency: about 40-4000 samples per cell, about a minute in all.
REPEATS = {1: 40, 64: 8, 256: 6, 1024: 4}
#: Events per stream: a first token, more tokens, usage, [DONE].
TOKENS = 8
PROMPT_TOKENS = 16


# --- the instant server (child process) -------------------------------------------------------

_EVENT = (
    b'data: {"id":"cmpl-b","object":"text_completion","created":0,"model":"bench",'
    b'"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null}]}\n\n'
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Server(asyncio.Protocol):
    log: list = []

    def connection_made(self, transport):
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def data_received(self, data):
        now = time.perf_counter()
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])}
            need = end + 4 + int(headers.get("content-length", "0"))
            if len(self.buf) < need:
                return
            body, self.buf = self.buf[end + 4 : need], self.buf[need:]
            method, path, _ = head[0].split(" ", 2)
            self.handle(method, path, headers, body, now)

    def reply(self, body: bytes, ctype: bytes = b"application/json") -> None:
        self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (ctype, len(body), body))

    def handle(self, method, path, headers, body, now):
        if path.startswith("/v1/completions"):
            req = json.loads(body)
            n = int(req.get("max_tokens", TOKENS))
            prompt_tokens = 1 + len(str(req.get("prompt", "")).split())
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            if not req.get("stream"):
                self.reply(json.dumps({"choices": [{"index": 0, "text": " tok" * n, "finish_reason": "length"}], "usage": usage}).encode())
                return
            self.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunk(_EVENT)
            )
            first = time.perf_counter()
            rest = [_chunk(_EVENT) for _ in range(n - 1)]
            rest.append(_chunk(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"))
            rest.append(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            self.transport.write(b"".join(rest))
            _Server.log.append((headers.get("x-request-id", ""), now, first))
        elif path == "/tokenize":
            req = json.loads(body)
            count = 1 + len(str(req.get("prompt", "")).split())
            self.reply(json.dumps({"count": count, "max_model_len": 4096, "tokens": list(range(count))}).encode())
        elif path == "/v1/models":
            self.reply(b'{"object":"list","data":[{"id":"bench","object":"model","owned_by":"vllm","max_model_len":4096}]}')
        elif path == "/version":
            self.reply(b'{"version":"bench"}')
        elif path == "/metrics":
            self.reply(b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
                       b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n", b"text/plain")
        elif path == "/log":
            data, _Server.log = _Server.log, []
            self.reply(json.dumps(data).encode())
        else:
            self.reply(b"")


def serve() -> None:
    async def main():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_Server, "127.0.0.1", 0, backlog=4096)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


# --- helpers ------------------------------------------------------------------------------------


async def server_log(url: str) -> dict[str, float]:
    """x_request_id -> server-side TTFT (first event written - request read)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/log") as r:
        return {x: first - read for x, read, first in json.loads(await r.read())}


async def sleep_until(t: float) -> None:
    while (left := t - time.perf_counter()) > 0:
        await asyncio.sleep(left - 0.0015 if left > 0.0015 else 0)


def request_body(i: int) -> bytes:
    words = " ".join(f"w{i}x{j}" for j in range(PROMPT_TOKENS - 1))
    return json.dumps({"model": "bench", "prompt": words, "max_tokens": TOKENS, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}}).encode()


def has_text(event: bytes) -> bool:
    if event.startswith(b"data: [DONE]"):
        return False
    choices = json.loads(event[6:]).get("choices") or []
    return any(c.get("text") for c in choices)


# --- client 1: raw sockets ----------------------------------------------------------------------


async def raw_burst(host: str, port: int, c: int, tag: str) -> list[tuple[str, float, float]]:
    """(x_request_id, ttft_s, lateness_s) per request."""
    conns = [await asyncio.open_connection(host, port, limit=1 << 22) for _ in range(c)]
    for _, w in conns:
        w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reqs = []
    for i in range(c):
        body = request_body(i)
        xid = f"{tag}-{i}"
        reqs.append((xid, b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                     b"X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n%s" % (host.encode(), port, xid.encode(), len(body), body)))

    async def one(conn, xid, data, t0):
        reader, writer = conn
        sent = time.perf_counter()
        writer.write(data)
        await reader.readuntil(b"\r\n\r\n")
        ttft = None
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            if size == 0:
                await reader.readexactly(2)
                break
            event = (await reader.readexactly(size + 2))[:-2]
            now = time.perf_counter()
            if ttft is None and has_text(event):
                ttft = now - sent
        return xid, ttft, sent - t0

    t0 = time.perf_counter() + 0.005
    await sleep_until(t0)
    out = await asyncio.gather(*(one(conn, xid, data, t0) for conn, (xid, data) in zip(conns, reqs)))
    for _, w in conns:
        w.close()
    return out


# --- client 2: the fuzzer's executor ------------------------------------------------------------


async def ours_burst(target: HttpTarget, c: int) -> list[tuple[str, float, float]]:
    trace = tf.from_dict({"requests": [{"id": f"q{i}", "at_ms": 0, "prompt_tokens": PROMPT_TOKENS, "max_tokens": TOKENS}
                                       for i in range(c)]})
    result = await target.execute(trace)
    assert not result.failures, result.failures[:1]
    return [(r.x_request_id, r.ttft_s, r.dispatch_lateness_s) for r in result.requests]


# --- client 3: vLLM's benchmark request function, as documented ---------------------------------


async def vllm_burst(url: str, c: int, tag: str) -> list[tuple[str, float, float]]:
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300, use_dns_cache=True,
                                     keepalive_timeout=60, enable_cleanup_closed=True, force_close=False)
    session = aiohttp.ClientSession(connector=connector, trust_env=True,
                                    timeout=aiohttp.ClientTimeout(total=6 * 60 * 60))
    # `vllm bench serve` sends one test prompt first: one connection is warm, the rest are not.
    async with session.post(url + "/v1/completions", data=request_body(0), headers={"Content-Type": "application/json"}) as r:
        await r.read()

    async def one(i, t0):
        xid = f"{tag}-{i}"
        payload = json.loads(request_body(i))
        st = time.perf_counter()
        ttft = None
        async with session.post(url + "/v1/completions", json=payload,
                                headers={"Content-Type": "application/json", "X-Request-Id": xid}) as response:
            decoder = codecs.getincrementaldecoder("utf-8")()
            buffer = ""
            async for chunk_bytes in response.content.iter_any():
                buffer += decoder.decode(chunk_bytes)
                while "\n\n" in buffer:
                    message, buffer = buffer.split("\n\n", 1)
                    message = message.strip()
                    if not message or message.startswith(":"):
                        continue
                    data = message.removeprefix("data: ")
                    if data == "[DONE]":
                        continue
                    timestamp = time.perf_counter()
                    obj = json.loads(data)
                    if obj.get("choices") and ttft is None:
                        ttft = timestamp - st
        return xid, ttft, st - t0

    t0 = time.perf_counter() + 0.005
    await sleep_until(t0)
    tasks = [asyncio.create_task(one(i, t0)) for i in range(c)]
    out = await asyncio.gather(*tasks)
    await session.close()
    return out


# --- the run ------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


@contextlib.contextmanager
def client_env(value: str | None):
    """FUZZ_HTTP_CLIENT set to ``value`` (None: unset) while a target starts."""
    old = os.environ.pop(fastpath.ENV, None)
    if value is not None:
        os.environ[fastpath.ENV] = value
    try:
        yield
    finally:
        os.environ.pop(fastpath.ENV, None)
        if old is not None:
            os.environ[fastpath.ENV] = old


async def started_target(url: str, seed: int, client: str | None) -> HttpTarget:
    target = HttpTarget(url, rng=random.Random(seed), idle_timeout_s=5)
    with client_env(client):
        await target.start()
    return target


async def fidelity(url: str, host: str, port: int, repeats: dict[int, int]) -> dict:
    cells: dict = {}
    fast = await started_target(url, 1, None)
    slow = await started_target(url, 4, "aiohttp")
    assert fast._fast is not None and slow._fast is None
    try:
        for c in CONCURRENCIES:
            order = list(CLIENTS)
            for rep in range(repeats[c]):
                random.Random(rep).shuffle(order)  # interleaved, in a varying order
                for client in order:
                    await server_log(url)  # drop what earlier clients left
                    tag = f"{client}{c}r{rep}"
                    cpu = time.process_time()
                    if client == "raw":
                        got = await raw_burst(host, port, c, tag)
                    elif client == "ours":
                        got = await ours_burst(fast, c)
                    elif client == "aiohttp":
                        got = await ours_burst(slow, c)
                    else:
                        got = await vllm_burst(url, c, tag)
                    cpu = time.process_time() - cpu
                    server = await server_log(url)
                    cell = cells.setdefault((client, c), {"added": [], "late": [], "cpu": 0.0, "events": 0})
                    for xid, ttft, late in got:
                        cell["added"].append(ttft - server[xid])
                        cell["late"].append(late)
                    cell["cpu"] += cpu
                    cell["events"] += len(got) * (TOKENS + 2)
                    await asyncio.sleep(0.05)
    finally:
        await fast.aclose()
        await slow.aclose()
    return cells


async def events_per_second(url: str, *, streams: int = 8, tokens: int = 4000,
                            client: str | None = None) -> tuple[float, int]:
    trace = tf.from_dict({"requests": [{"id": f"e{i}", "at_ms": 0, "prompt_tokens": PROMPT_TOKENS, "max_tokens": tokens}
                                       for i in range(streams)]})
    target = await started_target(url, 2, client)
    try:
        await target.execute(trace)  # warm
        cpu = time.process_time()
        result = await target.execute(trace)
        cpu = time.process_time() - cpu
    finally:
        await target.aclose()
    assert not result.failures
    events = sum(len(r.token_times_s) + 2 for r in result.requests)  # tokens + usage + [DONE]
    return events / cpu, events


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--profile", metavar="C", type=int, help="profile ours at concurrency C and print the top")
    parser.add_argument("--uvloop", action="store_true", help="run every client on uvloop's event loop (pip install uvloop)")
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        host, url = "127.0.0.1", f"http://127.0.0.1:{port}"
        if args.profile:
            profile(url, args.profile)
            return
        repeats = {c: max(1, n // 4) for c, n in REPEATS.items()} if args.quick else REPEATS
        started = time.perf_counter()
        if args.uvloop:
            import uvloop

            run = uvloop.run
        else:
            run = asyncio.run
        cells = run(fidelity(url, host, port, repeats))
        eps, events = run(events_per_second(url))
        eps_aiohttp, _ = run(events_per_second(url, client="aiohttp"))
        report(cells, eps, eps_aiohttp, events, time.perf_counter() - started)
    finally:
        proc.terminate()
        proc.wait()


def report(cells: dict, eps: float, eps_aiohttp: float, events: int, wall_s: float) -> None:
    load = os.getloadavg()
    print(f"client-added TTFT and dispatch lateness, ms (p50 / p99); {os.cpu_count()} CPUs, {wall_s:.0f} s, "
          f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    names = {"raw": "raw floor", "ours": "ours (hot path)", "aiohttp": "ours via aiohttp", "vllm": "vLLM client"}
    print("| C | " + " | ".join(f"{names[k]}: added TTFT" for k in CLIENTS) + " | "
          + " | ".join(f"{k}: lateness" for k in CLIENTS) + " | "
          + " | ".join(f"{k}: events/CPU-s" for k in CLIENTS) + " | ours/raw TTFT p50, p99 | vLLM/ours p50 | samples |")
    print("|---:" * (2 + 3 * len(CLIENTS) + 2) + "|")
    for c in CONCURRENCIES:
        row = [str(c)]
        for key in ("added", "late"):
            for client in CLIENTS:
                v = [x * 1000 for x in cells[(client, c)][key]]
                row.append(f"{pct(v, 50):.2f} / {pct(v, 99):.2f}")
        for client in CLIENTS:
            cell = cells[(client, c)]
            row.append(f"{cell['events'] / max(cell['cpu'], 1e-9):,.0f}")
        ours, raw, vllm = (cells[(k, c)]["added"] for k in ("ours", "raw", "vllm"))
        row.append(f"{pct(ours, 50) / pct(raw, 50):.2f}x, {pct(ours, 99) / pct(raw, 99):.2f}x")
        row.append(f"{pct(vllm, 50) / pct(ours, 50):.1f}x")
        row.append(str(len(ours)))
        print("| " + " | ".join(row) + " |")
    print(f"SSE events parsed per second of client CPU (end to end, {events} events): "
          f"ours {eps:,.0f}; via aiohttp {eps_aiohttp:,.0f}")


def profile(url: str, c: int) -> None:
    """cProfile of ours over C-request bursts, from the end of the connection warm-up to the last
    answer (the window TTFT and lateness are measured in; prompts, the idle barrier and the
    warm-up are left out)."""
    import cProfile
    import pstats

    from fuzzer.execute import clientlag
    from fuzzer.execute import http as executor

    prof = cProfile.Profile()
    warm, stop = executor.HttpTarget._warm, clientlag.LagMonitor.stop

    async def warm_then_profile(self, connections):
        await warm(self, connections)
        prof.enable()

    async def stop_profiling(self):
        prof.disable()
        return await stop(self)

    async def run():
        target = await started_target(url, 3, os.environ.get(fastpath.ENV))
        try:
            await ours_burst(target, c)
            executor.HttpTarget._warm, clientlag.LagMonitor.stop = warm_then_profile, stop_profiling
            for _ in range(4):
                await ours_burst(target, c)
        finally:
            executor.HttpTarget._warm, clientlag.LagMonitor.stop = warm, stop
            await target.aclose()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)

    asyncio.run(run())


if __name__ == "__main__":
    main()
