#!/usr/bin/env python3
"""Standalone self-test for server.py (needs only aiohttp).

For each planted bug: start the server with --bugs none and with --bugs <name>
(same flags), replay a small handcrafted request mix that triggers the bug,
and compare the victim's latency; check the ground-truth tags (victim tagged
with the bug in the buggy run, nothing tagged in any clean run).
"""
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.join(HERE, "server.py")
SCENARIO_TIMEOUT = 25.0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, bugs, flags, gt_path, log_path):
        self.bugs, self.flags, self.gt, self.log_path = bugs, flags, gt_path, log_path
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.startup_s = None

    async def __aenter__(self):
        self.log = open(self.log_path, "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, SERVER, "--port", str(self.port), "--bugs", self.bugs, "--seed", "1",
             "--ground-truth", self.gt, *self.flags],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        async with aiohttp.ClientSession() as s:
            while time.monotonic() - t0 < 10:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited early, see {self.log_path}")
                try:
                    async with s.get(self.base + "/health") as r:
                        if r.status == 200:
                            self.startup_s = time.monotonic() - t0
                            return self
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        raise RuntimeError("server did not become healthy")

    async def __aexit__(self, *exc):
        self.stop()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(3)
                raise RuntimeError("server did not exit on SIGTERM")
        self.log.close()


def ids(n, seed):
    r = random.Random(seed)
    return [r.randrange(300, 1500) for _ in range(n)]


def cmpl(prompt, max_tokens, stream=False, **kw):
    return {"model": "heldout-7b", "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
            "ignore_eos": True, **kw}


async def call(sess, base, rid, body, delay=0.0, cancel_after=None, disconnect_after_tokens=None):
    """Send one request; return timings of content-bearing chunks (relative to send)."""
    if delay:
        await asyncio.sleep(delay)
    t0 = time.monotonic()
    res = {"rid": rid, "times": [], "status": None, "done": False}

    async def go():
        async with sess.post(base + "/v1/completions", json=body, headers={"X-Request-Id": rid}) as resp:
            res["status"] = resp.status
            if not body.get("stream"):
                await resp.read()
                res["times"].append(time.monotonic() - t0)
                res["done"] = True
                return
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    res["done"] = True
                    break
                for ch in json.loads(data).get("choices", []):
                    if ch.get("text"):
                        res["times"].append(time.monotonic() - t0)
                if disconnect_after_tokens and len(res["times"]) >= disconnect_after_tokens:
                    resp.close()
                    return

    if cancel_after is not None:
        try:
            await asyncio.wait_for(go(), cancel_after)
        except asyncio.TimeoutError:
            pass
    else:
        await go()
    t = res["times"]
    res["ttft"] = t[0] if t else None
    res["e2e"] = t[-1] if t else None
    res["max_gap"] = max((b - a for a, b in zip(t, t[1:])), default=None)
    return res


async def running_now(sess, base):
    async with sess.get(base + "/metrics") as r:
        m = re.search(r'^vllm:num_requests_running\{[^}]*\} ([0-9.]+)', await r.text(), re.M)
        return float(m.group(1))


# ---------------------------------------------------------------- scenarios
# Each returns (victim result dict, info dict).

async def sc_bug1(sess, base):
    pre = ids(512, 11)
    tasks = [call(sess, base, f"blk{i}", cmpl(pre + ids(20, 100 + i), 150 + 50 * i), delay=0.0) for i in range(4)]
    victim = call(sess, base, "victim", cmpl(ids(300, 7), 30, stream=True), delay=0.15)
    tasks += [call(sess, base, f"hot{i}", cmpl(pre + ids(20, 200 + i), 150), delay=0.2 + 0.01 * i) for i in range(8)]
    out = await asyncio.gather(victim, *tasks)
    return out[0], {}


async def sc_bug2(sess, base):
    await call(sess, base, "warm", cmpl(ids(50, 1), 20, stream=True))
    await asyncio.sleep(4.6)
    v = await call(sess, base, "victim", cmpl(ids(50, 2), 20, stream=True))
    return v, {}


async def sc_bug2_burst(sess, base):
    """Idle gap, then a burst within 20 ms: every request of the burst must be tagged, not
    only the one that reached the engine first."""
    await call(sess, base, "warm", cmpl(ids(50, 1), 20, stream=True))
    await asyncio.sleep(4.6)
    bodies = [cmpl(ids(256, 20 + i), 64, stream=True) for i in range(5)]
    bodies.insert(3, cmpl(ids(256, 26), 16, n=4, logprobs=5))
    bodies.append(cmpl(ids(128, 27), 32))
    rids = [f"b{i}" for i in range(len(bodies))]
    rids[4] = "victim"
    out = await asyncio.gather(*[call(sess, base, rid, b, delay=0.003 * i)
                                 for i, (rid, b) in enumerate(zip(rids, bodies))])
    return out[4], {"must_tag": [r for r in rids if r != "victim"]}


async def sc_bug3(sess, base):
    tasks = [call(sess, base, f"gone{i}", cmpl(ids(1900, 30 + i), 400, stream=True), delay=0.005 * i,
                  cancel_after=0.03) for i in range(2)]
    victim = call(sess, base, "victim", cmpl(ids(2000, 40), 30, stream=True), delay=0.3)

    async def probe():
        await asyncio.sleep(0.25)
        return await running_now(sess, base)
    out = await asyncio.gather(victim, probe(), *tasks)
    return out[0], {"running@0.25s": out[1]}


async def sc_bug4(sess, base):
    tasks = [call(sess, base, f"fill{i}", cmpl(ids(64, 300 + i), 80)) for i in range(60)]
    victim = call(sess, base, "victim", cmpl(ids(64, 5), 80, stream=True))
    seeded = call(sess, base, "seeded", cmpl(ids(64, 6), 80, seed=7))
    out = await asyncio.gather(victim, seeded, *tasks)
    return out[0], {}


async def sc_bug5(sess, base):
    victim = call(sess, base, "victim", cmpl(ids(50, 50), 300, stream=True))
    tasks = [call(sess, base, f"dec{i}", cmpl(ids(50, 51 + i), 300)) for i in range(3)]
    tasks += [call(sess, base, f"long{i}", cmpl(ids(8000, 60 + i), 16), delay=0.3 + 0.01 * i) for i in range(2)]
    out = await asyncio.gather(victim, *tasks)
    return out[0], {}


async def sc_bug6(sess, base):
    pre = ids(4000, 70)
    a = call(sess, base, "owner", cmpl(pre + ids(32, 71), 400))
    victim = call(sess, base, "victim", cmpl(pre + ids(32, 72), 30, stream=True), delay=0.5)
    out = await asyncio.gather(victim, a)
    return out[0], {}


async def sc_bug7(sess, base):
    tasks = [call(sess, base, f"r{i}", cmpl(ids(600, 80 + i), 80), delay=0.005 * i) for i in range(4)]
    victim = call(sess, base, "victim", cmpl(ids(600, 85), 200, stream=True), delay=0.03)
    tasks += [call(sess, base, f"s{i}", cmpl(ids(640, 90 + i), 160), delay=0.1 + 0.01 * i) for i in range(4)]
    out = await asyncio.gather(victim, *tasks)
    return out[0], {}


async def sc_bug8(sess, base):
    par = call(sess, base, "par", cmpl(ids(400, 95), 500, stream=True, n=3), disconnect_after_tokens=30)
    victim = call(sess, base, "victim", cmpl(ids(2000, 96), 30, stream=True), delay=0.5)

    async def probe():
        await asyncio.sleep(0.45)
        return await running_now(sess, base)
    out = await asyncio.gather(victim, probe(), par)
    return out[0], {"running@0.45s": out[1]}


SCENARIOS = [  # name (bug name, optionally "-variant"), server flags, scenario, victim metric
    ("bug1", ["--max-num-seqs", "4"], sc_bug1, "ttft"),
    ("bug2", [], sc_bug2, "ttft"),
    ("bug2-burst", [], sc_bug2_burst, "ttft"),
    ("bug3", ["--num-gpu-blocks", "300"], sc_bug3, "ttft"),
    ("bug4", [], sc_bug4, "e2e"),
    ("bug5", [], sc_bug5, "max_gap"),
    ("bug6", ["--num-gpu-blocks", "400"], sc_bug6, "ttft"),
    ("bug7", ["--num-gpu-blocks", "200"], sc_bug7, "max_gap"),
    ("bug8", ["--num-gpu-blocks", "160"], sc_bug8, "ttft"),
]


def read_gt(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


async def run_one(tmp, name, bugs, flags, fn):
    gt = os.path.join(tmp, f"gt_{name}_{bugs}.jsonl")
    async with Server(bugs, flags, gt, os.path.join(tmp, f"log_{name}_{bugs}.txt")) as srv:
        conn = aiohttp.TCPConnector(force_close=True, limit=0)
        async with aiohttp.ClientSession(connector=conn) as sess:
            victim, info = await asyncio.wait_for(fn(sess, srv.base), SCENARIO_TIMEOUT)
        await asyncio.sleep(0.2)
        startup = srv.startup_s
    return victim, info, read_gt(gt), startup


async def smoke_all(tmp):
    """Random mixed traffic with every bug enabled: server must stay healthy and log ground truth."""
    gt = os.path.join(tmp, "gt_smoke_all.jsonl")
    async with Server("all", ["--num-gpu-blocks", "600", "--max-num-seqs", "16"], gt,
                      os.path.join(tmp, "log_smoke_all.txt")) as srv:
        r = random.Random(5)
        conn = aiohttp.TCPConnector(force_close=True, limit=0)
        async with aiohttp.ClientSession(connector=conn) as sess:
            jobs = []
            for i in range(40):
                body = cmpl(ids(r.choice([20, 300, 1500]), i) if i % 3 else ids(700, 1) + ids(30, i),
                            r.choice([10, 60, 200]), stream=r.random() < 0.6, n=r.choice([1, 1, 2]))
                if r.random() < 0.2:
                    body["seed"] = i
                if r.random() < 0.3:
                    body["ignore_eos"] = False
                jobs.append(call(sess, srv.base, f"smoke{i}", body, delay=r.random() * 2.0,
                                 cancel_after=0.05 if r.random() < 0.1 else None))
            res = await asyncio.wait_for(asyncio.gather(*jobs), 40)
            async with sess.get(srv.base + "/health") as h:
                healthy = h.status == 200
        await asyncio.sleep(0.3)
    return healthy, sum(1 for x in res if x["status"] == 200), read_gt(gt)


async def main():
    t_start = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="heldout_selftest_")
    rows, ok_all = [], True
    clean_tagged = 0
    startups = []
    only = set(sys.argv[1:])
    for name, flags, fn, metric in SCENARIOS:
        bug = name.split("-")[0]
        if only and name not in only and bug not in only:
            continue
        vc, ic, gtc, s1 = await run_one(tmp, name, "none", flags, fn)
        vb, ib, gtb, s2 = await run_one(tmp, name, bug, flags, fn)
        startups += [s1, s2]
        tagged_clean = [g for g in gtc if g["pathologies"]]
        clean_tagged += len(tagged_clean)
        vgt = next((g for g in gtb if g["request_id"] == "victim"), None)
        vtags = vgt["pathologies"] if vgt else None
        others = sorted({g["request_id"] for g in gtb if g["pathologies"] and g["request_id"] != "victim"})
        c, b = vc[metric], vb[metric]
        ratio = b / c if c and b else float("nan")
        # other requests the scenario's bug slows: each must carry the bug's tag as well
        must = ib.pop("must_tag", [])
        ic.pop("must_tag", None)
        gtb_by = {g["request_id"]: g["pathologies"] for g in gtb}
        missing = [r for r in must if bug not in (gtb_by.get(r) or [])]
        if must:
            ib["must_tag_missing"] = f"{len(missing)}/{len(must)}"
        ok = bool(c and b and ratio >= 2.0 and vtags == [bug] and not tagged_clean and not missing)
        ok_all &= ok
        rows.append((name, metric, c, b, ratio, vtags, len(others), len(gtb), ib or ic, ic, ok))
        print(f"  {name}: {metric} clean={c:.3f}s bug={b:.3f}s x{ratio:.1f} victim_tags={vtags} "
              f"other_tagged={len(others)}/{len(gtb)} info_clean={ic} info_bug={ib} "
              f"{'PASS' if ok else 'FAIL'}", flush=True)
    if only and "smoke" not in only:
        healthy, n200, gts = True, 40, [{"pathologies": []}] * 40
    else:
        healthy, n200, gts = await smoke_all(tmp)
    smoke_ok = healthy and n200 >= 30 and len(gts) >= 30
    ok_all &= smoke_ok and clean_tagged == 0
    print()
    print(f"{'bug':10} {'victim metric':14} {'clean (s)':>10} {'bug (s)':>10} {'ratio':>7}  {'victim tags':14} "
          f"{'others tagged':>13}  result")
    for name, metric, c, b, ratio, vtags, no, ng, *_rest, ok in rows:
        print(f"{name:10} {metric:14} {c:10.3f} {b:10.3f} {ratio:6.1f}x  {str(vtags):14} {no:>6}/{ng:<6}  "
              f"{'PASS' if ok else 'FAIL'}")
    print(f"--bugs none runs: {clean_tagged} request(s) tagged (expected 0)")
    print(f"--bugs all smoke: healthy={healthy} ok_responses={n200}/40 gt_lines={len(gts)} "
          f"tagged={sum(1 for g in gts if g['pathologies'])} -> {'PASS' if smoke_ok else 'FAIL'}")
    print(f"server startup (to healthy): max {max(startups):.2f}s")
    print(f"selftest wall time: {time.monotonic() - t_start:.1f}s; logs in {tmp}")
    print("SELFTEST", "PASSED" if ok_all else "FAILED")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
