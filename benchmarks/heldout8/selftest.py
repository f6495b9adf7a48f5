#!/usr/bin/env python3
"""Self-test for the heldout8 simulated server (CONFIDENTIAL: exercises the
planted bugs described in BUGS.md).

Runs servers on random free ports on 127.0.0.1, checks the API surface, clean
FCFS behaviour, each planted bug (ground-truth tags + a user-visible latency
effect) and that an ordinary load of short equal requests with --bugs all is
never tagged.  Exit status is non-zero on any failure.
"""
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.join(HERE, "server.py")
PY = sys.executable
WORDS = ("the of and to in is it you that he was for on are with as his they be at one have "
         "this from or had by hot word but what some we can out other were all there when up "
         "use your how said an each she which do their time if will way about").split()
TICK = os.sysconf("SC_CLK_TCK")

RESULTS = []          # (name, ok, detail)
SERVERS = []          # every server started, stopped again at exit
TMP = tempfile.mkdtemp(prefix="heldout8-selftest-")
CPU = {"cpu_s": 0.0, "wall_s": 0.0}


def check(name, cond, detail=""):
    RESULTS.append((name, bool(cond), detail))
    print(("PASS " if cond else "FAIL ") + name + (("  [" + detail + "]") if detail else ""),
          flush=True)
    return bool(cond)


def prompt(n, salt):
    """n-token prompt; the first word is unique per salt (no shared prefix)."""
    return " ".join(["u%s" % salt] + [WORDS[(i * 7 + len(str(salt))) % len(WORDS)]
                                      for i in range(n - 1)])


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Server:
    def __init__(self, bugs="none", seed=1, extra=()):
        self.port = free_port()
        self.gt_path = os.path.join(TMP, "gt-%d.jsonl" % self.port)
        self.base = "http://127.0.0.1:%d" % self.port
        self.err = open(os.path.join(TMP, "stderr-%d.txt" % self.port), "w+b")
        self.proc = subprocess.Popen([PY, SERVER, "--port", str(self.port), "--seed", str(seed),
                                      "--bugs", bugs, "--ground-truth", self.gt_path, *extra],
                                     stdout=subprocess.DEVNULL, stderr=self.err,
                                     start_new_session=True)
        self.t_start = time.monotonic()
        SERVERS.append(self)

    async def ready(self, sess):
        for _ in range(200):
            try:
                async with sess.get(self.base + "/health") as r:
                    if r.status == 200:
                        return True
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
        self.err.seek(0)
        raise RuntimeError("server did not start: " + self.err.read().decode()[-2000:])

    def cpu(self):
        try:
            with open("/proc/%d/stat" % self.proc.pid) as f:
                parts = f.read().rsplit(")", 1)[1].split()
            return (int(parts[11]) + int(parts[12])) / TICK
        except OSError:
            return 0.0

    def gt(self):
        out = {}
        if os.path.exists(self.gt_path):
            with open(self.gt_path) as f:
                for line in f:
                    d = json.loads(line)
                    out[d["request_id"]] = d
        return out

    def stop(self):
        if self.proc.poll() is None:
            CPU["cpu_s"] += self.cpu()
            CPU["wall_s"] += time.monotonic() - self.t_start
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(3)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()


# ---------------------------------------------------------------- client side
async def call(sess, base, body, rid, chat=False, stream=None, disconnect_after=None,
               disconnect_s=None):
    """Send one request; returns a record with token arrival times."""
    url = base + ("/v1/chat/completions" if chat else "/v1/completions")
    body = dict(body)
    if stream is not None:
        body["stream"] = stream
    rec = {"rid": rid, "t0": time.monotonic(), "tok": [], "chunks": [], "status": None,
           "finish": None, "usage": None, "done": False, "json": None}
    try:
        coro = _do(sess, url, body, rid, chat, rec, disconnect_after)
        if disconnect_s is not None:
            await asyncio.wait_for(coro, disconnect_s)
        else:
            await coro
    except asyncio.TimeoutError:
        rec["disconnected"] = True
    rec["t1"] = time.monotonic()
    return rec


async def _do(sess, url, body, rid, chat, rec, disconnect_after):
    async with sess.post(url, json=body, headers={"X-Request-Id": rid}) as r:
        rec["status"] = r.status
        rec["hdr_rid"] = r.headers.get("X-Request-Id")
        if not body.get("stream"):
            rec["json"] = await r.json(content_type=None)
            rec["done"] = True
            return
        async for raw in r.content:
            line = raw.decode().rstrip("\n")
            if not line:
                continue
            rec["chunks"].append(line)
            if line == "data: [DONE]":
                rec["done"] = True
                break
            d = json.loads(line[6:])
            if d.get("usage"):
                rec["usage"] = d["usage"]
            for ch in d.get("choices", []):
                if chat and "role" in ch.get("delta", {}):
                    continue
                rec["tok"].append(time.monotonic())
                if ch.get("finish_reason"):
                    rec["finish"] = ch["finish_reason"]
            if disconnect_after is not None and len(rec["tok"]) >= disconnect_after:
                rec["disconnected"] = True
                r.close()
                return


def ttft(rec):
    return rec["tok"][0] - rec["t0"] if rec["tok"] else float("inf")


def itls(rec):
    t = rec["tok"]
    return [b - a for a, b in zip(t, t[1:])]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def metrics(sess, base):
    async with sess.get(base + "/metrics") as r:
        txt = await r.text()
    vals = {}
    for line in txt.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_lab, v = line.rsplit(" ", 1)
        name = name_lab.split("{", 1)[0]
        if "_bucket" in name:
            continue
        vals[name] = vals.get(name, 0.0) + float(v)
    return txt, vals


async def warm(sess, srv):
    await srv.ready(sess)
    await call(sess, srv.base, {"prompt": prompt(8, "warm"), "max_tokens": 4, "ignore_eos": True},
               "warmup-%d" % srv.port)


def session():
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=120))


def tags_of(gt):
    return {rid: set(d["pathologies"]) for rid, d in gt.items()}


# ------------------------------------------------------------------ API tests
async def test_api():
    srv = Server("none")
    try:
        async with session() as s:
            await warm(s, srv)
            b = srv.base
            async with s.get(b + "/health") as r:
                check("api: /health 200", r.status == 200)
            async with s.get(b + "/version") as r:
                check("api: /version", "version" in await r.json())
            async with s.get(b + "/v1/models") as r:
                d = await r.json()
            m = d["data"][0]
            check("api: /v1/models one model with max_model_len", len(d["data"]) == 1 and
                  m["max_model_len"] == 8192, str(m.get("max_model_len")))
            text = "the quick brown fox zzqx jumps of and 42 ünïcode"
            async with s.post(b + "/tokenize", json={"prompt": text}) as r:
                tk = await r.json()
            async with s.post(b + "/detokenize", json={"tokens": tk["tokens"]}) as r:
                dt = await r.json()
            check("api: tokenize count = words, round trip", tk["count"] == len(text.split()) ==
                  len(tk["tokens"]) and dt["prompt"] == text and tk["max_model_len"] == 8192,
                  "%s -> %r" % (tk["count"], dt["prompt"]))
            msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there you"}]
            async with s.post(b + "/tokenize", json={"messages": msgs}) as r:
                tc = await r.json()
            check("api: chat template = words + 1 per message + 1", tc["count"] == 5 + 2 + 1,
                  str(tc["count"]))
            r1 = await call(s, b, {"prompt": prompt(20, "a1"), "max_tokens": 7, "ignore_eos": True},
                            "api-nonstream")
            j = r1["json"]
            check("api: completion non-stream", r1["status"] == 200 and
                  j["usage"]["completion_tokens"] == 7 and j["usage"]["prompt_tokens"] == 20 and
                  j["choices"][0]["finish_reason"] == "length" and j["object"] == "text_completion"
                  and len(j["choices"][0]["text"].split()) == 7, json.dumps(j)[:200])
            check("api: X-Request-Id echoed and used as id", r1["hdr_rid"] == "api-nonstream" and
                  "api-nonstream" in j["id"])
            r2 = await call(s, b, {"prompt": [16, 17, 18, 19, 5000], "max_tokens": 3, "ignore_eos": True},
                            "api-ids")
            check("api: token-id prompt", r2["json"]["usage"]["prompt_tokens"] == 5)
            r3 = await call(s, b, {"prompt": prompt(12, "a3"), "max_tokens": 9, "ignore_eos": True,
                                   "stream_options": {"include_usage": True}}, "api-stream", stream=True)
            ch = r3["chunks"]
            datas = [json.loads(c[6:]) for c in ch[:-1]]
            tokc = [d for d in datas if d["choices"]]
            fins = [d["choices"][0]["finish_reason"] for d in tokc]
            check("api: SSE completion stream format",
                  all(c.startswith("data: ") for c in ch) and ch[-1] == "data: [DONE]" and
                  len(tokc) == 9 and fins[:-1] == [None] * 8 and fins[-1] == "length" and
                  all(len(d["choices"][0]["text"].split()) == 1 for d in tokc) and
                  datas[-1]["choices"] == [] and datas[-1]["usage"]["completion_tokens"] == 9,
                  "%d chunks" % len(ch))
            r4 = await call(s, b, {"messages": msgs, "max_completion_tokens": 5, "ignore_eos": True},
                            "api-chat-stream", chat=True, stream=True)
            cd = [json.loads(c[6:]) for c in r4["chunks"][:-1]]
            check("api: chat stream role chunk then 5 content chunks",
                  cd[0]["object"] == "chat.completion.chunk" and
                  cd[0]["choices"][0]["delta"].get("role") == "assistant" and len(cd) == 6 and
                  cd[-1]["choices"][0]["finish_reason"] == "length" and r4["chunks"][-1] == "data: [DONE]")
            r5 = await call(s, b, {"messages": msgs, "max_tokens": 4}, "api-chat", chat=True)
            j5 = r5["json"]
            check("api: chat non-stream", j5["object"] == "chat.completion" and
                  j5["choices"][0]["message"]["role"] == "assistant" and j5["usage"]["prompt_tokens"] == 8)
            r6 = await call(s, b, {"prompt": prompt(10, "a6"), "max_tokens": 6, "n": 3, "ignore_eos": True,
                                   "logprobs": 2}, "api-n3")
            j6 = r6["json"]
            check("api: n=3 fan-out with logprobs", len(j6["choices"]) == 3 and
                  j6["usage"]["completion_tokens"] == 18 and
                  len(j6["choices"][2]["logprobs"]["top_logprobs"][0]) == 2)
            r7 = await call(s, b, {"prompt": prompt(20, "a7"), "max_tokens": 200}, "api-eos")
            j7 = r7["json"]["choices"][0]
            check("api: without ignore_eos stops at <= max_tokens", j7["finish_reason"] in ("stop", "length"))
            r8 = await call(s, b, {"prompt": prompt(8000, "a8"), "max_tokens": 300}, "api-toolong")
            check("api: prompt + max_tokens > max_model_len -> 400 OpenAI error",
                  r8["status"] == 400 and r8["json"]["error"]["code"] == 400 and
                  "maximum context length" in r8["json"]["error"]["message"])
            async with s.post(b + "/v1/completions", data=b"{not json") as r:
                check("api: invalid JSON -> 400", r.status == 400 and "error" in await r.json())
            txt, vals = await metrics(s, b)
            need = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                    "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
                    "vllm:generation_tokens_total", "vllm:request_success_total",
                    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                    "vllm:cache_config_info", "vllm:time_to_first_token_seconds_bucket",
                    "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
                    "vllm:request_queue_time_seconds_sum"]
            missing = [n for n in need if n + "{" not in txt]
            check("api: metric names", not missing and 'num_gpu_blocks="768"' in txt and
                  'block_size="32"' in txt and 'model_name="' in txt, "missing %s" % missing)
            # disconnects in clean mode: streaming and non-streaming n>1
            rd = await call(s, b, {"prompt": prompt(30, "d1"), "max_tokens": 800, "ignore_eos": True},
                            "api-disc-stream", stream=True, disconnect_after=5)
            rn = await call(s, b, {"prompt": prompt(30, "d2"), "max_tokens": 800, "ignore_eos": True,
                                   "n": 3}, "api-disc-n3", disconnect_s=0.3)
            await asyncio.sleep(0.3)
            _, vals = await metrics(s, b)
            gt = srv.gt()
            g1, g2 = gt.get("api-disc-stream", {}), gt.get("api-disc-n3", {})
            check("api: disconnect aborts and frees KV (clean)",
                  rn.get("disconnected") and vals["vllm:num_requests_running"] == 0 and
                  vals["vllm:kv_cache_usage_perc"] == 0.0 and
                  g1.get("finish_reason") == "abort" and g1.get("client_disconnected") is True and
                  g2.get("finish_reason") == "abort" and g2.get("client_disconnected") is True and
                  g1.get("output_tokens", 999) < 100 and g2.get("output_tokens", 999) < 300,
                  "running=%s kv=%s g1=%s g2=%s" % (vals["vllm:num_requests_running"],
                                                    vals["vllm:kv_cache_usage_perc"], g1, g2))
            check("api: ground truth line per request, no tags in clean mode",
                  all(k in g1 for k in ("request_id", "finish_reason", "client_disconnected", "e2e_s",
                                        "prompt_tokens", "output_tokens", "pathologies")) and
                  "api-toolong" in gt and gt["api-toolong"]["finish_reason"] == "error" and
                  all(not d["pathologies"] for d in gt.values()), "%d lines" % len(gt))
    finally:
        srv.stop()


async def test_sigterm():
    srv = Server("all")
    async with session() as s:
        await warm(s, srv)
        tasks = [asyncio.create_task(call(s, srv.base, {"prompt": prompt(20, "t%d" % i),
                                                        "max_tokens": 2000, "ignore_eos": True},
                                          "term-%d" % i, stream=(i % 2 == 0))) for i in range(4)]
        await asyncio.sleep(0.4)
        CPU["cpu_s"] += srv.cpu()
        CPU["wall_s"] += time.monotonic() - srv.t_start
        t0 = time.monotonic()
        os.kill(srv.proc.pid, signal.SIGTERM)
        try:
            srv.proc.wait(3)
        except subprocess.TimeoutExpired:
            pass
        dt = time.monotonic() - t0
        await asyncio.gather(*tasks, return_exceptions=True)
    gt = srv.gt()
    check("sigterm: exits within ~1 s and writes abort lines for in-flight requests",
          srv.proc.poll() is not None and dt < 1.3 and
          all(gt.get("term-%d" % i, {}).get("finish_reason") == "abort" for i in range(4)),
          "exit after %.2fs, lines=%d" % (dt, len(gt)))
    srv.stop()


# -------------------------------------------------------------- clean FCFS
async def test_clean_fcfs():
    srv = Server("none", seed=3)
    try:
        async with session() as s:
            await warm(s, srv)
            b = srv.base
            jobs = []

            async def later(dt, coro):
                await asyncio.sleep(dt)
                return await coro

            # KV-exhausting burst of equal long requests, staggered arrivals
            for i in range(16):
                jobs.append(later(0.012 * i, call(s, b, {"prompt": prompt(1400, "kv%d" % i),
                                                        "max_tokens": 420, "ignore_eos": True},
                                                  "kv-%02d" % i, stream=True)))
            # fan-out requests with long outputs, a long prompt, logprobs, long max_tokens
            for i in range(2):
                jobs.append(later(0.25 + 0.01 * i, call(s, b, {"prompt": prompt(60, "fan%d" % i),
                                                               "max_tokens": 300, "n": 4,
                                                               "ignore_eos": True}, "fan-%d" % i)))
            jobs.append(later(0.3, call(s, b, {"prompt": prompt(7000, "lp"), "max_tokens": 16},
                                        "longprompt", stream=True)))
            jobs.append(later(0.35, call(s, b, {"prompt": prompt(40, "lgp"), "max_tokens": 80,
                                                "logprobs": 8, "ignore_eos": True}, "logprobs8",
                                         stream=True)))
            jobs.append(later(0.4, call(s, b, {"prompt": prompt(40, "mt"), "max_tokens": 1500},
                                        "maxtok-1500", stream=True, disconnect_after=40)))
            jobs.append(later(0.45, call(s, b, {"prompt": prompt(40, "dn"), "max_tokens": 600,
                                                "n": 3, "ignore_eos": True}, "disc-n3",
                                         disconnect_s=0.6)))
            # equal short requests in a known order
            for i in range(10):
                jobs.append(later(0.6 + 0.02 * i, call(s, b, {"prompt": prompt(50, "eq%d" % i),
                                                              "max_tokens": 40, "ignore_eos": True},
                                                       "eq-%02d" % i, stream=True)))
            recs = await asyncio.gather(*jobs)
            await asyncio.sleep(0.2)
            _, vals = await metrics(s, b)
        gt = srv.gt()
        by = {r["rid"]: r for r in recs}
        kv = [by["kv-%02d" % i] for i in range(16)]
        eq = [by["eq-%02d" % i] for i in range(10)]
        check("clean: KV burst preempts (recompute) and every request completes",
              vals["vllm:num_preemptions_total"] > 0 and all(len(r["tok"]) == 420 for r in kv) and
              all(len(r["tok"]) == 40 for r in eq) and gt["fan-0"]["output_tokens"] == 1200,
              "preemptions=%d" % vals["vllm:num_preemptions_total"])
        firsts = [r["tok"][0] for r in kv]
        check("clean: FCFS first-token order for the equal KV burst",
              all(a <= b + 3e-3 for a, b in zip(firsts, firsts[1:])))
        firsts = [r["tok"][0] for r in eq]
        check("clean: FCFS first-token order for equal short requests",
              all(a <= b + 3e-3 for a, b in zip(firsts, firsts[1:])))
        inv = inversions(by)
        check("clean: no request that arrived during another's preemption stall overtakes it",
              not inv, str(inv[:3]))
        check("clean: no ground-truth tags under mixed load", len(gt) >= 33 and
              all(not d["pathologies"] for d in gt.values()),
              "%d lines, tagged=%s" % (len(gt), [k for k, d in gt.items() if d["pathologies"]]))
        check("clean: disconnected fan-out aborted promptly",
              gt["disc-n3"]["finish_reason"] == "abort" and gt["disc-n3"]["e2e_s"] < 1.0,
              "e2e=%.2f" % gt["disc-n3"]["e2e_s"])
    finally:
        srv.stop()


# ------------------------------------------------------------- bug scenarios
async def pair(scenario, bug):
    """Run the same scenario on a clean server, then on a server with `bug`
    (one after the other, so that they do not compete for the CPU)."""
    out = []
    for mode in ("none", bug):
        srv = Server(mode, seed=5)
        try:
            async with session() as s:
                await warm(s, srv)
                recs = await scenario(s, srv.base)
                await idle(s, srv)
            out.append((recs, srv.gt()))
        finally:
            srv.stop()
    (rc, gc), (rb, gb) = out
    return rc, rb, gc, gb


async def idle(s, srv, limit=8.0):
    """Wait until the server has nothing running or waiting."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        _, v = await metrics(s, srv.base)
        if v["vllm:num_requests_running"] == 0 and v["vllm:num_requests_waiting"] == 0:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.1)


async def later(dt, coro):
    await asyncio.sleep(dt)
    return await coro


async def sc_bug1(s, b):
    jobs = [call(s, b, {"prompt": prompt(40, "z%d" % i), "max_tokens": 400, "n": 8, "ignore_eos": True},
                 "amp-%d" % i, disconnect_s=0.3) for i in range(4)]
    jobs += [later(0.6, call(s, b, {"prompt": prompt(40, "v%d" % i), "max_tokens": 40, "ignore_eos": True},
                             "vic-%02d" % i, stream=True)) for i in range(30)]
    return {r["rid"]: r for r in await asyncio.gather(*jobs)}


async def sc_bug2(s, b):
    jobs = [later(0.015 * i, call(s, b, {"prompt": prompt(1800, "p%d" % i), "max_tokens": 300,
                                         "ignore_eos": True}, "early-%02d" % i, stream=True))
            for i in range(13)]
    jobs += [later(0.3 + 0.12 * i, call(s, b, {"prompt": prompt(1800, "q%d" % i), "max_tokens": 200,
                                               "ignore_eos": True}, "late-%02d" % i, stream=True))
             for i in range(20)]
    return {r["rid"]: r for r in await asyncio.gather(*jobs)}


async def sc_bug3(s, b):
    jobs = [call(s, b, {"prompt": prompt(64, "w%d" % i), "max_tokens": 120, "ignore_eos": True},
                 "vic-%02d" % i, stream=True) for i in range(20)]
    jobs.append(call(s, b, {"prompt": prompt(64, "amp"), "max_tokens": 150, "ignore_eos": True,
                            "logprobs": 8}, "amp", stream=True))
    return {r["rid"]: r for r in await asyncio.gather(*jobs)}


async def sc_bug4(s, b):
    jobs = [call(s, b, {"prompt": prompt(32, "d%d" % i), "max_tokens": 160, "ignore_eos": True},
                 "vic-%02d" % i, stream=True) for i in range(8)]
    jobs.append(later(0.3, call(s, b, {"prompt": prompt(8000, "long"), "max_tokens": 20,
                                       "ignore_eos": True}, "amp", stream=True)))
    return {r["rid"]: r for r in await asyncio.gather(*jobs)}


async def sc_bug5(s, b):
    jobs = [later(0.01 * i, call(s, b, {"prompt": prompt(100, "L%d" % i), "max_tokens": 6000,
                                        "ignore_eos": True}, "amp-%d" % i, stream=True,
                                 disconnect_s=1.6)) for i in range(4)]
    jobs += [later(0.3 + 0.01 * i, call(s, b, {"prompt": prompt(40, "s%d" % i), "max_tokens": 30,
                                               "ignore_eos": True}, "vic-%02d" % i, stream=True))
             for i in range(12)]
    return {r["rid"]: r for r in await asyncio.gather(*jobs)}


def tagged(gt, prefix, bug):
    ids = [k for k in gt if k.startswith(prefix)]
    return [k for k in ids if bug in gt[k]["pathologies"]], ids


def only(gt, bug):
    extra = {t for d in gt.values() for t in d["pathologies"]} - {bug}
    return not extra, extra


async def test_bug1():
    rc, rb, gc, gb = await pair(sc_bug1, "bug1")
    tv, ids = tagged(gb, "vic-", "bug1")
    ta, _ = tagged(gb, "amp-", "bug1")
    vc = [ttft(rc[k]) for k in ids]
    vb = [ttft(rb[k]) for k in ids]
    ratio = pct(vb, 0.9) / pct(vc, 0.9)
    leak = statistics.mean(gb["amp-%d" % i]["e2e_s"] for i in range(4))
    leak_c = statistics.mean(gc["amp-%d" % i]["e2e_s"] for i in range(4))
    check("bug1: tags + latency", len(ta) == 4 and len(tv) >= 10 and ratio >= 3 and leak > 3 * leak_c and
          only(gb, "bug1")[0] and not any(d["pathologies"] for d in gc.values()),
          "amp tagged %d/4, victims tagged %d/%d, p90 TTFT %.0f->%.0f ms (x%.1f), amp e2e %.2f->%.2f s"
          % (len(ta), len(tv), len(ids), pct(vc, .9) * 1e3, pct(vb, .9) * 1e3, ratio, leak_c, leak))


def gaps(rec, min_gap=0.15):
    t = rec["tok"]
    return [(a, b) for a, b in zip(t, t[1:]) if b - a >= min_gap]


def inversions(recs):
    """Pairs (E, L): L arrived during E's stall (a preemption) and got its first
    token well before E resumed.  FCFS with resume-first never does this."""
    out = []
    for e, re_ in recs.items():
        for a, b in gaps(re_):
            for l, rl in recs.items():
                if l != e and rl["tok"] and rl["t0"] > a + 0.01 and a + 0.01 < rl["tok"][0] < b - 0.1:
                    out.append((e, l))
    return out


async def test_bug2():
    rc, rb, gc, gb = await pair(sc_bug2, "bug2")
    tv, ids = tagged(gb, "early-", "bug2")
    e2e = lambda r: r["tok"][-1] - r["t0"]
    gap = lambda r: max(itls(r))
    worst = max(tv, key=lambda k: gap(rb[k]) / gap(rc[k])) if tv else None
    inv_b = [p for p in inversions(rb) if p[0] in tv]
    inv_c = inversions(rc)
    ok = bool(worst) and gap(rb[worst]) >= 1.8 * gap(rc[worst]) and e2e(rb[worst]) >= 1.15 * e2e(rc[worst])
    check("bug2: tags + latency + ordering inversion",
          ok and inv_b and not inv_c and only(gb, "bug2")[0] and
          not any(d["pathologies"] for d in gc.values()),
          "tagged early %s; %s: stall %.2f->%.2f s, e2e %.2f->%.2f s; inversions bug=%d clean=%d"
          % (tv, worst, gap(rc[worst]) if worst else 0, gap(rb[worst]) if worst else 0,
             e2e(rc[worst]) if worst else 0, e2e(rb[worst]) if worst else 0, len(inv_b), len(inv_c)))


async def test_bug3():
    rc, rb, gc, gb = await pair(sc_bug3, "bug3")
    tv, ids = tagged(gb, "vic-", "bug3")
    mc = statistics.median([x for k in ids for x in itls(rc[k])])
    mb = statistics.median([x for k in ids for x in itls(rb[k])])
    ratio = mb / mc
    check("bug3: tags + subtle ITL slowdown", len(tv) >= 15 and 1.3 <= ratio <= 3.0 and
          only(gb, "bug3")[0] and not any(d["pathologies"] for d in gc.values()),
          "victims tagged %d/%d, median ITL %.1f->%.1f ms (x%.2f)"
          % (len(tv), len(ids), mc * 1e3, mb * 1e3, ratio))


async def test_bug4():
    rc, rb, gc, gb = await pair(sc_bug4, "bug4")
    tv, ids = tagged(gb, "vic-", "bug4")
    mc = statistics.median([max(itls(rc[k])) for k in ids])
    mb = statistics.median([max(itls(rb[k])) for k in ids])
    ratio = mb / mc
    check("bug4: tags + stalled live streams", len(tv) >= 6 and ratio >= 2.5 and
          "bug4" not in gb["amp"]["pathologies"] and only(gb, "bug4")[0] and
          not any(d["pathologies"] for d in gc.values()),
          "victims tagged %d/%d, median of per-stream max ITL %.0f -> %.0f ms x%.1f"
          % (len(tv), len(ids), mc * 1e3, mb * 1e3, ratio))


async def test_bug5():
    rc, rb, gc, gb = await pair(sc_bug5, "bug5")
    tv, ids = tagged(gb, "vic-", "bug5")
    vc = statistics.median(ttft(rc[k]) for k in ids)
    vb = statistics.median(ttft(rb[k]) for k in ids)
    check("bug5: tags + admission stall", len(tv) >= 10 and vb / vc >= 5 and only(gb, "bug5")[0] and
          not any(d["pathologies"] for d in gc.values()),
          "victims tagged %d/%d, median TTFT %.0f->%.0f ms (x%.1f)"
          % (len(tv), len(ids), vc * 1e3, vb * 1e3, vb / vc))


# ---------------------------------------------------------- generic load
async def test_generic_all():
    srv = Server("all", seed=7)
    try:
        async with session() as s:
            await warm(s, srv)
            b = srv.base
            sem = asyncio.Semaphore(24)
            cpu0, t0 = srv.cpu(), time.monotonic()

            async def one(i):
                async with sem:
                    body = {"prompt": prompt(48, "g%d" % i) if i % 2 else prompt(48, "same"),
                            "max_tokens": 48, "ignore_eos": i % 3 != 0}
                    if i % 5 == 0:
                        return await call(s, b, {"messages": [{"role": "user", "content": body["prompt"]}],
                                                 "max_tokens": 48}, "gen-%03d" % i, chat=True,
                                          stream=True)
                    return await call(s, b, body, "gen-%03d" % i, stream=i % 4 != 1)
            recs = await asyncio.gather(*[one(i) for i in range(120)])
            load_cpu = (srv.cpu() - cpu0) / (time.monotonic() - t0)
            await asyncio.sleep(0.2)
            cpu1, t1 = srv.cpu(), time.monotonic()
            single = await call(s, b, {"prompt": prompt(48, "solo"), "max_tokens": 150,
                                       "ignore_eos": True}, "solo", stream=True)
            one_cpu = (srv.cpu() - cpu1) / (time.monotonic() - t1)
            await asyncio.sleep(1.0)
            cpu2 = srv.cpu()
            await asyncio.sleep(1.0)
            idle_cpu = srv.cpu() - cpu2
        gt = srv.gt()
        check("generic: short equal load with --bugs all is never tagged",
              len(gt) >= 121 and all(r["done"] for r in recs) and
              all(not d["pathologies"] for d in gt.values()),
              "%d lines, tagged=%s" % (len(gt), [k for k, d in gt.items() if d["pathologies"]][:5]))
        CPU["load"], CPU["one"], CPU["idle"] = load_cpu, one_cpu, idle_cpu
        check("cpu: modest CPU use", one_cpu < 0.15 and idle_cpu < 0.05,
              "24 concurrent streams %.0f%%, one stream %.1f%%, idle %.1f%% of a core"
              % (load_cpu * 100, one_cpu * 100, idle_cpu * 100))
    finally:
        srv.stop()


async def main(argv):
    t0 = time.monotonic()
    tests = [test_api, test_sigterm, test_clean_fcfs, test_bug1, test_bug2, test_bug3, test_bug4,
             test_bug5, test_generic_all]
    if argv:
        tests = [t for t in tests if any(a in t.__name__ for a in argv)]
    for t in tests:
        try:
            await t()
        except Exception as e:  # noqa
            import traceback
            traceback.print_exc()
            check(t.__name__ + " raised", False, repr(e))
        finally:
            for srv in SERVERS:
                srv.stop()
    for srv in SERVERS:
        srv.stop()
    errs = []
    for srv in SERVERS:
        srv.err.seek(0)
        txt = srv.err.read().decode(errors="replace")
        if "Traceback" in txt or "engine died" in txt:
            errs.append(txt[-600:])
    check("servers: no tracebacks on stderr", not errs, errs[0] if errs else "")
    dt = time.monotonic() - t0
    npass = sum(1 for r in RESULTS if r[1])
    nfail = len(RESULTS) - npass
    print("\n%d passed, %d failed in %.1f s; server CPU %.1f s over %.1f s of server wall time"
          % (npass, nfail, dt, CPU["cpu_s"], CPU["wall_s"]))
    if not nfail:
        shutil.rmtree(TMP, ignore_errors=True)
    return 1 if nfail or not RESULTS else 0


if __name__ == "__main__":
    try:
        rc = asyncio.run(main(sys.argv[1:]))
    finally:
        for _srv in SERVERS:
            _srv.stop()
    sys.exit(rc)
