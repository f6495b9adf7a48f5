#!/usr/bin/env python3
"""Self-test for heldout7/server.py.  Exits non-zero on failure.

Starts servers on free ports on 127.0.0.1 (stops them at the end), checks the API,
FCFS/no-tag behaviour in clean mode, and for every planted bug: its trigger is tagged
and visibly slower with the bug on, and a generic load of short equal requests
produces no tag with --bugs all.
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
import uuid

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.join(HERE, "server.py")
PY = sys.executable
TMP = tempfile.mkdtemp(prefix="heldout7-selftest-")
FAILS = []
SUMMARY = []


def check(cond, msg):
    print(("  ok   " if cond else "  FAIL ") + msg, flush=True)
    if not cond:
        FAILS.append(msg)
    return cond


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def words(prefix, n):
    return " ".join("%s%d" % (prefix, i) for i in range(n))


def uniq():
    return "u" + uuid.uuid4().hex[:10]


class Srv:
    ALL = []

    def __init__(self, bugs, tag):
        self.port = free_port()
        self.base = "http://127.0.0.1:%d" % self.port
        self.gt = os.path.join(TMP, "gt_%s.jsonl" % tag)
        self.log = open(os.path.join(TMP, "log_%s.txt" % tag), "w")
        self.proc = subprocess.Popen(
            [PY, SERVER, "--port", str(self.port), "--bugs", bugs, "--seed", "7",
             "--ground-truth", self.gt], stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        Srv.ALL.append(self)

    async def ready(self, sess):
        t = time.monotonic()
        while time.monotonic() - t < 15:
            try:
                async with sess.get(self.base + "/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
        # get through the legitimate cold start
        await asyncio.gather(*(post(sess, self, "/v1/completions",
                                    {"prompt": "warm up " + uniq(), "max_tokens": 4, "ignore_eos": True},
                                    rid="warm-%s" % uniq()) for _ in range(4)))

    def cpu_s(self):
        with open("/proc/%d/stat" % self.proc.pid) as f:
            p = f.read().rsplit(")", 1)[1].split()
        return (int(p[11]) + int(p[12])) / os.sysconf("SC_CLK_TCK")

    def gt_lines(self):
        out = {}
        if os.path.exists(self.gt):
            with open(self.gt) as f:
                for line in f:
                    if line.strip():
                        d = json.loads(line)
                        out[d["request_id"]] = d
        return out

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(3)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self.log.close()


async def post(sess, srv, path, body, rid=None, raw=False):
    h = {"X-Request-Id": rid} if rid else {}
    async with sess.post(srv.base + path, json=body, headers=h) as r:
        j = await r.json()
        return (r.status, j, r.headers) if raw else j


async def metrics(sess, srv):
    async with sess.get(srv.base + "/metrics") as r:
        text = await r.text()
    vals = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, v = line.rsplit(" ", 1)
        vals[name.split("{")[0]] = vals.get(name.split("{")[0], 0.0) + float(v)
    return text, vals


async def stream(sess, srv, body, rid, path="/v1/completions", ttft_timeout=None,
                 cancel_after=None, stop_after_tokens=None):
    """Streaming request; records per-token arrival times. Disconnects on the given
    conditions (closing the connection, like a client that gives up)."""
    body = dict(body, stream=True)
    rec = {"rid": rid, "t0": time.monotonic(), "times": [], "chunks": [], "finish": None,
           "usage": None, "done": False, "disconnected": False, "status": None, "text": ""}
    first = asyncio.Event()

    async def inner():
        async with sess.post(srv.base + path, json=body, headers={"X-Request-Id": rid}) as r:
            rec["status"], rec["hdr_rid"] = r.status, r.headers.get("X-Request-Id")
            if r.status != 200:
                rec["error"] = await r.json()
                return
            async for line in r.content:
                line = line.strip()
                if not line:
                    continue
                rec.setdefault("raw", []).append(line)
                if not line.startswith(b"data: "):
                    rec["bad_frame"] = line
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    rec["done"] = True
                    break
                obj = json.loads(data)
                rec["chunks"].append(obj)
                now = time.monotonic()
                for ch in obj.get("choices", []):
                    t = ch["text"] if "text" in ch else ch.get("delta", {}).get("content")
                    if t:
                        rec["times"].append(now)
                        rec["text"] += t
                        first.set()
                    if ch.get("finish_reason"):
                        rec["finish"] = ch["finish_reason"]
                if "usage" in obj:
                    rec["usage"] = obj["usage"]
                if stop_after_tokens and len(rec["times"]) >= stop_after_tokens:
                    rec["disconnected"] = True
                    r.close()
                    return

    task = asyncio.ensure_future(inner())
    try:
        if ttft_timeout is not None:
            fw = asyncio.ensure_future(first.wait())
            await asyncio.wait({fw, task}, timeout=ttft_timeout, return_when=asyncio.FIRST_COMPLETED)
            fw.cancel()
            if not first.is_set() and not task.done():
                rec["disconnected"] = True
                task.cancel()
        if cancel_after is not None:
            done, _ = await asyncio.wait({task}, timeout=cancel_after)
            if not done:
                rec["disconnected"] = True
                task.cancel()
        await task
    except asyncio.CancelledError:
        pass
    rec["ttft"] = rec["times"][0] - rec["t0"] if rec["times"] else None
    return rec


def gaps(rec, t_from=None, t_to=None):
    ts = rec["times"]
    return [b - a for a, b in zip(ts, ts[1:]) if (t_from is None or b >= t_from)
            and (t_to is None or a <= t_to)]


async def wait_idle(sess, srv, timeout=5.0):
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        _, v = await metrics(sess, srv)
        if v.get("vllm:num_requests_running", 1) == 0 and v.get("vllm:num_requests_waiting", 1) == 0:
            return v
        await asyncio.sleep(0.05)
    return v


def tagged(srv, rids, bug):
    gt = srv.gt_lines()
    return [r for r in rids if r in gt and bug in gt[r]["pathologies"]]


# ====================================================================== tests
async def test_api(sess, s):
    print("[api] clean server", flush=True)
    async with sess.get(s.base + "/health") as r:
        check(r.status == 200, "/health 200")
    async with sess.get(s.base + "/version") as r:
        check("version" in await r.json(), "/version")
    async with sess.get(s.base + "/v1/models") as r:
        m = await r.json()
    check(len(m["data"]) == 1 and m["data"][0]["max_model_len"] > 0, "/v1/models one model with max_model_len")
    model, L = m["data"][0]["id"], m["data"][0]["max_model_len"]

    st, j, h = await post(sess, s, "/v1/completions", {"model": model, "prompt": words("a", 37),
                          "max_tokens": 21, "ignore_eos": True}, rid="api-c1", raw=True)
    check(st == 200 and j["usage"]["prompt_tokens"] == 37 and j["usage"]["completion_tokens"] == 21
          and j["choices"][0]["finish_reason"] == "length" and len(j["choices"][0]["text"].split()) == 21,
          "completion: 37 words -> 37 prompt tokens, exactly max_tokens with ignore_eos")
    check(h.get("X-Request-Id") == "api-c1" and j["object"] == "text_completion", "X-Request-Id echoed")
    j = await post(sess, s, "/v1/completions", {"prompt": [5, 6, 7, 8, 70000], "max_tokens": 3, "ignore_eos": True})
    check(j["usage"]["prompt_tokens"] == 5, "token-id list prompt")
    j = await post(sess, s, "/v1/completions", {"prompt": "x y z", "max_tokens": 4, "n": 3, "logprobs": 2, "ignore_eos": True})
    check(len(j["choices"]) == 3 and j["usage"]["completion_tokens"] == 12
          and len(j["choices"][0]["logprobs"]["top_logprobs"][0]) >= 2, "n=3 with logprobs")
    stops = 0
    for i in range(12):
        j = await post(sess, s, "/v1/completions", {"prompt": "eos probe %d" % i, "max_tokens": 40})
        stops += j["choices"][0]["finish_reason"] == "stop" and j["usage"]["completion_tokens"] < 40
    check(stops > 0, "without ignore_eos some requests stop early (%d/12)" % stops)

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": words("q", 10)}]
    j = await post(sess, s, "/tokenize", {"messages": msgs})
    jc = await post(sess, s, "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "ignore_eos": True})
    check(jc["object"] == "chat.completion" and jc["choices"][0]["message"]["role"] == "assistant"
          and jc["usage"]["completion_tokens"] == 5, "chat completion")
    check(j["count"] == jc["usage"]["prompt_tokens"] == len(j["tokens"]), "/tokenize messages count == chat prompt_tokens")
    jc = await post(sess, s, "/v1/chat/completions", {"messages": msgs, "max_completion_tokens": 3, "ignore_eos": True})
    check(jc["usage"]["completion_tokens"] == 3, "chat max_completion_tokens")

    text = "the quick brown fox zyxwv-unknown jumps over 42 times"
    j = await post(sess, s, "/tokenize", {"prompt": text})
    d = await post(sess, s, "/detokenize", {"tokens": j["tokens"]})
    check(j["count"] == 9 and j["max_model_len"] == L and d["prompt"] == text, "tokenize/detokenize round trip")

    st, j, _ = await post(sess, s, "/v1/completions", {"prompt": words("w", 100), "max_tokens": L}, raw=True)
    check(st == 400 and j["error"]["code"] == 400 and "message" in j["error"], "400 when prompt+max_tokens > max_model_len")
    st, j, _ = await post(sess, s, "/v1/completions", {"prompt": words("w", L + 1)}, raw=True)
    check(st == 400, "400 when prompt alone exceeds max_model_len")

    # streaming formats
    r = await stream(sess, s, {"prompt": words("s", 12), "max_tokens": 6, "ignore_eos": True,
                               "stream_options": {"include_usage": True}}, "api-s1")
    ch = r["chunks"]
    fin = [c["choices"][0]["finish_reason"] for c in ch if c["choices"]]
    check(r["done"] and "bad_frame" not in r and len(r["times"]) == 6 and fin[-1] == "length"
          and all(f is None for f in fin[:-1]) and ch[-1]["choices"] == []
          and ch[-1]["usage"]["completion_tokens"] == 6 and ch[-1]["usage"]["prompt_tokens"] == 12
          and r["hdr_rid"] == "api-s1",
          "completion SSE: one token per chunk, finish on last token, usage chunk, [DONE]")
    r = await stream(sess, s, {"messages": msgs, "max_tokens": 4, "ignore_eos": True}, "api-s2",
                     path="/v1/chat/completions")
    ch = r["chunks"]
    check(ch[0]["choices"][0]["delta"].get("role") == "assistant" and len(r["times"]) == 4
          and ch[-1]["choices"][0]["finish_reason"] == "length" and r["done"]
          and ch[0]["object"] == "chat.completion.chunk", "chat SSE: role chunk, 4 content chunks, [DONE]")

    text, vals = await metrics(sess, s)
    need = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
            "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
            "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
            "vllm:request_queue_time_seconds_bucket", "vllm:time_per_output_token_seconds_bucket"]
    missing = [n for n in need if n not in vals]
    check(not missing and 'model_name="' in text, "metrics names present %s" % (missing or ""))

    # disconnects abort and free KV (clean mode): mid-decode and before the first token
    r = await stream(sess, s, {"prompt": words("d", 300), "max_tokens": 3000, "ignore_eos": True},
                     "api-disc1", stop_after_tokens=3)
    r2 = await stream(sess, s, {"prompt": uniq() + " " + words("e", 4000), "max_tokens": 500, "ignore_eos": True},
                      "api-disc2", cancel_after=0.02)
    await asyncio.sleep(0.3)
    _, v = await metrics(sess, s)
    gt = s.gt_lines()
    ok = all(gt.get(x, {}).get("finish_reason") == "abort" and gt[x]["client_disconnected"]
             for x in ("api-disc1", "api-disc2"))
    check(r["disconnected"] and r2["disconnected"] and v["vllm:num_requests_running"] == 0
          and v["vllm:kv_cache_usage_perc"] == 0 and ok,
          "client disconnect (mid-decode and before first token) aborts and frees KV")
    gt = s.gt_lines()
    check(gt.get("api-c1", {}).get("prompt_tokens") == 37 and gt["api-c1"]["output_tokens"] == 21,
          "ground-truth line fields")


async def fcfs_scenario(sess, s, tag):
    """32 seats held by fillers that finish one by one; then probes arrive in a known
    order, some sharing a cached 256-token prefix.  Returns probe records."""
    shared = words("shared", 256)
    await post(sess, s, "/v1/completions", {"prompt": shared + " warm", "max_tokens": 1})
    fill = [asyncio.ensure_future(post(sess, s, "/v1/completions",
            {"prompt": uniq() + " " + words("f", 19), "max_tokens": 40 + 6 * i, "ignore_eos": True},
            rid="%s-fill%d" % (tag, i))) for i in range(32)]
    await asyncio.sleep(0.12)
    kinds = ["U", "S", "S", "S", "U", "S", "S", "S", "S", "U"]
    probes = []
    for i, k in enumerate(kinds):
        p = (shared + " " + uniq() + " " + words("t", 12)) if k == "S" else (uniq() + " " + words("v", 268))
        probes.append(asyncio.ensure_future(stream(sess, s, {"prompt": p, "max_tokens": 24, "ignore_eos": True},
                                                   "%s-probe%d%s" % (tag, i, k))))
        await asyncio.sleep(0.012)
    recs = await asyncio.gather(*probes)
    await asyncio.gather(*fill)
    return recs


async def test_clean_fcfs(sess, s):
    print("[clean] FCFS order with saturated seats and shared-prefix probes", flush=True)
    recs = await fcfs_scenario(sess, s, "cfcfs")
    firsts = [r["times"][0] for r in recs]
    inv = sum(1 for a, b in zip(firsts, firsts[1:]) if b < a - 0.002)
    check(inv == 0, "first tokens in arrival order (inversions=%d)" % inv)
    return recs


async def test_clean_mixed(sess, s):
    print("[clean] mixed load with preempting bursts", flush=True)
    _, v0 = await metrics(sess, s)
    tasks = []
    shared = words("sys", 200)
    for b in range(2):
        for i in range(5):
            tasks.append(stream(sess, s, {"prompt": uniq() + " " + words("big", 3300), "max_tokens": 160,
                                          "ignore_eos": True}, "mix-big%d-%d" % (b, i)))
        for i in range(8):
            tasks.append(stream(sess, s, {"prompt": uniq() + " " + words("sm", 30), "max_tokens": 40},
                                "mix-small%d-%d" % (b, i)))
        for i in range(4):
            tasks.append(stream(sess, s, {"messages": [{"role": "system", "content": shared},
                                                       {"role": "user", "content": uniq()}],
                                          "max_tokens": 30}, "mix-chat%d-%d" % (b, i), path="/v1/chat/completions"))
        tasks.append(stream(sess, s, {"prompt": uniq() + " lp", "max_tokens": 60, "logprobs": 20},
                            "mix-lp%d" % b))
        tasks.append(post(sess, s, "/v1/completions", {"prompt": uniq() + " n", "max_tokens": 30, "n": 3},
                          rid="mix-n%d" % b))
        tasks.append(stream(sess, s, {"prompt": uniq() + " " + words("long", 5000), "max_tokens": 20},
                            "mix-long%d" % b))
        tasks.append(stream(sess, s, {"prompt": uniq() + " " + words("gone", 2000), "max_tokens": 300},
                            "mix-gone%d" % b, cancel_after=0.03))
    futs = []
    for i, t in enumerate(tasks):
        futs.append(asyncio.ensure_future(t))
        if i == len(tasks) // 2:
            await asyncio.sleep(0.8)
    await asyncio.gather(*futs)
    v = await wait_idle(sess, s)
    preempt = v["vllm:num_preemptions_total"] - v0["vllm:num_preemptions_total"]
    check(preempt > 0, "bursts of long prompts preempt (%d preemptions)" % preempt)
    check(v["vllm:kv_cache_usage_perc"] == 0, "KV fully freed after the load")
    SUMMARY.append("clean mixed load: %d preemptions" % preempt)


def check_clean_gt(s):
    gt = s.gt_lines()
    bad = [r for r, d in gt.items() if d["pathologies"]]
    check(len(gt) > 100 and not bad, "clean mode: %d ground-truth lines, none tagged %s" % (len(gt), bad[:3]))


# ---------------------------------------------------------------- bugs
async def scen_bug1(sess, s, tag):
    """Long-output holders; a further long-output request arrives while KV is mostly free."""
    holders = [asyncio.ensure_future(stream(sess, s, {"prompt": uniq() + " " + words("h", 199), "max_tokens": 4000,
                                                       "ignore_eos": True}, "%s-hold%d" % (tag, i), cancel_after=2.4))
               for i in range(3)]
    await asyncio.sleep(0.2)
    victim = asyncio.ensure_future(stream(sess, s, {"prompt": uniq() + " " + words("v", 199), "max_tokens": 3800,
                                                     "ignore_eos": True}, "%s-victim" % tag, ttft_timeout=1.5,
                                          stop_after_tokens=3))
    await asyncio.sleep(0.8)
    _, v = await metrics(sess, s)
    rec = await victim
    await asyncio.gather(*holders)
    return rec, v


async def test_bug1(sess, sb, sc):
    print("[bug1]", flush=True)
    (rb, vb), (rc, vc) = await asyncio.gather(scen_bug1(sess, sb, "b1"), scen_bug1(sess, sc, "c1"))
    tb = rb["ttft"] or 1.5
    check(rc["ttft"] is not None and rc["ttft"] < 0.2, "clean: victim TTFT %.3fs" % (rc["ttft"] or -1))
    check(tb > 1.0 and vb["vllm:num_requests_waiting"] >= 1 and vb["vllm:kv_cache_usage_perc"] < 0.2,
          "bug on: victim TTFT %s while waiting=%d, KV usage %.2f" % (
              "%.3fs" % rb["ttft"] if rb["ttft"] else ">1.5s (gave up)", vb["vllm:num_requests_waiting"],
              vb["vllm:kv_cache_usage_perc"]))
    await asyncio.sleep(0.2)
    check(tagged(sb, ["b1-victim"], "bug1") == ["b1-victim"], "bug on: victim tagged bug1")
    SUMMARY.append("bug1: victim TTFT clean %.3fs vs bug >=%.2fs (KV usage %.0f%%)" % (
        rc["ttft"] or -1, tb, 100 * vb["vllm:kv_cache_usage_perc"]))


async def test_bug2(sess, sb, clean_recs):
    print("[bug2]", flush=True)
    recs = await fcfs_scenario(sess, sb, "b2")
    firsts = [r["times"][0] for r in recs]
    inv = [(recs[i]["rid"], recs[j]["rid"]) for i in range(len(recs)) for j in range(i + 1, len(recs))
           if firsts[j] < firsts[i] - 0.002]
    check(len(inv) > 0, "bug on: later shared-prefix probes served before earlier ones (%d pairs)" % len(inv))
    u = [i for i, r in enumerate(recs) if r["rid"].endswith("U")]
    ratio = max(recs[i]["ttft"] / clean_recs[i]["ttft"] for i in u)
    check(ratio > 1.4, "bug on: unshared probe TTFT x%.2f vs clean" % ratio)
    await asyncio.sleep(0.1)
    passed = [recs[i]["rid"] for i in u if any(firsts[j] < firsts[i] - 0.002 for j in range(i + 1, len(recs)))]
    t = tagged(sb, [r["rid"] for r in recs], "bug2")
    check(passed and set(passed) <= set(t) and all(r.endswith("U") for r in t),
          "bug on: passed-over unshared probes tagged bug2 (%s), shared ones not" % t)
    SUMMARY.append("bug2: unshared probe TTFT up to x%.2f vs clean, %d inverted pairs" % (ratio, len(inv)))


async def scen_bug3(sess, s, tag):
    dec = [asyncio.ensure_future(stream(sess, s, {"prompt": uniq() + " " + words("d", 19), "max_tokens": 160,
                                                   "ignore_eos": True}, "%s-dec%d" % (tag, i))) for i in range(6)]
    await asyncio.sleep(0.25)
    t = time.monotonic()
    lr = await stream(sess, s, {"prompt": uniq() + " " + words("L", 5000), "max_tokens": 4, "ignore_eos": True},
                      "%s-long" % tag)
    t_end = time.monotonic()
    recs = await asyncio.gather(*dec)
    return max(max(gaps(r, t, t_end) or [0]) for r in recs), [r["rid"] for r in recs], lr


async def test_bug3(sess, sb, sc):
    print("[bug3]", flush=True)
    (gb, rb, lb), (gc, _, lc) = await asyncio.gather(scen_bug3(sess, sb, "b3"), scen_bug3(sess, sc, "c3"))
    check(gb > 3 * gc, "bug on: max inter-token gap of live streams %.1fms vs clean %.1fms" % (gb * 1e3, gc * 1e3))
    await asyncio.sleep(0.1)
    t = tagged(sb, rb, "bug3")
    check(len(t) >= 5, "bug on: stalled streams tagged bug3 (%d/6)" % len(t))
    SUMMARY.append("bug3: stream ITL stall %.0fms vs %.0fms clean (long prompt TTFT %.0f vs %.0fms)" % (
        gb * 1e3, gc * 1e3, lb["ttft"] * 1e3, lc["ttft"] * 1e3))


async def scen_bug4(sess, s, tag, k):
    vic = [asyncio.ensure_future(stream(sess, s, {"prompt": uniq() + " " + words("p", 19), "max_tokens": 100,
                                                   "ignore_eos": True}, "%s-k%d-vic%d" % (tag, k, i))) for i in range(8)]
    amp = asyncio.ensure_future(stream(sess, s, {"prompt": uniq() + " amp", "max_tokens": 130, "ignore_eos": True,
                                                 "logprobs": k}, "%s-k%d-amp" % (tag, k)))
    recs = await asyncio.gather(*vic)
    await amp
    g = [x for r in recs for x in gaps(r)[5:]]
    return sum(g) / len(g), [r["rid"] for r in recs]


async def test_bug4(sess, sb, sc):
    print("[bug4]", flush=True)
    for k, want in ((5, 1.15), (20, 1.6)):
        (ib, rb), (ic, _) = await asyncio.gather(scen_bug4(sess, sb, "b4", k), scen_bug4(sess, sc, "c4", k))
        check(ib > want * ic, "bug on, logprobs=%d: victims' mean ITL %.2fms vs clean %.2fms (x%.2f)" % (
            k, ib * 1e3, ic * 1e3, ib / ic))
        await asyncio.sleep(0.1)
        t = tagged(sb, rb, "bug4")
        check(len(t) == 8, "bug on, logprobs=%d: victims tagged bug4 (%d/8)" % (k, len(t)))
        SUMMARY.append("bug4: logprobs=%d -> victims' ITL x%.2f" % (k, ib / ic))


async def scen_bug5(sess, s, tag):
    gone = [asyncio.ensure_future(stream(sess, s, {"prompt": uniq() + " " + words("z", 4500), "max_tokens": 450,
                                                    "ignore_eos": True}, "%s-gone%d" % (tag, i), cancel_after=0.03))
            for i in range(3)]
    await asyncio.gather(*gone)
    await asyncio.sleep(0.2)
    _, v = await metrics(sess, s)
    vr = await stream(sess, s, {"prompt": uniq() + " " + words("v", 3000), "max_tokens": 8, "ignore_eos": True},
                      "%s-victim" % tag)
    return v, vr


async def test_bug5(sess, sb, sc):
    print("[bug5]", flush=True)
    (vb, rb), (vc, rc) = await asyncio.gather(scen_bug5(sess, sb, "b5"), scen_bug5(sess, sc, "c5"))
    check(vc["vllm:num_requests_running"] == 0 and vc["vllm:kv_cache_usage_perc"] == 0,
          "clean: requests abandoned before their first token are aborted")
    check(vb["vllm:num_requests_running"] == 3 and vb["vllm:kv_cache_usage_perc"] > 0.5,
          "bug on: abandoned requests keep running (running=%d, KV %.2f)" % (
              vb["vllm:num_requests_running"], vb["vllm:kv_cache_usage_perc"]))
    check(rb["ttft"] > 5 * rc["ttft"], "bug on: next request TTFT %.3fs vs clean %.3fs" % (rb["ttft"], rc["ttft"]))
    v = await wait_idle(sess, sb, 6)
    gt = sb.gt_lines()
    z = [gt.get("b5-gone%d" % i, {}) for i in range(3)]
    check(all(d.get("client_disconnected") and "bug5" in d["pathologies"] and d["finish_reason"] != "abort"
              for d in z), "bug on: leaked requests ran to completion, tagged bug5")
    check("bug5" in gt.get("b5-victim", {}).get("pathologies", []), "bug on: delayed request tagged bug5")
    SUMMARY.append("bug5: 3 leaked requests; next request TTFT %.2fs vs %.3fs clean" % (rb["ttft"], rc["ttft"]))


async def generic_load(sess, s, secs=5.0, workers=16):
    print("[generic] short equal requests, --bugs all, %d workers for %.0fs" % (workers, secs), flush=True)
    prompt = words("g", 24)
    stop = time.monotonic() + secs
    rids = []
    cpu0, t0 = s.cpu_s(), time.monotonic()

    async def worker(w):
        i = 0
        while time.monotonic() < stop:
            rid = "gen-%d-%d" % (w, i)
            rids.append(rid)
            if i % 2:
                await stream(sess, s, {"prompt": prompt, "max_tokens": 32, "ignore_eos": True}, rid)
            else:
                await post(sess, s, "/v1/completions", {"prompt": prompt, "max_tokens": 32, "ignore_eos": True}, rid=rid)
            i += 1
    await asyncio.gather(*(worker(w) for w in range(workers)))
    cpu = (s.cpu_s() - cpu0) / (time.monotonic() - t0)
    await asyncio.sleep(0.1)
    gt = s.gt_lines()
    got = [gt[r] for r in rids if r in gt]
    bad = [d["request_id"] for d in got if d["pathologies"]]
    check(len(got) == len(rids) and not bad, "generic load: %d requests, none tagged %s" % (len(got), bad[:3]))
    SUMMARY.append("generic load (--bugs all): %d requests, 0 tags; server CPU %.0f%% of a core at %d streams"
                   % (len(got), 100 * cpu, workers))
    return cpu


async def light_cpu(sess, s):
    """CPU at a moderate load (4 concurrent streams)."""
    cpu0, t0 = s.cpu_s(), time.monotonic()
    await asyncio.gather(*(stream(sess, s, {"prompt": words("c", 40), "max_tokens": 300, "ignore_eos": True},
                                  "cpu-%d" % i) for i in range(4)))
    cpu = (s.cpu_s() - cpu0) / (time.monotonic() - t0)
    SUMMARY.append("server CPU %.1f%% of a core at 4 concurrent streams" % (100 * cpu))
    check(cpu < 0.25, "CPU low at moderate load (%.1f%%)" % (100 * cpu))


async def test_sigterm(sess, s):
    print("[sigterm]", flush=True)
    futs = [asyncio.ensure_future(stream(sess, s, {"prompt": uniq() + " " + words("k", 200), "max_tokens": 3000,
                                                    "ignore_eos": True}, "term-%d" % i)) for i in range(3)]
    await asyncio.sleep(0.4)
    t = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    try:
        s.proc.wait(3)
    except subprocess.TimeoutExpired:
        pass
    dt = time.monotonic() - t
    await asyncio.gather(*futs, return_exceptions=True)
    gt = s.gt_lines()
    ok = all(gt.get("term-%d" % i, {}).get("finish_reason") == "abort" for i in range(3))
    check(s.proc.returncode is not None and dt < 1.5 and ok,
          "SIGTERM: exit in %.2fs, in-flight requests written as aborted" % dt)


async def main():
    t_start = time.monotonic()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as sess:
        clean = Srv("none", "clean")
        ref = Srv("none", "ref")
        b = {k: Srv(k, k) for k in ("bug1", "bug2", "bug3", "bug4", "bug5")}
        allb = Srv("all", "all")
        await asyncio.gather(*(x.ready(sess) for x in Srv.ALL))
        await test_api(sess, clean)
        await light_cpu(sess, ref)
        clean_recs = await test_clean_fcfs(sess, clean)
        await test_clean_mixed(sess, clean)
        await test_bug1(sess, b["bug1"], ref)
        await test_bug2(sess, b["bug2"], clean_recs)
        await test_bug3(sess, b["bug3"], ref)
        await test_bug4(sess, b["bug4"], ref)
        await test_bug5(sess, b["bug5"], ref)
        await generic_load(sess, allb)
        check_clean_gt(clean)
        check(not [d for d in ref.gt_lines().values() if d["pathologies"]], "reference clean server: no tags")
        await test_sigterm(sess, clean)
    for x in Srv.ALL:
        x.stop()
    print("\nsummary:")
    for line in SUMMARY:
        print("  " + line)
    print("selftest %s in %.1fs (%d failures); logs in %s" % ("PASSED" if not FAILS else "FAILED",
          time.monotonic() - t_start, len(FAILS), TMP))
    return 1 if FAILS else 0


if __name__ == "__main__":
    rc = 1
    try:
        rc = asyncio.run(main())
    finally:
        for x in Srv.ALL:
            try:
                x.stop()
            except Exception:
                pass
    sys.exit(rc)
