#!/usr/bin/env python3
"""Self-test for server.py.

For every planted bug: start the clean server and the server with only that
bug on (free loopback ports), run a small scenario that triggers it, and check
that the victim is materially slower with the bug, that the victim is tagged
in the ground truth, and that the clean server tagged nothing.  Then run a
random mixed load against the clean server (must tag nothing) and a short
robustness load against --bugs all.

Run:  nice -n 10 .venv/bin/python selftest.py [bug1 bug3 ...] [--no-mixed]
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
SERVER = os.path.join(HERE, "server.py")
PY = sys.executable
MIN_RATIO = 1.5


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Srv:
    def __init__(self, bugs, extra, tmpdir, tag):
        self.bugs = bugs
        self.extra = list(extra)
        self.port = free_port()
        self.base = "http://127.0.0.1:%d" % self.port
        self.gt_path = os.path.join(tmpdir, "gt-%s-%s.jsonl" % (tag, bugs))
        self.log_path = os.path.join(tmpdir, "log-%s-%s.txt" % (tag, bugs))
        self.proc = None

    async def __aenter__(self):
        self.log = open(self.log_path, "w")
        cmd = [PY, SERVER, "--port", str(self.port), "--bugs", self.bugs, "--seed", "1",
               "--ground-truth", self.gt_path] + self.extra
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 15
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                try:
                    async with s.get(self.base + "/health") as r:
                        if r.status == 200:
                            return self
                except aiohttp.ClientError:
                    pass
                if self.proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
        await self.__aexit__(None, None, None)
        raise RuntimeError("server did not start: " + open(self.log_path).read())

    async def __aexit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            for _ in range(50):
                if self.proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self.log.close()
        return False

    def gt(self):
        out = {}
        if os.path.exists(self.gt_path):
            with open(self.gt_path) as f:
                for line in f:
                    line = line.strip()
                    if line:
                        rec = json.loads(line)
                        out[rec["request_id"]] = rec
        return out

    async def wait_gt(self, rids, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            g = self.gt()
            if all(r in g for r in rids):
                return g
            await asyncio.sleep(0.1)
        return self.gt()

    async def wait_idle(self, s, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = await metrics(s, self.base)
            if m.get("vllm:num_requests_running", 1) == 0 and m.get("vllm:num_requests_waiting", 1) == 0:
                return m
            await asyncio.sleep(0.2)
        return await metrics(s, self.base)


async def metrics(s, base):
    async with s.get(base + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or "{" not in line:
            continue
        name = line.split("{", 1)[0]
        if name.endswith("_bucket"):
            continue
        try:
            out[name] = out.get(name, 0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            pass
    return out


def words(tag, n):
    return " ".join("%sw%d" % (tag, i) for i in range(n))


async def stream_req(s, base, path, body, rid, disconnect_after=None):
    """Streaming request; returns ttft (first token chunk) and e2e, client side."""
    body = dict(body)
    body["stream"] = True
    res = {"rid": rid, "ttft": None, "e2e": None, "chunks": 0, "status": None,
           "disconnected": False}
    t0 = time.monotonic()

    async def inner():
        async with s.post(base + path, json=body, headers={"X-Request-Id": rid}) as r:
            res["status"] = r.status
            if r.status != 200:
                await r.read()
                return
            try:
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    if b'"role"' in line:
                        continue
                    if b'"text"' in line or b'"content"' in line:
                        res["chunks"] += 1
                        if res["ttft"] is None:
                            res["ttft"] = time.monotonic() - t0
            finally:
                r.close()

    try:
        if disconnect_after is None:
            await inner()
        else:
            await asyncio.wait_for(inner(), disconnect_after)
    except asyncio.TimeoutError:
        res["disconnected"] = True
    res["e2e"] = time.monotonic() - t0
    return res


async def full_req(s, base, path, body, rid, disconnect_after=None):
    t0 = time.monotonic()
    res = {"rid": rid, "status": None, "e2e": None, "disconnected": False, "json": None}

    async def inner():
        async with s.post(base + path, json=body, headers={"X-Request-Id": rid}) as r:
            res["status"] = r.status
            try:
                res["json"] = await r.json(content_type=None)
            finally:
                r.close()

    try:
        if disconnect_after is None:
            await inner()
        else:
            await asyncio.wait_for(inner(), disconnect_after)
    except asyncio.TimeoutError:
        res["disconnected"] = True
    res["e2e"] = time.monotonic() - t0
    return res


def later(delay, coro):
    async def run():
        await asyncio.sleep(delay)
        return await coro
    return asyncio.create_task(run())


# ----------------------------------------------------------------------------
# Scenarios.  Each returns (victim_metric_seconds, victim_rids, extra_rids,
# description).  extra_rids: requests whose GT line must exist.
# ----------------------------------------------------------------------------
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"


async def sc_bug1(s, base):
    z = asyncio.create_task(stream_req(s, base, CMPL, {
        "prompt": words("z", 400), "max_tokens": 500, "ignore_eos": True, "n": 8},
        "b1-z", disconnect_after=0.4))
    await asyncio.sleep(1.0)
    v = await stream_req(s, base, CMPL, {"prompt": words("v", 5500), "max_tokens": 20,
                                         "ignore_eos": True}, "b1-v")
    await z
    return v["ttft"], ["b1-v"], ["b1-z"], "victim TTFT"


async def sc_bug2(s, base):
    tasks = []
    for i in range(3):
        tasks.append(later(0.03 * i, stream_req(s, base, CMPL, {
            "prompt": words("L%d" % i, 2000), "max_tokens": 200, "ignore_eos": True},
            "b2-L%d" % i)))
    for i in range(16):
        tasks.append(later(0.3 + 0.005 * i, stream_req(s, base, CMPL, {
            "prompt": words("Q%d" % i, 200), "max_tokens": 150, "ignore_eos": True},
            "b2-Q%d" % i)))
    res = await asyncio.gather(*tasks)
    return res[2]["e2e"], ["b2-L2"], [], "preempted request e2e"


async def sc_bug3(s, base):
    tasks = []
    for i in range(80):
        body = {"prompt": words("s%d" % i, 200), "max_tokens": 120, "ignore_eos": True}
        if i == 0:
            body["seed"] = 42
        tasks.append(later(0.002 * i, stream_req(s, base, CMPL, body, "b3-%d" % i)))
    res = await asyncio.gather(*tasks)
    e2es = sorted(r["e2e"] for r in res[1:])
    return e2es[len(e2es) // 2], ["b3-%d" % i for i in (1, 20, 40, 79)], [], \
        "median e2e of co-batched requests"


async def sc_bug4(s, base):
    P = words("p", 14000)
    a = await full_req(s, base, CMPL, {"prompt": P, "max_tokens": 4}, "b4-a")
    assert a["status"] == 200, a
    f = await full_req(s, base, CMPL, {"prompt": words("f", 10500), "max_tokens": 4}, "b4-f")
    assert f["status"] == 200, f
    c = await stream_req(s, base, CMPL, {"prompt": P + " " + words("c", 200),
                                         "max_tokens": 4}, "b4-c")
    return c["ttft"], ["b4-c"], [], "TTFT of prefix-reusing request"


async def sc_bug5(s, base):
    tasks = []
    for i in range(4):
        tasks.append(later(0.01 * i, stream_req(s, base, CMPL, {
            "prompt": words("lp%d" % i, 100), "max_tokens": 350, "ignore_eos": True,
            "logprobs": 20}, "b5-lp%d" % i)))
    tasks.append(later(1.5, stream_req(s, base, CMPL, {
        "prompt": words("v5", 100), "max_tokens": 100, "ignore_eos": True}, "b5-v")))
    res = await asyncio.gather(*tasks)
    return res[-1]["e2e"], ["b5-v"], [], "e2e of plain stream"


async def sc_bug6(s, base):
    tasks = []
    for i in range(6):
        tasks.append(later(0.002 * i, stream_req(s, base, CMPL, {
            "prompt": words("W%d" % i, 8000), "max_tokens": 50},
            "b6-W%d" % i, disconnect_after=0.1)))
    v = later(0.15, stream_req(s, base, CMPL, {"prompt": words("v6", 200), "max_tokens": 20,
                                               "ignore_eos": True}, "b6-v"))
    res = await asyncio.gather(*tasks)
    vr = await v
    return vr["ttft"], ["b6-v"], [r["rid"] for r in res], "victim TTFT"


async def sc_bug7(s, base):
    tasks = []
    for i in range(4):
        tasks.append(later(0.01 * i, stream_req(s, base, CMPL, {
            "prompt": words("F%d" % i, 2800), "max_tokens": 400, "ignore_eos": True},
            "b7-F%d" % i)))
    x = later(0.9, stream_req(s, base, CHAT, {"messages": [
        {"role": "user", "content": words("x7", 500)}]}, "b7-x"))
    y = later(1.0, stream_req(s, base, CMPL, {"prompt": words("y7", 100), "max_tokens": 20,
                                              "ignore_eos": True}, "b7-y"))
    await asyncio.gather(*tasks)
    xr = await x
    yr = await y
    return yr["e2e"], ["b7-y", "b7-x"], [], "e2e of short request queued behind"


SCENARIOS = {
    "bug1": (sc_bug1, ["--num-gpu-blocks", "400"]),
    "bug2": (sc_bug2, ["--num-gpu-blocks", "400", "--max-num-seqs", "3"]),
    "bug3": (sc_bug3, []),
    "bug4": (sc_bug4, ["--num-gpu-blocks", "1500"]),
    "bug5": (sc_bug5, []),
    "bug6": (sc_bug6, []),
    "bug7": (sc_bug7, ["--num-gpu-blocks", "1000"]),
}


async def run_scenario(bug, tmpdir):
    fn, extra = SCENARIOS[bug]
    out = {}
    for mode in ("none", bug):
        async with Srv(mode, extra, tmpdir, bug) as srv:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                t0 = time.monotonic()
                metric, victims, extra_rids, desc = await fn(s, srv.base)
                await srv.wait_idle(s, 60)
                g = await srv.wait_gt(victims + extra_rids, 30)
                out[mode] = (metric, victims, g, time.monotonic() - t0, desc)
    clean_metric, victims, g_clean, t_clean, desc = out["none"]
    bug_metric, _, g_bug, t_bug, _ = out[bug]
    problems = []
    tagged_clean = [r for r in g_clean.values() if r["pathologies"]]
    if tagged_clean:
        problems.append("clean server tagged %d requests: %s" % (len(tagged_clean), tagged_clean[:2]))
    for v in victims:
        rec = g_bug.get(v)
        if rec is None:
            problems.append("no GT line for victim %s" % v)
        elif bug not in rec["pathologies"]:
            problems.append("victim %s not tagged: %s" % (v, rec))
    others = [r for r in g_bug.values() if set(r["pathologies"]) - {bug}]
    if others:
        problems.append("other tags present: %s" % others[:2])
    if clean_metric is None or bug_metric is None:
        problems.append("missing metric")
        ratio = 0.0
    else:
        ratio = bug_metric / max(clean_metric, 1e-6)
        if ratio < MIN_RATIO:
            problems.append("victim not materially slower: %.3f vs %.3f" % (bug_metric, clean_metric))
    n_tagged = sum(1 for r in g_bug.values() if bug in r["pathologies"])
    return {"bug": bug, "desc": desc, "clean": clean_metric, "buggy": bug_metric,
            "ratio": ratio, "victim_tagged": all(bug in (g_bug.get(v) or {}).get("pathologies", [])
                                                for v in victims),
            "clean_tags": len(tagged_clean), "n_tagged_bug": n_tagged, "n_bug_lines": len(g_bug),
            "time": t_clean + t_bug, "problems": problems}


# ----------------------------------------------------------------------------
# Random mixed load
# ----------------------------------------------------------------------------
async def mixed_load(s, base, duration, seed, nclients=14):
    rng = random.Random(seed)
    systems = [words("sys%d" % k, rng.randint(300, 1500)) for k in range(3)]
    accepted = []
    errors = []
    counter = [0]

    async def client(cid):
        crng = random.Random(seed * 100 + cid)
        t_end = time.monotonic() + duration
        while time.monotonic() < t_end:
            counter[0] += 1
            rid = "mx-%d-%d" % (cid, counter[0])
            kind = crng.random()
            plen = int(crng.choice([20, 100, 400, 1500, 4000]) * crng.uniform(0.5, 1.0))
            body = {"max_tokens": crng.choice([1, 8, 32, 128, 400])}
            if crng.random() < 0.5:
                prefix = crng.choice(systems) + " "
            else:
                prefix = ""
            text = prefix + words("u%s" % rid, plen)
            if crng.random() < 0.3:
                body["ignore_eos"] = True
            if crng.random() < 0.2:
                body["n"] = crng.randint(2, 4)
            if crng.random() < 0.15:
                body["seed"] = crng.randint(0, 1000)
            if crng.random() < 0.1:
                body["temperature"] = 0.0
            if crng.random() < 0.1:
                body["min_tokens"] = min(body["max_tokens"], 5)
            if kind < 0.55:
                path = CMPL
                body["prompt"] = text
                if crng.random() < 0.1:
                    body["logprobs"] = crng.randint(0, 5)
            else:
                path = CHAT
                body["messages"] = [{"role": "system", "content": prefix},
                                    {"role": "user", "content": text}]
                if crng.random() < 0.1:
                    body["logprobs"] = True
                    body["top_logprobs"] = crng.randint(0, 5)
                if crng.random() < 0.05:
                    body.pop("max_tokens")
                    body["max_completion_tokens"] = 300
            disc = crng.uniform(0.05, 2.0) if crng.random() < 0.15 else None
            stream = crng.random() < 0.6
            if stream:
                body["stream_options"] = {"include_usage": crng.random() < 0.5}
                r = await stream_req(s, base, path, body, rid, disc)
            else:
                r = await full_req(s, base, path, body, rid, disc)
            if r["status"] == 200 or r["disconnected"]:
                accepted.append(rid)
            elif r["status"] is not None:
                errors.append((rid, r["status"]))
            await asyncio.sleep(crng.uniform(0, 0.3))

    await asyncio.gather(*[client(i) for i in range(nclients)])
    return accepted, errors


async def run_mixed(tmpdir, bugs="none", duration=20.0, tag="mixed"):
    async with Srv(bugs, ["--num-gpu-blocks", "1500"], tmpdir, tag) as srv:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            t0 = time.monotonic()
            accepted, errors = await mixed_load(s, srv.base, duration, 7)
            m = await srv.wait_idle(s, 90)
            g = await srv.wait_gt(accepted, 30)
            # a few protocol checks
            async with s.post(srv.base + "/tokenize", json={"prompt": "a b c"}) as r:
                tok = await r.json()
            async with s.post(srv.base + CMPL, json={"prompt": words("e", 30000),
                                                     "max_tokens": 3000}) as r:
                too_long = r.status
            t = time.monotonic() - t0
    tagged = [r for r in g.values() if r["pathologies"]]
    missing = [r for r in accepted if r not in g]
    disc = sum(1 for r in g.values() if r["client_disconnected"])
    problems = []
    if bugs == "none" and tagged:
        problems.append("clean server tagged %d requests, e.g. %s" % (len(tagged), tagged[:2]))
    if missing:
        problems.append("%d accepted requests have no GT line: %s" % (len(missing), missing[:3]))
    if errors:
        problems.append("unexpected HTTP errors: %s" % errors[:3])
    if m.get("vllm:num_requests_running", 1) != 0 or m.get("vllm:num_requests_waiting", 1) != 0:
        problems.append("server did not drain: %s" % m)
    if bugs == "none" and m.get("vllm:kv_cache_usage_perc", 1) != 0:
        problems.append("KV not released when idle: %s" % m.get("vllm:kv_cache_usage_perc"))
    if tok.get("count") != 3:
        problems.append("tokenize count wrong: %s" % tok)
    if too_long != 400:
        problems.append("over-long request not rejected with 400 (%s)" % too_long)
    return {"bugs": bugs, "requests": len(accepted), "gt_lines": len(g), "tagged": len(tagged),
            "disconnected": disc, "preemptions": m.get("vllm:num_preemptions_total"),
            "prefix_hit_rate": (m.get("vllm:prefix_cache_hits_total", 0) /
                                max(1.0, m.get("vllm:prefix_cache_queries_total", 0))),
            "time": t, "problems": problems}


async def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    bugs = [] if "--only-mixed" in sys.argv else (args or sorted(SCENARIOS))
    tmpdir = tempfile.mkdtemp(prefix="heldout3-selftest-")
    ok = True
    results = []
    for b in bugs:
        r = await run_scenario(b, tmpdir)
        results.append(r)
        status = "PASS" if not r["problems"] else "FAIL"
        ok &= not r["problems"]
        print("%s %s: %s clean %.3fs vs buggy %.3fs (x%.1f), victim tagged=%s, clean tags=%d, "
              "bug-tagged lines %d/%d [%.0fs]" % (
                  status, b, r["desc"], r["clean"] or -1, r["buggy"] or -1, r["ratio"],
                  r["victim_tagged"], r["clean_tags"], r["n_tagged_bug"], r["n_bug_lines"],
                  r["time"]), flush=True)
        for p in r["problems"]:
            print("    problem:", p, flush=True)
    if "--no-mixed" not in sys.argv:
        for bugs_mode, dur, tag in (("none", 20.0, "mixed"), ("all", 8.0, "mixed-all")):
            r = await run_mixed(tmpdir, bugs_mode, dur, tag)
            status = "PASS" if not r["problems"] else "FAIL"
            ok &= not r["problems"]
            print("%s mixed load (--bugs %s): %d requests, %d GT lines, %d tagged, %d disconnected, "
                  "%s preemptions, prefix hit rate %.2f [%.0fs]" % (
                      status, bugs_mode, r["requests"], r["gt_lines"], r["tagged"],
                      r["disconnected"], r["preemptions"], r["prefix_hit_rate"], r["time"]),
                  flush=True)
            for p in r["problems"]:
                print("    problem:", p, flush=True)
    print("logs and ground truth in", tmpdir)
    print("OVERALL:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
