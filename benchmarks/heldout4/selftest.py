#!/usr/bin/env python3
"""Self-test for server.py.

For every planted fault: start the clean server and a server with only that
fault, run a short triggering scenario against both at once, and check that the
victim is >= 1.5x slower with the fault, that the victim is tagged in the
ground truth, and that the clean server tagged nothing.  Then run a 20 s random
mixed load on the clean server (no tags, no errors) and an 8 s load against
--bugs all (robustness).

Run:  nice -n 10 .venv/bin/python selftest.py [bug3 bug5 ...] [--skip-load]
"""
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable
MODEL = "meta-llama/Llama-3.1-8B-Instruct-FP8"
RATIO = 1.5


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class ServerProc:
    def __init__(self, bugs, extra, tmpdir, label):
        self.port = free_port()
        self.gt = os.path.join(tmpdir, "gt-%s-%d.jsonl" % (label, self.port))
        self.log = open(os.path.join(tmpdir, "log-%s-%d.txt" % (label, self.port)), "w")
        cmd = [PY, os.path.join(HERE, "server.py"), "--port", str(self.port), "--bugs", bugs,
               "--seed", "1", "--ground-truth", self.gt] + list(extra)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.base = "http://127.0.0.1:%d" % self.port

    async def wait_ready(self, timeout=15):
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s:
            while time.monotonic() - t0 < timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError("server exited early (rc=%s)" % self.proc.returncode)
                try:
                    async with s.get(self.base + "/health") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError("server not ready")

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(5)
        self.log.close()

    def records(self):
        out = {}
        if os.path.exists(self.gt):
            with open(self.gt) as f:
                for line in f:
                    line = line.strip()
                    if line:
                        d = json.loads(line)
                        out[d["request_id"]] = d
        return out


def words(n, tag):
    return " ".join("%s%d" % (tag, i) for i in range(n))


async def request(session, base, rid, body, chat=False, cancel_after=None):
    """Send one request; returns a result dict with client-side timings."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = dict(body)
    body.setdefault("model", MODEL)
    res = {"rid": rid, "status": None, "ttft": None, "gaps": [], "e2e": None, "error": None,
           "cancelled": False, "done": False, "text": ""}
    t0 = time.monotonic()

    async def go():
        async with session.post(base + path, json=body, headers={"X-Request-Id": rid}) as r:
            res["status"] = r.status
            if r.headers.get("X-Request-Id") != rid:
                res["error"] = "X-Request-Id not echoed"
            if not body.get("stream"):
                data = await r.json()
                if r.status == 200:
                    ch = data["choices"]
                    res["text"] = ch[0].get("text") or ch[0].get("message", {}).get("content")
                    res["done"] = True
                else:
                    res["error"] = "status %d: %s" % (r.status, data)
                return
            last = None
            async for raw in r.content:
                line = raw.decode().strip()
                if not line:
                    continue
                if not line.startswith("data: "):
                    res["error"] = "bad SSE line %r" % line[:80]
                    return
                payload = line[6:]
                if payload == "[DONE]":
                    res["done"] = True
                    break
                d = json.loads(payload)
                got = False
                for c in d.get("choices", []):
                    if c.get("text") or (c.get("delta") or {}).get("content"):
                        got = True
                if got:
                    now = time.monotonic()
                    if res["ttft"] is None:
                        res["ttft"] = now - t0
                    else:
                        res["gaps"].append(now - last)
                    last = now
            if not res["done"]:
                res["error"] = "stream ended without [DONE]"

    try:
        if cancel_after is not None:
            try:
                await asyncio.wait_for(go(), cancel_after)
            except asyncio.TimeoutError:
                res["cancelled"] = True
        else:
            await go()
    except Exception as e:  # noqa
        res["error"] = "%s: %s" % (type(e).__name__, e)
    res["e2e"] = time.monotonic() - t0
    return res


async def later(delay, coro):
    await asyncio.sleep(delay)
    return await coro


async def wait_record(srv, rid, timeout=15.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        r = srv.records().get(rid)
        if r:
            return r
        await asyncio.sleep(0.1)
    return None


# ---------------------------------------------------------------------------
# Scenarios.  Each returns (victim_metric_seconds, [victim request ids]).
# ---------------------------------------------------------------------------
async def sc_bug1(srv, s):
    body = {"prompt": words(40, "a"), "max_tokens": 150, "ignore_eos": True, "stream": False}
    await request(s, srv.base, "v1", body, cancel_after=0.6)
    rec = await wait_record(srv, "v1", 15)
    return (rec["e2e_s"] if rec else 99.0), ["v1"]


async def sc_bug2(srv, s):
    v = request(s, srv.base, "v2", {"prompt": words(20, "b"), "max_tokens": 60,
                                     "ignore_eos": True, "stream": True})
    o = request(s, srv.base, "lp2", {"prompt": words(20, "c"), "max_tokens": 60,
                                      "ignore_eos": True, "logprobs": 5})
    rv, _ = await asyncio.gather(v, o)
    return rv["e2e"], ["v2"]


async def sc_bug3(srv, s):
    v = request(s, srv.base, "v3", {"prompt": words(20, "d"), "max_tokens": 60,
                                     "ignore_eos": True, "stream": True})
    o = later(0.4, request(s, srv.base, "long3", {"prompt": words(6000, "e"), "max_tokens": 2,
                                                   "ignore_eos": True}))
    rv, _ = await asyncio.gather(v, o)
    return max(rv["gaps"] or [99.0]), ["v3"]


async def sc_bug4(srv, s):
    v = request(s, srv.base, "v4", {"prompt": words(300, "f"), "max_tokens": 120,
                                     "ignore_eos": True, "stream": True})
    others = [later(0.3 + 0.02 * i, request(s, srv.base, "o4-%d" % i,
                                            {"prompt": words(200, "g%d_" % i), "max_tokens": 120,
                                             "ignore_eos": True}))
              for i in range(3)]
    res = await asyncio.gather(v, *others)
    return res[0]["e2e"], ["v4"]


async def sc_bug5(srv, s):
    pfx = words(200, "p")
    tasks = [request(s, srv.base, "w5-%d" % i, {"prompt": pfx + " " + words(10, "u%d_" % i),
                                                "max_tokens": 40, "ignore_eos": True})
             for i in range(4)]
    tasks.append(later(0.3, request(s, srv.base, "v5", {"prompt": words(210, "q"),
                                                         "max_tokens": 10, "ignore_eos": True})))
    for i in range(4, 16):
        tasks.append(later(0.4 + 0.01 * i, request(
            s, srv.base, "w5-%d" % i, {"prompt": pfx + " " + words(10, "u%d_" % i),
                                       "max_tokens": 40, "ignore_eos": True})))
    res = await asyncio.gather(*tasks)
    return res[4]["e2e"], ["v5"]


async def sc_bug6(srv, s):
    r = await request(s, srv.base, "v6", {"prompt": words(30, "h"), "max_tokens": 40, "n": 3,
                                           "ignore_eos": True, "stream": True,
                                           "stream_options": {"include_usage": True}})
    return r["e2e"], ["v6"]


async def sc_bug7(srv, s):
    await request(s, srv.base, "l7", {"prompt": words(3900, "i"), "max_tokens": 5,
                                      "ignore_eos": True, "stream": True}, cancel_after=0.2)
    await asyncio.sleep(0.4)
    r = await request(s, srv.base, "v7", {"prompt": words(2800, "j"), "max_tokens": 20,
                                           "ignore_eos": True, "stream": True})
    return r["e2e"], ["v7"]


async def sc_bug8(srv, s):
    bg = request(s, srv.base, "bg8", {"prompt": words(20, "k"), "max_tokens": 100,
                                       "ignore_eos": True, "stream": True})
    burst = [later(0.5, request(s, srv.base, "v8-%d" % i,
                                {"messages": [{"role": "user", "content": words(25, "m%d_" % i)}],
                                 "max_tokens": 8, "ignore_eos": True, "stream": True}, chat=True))
             for i in range(6)]
    res = await asyncio.gather(bg, *burst)
    ttfts = [r["ttft"] if r["ttft"] is not None else 99.0 for r in res[1:]]
    return sum(ttfts) / len(ttfts), ["v8-%d" % i for i in range(6)]


SCENARIOS = {
    "bug1": (sc_bug1, []),
    "bug2": (sc_bug2, []),
    "bug3": (sc_bug3, []),
    "bug4": (sc_bug4, ["--num-gpu-blocks", "60", "--max-model-len", "800", "--max-num-seqs", "8"]),
    "bug5": (sc_bug5, ["--max-num-seqs", "4"]),
    "bug6": (sc_bug6, []),
    "bug7": (sc_bug7, ["--num-gpu-blocks", "300", "--max-num-batched-tokens", "512",
                       "--max-model-len", "4000"]),
    "bug8": (sc_bug8, []),
}


async def run_bug(name, tmpdir):
    fn, extra = SCENARIOS[name]
    clean = ServerProc("none", extra, tmpdir, "clean-" + name)
    bug = ServerProc(name, extra, tmpdir, name)
    try:
        await asyncio.gather(clean.wait_ready(), bug.wait_ready())
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=90)) as s:
            (mc, vic), (mb, _) = await asyncio.gather(fn(clean, s), fn(bug, s))
        await asyncio.sleep(0.5)
        rc, rb = clean.records(), bug.records()
    finally:
        clean.stop()
        bug.stop()
    problems = []
    ratio = mb / mc if mc > 0 else float("inf")
    if ratio < RATIO:
        problems.append("victim only %.2fx slower (clean %.3fs, bug %.3fs)" % (ratio, mc, mb))
    untagged = [v for v in vic if name not in rb.get(v, {}).get("pathologies", [])]
    if untagged:
        problems.append("victims not tagged: %s" % untagged)
    ctags = {k: v["pathologies"] for k, v in rc.items() if v["pathologies"]}
    if ctags:
        problems.append("clean server tagged: %s" % ctags)
    other = {k: v["pathologies"] for k, v in rb.items() if set(v["pathologies"]) - {name}}
    if other:
        problems.append("foreign tags: %s" % other)
    status = "PASS" if not problems else "FAIL"
    print("%-5s %s  clean=%.3fs bug=%.3fs ratio=%.2f tagged=%d/%d  %s"
          % (name, status, mc, mb, ratio, len(vic) - len(untagged), len(vic),
             "; ".join(problems)), flush=True)
    return not problems


# ---------------------------------------------------------------------------
# Random mixed load
# ---------------------------------------------------------------------------
def random_body(rng, prefixes):
    chat = rng.random() < 0.45
    kind = rng.random()
    if kind < 0.35:
        text = rng.choice(prefixes) + " " + words(rng.randint(5, 60), "r%d_" % rng.randrange(10 ** 6))
    elif kind < 0.45:
        text = words(rng.randint(2500, 5000), "L%d_" % rng.randrange(10 ** 6))
    else:
        text = words(rng.randint(3, 400), "x%d_" % rng.randrange(10 ** 6))
    body = {"max_tokens": rng.randint(4, 100), "stream": rng.random() < 0.6,
            "n": rng.choice([1, 1, 1, 1, 2, 3, 4]), "temperature": rng.choice([0, 0.7, 1.0])}
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 1000)
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": text}]
        if rng.random() < 0.25:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 5)
    else:
        body["prompt"] = text
        if rng.random() < 0.25:
            body["logprobs"] = rng.randint(0, 5)
    return body, chat


async def random_load(bugs, duration, seed, tmpdir, extra=()):
    srv = ServerProc(bugs, list(extra), tmpdir, "load-" + bugs)
    rng = random.Random(seed)
    prefixes = [words(rng.randint(100, 400), "P%d_" % i) for i in range(3)]
    problems = []
    sent = []
    try:
        await srv.wait_ready()
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
            tasks = []
            t0 = time.monotonic()
            i = 0
            while time.monotonic() - t0 < duration:
                body, chat = random_body(rng, prefixes)
                cancel = rng.uniform(0.05, 2.0) if rng.random() < 0.15 else None
                rid = "load-%d" % i
                i += 1
                sent.append(rid)
                tasks.append(asyncio.ensure_future(request(s, srv.base, rid, body, chat, cancel)))
                if rng.random() < 0.1:
                    for j in range(rng.randint(3, 8)):
                        body, chat = random_body(rng, prefixes)
                        rid = "load-%d" % i
                        i += 1
                        sent.append(rid)
                        tasks.append(asyncio.ensure_future(request(s, srv.base, rid, body, chat)))
                await asyncio.sleep(rng.expovariate(3.0))
            results = await asyncio.gather(*tasks)
            async with s.get(srv.base + "/metrics") as r:
                mtext = await r.text()
                if r.status != 200 or "vllm:num_requests_running" not in mtext:
                    problems.append("metrics endpoint broken")
        for r in results:
            if r["cancelled"]:
                continue
            if r["error"] or r["status"] != 200 or not r["done"]:
                problems.append("%s: status=%s error=%s" % (r["rid"], r["status"], r["error"]))
        if not srv.alive():
            problems.append("server died")
        if bugs == "none":
            t1 = time.monotonic()
            while time.monotonic() - t1 < 10 and len(srv.records()) < len(sent):
                await asyncio.sleep(0.2)
            recs = srv.records()
            missing = [x for x in sent if x not in recs]
            if missing:
                problems.append("no ground truth for %d requests, e.g. %s" % (len(missing), missing[:3]))
            tagged = {k: v["pathologies"] for k, v in recs.items() if v["pathologies"]}
            if tagged:
                problems.append("clean server tagged %s" % tagged)
            for x in results:
                rec = recs.get(x["rid"])
                if rec and x["cancelled"] != rec["client_disconnected"] and not x["cancelled"]:
                    problems.append("%s: spurious client_disconnected" % x["rid"])
    finally:
        srv.stop()
    ncancel = sum(1 for r in results if r["cancelled"]) if 'results' in dir() else 0
    status = "PASS" if not problems else "FAIL"
    print("load --bugs %-4s %s  %d requests (%d cancelled by client) in %.0fs  %s"
          % (bugs, status, len(sent), ncancel, duration, "; ".join(problems[:5])), flush=True)
    return not problems


async def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    skip_load = "--skip-load" in sys.argv
    names = args or list(SCENARIOS)
    t0 = time.monotonic()
    ok = True
    with tempfile.TemporaryDirectory(prefix="h4selftest-") as tmpdir:
        for n in names:
            try:
                ok &= await run_bug(n, tmpdir)
            except Exception as e:  # noqa
                print("%-5s FAIL  exception %s: %s" % (n, type(e).__name__, e), flush=True)
                ok = False
        if not skip_load:
            ok &= await random_load("none", 20, 42, tmpdir)
            ok &= await random_load("all", 8, 43, tmpdir)
    print("selftest %s in %.1fs" % ("PASSED" if ok else "FAILED", time.monotonic() - t0))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
