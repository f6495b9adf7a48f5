#!/usr/bin/env python3
"""Self-test for server.py.

Starts the server on a free loopback port (clean, then --bugs all), checks the
HTTP surface and clean behaviour, then drives five short workloads and checks
that, with --bugs all, each planted bug is triggered and tagged in the ground
truth (and that with --bugs none nothing is ever tagged).  Exit status 0 on
success.  Run with the interpreter that has aiohttp:
    python selftest.py
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
    if not cond:
        FAILS.append(msg)
        print("  FAIL:", msg, flush=True)
    return cond


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Srv:
    def __init__(self, bugs, gt):
        self.port = free_port()
        self.gt = gt
        self.proc = subprocess.Popen(
            [sys.executable, SERVER, "--port", str(self.port), "--seed", "7", "--bugs", bugs,
             "--ground-truth", gt], stdout=subprocess.DEVNULL,
            stderr=None if os.environ.get("SIMVLLM_DEBUG") else subprocess.DEVNULL)
        self.base = "http://127.0.0.1:%d" % self.port

    async def wait_ready(self, session):
        for _ in range(100):
            try:
                async with session.get(self.base + "/health") as r:
                    if r.status == 200:
                        return True
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
        return False

    def stop(self):
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return time.monotonic() - t0


def gt_lines(path):
    out = {}
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                d = json.loads(line)
                out[d["request_id"]] = d
    return out


def words(tag, n):
    return " ".join("%s_%d" % (tag, i) for i in range(n))


async def call(session, base, path, body, rid, cancel_after=None):
    """Returns dict(status, events|json, ttft, e2e, headers)."""
    t0 = time.monotonic()
    res = {"status": None, "events": [], "json": None, "ttft": None, "e2e": None,
           "headers": {}, "raw": b""}

    async def go():
        async with session.post(base + path, json=body, headers={"X-Request-Id": rid}) as r:
            res["status"] = r.status
            res["headers"] = {"X-Request-Id": r.headers.get("X-Request-Id")}
            if body.get("stream") and r.status == 200:
                buf = b""
                async for chunk in r.content.iter_any():
                    buf += chunk
                    res["raw"] += chunk
                    while b"\n\n" in buf:
                        ev, buf = buf.split(b"\n\n", 1)
                        s = ev.decode()
                        res["events"].append(s)
                        if res["ttft"] is None and s.startswith("data: {"):
                            d = json.loads(s[6:])
                            if d["choices"] and (d["choices"][0].get("text") or
                                                 d["choices"][0].get("delta", {}).get("content")):
                                res["ttft"] = time.monotonic() - t0
            else:
                res["json"] = await r.json()
        res["e2e"] = time.monotonic() - t0

    if cancel_after is None:
        await go()
    else:
        try:
            await asyncio.wait_for(go(), cancel_after)
        except asyncio.TimeoutError:
            res["status"] = "cancelled"
    return res


def cmpl(prompt, max_tokens, **kw):
    d = {"prompt": prompt, "max_tokens": max_tokens}
    d.update(kw)
    return d


# ---------------------------------------------------------------------------
# functional checks (clean server)
# ---------------------------------------------------------------------------
async def functional(session, base, gt):
    print("functional checks", flush=True)
    async with session.get(base + "/v1/models") as r:
        d = await r.json()
        check(r.status == 200 and d["data"][0]["max_model_len"] > 0, "/v1/models")
        model = d["data"][0]["id"]
    async with session.get(base + "/version") as r:
        check(r.status == 200 and "version" in await r.json(), "/version")
    async with session.post(base + "/tokenize", json={"prompt": "a b c"}) as r:
        d = await r.json()
        check(d["count"] == 4 and len(d["tokens"]) == 4, "/tokenize adds BOS + 1 per word")
        toks = d["tokens"]
    async with session.post(base + "/detokenize", json={"tokens": toks}) as r:
        check((await r.json())["prompt"] == "a b c", "/detokenize roundtrip")

    r = await call(session, base, "/v1/completions",
                   cmpl("hello there general", 5, logprobs=2, model=model), "f-plain")
    j = r["json"]
    check(r["status"] == 200 and r["headers"].get("X-Request-Id") == "f-plain", "X-Request-Id echo")
    check(j["id"] == "cmpl-f-plain" and j["object"] == "text_completion", "completion id/object")
    check(j["usage"]["prompt_tokens"] == 4, "prompt tokens = words + BOS")
    lp = j["choices"][0]["logprobs"]
    check(lp is not None and len(lp["tokens"]) == j["usage"]["completion_tokens"]
          and all(len(t) == 2 for t in lp["top_logprobs"]), "completion logprobs shape")

    r = await call(session, base, "/v1/completions",
                   cmpl("stream me please", 12, stream=True, ignore_eos=True,
                        stream_options={"include_usage": True}), "f-stream")
    ev = r["events"]
    check(r["raw"].endswith(b"data: [DONE]\n\n") and all(e.startswith("data: ") for e in ev),
          "SSE framing")
    datas = [json.loads(e[6:]) for e in ev[:-1]]
    tok_chunks = [d for d in datas if d["choices"]]
    check(len(tok_chunks) == 12, "one token per event (ignore_eos -> exactly max_tokens)")
    check(all(d["choices"][0]["finish_reason"] is None for d in tok_chunks[:-1]) and
          tok_chunks[-1]["choices"][0]["finish_reason"] == "length", "finish_reason on last chunk")
    check(datas[-1]["choices"] == [] and datas[-1]["usage"]["completion_tokens"] == 12,
          "usage chunk")

    r = await call(session, base, "/v1/chat/completions",
                   {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 6,
                    "stream": True, "n": 2, "logprobs": True, "top_logprobs": 3}, "f-chat")
    datas = [json.loads(e[6:]) for e in r["events"][:-1]]
    check(datas[0]["object"] == "chat.completion.chunk" and
          datas[0]["choices"][0]["delta"].get("role") == "assistant", "chat role delta first")
    idx = {d["choices"][0]["index"] for d in datas}
    check(idx == {0, 1}, "chat n=2 stream indices")
    c = [d for d in datas if d["choices"][0]["delta"].get("content")]
    check(c and len(c[0]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3,
          "chat top_logprobs")

    r = await call(session, base, "/v1/chat/completions",
                   {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 4,
                    "n": 3, "seed": 11, "ignore_eos": True}, "f-chat-n3")
    j = r["json"]
    check(len(j["choices"]) == 3 and j["usage"]["completion_tokens"] == 12, "chat n=3 usage")
    r2 = await call(session, base, "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 4,
                     "n": 3, "seed": 11, "ignore_eos": True}, "f-chat-n3b")
    check([c["message"]["content"] for c in j["choices"]] ==
          [c["message"]["content"] for c in r2["json"]["choices"]], "seed determinism")

    r = await call(session, base, "/v1/completions", cmpl("go", 40, min_tokens=30), "f-mintok")
    check(r["json"]["usage"]["completion_tokens"] >= 30, "min_tokens honoured")

    r = await call(session, base, "/v1/completions", cmpl(words("long", 4000), 200), "f-toolong")
    check(r["status"] == 400 and "error" in r["json"] and r["json"]["error"]["code"] == 400,
          "400 on prompt+max_tokens > max_model_len")

    r = await call(session, base, "/v1/completions",
                   cmpl(words("cancel", 50), 500, stream=True, ignore_eos=True), "f-cancel",
                   cancel_after=0.3)
    check(r["status"] == "cancelled", "client cancel")
    r = await call(session, base, "/v1/completions",
                   cmpl(words("cancel2", 50), 500, ignore_eos=True), "f-cancel-nonstream",
                   cancel_after=0.3)
    check(r["status"] == "cancelled", "client cancel (non-stream)")
    await asyncio.sleep(0.2)

    async with session.get(base + "/metrics") as r:
        text = await r.text()
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:cache_config_info",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket"]:
        check(any(l.startswith(name + "{") and 'engine="0"' in l and "model_name=" in l
                  for l in text.splitlines()), "metric " + name)
    check('finished_reason="abort"} 2.0' in text, "abort counted in request_success_total")

    g = gt_lines(gt)
    check(g.get("f-toolong", {}).get("finish_reason") == "error", "GT error line")
    c = g.get("f-cancel", {})
    check(c.get("finish_reason") == "abort" and c.get("client_disconnected") is True,
          "GT abort + client_disconnected")
    c = g.get("f-cancel-nonstream", {})
    check(c.get("finish_reason") == "abort" and c.get("client_disconnected") is True
          and 0 < c.get("output_tokens", 0) < 500, "GT abort (non-stream disconnect)")
    check(g.get("f-stream", {}).get("output_tokens") == 12, "GT output tokens")
    check(g.get("f-chat-n3", {}).get("output_tokens") == 12, "GT n=3 output tokens")


# ---------------------------------------------------------------------------
# workloads (same traffic in both modes)
# ---------------------------------------------------------------------------
async def w1(session, base, p):
    """shared-prefix burst"""
    pre = words("sharedpfx", 1500)
    bg = asyncio.ensure_future(call(session, base, "/v1/completions",
                                    cmpl("bg", 150, ignore_eos=True), p + "bg"))
    await call(session, base, "/v1/completions", cmpl(pre, 1), p + "warm")
    blocker = asyncio.ensure_future(call(session, base, "/v1/completions",
                                         cmpl(words(p + "blk", 3000), 4, ignore_eos=True),
                                         p + "blocker"))
    await asyncio.sleep(0.01)
    tasks = []
    for i in range(6):
        tasks.append(call(session, base, "/v1/completions",
                          cmpl(pre + " " + words(p + "s%d" % i, 40), 8, ignore_eos=True),
                          p + "s%d" % i))
        tasks.append(call(session, base, "/v1/completions",
                          cmpl(words(p + "u%d" % i, 400), 8, ignore_eos=True), p + "u%d" % i))
    await asyncio.gather(*tasks, blocker, bg)


async def w2(session, base, p):
    """cancellations mid-prefill under decode load"""
    fill = [asyncio.ensure_future(call(session, base, "/v1/completions",
                                       cmpl(words(p + "f%d" % i, 500), 300, ignore_eos=True),
                                       p + "f%d" % i)) for i in range(8)]
    await asyncio.sleep(0.15)
    canc = [asyncio.ensure_future(call(session, base, "/v1/completions",
                                       cmpl(words(p + "c%d" % i, 3000), 50, stream=True),
                                       p + "c%d" % i, cancel_after=0.12)) for i in range(4)]
    await asyncio.gather(*canc)
    await asyncio.sleep(0.1)
    vict = [call(session, base, "/v1/completions",
                 cmpl(words(p + "v%d" % i, 1000), 100, ignore_eos=True), p + "v%d" % i)
            for i in range(8)]
    await asyncio.gather(*vict, *fill)


async def w3(session, base, p):
    """decode batch with one min_tokens request"""
    tasks = [call(session, base, "/v1/completions",
                  cmpl(words(p + "d%d" % i, 50), 120, ignore_eos=True, stream=True), p + "d%d" % i)
             for i in range(16)]
    tasks.append(call(session, base, "/v1/completions",
                      cmpl(words(p + "m", 50), 120, min_tokens=100), p + "m"))
    await asyncio.gather(*tasks)


async def w4(session, base, p):
    """KV pressure -> preemption, with later arrivals"""
    tasks = [asyncio.ensure_future(call(session, base, "/v1/completions",
                                        cmpl(words(p + "k%d" % i, 1800), 120, ignore_eos=True),
                                        p + "k%d" % i)) for i in range(12)]
    await asyncio.sleep(0.4)
    tasks += [asyncio.ensure_future(call(session, base, "/v1/completions",
                                         cmpl(words(p + "l%d" % i, 1800), 40, ignore_eos=True),
                                         p + "l%d" % i)) for i in range(4)]
    await asyncio.gather(*tasks)


async def w5(session, base, p):
    """n>1 fan-out plus single requests"""
    tasks = [call(session, base, "/v1/completions",
                  cmpl(words(p + "n", 30), 80, n=8, ignore_eos=True), p + "n8")]
    await asyncio.sleep(0.005)
    tasks += [call(session, base, "/v1/completions",
                   cmpl(words(p + "o%d" % i, 30), 20, ignore_eos=True), p + "o%d" % i)
              for i in range(6)]
    await asyncio.gather(*tasks)


WORKLOADS = [("bug1", "W1-", w1), ("bug2", "W2-", w2), ("bug3", "W3-", w3),
             ("bug4", "W4-", w4), ("bug5", "W5-", w5)]


async def run_mode(bugs, gt):
    srv = Srv(bugs, gt)
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    results = {}
    try:
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            if not check(await srv.wait_ready(session), "server ready (%s)" % bugs):
                return results, 0
            if bugs == "none":
                await functional(session, srv.base, gt)
            for bug, prefix, fn in WORKLOADS:
                t0 = time.monotonic()
                await fn(session, srv.base, prefix)
                print("  %s workload %s done in %.2fs" % (bugs, prefix, time.monotonic() - t0),
                      flush=True)
                await asyncio.sleep(0.15)
            # SIGTERM with a request in flight
            inflight = asyncio.ensure_future(call(session, srv.base, "/v1/completions",
                                                  cmpl("sig term", 1000, ignore_eos=True),
                                                  "sigterm-inflight"))
            await asyncio.sleep(0.3)
            dt = srv.stop()
            check(dt < 1.5, "exit after SIGTERM within 1.5s (%.2fs)" % dt)
            try:
                await asyncio.wait_for(inflight, 3)
            except Exception:
                pass
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
    g = gt_lines(gt)
    check(g.get("sigterm-inflight", {}).get("finish_reason") == "abort", "GT line on SIGTERM")
    return g, 1


def main():
    t_start = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="simvllm-selftest-")
    gt_clean = os.path.join(tmp, "gt_clean.jsonl")
    gt_bugs = os.path.join(tmp, "gt_bugs.jsonl")

    print("== clean server (--bugs none)", flush=True)
    g0, ok = asyncio.run(run_mode("none", gt_clean))
    tagged = [r for r in g0.values() if r["pathologies"]]
    check(ok and not tagged, "no pathologies with --bugs none (%d tagged)" % len(tagged))
    check(all(r["finish_reason"] in ("stop", "length", "abort", "error") for r in g0.values()),
          "finish reasons valid")
    for bug, prefix, _ in WORKLOADS:
        check(any(k.startswith(prefix) for k in g0), "clean GT lines for %s" % prefix)

    print("== buggy server (--bugs all)", flush=True)
    g1, ok = asyncio.run(run_mode("all", gt_bugs))
    for bug, prefix, _ in WORKLOADS:
        rows = {k: v for k, v in g1.items() if k.startswith(prefix)}
        hit = [k for k, v in rows.items() if bug in v["pathologies"]]
        check(len(hit) > 0, "%s triggered and tagged by workload %s" % (bug, prefix))
        if hit:
            clean = [g0[k]["e2e_s"] for k in hit if k in g0]
            buggy = [g1[k]["e2e_s"] for k in hit]
            print("  %s: %d/%d requests tagged; tagged mean e2e clean %.3fs -> buggy %.3fs"
                  % (bug, len(hit), len(rows), sum(clean) / max(1, len(clean)),
                     sum(buggy) / len(buggy)), flush=True)
    allbugs = {"bug1", "bug2", "bug3", "bug4", "bug5"}
    check(all(set(v["pathologies"]) <= allbugs for v in g1.values()), "tag names valid")

    dt = time.monotonic() - t_start
    if FAILS:
        print("SELFTEST FAILED (%d failures) in %.1fs" % (len(FAILS), dt))
        sys.exit(1)
    print("SELFTEST PASSED in %.1fs" % dt)


if __name__ == "__main__":
    main()
