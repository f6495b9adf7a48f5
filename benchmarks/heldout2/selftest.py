#!/usr/bin/env python3
"""Self-test for server.py.

For every planted bug: start the server clean and with that bug alone (same engine flags),
replay a small handcrafted scenario, and check that
  (a) the victim is materially slower with the bug (>= 1.5x and >= 50 ms slower),
  (b) the ground truth of the buggy run tags the victim with the bug,
  (c) the ground truth of the clean run tags nothing.
Finally a scenario-free random mixed load is replayed against the clean server, whose ground
truth must tag nothing (and the same load against --bugs all must keep the server alive).

Usage: selftest.py [bug1 bug3 ... | clean]
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
PY = os.path.join(HERE, ".venv", "bin", "python")
if not os.path.exists(PY):
    PY = sys.executable
SERVER = os.path.join(HERE, "server.py")
PROCS = []


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def start_server(bugs, extra, gt, log):
    port = free_port()
    cmd = [PY, SERVER, "--port", str(port), "--bugs", bugs, "--seed", "7",
           "--ground-truth", gt] + list(extra)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    PROCS.append(proc)
    deadline = time.time() + 15
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, port
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("server exited early: %s" % " ".join(cmd))
            time.sleep(0.05)
    raise RuntimeError("server did not start")


def stop_server(proc):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(5)
    if proc in PROCS:
        PROCS.remove(proc)


_WORD_CTR = [0]


def words(n, tag="", start=None):
    """n distinct whitespace-separated words (= n tokens).  Without `start`, every call uses
    fresh words, so prompts share no prefix unless the scenario wants them to."""
    if start is None:
        start = _WORD_CTR[0]
        _WORD_CTR[0] += n
    w = ["w%d" % (start + i) for i in range(n)]
    if tag:
        w[-1] = tag
    return " ".join(w)


class Client:
    def __init__(self, port):
        self.port = port
        self.base = "http://127.0.0.1:%d" % port
        self.session = None

    async def __aenter__(self):
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=120))
        return self

    async def __aexit__(self, *a):
        await self.session.close()

    async def send(self, path, body, rid, delay=0.0):
        if delay:
            await asyncio.sleep(delay)
        t0 = time.monotonic()
        ttft = None
        ntok = 0
        async with self.session.post(self.base + path, json=body,
                                     headers={"X-Request-Id": rid}) as resp:
            if resp.status != 200:
                txt = await resp.text()
                raise RuntimeError("HTTP %d: %s" % (resp.status, txt[:200]))
            if body.get("stream"):
                async for line in resp.content:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    for ch in obj.get("choices", []):
                        txt = ch.get("text")
                        if txt is None:
                            txt = (ch.get("delta") or {}).get("content")
                        if txt:
                            ntok += len(txt.split())
                            if ttft is None:
                                ttft = time.monotonic() - t0
            else:
                await resp.json()
        e2e = time.monotonic() - t0
        return {"rid": rid, "e2e": e2e, "ttft": ttft if ttft is not None else e2e, "ntok": ntok}

    async def send_and_drop(self, path, body, rid, after, delay=0.0):
        """Send a request on a raw socket and close the socket after `after` seconds."""
        if delay:
            await asyncio.sleep(delay)
        r, w = await asyncio.open_connection("127.0.0.1", self.port)
        data = json.dumps(body).encode()
        head = ("POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                "X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n" % (path, rid, len(data)))
        w.write(head.encode() + data)
        await w.drain()
        await asyncio.sleep(after)
        w.transport.abort()
        return {"rid": rid}


def cmpl(prompt, max_tokens, stream=True, **kw):
    b = {"model": "simllm-8b", "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
         "ignore_eos": True}
    b.update(kw)
    return b


async def warmup(c, n=3, big=2500):
    # warm the shapes a scenario will use (the clean engine's one-time warm-up is legitimate)
    for i in range(n):
        await asyncio.gather(*[c.send("/v1/completions", cmpl(words(20 + 40 * j, "wu%d_%d" % (i, j)), 8),
                                      "warm-%d-%d" % (i, j)) for j in range(4)])
    if big:
        await c.send("/v1/completions", cmpl(words(big, "wubig"), 4), "warm-big")


# ------------------------------------------------------------------------------ scenarios
async def scen_bug1(c):
    await warmup(c)
    tasks = [c.send("/v1/completions", cmpl(words(64, "s1v"), 150, temperature=1.0), "b1-victim")]
    for i in range(23):
        tasks.append(c.send("/v1/completions", cmpl(words(64, "s1o%d" % i), 150, temperature=1.0),
                            "b1-other-%d" % i))
    tasks.append(c.send("/v1/completions", cmpl(words(64, "s1seed"), 150, temperature=0.8, seed=1234),
                        "b1-seeded"))
    res = await asyncio.gather(*tasks)
    return {"victim": "b1-victim", "lat": res[0]["e2e"], "metric": "e2e"}


async def scen_bug2(c):
    await warmup(c)
    drops = [c.send_and_drop("/v1/completions", cmpl(words(32, "z%d" % i), 500, stream=False),
                             "b2-gaveup-%d" % i, after=0.3) for i in range(4)]
    victim = c.send("/v1/completions", cmpl(words(32, "s2v"), 20), "b2-victim", delay=0.6)
    res = await asyncio.gather(victim, *drops)
    return {"victim": "b2-victim", "lat": res[0]["e2e"], "metric": "e2e",
            "wait_for": ["b2-gaveup-%d" % i for i in range(4)],
            "check": check_bug2}


def check_bug2(gt, buggy):
    ok = True
    for i in range(4):
        rec = gt.get("b2-gaveup-%d" % i)
        if rec is None or not rec["client_disconnected"]:
            return False
        if buggy:
            ok &= rec["finish_reason"] == "length" and "bug2" in rec["pathologies"]
        else:
            ok &= rec["finish_reason"] == "abort" and not rec["pathologies"]
    return ok


async def scen_bug3(c):
    await warmup(c, big=600)
    a = c.send("/v1/completions", cmpl(words(700, "s3a"), 200), "b3-A")
    b = c.send("/v1/completions", cmpl(words(300, "s3b"), 300), "b3-victim", delay=0.05)
    ws = [c.send("/v1/completions", cmpl(words(480, "s3w%d" % i), 140), "b3-w%d" % i,
                 delay=0.3 + 0.01 * i) for i in range(10)]
    res = await asyncio.gather(b, a, *ws)
    return {"victim": "b3-victim", "lat": res[0]["e2e"], "metric": "e2e"}


async def scen_bug4(c):
    await warmup(c)
    for i in range(3):
        await c.send("/v1/completions", cmpl(words(50, "s4p%d" % i), 10), "b4-pre-%d" % i)
    await asyncio.sleep(3.6)
    r = await c.send("/v1/completions", cmpl(words(50, "s4v"), 10), "b4-victim")
    return {"victim": "b4-victim", "lat": r["e2e"], "metric": "e2e"}


async def scen_bug5(c):
    await warmup(c)
    prefix = words(6000, start=10**7)
    a = c.send("/v1/completions", cmpl(prefix + " s5a", 300), "b5-A")
    b = c.send("/v1/completions", cmpl(prefix + " s5b", 8), "b5-victim", delay=0.6)
    res = await asyncio.gather(b, a)
    return {"victim": "b5-victim", "lat": res[0]["ttft"], "metric": "ttft"}


async def scen_bug6(c):
    await warmup(c)
    r1 = c.send("/v1/completions", cmpl(words(50, "s6r"), 700), "b6-R")
    lg = c.send("/v1/completions", cmpl(words(3000, "s6l"), 600), "b6-L", delay=0.1)
    v = c.send("/v1/completions", cmpl(words(50, "s6v"), 20), "b6-victim", delay=0.5)
    res = await asyncio.gather(v, r1, lg)
    return {"victim": "b6-victim", "lat": res[0]["e2e"], "metric": "e2e"}


async def scen_bug7(c):
    await warmup(c)
    drops = [c.send_and_drop("/v1/completions", cmpl(words(3000, "s7x%d" % i), 10),
                             "b7-drop-%d" % i, after=0.03) for i in range(3)]
    v = c.send("/v1/completions", cmpl(words(2500, "s7v"), 10), "b7-victim", delay=0.3)
    res = await asyncio.gather(v, *drops)
    return {"victim": "b7-victim", "lat": res[0]["e2e"], "metric": "e2e",
            "wait_for": ["b7-drop-%d" % i for i in range(3)]}


async def scen_bug8(c):
    await warmup(c)
    lps = [c.send("/v1/completions", cmpl(words(40, "s8l%d" % i), 600, logprobs=5), "b8-lp%d" % i)
           for i in range(4)]
    v = c.send("/v1/completions", cmpl(words(40, "s8v"), 20), "b8-victim", delay=2.5)
    res = await asyncio.gather(v, *lps)
    return {"victim": "b8-victim", "lat": res[0]["e2e"], "metric": "e2e"}


SCENARIOS = {
    "bug1": (scen_bug1, []),
    "bug2": (scen_bug2, ["--max-num-seqs", "4"]),
    "bug3": (scen_bug3, ["--num-gpu-blocks", "80", "--max-model-len", "1280"]),
    "bug4": (scen_bug4, []),
    "bug5": (scen_bug5, []),
    "bug6": (scen_bug6, []),
    "bug7": (scen_bug7, ["--num-gpu-blocks", "256", "--max-model-len", "4096"]),
    "bug8": (scen_bug8, []),
}


def read_gt(path):
    out = {}
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    rec = json.loads(line)
                    out[rec["request_id"]] = rec
    except FileNotFoundError:
        pass
    return out


async def run_once(bugs, fn, extra, tmp, label):
    gt = os.path.join(tmp, "gt-%s.jsonl" % label)
    logf = open(os.path.join(tmp, "log-%s.txt" % label), "w")
    proc, port = start_server(bugs, extra, gt, logf)
    try:
        async with Client(port) as c:
            res = await asyncio.wait_for(fn(c), 60)
        need = [res["victim"]] + res.get("wait_for", [])
        deadline = time.time() + 20
        while time.time() < deadline:
            g = read_gt(gt)
            if all(r in g for r in need):
                break
            await asyncio.sleep(0.1)
        res["gt"] = read_gt(gt)
    finally:
        stop_server(proc)
        logf.close()
    return res


async def test_bug(bug, tmp):
    fn, extra = SCENARIOS[bug]
    clean = await run_once("none", fn, extra, tmp, bug + "-clean")
    buggy = await run_once(bug, fn, extra, tmp, bug + "-buggy")
    v = clean["victim"]
    lc, lb = clean["lat"], buggy["lat"]
    vrec = buggy["gt"].get(v, {})
    tagged = bug in vrec.get("pathologies", [])
    clean_tags = sorted({p for rec in clean["gt"].values() for p in rec["pathologies"]})
    slower = lb >= 1.5 * lc and lb - lc >= 0.05
    extra_ok = True
    if "check" in clean:
        extra_ok = clean["check"](clean["gt"], False) and buggy["check"](buggy["gt"], True)
    ok = slower and tagged and not clean_tags and extra_ok
    print("%-5s victim %s: clean %.3f s, buggy %.3f s (x%.1f); victim tagged: %s; "
          "clean run tags: %s%s -> %s"
          % (bug, clean["metric"], lc, lb, lb / max(lc, 1e-9), "yes" if tagged else "no",
             ",".join(clean_tags) or "none",
             "" if "check" not in clean else "; disconnect records ok: %s" % extra_ok,
             "PASS" if ok else "FAIL"), flush=True)
    return ok


async def random_load(c, seed, duration=12.0):
    rng = random.Random(seed)
    prefixes = [words(rng.randint(200, 3000), start=2 * 10**7 + 10000 * k) for k in range(3)]
    tasks = []
    t0 = time.monotonic()
    i = 0
    while time.monotonic() - t0 < duration:
        i += 1
        rid = "rnd-%d" % i
        kind = rng.random()
        body = {"max_tokens": rng.choice([1, 4, 16, 64, 128, 300]),
                "stream": rng.random() < 0.7}
        if rng.random() < 0.3:
            body["ignore_eos"] = True
        if rng.random() < 0.15:
            body["n"] = rng.randint(2, 4)
        if rng.random() < 0.15:
            body["seed"] = rng.randint(0, 99)
        if rng.random() < 0.2:
            body["temperature"] = 0.0
        if rng.random() < 0.5 and body["stream"]:
            body["stream_options"] = {"include_usage": True}
        plen = rng.choice([8, 30, 120, 500, 1500, 4000])
        text = words(plen, "r%d" % i)
        if rng.random() < 0.3:
            text = rng.choice(prefixes) + " " + text
        if kind < 0.7:
            path = "/v1/completions"
            body["prompt"] = text
            if rng.random() < 0.15:
                body["logprobs"] = rng.randint(0, 5)
        else:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "system", "content": "be brief"},
                                {"role": "user", "content": text}]
            if rng.random() < 0.15:
                body["logprobs"] = True
                body["top_logprobs"] = rng.randint(0, 5)
        if rng.random() < 0.1:
            tasks.append(asyncio.ensure_future(
                c.send_and_drop(path, body, rid, after=rng.uniform(0.005, 1.0))))
        else:
            tasks.append(asyncio.ensure_future(c.send(path, body, rid)))
        await asyncio.sleep(rng.expovariate(12.0))
    res = await asyncio.gather(*tasks, return_exceptions=True)
    errs = [r for r in res if isinstance(r, Exception)]
    return i, errs


async def test_clean_random(tmp):
    ok = True
    for bugs in ("none", "all"):
        gt = os.path.join(tmp, "gt-random-%s.jsonl" % bugs)
        logf = open(os.path.join(tmp, "log-random-%s.txt" % bugs), "w")
        proc, port = start_server(bugs, [], gt, logf)
        try:
            async with Client(port) as c:
                n, errs = await random_load(c, 99)
            await asyncio.sleep(1.0)
            alive = proc.poll() is None
        finally:
            stop_server(proc)
            logf.close()
        g = read_gt(gt)
        tags = {}
        for rec in g.values():
            for p in rec["pathologies"]:
                tags[p] = tags.get(p, 0) + 1
        if bugs == "none":
            good = not tags and not errs and alive
            ok &= good
            print("clean random mixed load: %d requests, %d ground-truth lines, %d client errors, "
                  "tags: %s -> %s" % (n, len(g), len(errs), tags or "none", "PASS" if good else "FAIL"),
                  flush=True)
        else:
            good = alive and not errs
            ok &= good
            print("smoke (--bugs all, same load): %d requests, %d ground-truth lines, %d client "
                  "errors, server alive: %s -> %s" % (n, len(g), len(errs), alive,
                                                        "PASS" if good else "FAIL"), flush=True)
        if errs:
            print("   first error:", repr(errs[0])[:300])
    return ok


async def main():
    which = sys.argv[1:] or list(SCENARIOS) + ["clean"]
    tmp = tempfile.mkdtemp(prefix="simllm-selftest-")
    print("logs and ground truth in", tmp, flush=True)
    ok = True
    for w in which:
        if w == "clean":
            ok &= await test_clean_random(tmp)
        else:
            ok &= await test_bug(w, tmp)
    print("ALL PASS" if ok else "SOME FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    rc = 1
    try:
        rc = asyncio.run(main())
    finally:
        for p in list(PROCS):
            stop_server(p)
    sys.exit(rc)
