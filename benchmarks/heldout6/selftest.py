#!/usr/bin/env python3
"""Self-test for server.py: clean FCFS behaviour, each planted bug on its trigger shape, SIGTERM handling.

Run with the venv interpreter:  .venv/bin/python selftest.py
"""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.join(HERE, "server.py")
FAILS = []


def check(cond, msg):
    print(("  ok   " if cond else "  FAIL ") + msg, flush=True)
    if not cond:
        FAILS.append(msg)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def words(n, tag):
    return " ".join(f"{tag}x{i}" for i in range(n))


class Srv:
    def __init__(self, bugs, tmp):
        self.bugs, self.port = bugs, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.gt = os.path.join(tmp, f"gt_{bugs.replace(',', '_')}.jsonl")
        self.log = open(os.path.join(tmp, f"log_{bugs}.txt"), "w")
        self.p = subprocess.Popen([sys.executable, SERVER, "--port", str(self.port), "--bugs", bugs,
                                   "--seed", "7", "--ground-truth", self.gt], stdout=self.log, stderr=self.log)

    async def wait_ready(self, s):
        for _ in range(100):
            try:
                async with s.get(self.base + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
        raise RuntimeError("server did not start")

    def lines(self):
        if not os.path.exists(self.gt):
            return {}
        with open(self.gt) as f:
            return {d["request_id"]: d for d in map(json.loads, f)}

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        self.log.close()


async def stream(s, base, rid, prompt, max_tokens, hangup_after=None, hangup=None, ignore_eos=True):
    """Streaming completion. Returns send time, per-token arrival times, finish reason."""
    out = {"rid": rid, "t0": time.monotonic(), "times": [], "finish": None, "hung_up": False}
    body = {"model": "simlab/sim-chat-1.3b", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}
    async with s.post(base + "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d["choices"]:
                if d["choices"][0]["text"]:
                    out["times"].append(time.monotonic())
                out["finish"] = d["choices"][0]["finish_reason"] or out["finish"]
            if (hangup_after is not None and len(out["times"]) >= hangup_after) or (hangup and hangup.is_set()):
                out["hung_up"] = True
                r.close()
                break
    out["t1"] = time.monotonic()
    return out


async def plain(s, base, rid, prompt, max_tokens):
    t0 = time.monotonic()
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    async with s.post(base + "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
        d = await r.json()
        return {"rid": rid, "status": r.status, "e2e": time.monotonic() - t0, "body": d}


def ttft(o):
    return o["times"][0] - o["t0"] if o["times"] else float("inf")


def max_gap(o):
    t = o["times"]
    return max((b - a for a, b in zip(t, t[1:])), default=0.0)


async def later(delay, coro):
    await asyncio.sleep(delay)
    return await coro


# ----------------------------------------------------------------- scenarios
async def s0_fcfs(s, srv, tag):
    """14 equal streams, 15 ms apart (> max_num_seqs): first tokens must come in arrival order."""
    outs = await asyncio.gather(*[later(0.015 * i, stream(s, srv.base, f"{tag}-s0-{i}", words(40, f"{tag}s0{i}"), 24))
                                  for i in range(14)])
    firsts = [o["times"][0] for o in outs]
    inv = [i for i in range(13) if firsts[i] > firsts[i + 1] + 0.003]
    return {"fcfs_inversions": inv, "rids": [o["rid"] for o in outs]}


async def s1(s, srv, tag):
    """A long prompt being chunk-prefilled, short requests arriving meanwhile."""
    long_t = asyncio.create_task(stream(s, srv.base, f"{tag}-s1-long", words(3000, f"{tag}s1L"), 4))
    await asyncio.sleep(0.08)
    shorts = await asyncio.gather(*[later(0.01 * i, stream(s, srv.base, f"{tag}-s1-short{i}",
                                                           words(20, f"{tag}s1s{i}"), 4)) for i in range(3)])
    await long_t
    return {"metric": sum(ttft(o) for o in shorts) / 3, "victims": [o["rid"] for o in shorts]}


async def s2(s, srv, tag):
    """Live streams decoding while a prompt far beyond the token budget arrives."""
    decs = [asyncio.create_task(stream(s, srv.base, f"{tag}-s2-dec{i}", words(20, f"{tag}s2d{i}"), 200))
            for i in range(3)]
    await asyncio.sleep(0.12)
    await stream(s, srv.base, f"{tag}-s2-huge", words(5000, f"{tag}s2H"), 2)
    outs = await asyncio.gather(*decs)
    return {"metric": max(max_gap(o) for o in outs), "victims": [o["rid"] for o in outs]}


async def s3(s, srv, tag):
    """Several requests with large max_tokens, then short requests."""
    hang = asyncio.Event()
    bigs = [asyncio.create_task(later(0.01 * i, stream(s, srv.base, f"{tag}-s3-big{i}", words(300, f"{tag}s3b{i}"),
                                                       1400, hangup=hang))) for i in range(5)]
    await asyncio.sleep(0.1)
    shorts = [asyncio.create_task(plain(s, srv.base, f"{tag}-s3-short{i}", words(20, f"{tag}s3s{i}"), 8))
              for i in range(2)]
    done, _ = await asyncio.wait(shorts, timeout=2.0)
    hang.set()
    res = await asyncio.gather(*shorts)
    await asyncio.gather(*bigs)
    return {"metric": max(r["e2e"] for r in res), "victims": [r["rid"] for r in res]}


async def s4(s, srv, tag):
    """Ten streams whose clients hang up after 3 tokens, then short requests."""
    gone = await asyncio.gather(*[stream(s, srv.base, f"{tag}-s4-gone{i}", words(20, f"{tag}s4g{i}"), 400,
                                         hangup_after=3) for i in range(10)])
    await asyncio.sleep(0.3)
    res = await asyncio.gather(*[plain(s, srv.base, f"{tag}-s4-short{i}", words(20, f"{tag}s4s{i}"), 8)
                                 for i in range(2)])
    return {"metric": max(r["e2e"] for r in res), "victims": [r["rid"] for r in res],
            "gone": [o["rid"] for o in gone]}


async def s5(s, srv, tag):
    """A burst of long prompts that exhausts the KV cache."""
    first = asyncio.create_task(stream(s, srv.base, f"{tag}-s5-first", words(1500, f"{tag}s5f"), 24))
    await asyncio.sleep(0.02)
    rest = await asyncio.gather(*[later(0.005 * i, stream(s, srv.base, f"{tag}-s5-r{i}", words(1400, f"{tag}s5r{i}"),
                                                          150)) for i in range(5)])
    o = await first
    return {"metric": o["t1"] - o["t0"], "victims": [o["rid"]], "all": [o["rid"]] + [r["rid"] for r in rest]}


SCEN = {"bug1": s1, "bug2": s2, "bug3": s3, "bug4": s4, "bug5": s5}


async def wait_lines(srv, rids, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        g = srv.lines()
        if all(r in g for r in rids):
            return g
        await asyncio.sleep(0.1)
    return srv.lines()


async def sigterm_check(s, srv, tag):
    rid = f"{tag}-term"
    t = asyncio.create_task(stream(s, srv.base, rid, words(30, f"{tag}term"), 3000))
    await asyncio.sleep(0.3)  # stream is decoding by now
    t0 = time.monotonic()
    srv.p.send_signal(signal.SIGTERM)
    while srv.p.poll() is None and time.monotonic() - t0 < 6:
        await asyncio.sleep(0.02)
    dt = time.monotonic() - t0
    out = await t
    check(srv.p.poll() is not None and dt < 5, f"[{srv.bugs}] SIGTERM exit in {dt:.2f}s")
    g = srv.lines()
    check(rid in g and g[rid]["finish_reason"] == "abort" and out["finish"] == "abort",
          f"[{srv.bugs}] in-flight stream aborted on SIGTERM and recorded")


async def api_checks(s, srv):
    async with s.post(srv.base + "/v1/completions", data=b"{not json") as r:
        d = await r.json()
        check(r.status == 400 and "error" in d, "malformed JSON -> 400 with error body")
    async with s.get(srv.base + "/v1/models") as r:
        d = await r.json()
        check(d["data"][0]["max_model_len"] == 6144, "/v1/models max_model_len")
    async with s.post(srv.base + "/tokenize", json={"prompt": "a b c d"}) as r:
        d = await r.json()
        check(d["count"] == 4 and len(d["tokens"]) == 4, "/tokenize counts words")
    async with s.post(srv.base + "/v1/chat/completions", headers={"X-Request-Id": "api-chat"},
                      json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "n": 2}) as r:
        d = await r.json()
        check(r.headers.get("X-Request-Id") == "api-chat" and len(d["choices"]) == 2
              and d["usage"]["completion_tokens"] <= 10, "chat n=2 non-streaming + X-Request-Id echo")
    async with s.get(srv.base + "/metrics") as r:
        txt = await r.text()
    names = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
             "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
             "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
             "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
             "vllm:cache_config_info"]
    check(all(n + "{" in txt for n in names), "/metrics exposes all vLLM V1 names")


async def preemptions(s, srv):
    async with s.get(srv.base + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("vllm:num_preemptions_total"):
                return float(line.split()[-1])
    return 0.0


async def warm(s, srv):
    await stream(s, srv.base, f"warm-{srv.bugs}", "warm up", 4)


async def run_clean(s, tmp):
    srv = Srv("none", tmp)
    base = {}
    try:
        await srv.wait_ready(s)
        await warm(s, srv)
        await api_checks(s, srv)
        r0 = await s0_fcfs(s, srv, "c")
        check(not r0["fcfs_inversions"], f"[none] FCFS order of first tokens (inversions {r0['fcfs_inversions']})")
        for b, fn in SCEN.items():
            r = await fn(s, srv, "c")
            base[b] = r
            print(f"  clean {fn.__name__}: victim metric {r['metric']:.3f}s", flush=True)
        g = await wait_lines(srv, base["bug4"]["gone"])
        check(all(g[x]["client_disconnected"] and g[x]["finish_reason"] == "abort" for x in base["bug4"]["gone"]),
              "[none] disconnected streams aborted and recorded")
        check(await preemptions(s, srv) > 0, "[none] KV burst caused preemptions")
        tagged = [d for d in g.values() if d["pathologies"]]
        check(not tagged, f"[none] nothing tagged in clean mode ({len(g)} lines)")
        await sigterm_check(s, srv, "c")
    finally:
        srv.kill()
    return base


async def run_bug(s, tmp, bug, base):
    srv = Srv(bug, tmp)
    try:
        await srv.wait_ready(s)
        await warm(s, srv)
        r0 = await s0_fcfs(s, srv, bug)
        r = await SCEN[bug](s, srv, bug)
        ratio = r["metric"] / max(base[bug]["metric"], 1e-6)
        print(f"  {bug} victim metric {r['metric']:.3f}s vs clean {base[bug]['metric']:.3f}s (x{ratio:.1f})",
              flush=True)
        check(ratio > 1.5, f"[{bug}] victims measurably delayed vs clean (x{ratio:.1f})")
        need = r["victims"] + r0["rids"] + r.get("gone", [])
        g = await wait_lines(srv, need, timeout=12.0)
        check(all(bug in g.get(v, {}).get("pathologies", []) for v in r["victims"]), f"[{bug}] victims tagged {bug}")
        check(not any(g.get(x, {}).get("pathologies") for x in r0["rids"]),
              f"[{bug}] generic equal-shape load not tagged")
        check(not r0["fcfs_inversions"], f"[{bug}] generic load still FCFS")
        if bug == "bug4":
            check(all(g.get(x, {}).get("client_disconnected") and "bug4" in g[x]["pathologies"] for x in r["gone"]),
                  "[bug4] leaked streams recorded as disconnected + tagged after release")
        others = {p for d in g.values() for p in d["pathologies"]} - {bug}
        check(not others, f"[{bug}] no other bug names tagged ({others or 'none'})")
        await sigterm_check(s, srv, bug)
    finally:
        srv.kill()


async def main():
    t0 = time.monotonic()
    only = sys.argv[1:] or list(SCEN)
    with tempfile.TemporaryDirectory() as tmp:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout,
                                         connector=aiohttp.TCPConnector(limit=0, force_close=True)) as s:
            print("== clean mode", flush=True)
            base = await run_clean(s, tmp)
            for bug in only:
                print(f"== {bug}", flush=True)
                await run_bug(s, tmp, bug, base)
    dt = time.monotonic() - t0
    print(f"\n{'PASS' if not FAILS else 'FAIL'}: {len(FAILS)} failures, runtime {dt:.1f}s")
    for f in FAILS:
        print("  -", f)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
