#!/usr/bin/env python3
"""Self-test for server.py.  Exits non-zero on failure.

Part 1 checks the clean configuration (--bugs none): endpoints, tokenizer,
streaming format, validation, FCFS behaviour, disconnects, metrics, ground
truth and SIGTERM handling.  Part 2 runs one trigger scenario per planted bug
against a clean server and a server with only that bug enabled, and checks
that the bug changes client-observable latency and is tagged in the ground
truth.  Part 3 smoke-tests --bugs all with a mixed workload.
"""
import asyncio
import json
import os
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
MODEL = "simlab/quokka-7b-instruct"
TMP = tempfile.mkdtemp(prefix="simvllm_selftest_")
FAILS = []
NPASS = 0
VERBOSE = "-v" in sys.argv


def check(cond, msg):
    global NPASS
    if cond:
        NPASS += 1
        if VERBOSE:
            print("  ok:", msg)
    else:
        FAILS.append(msg)
        print("  FAIL:", msg, flush=True)
    return cond


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def words(n, tag):
    return " ".join("%s%d" % (tag, i) for i in range(n))


class Srv:
    n = 0

    def __init__(self, bugs="none", seed=1):
        Srv.n += 1
        self.port = free_port()
        self.bugs = bugs
        self.gt = os.path.join(TMP, "gt_%d_%s.jsonl" % (Srv.n, bugs.replace(",", "_")))
        self.errf = open(os.path.join(TMP, "err_%d.log" % Srv.n), "w")
        self.proc = subprocess.Popen(
            [sys.executable, SERVER, "--port", str(self.port), "--seed", str(seed),
             "--bugs", bugs, "--ground-truth", self.gt],
            stdout=subprocess.DEVNULL, stderr=self.errf)
        self.url = "http://127.0.0.1:%d" % self.port

    async def ready(self, sess):
        t0 = time.time()
        while time.time() - t0 < 20:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited early (bugs=%s)" % self.bugs)
            try:
                async with sess.get(self.url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
        raise RuntimeError("server did not come up")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.errf.close()

    def gt_lines(self):
        out = []
        if os.path.exists(self.gt):
            with open(self.gt) as f:
                for line in f:
                    line = line.strip()
                    if line:
                        out.append(json.loads(line))
        return out

    def gt_by_id(self):
        return {r["request_id"]: r for r in self.gt_lines()}


async def post(sess, srv, path, body, rid=None):
    hdr = {"X-Request-Id": rid} if rid else {}
    async with sess.post(srv.url + path, json=body, headers=hdr) as r:
        txt = await r.text()
        try:
            js = json.loads(txt)
        except ValueError:
            js = None
        return r.status, js, r.headers


async def sse(sess, srv, path, body, rid):
    """Returns (status, list of (t, payload-str)), t relative to send."""
    t0 = time.perf_counter()
    evs = []
    async with sess.post(srv.url + path, json=body, headers={"X-Request-Id": rid}) as r:
        status = r.status
        buf = b""
        async for chunk in r.content.iter_any():
            now = time.perf_counter() - t0
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                evs.append((now, ev.decode()))
        if buf.strip():
            evs.append((time.perf_counter() - t0, "TRAILING:" + buf.decode()))
    return status, evs, t0


async def send_and_drop(srv, path, body, rid, after_s=None, read_events=0):
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    data = json.dumps(body).encode()
    writer.write(("POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  "X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n" % (path, rid, len(data))).encode()
                 + data)
    await writer.drain()
    if read_events:
        got = b""
        t0 = time.time()
        while got.count(b"data: ") < read_events and time.time() - t0 < 10:
            chunk = await asyncio.wait_for(reader.read(65536), 10)
            if not chunk:
                break
            got += chunk
    else:
        await asyncio.sleep(after_s)
    writer.transport.abort()


async def metrics(sess, srv):
    async with sess.get(srv.url + "/metrics") as r:
        return await r.text()


def metric_value(text, name, extra=None):
    for line in text.splitlines():
        if line.startswith(name + "{") and (extra is None or extra in line):
            return float(line.rsplit(" ", 1)[1])
    return None


async def wait_idle(sess, srv, timeout=10):
    t0 = time.time()
    while time.time() - t0 < timeout:
        m = await metrics(sess, srv)
        if (metric_value(m, "vllm:num_requests_running") == 0
                and metric_value(m, "vllm:num_requests_waiting") == 0):
            return m
        await asyncio.sleep(0.05)
    return await metrics(sess, srv)


# ---------------------------------------------------------------------------
# Part 1: clean configuration
# ---------------------------------------------------------------------------
async def part_clean(sess):
    print("[clean] starting server --bugs none", flush=True)
    srv = Srv("none")
    try:
        await srv.ready(sess)
        # endpoints
        async with sess.get(srv.url + "/health") as r:
            check(r.status == 200, "/health 200")
        async with sess.get(srv.url + "/version") as r:
            check(r.status == 200 and "version" in await r.json(), "/version")
        async with sess.get(srv.url + "/v1/models") as r:
            js = await r.json()
            check(js["data"][0]["id"] == MODEL and js["data"][0]["max_model_len"] == 6144,
                  "/v1/models lists the model with max_model_len")
        # tokenizer
        st, js, _ = await post(sess, srv, "/tokenize", {"prompt": "a b  c"})
        check(st == 200 and js["count"] == 4 and js["tokens"][0] == 1
              and js["max_model_len"] == 6144, "tokenize string adds BOS")
        st, js, _ = await post(sess, srv, "/tokenize", {"prompt": "a b c",
                                                        "add_special_tokens": False})
        check(js["count"] == 3, "tokenize without special tokens")
        msgs = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello there world"}]
        st, js, _ = await post(sess, srv, "/tokenize", {"messages": msgs,
                                                        "add_generation_prompt": True})
        check(st == 200 and js["count"] == 11, "chat template token count (got %s)"
              % (js or {}).get("count"))
        chat_ids = js["tokens"]
        st, js, _ = await post(sess, srv, "/detokenize", {"tokens": chat_ids})
        check(st == 200 and js["prompt"].split()[:2] == ["<s>", "<|system|>"]
              and "hello there world" in js["prompt"], "detokenize round trip")

        # non-streaming completion
        st, js, hd = await post(sess, srv, "/v1/completions",
                                {"model": MODEL, "prompt": "one two three", "max_tokens": 8,
                                 "ignore_eos": True}, rid="c-basic")
        check(st == 200 and hd.get("X-Request-Id") == "c-basic", "X-Request-Id echoed")
        check(js["id"] == "cmpl-c-basic" and js["object"] == "text_completion", "completion id")
        check(js["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12,
                              "prompt_tokens_details": None}, "completion usage")
        check(js["choices"][0]["finish_reason"] == "length"
              and len(js["choices"][0]["text"].split()) == 8, "length finish")
        # token-id prompt and one-element list
        st, js, _ = await post(sess, srv, "/v1/completions",
                               {"prompt": [5, 100, 200], "max_tokens": 2, "ignore_eos": True})
        check(st == 200 and js["usage"]["prompt_tokens"] == 3, "token-id prompt used as given")
        st, js, _ = await post(sess, srv, "/v1/completions",
                               {"prompt": ["x y"], "max_tokens": 1})
        check(st == 200 and js["usage"]["prompt_tokens"] == 3, "one-element list prompt")
        # natural stops, n, logprobs, min_tokens
        st, js, _ = await post(sess, srv, "/v1/completions",
                               {"prompt": "tell me", "max_tokens": 3000, "n": 4, "logprobs": 2},
                               rid="c-natural")
        ok = st == 200 and len(js["choices"]) == 4
        ok = ok and all(c["finish_reason"] == "stop" for c in js["choices"])
        ok = ok and js["usage"]["completion_tokens"] < 4 * 3000
        ok = ok and all(len(c["logprobs"]["token_logprobs"]) >= 1 for c in js["choices"])
        check(ok, "natural stop with n=4 and logprobs")
        st, js, _ = await post(sess, srv, "/v1/completions",
                               {"prompt": "x", "max_tokens": 80, "min_tokens": 60, "seed": 3})
        check(st == 200 and js["usage"]["completion_tokens"] >= 61, "min_tokens respected")
        st2, js2, _ = await post(sess, srv, "/v1/completions",
                                 {"prompt": "x", "max_tokens": 80, "min_tokens": 60, "seed": 3})
        check(js2["choices"][0]["text"] == js["choices"][0]["text"], "seed is reproducible")
        # chat non-stream
        st, js, _ = await post(sess, srv, "/v1/chat/completions",
                               {"model": MODEL, "messages": msgs, "max_completion_tokens": 5,
                                "ignore_eos": True, "logprobs": True, "top_logprobs": 3},
                               rid="chat-basic")
        ok = st == 200 and js["object"] == "chat.completion"
        ok = ok and js["choices"][0]["message"]["role"] == "assistant"
        ok = ok and js["usage"]["prompt_tokens"] == 11 and js["usage"]["completion_tokens"] == 5
        ok = ok and len(js["choices"][0]["logprobs"]["content"]) == 5
        ok = ok and len(js["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
        check(ok, "chat completion non-stream")

        # streaming chat with usage
        st, evs, _ = await sse(sess, srv, "/v1/chat/completions",
                               {"messages": msgs, "max_tokens": 5, "n": 2, "stream": True,
                                "ignore_eos": True, "stream_options": {"include_usage": True}},
                               rid="chat-stream")
        payloads = [e for _, e in evs]
        check(st == 200 and all(p.startswith("data: ") for p in payloads), "SSE framing")
        check(payloads[-1] == "data: [DONE]", "stream ends with [DONE]")
        objs = [json.loads(p[6:]) for p in payloads[:-1]]
        usage = objs[-1]
        check(usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
              and usage["usage"]["prompt_tokens"] == 11, "usage chunk")
        roles = [o for o in objs[:-1] if o["choices"][0]["delta"].get("role") == "assistant"]
        check(len(roles) == 2 and objs[0]["choices"][0]["delta"].get("role") == "assistant",
              "role chunks first")
        for idx in (0, 1):
            toks = [o["choices"][0] for o in objs[:-1]
                    if o["choices"][0]["index"] == idx and "role" not in o["choices"][0]["delta"]]
            check(len(toks) == 5 and toks[-1]["finish_reason"] == "length"
                  and all(t["finish_reason"] is None for t in toks[:-1]),
                  "finish_reason on last token chunk (choice %d)" % idx)
        # streaming completion without usage
        st, evs, _ = await sse(sess, srv, "/v1/completions",
                               {"prompt": "a b", "max_tokens": 4, "stream": True,
                                "ignore_eos": True}, rid="cmpl-stream")
        payloads = [e for _, e in evs]
        objs = [json.loads(p[6:]) for p in payloads[:-1]]
        check(len(objs) == 4 and objs[-1]["choices"][0]["finish_reason"] == "length"
              and objs[0]["object"] == "text_completion" and payloads[-1] == "data: [DONE]",
              "completion stream")

        # validation errors
        st, js, _ = await post(sess, srv, "/v1/completions",
                               {"prompt": words(6100, "z"), "max_tokens": 100}, rid="err-long")
        check(st == 400 and set(js["error"]) == {"message", "type", "param", "code"}
              and js["error"]["code"] == 400, "too long -> 400 OpenAI error")
        st, js, _ = await post(sess, srv, "/v1/completions",
                               {"prompt": "a", "logprobs": 21}, rid="err-lp")
        check(st == 400, "logprobs > 20 -> 400")
        st, js, _ = await post(sess, srv, "/v1/completions",
                               {"prompt": "a", "model": "nope"}, rid="err-model")
        check(st == 404 and js["error"]["type"] == "NotFoundError", "unknown model -> 404")

        # FCFS: long prompts arriving in order get first tokens in order
        tasks = []
        for i in range(6):
            body = {"prompt": words(3000, "f%d_" % i), "max_tokens": 30, "ignore_eos": True,
                    "stream": True}
            tasks.append(asyncio.create_task(sse(sess, srv, "/v1/completions", body,
                                                 "fcfs-%d" % i)))
            await asyncio.sleep(0.015)
        res = await asyncio.gather(*tasks)
        firsts = [t0 + evs[0][0] for st, evs, t0 in res]
        check(all(st == 200 for st, _, _ in res), "fcfs requests succeed")
        check(all(firsts[i] <= firsts[i + 1] + 0.003 for i in range(5)),
              "FCFS: first tokens in arrival order %s"
              % [round(f - firsts[0], 3) for f in firsts])

        # client disconnect mid-stream
        await send_and_drop(srv, "/v1/completions",
                            {"prompt": "p q r", "max_tokens": 2000, "ignore_eos": True,
                             "stream": True}, "drop-1", read_events=3)
        m = await wait_idle(sess, srv, 5)
        check(metric_value(m, "vllm:num_requests_running") == 0, "disconnect frees the slot")

        # metrics
        lab = 'model_name="%s",engine="0"' % MODEL
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                     "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                     "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            check(("%s{%s}" % (name, lab)) in m, "metric %s present" % name)
        kv = metric_value(m, "vllm:kv_cache_usage_perc")
        check(kv is not None and 0.0 <= kv <= 1.0, "kv usage in [0,1]")
        check(metric_value(m, "vllm:request_success_total", 'finished_reason="abort"') >= 1,
              "abort counted")
        check(metric_value(m, "vllm:request_success_total", 'finished_reason="length"') >= 10,
              "length counted")
        check(metric_value(m, "vllm:request_success_total", 'finished_reason="stop"') >= 4,
              "stop counted")
        check(metric_value(m, "vllm:generation_tokens_total") > 100, "generation tokens")
        check(metric_value(m, "vllm:prompt_tokens_total") > 18000, "prompt tokens")
        ci = [l for l in m.splitlines() if l.startswith("vllm:cache_config_info{")]
        check(len(ci) == 1 and 'block_size="32"' in ci[0] and 'num_gpu_blocks="480"' in ci[0]
              and 'enable_prefix_caching="True"' in ci[0]
              and 'max_num_batched_tokens="1536"' in ci[0] and 'max_num_seqs="48"' in ci[0]
              and ci[0].endswith(" 1.0") and lab in ci[0], "cache_config_info")
        for h in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                  "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                  "vllm:iteration_tokens_total"):
            c = metric_value(m, h + "_count")
            inf = metric_value(m, h + "_bucket", 'le="+Inf"')
            check(c is not None and c > 0 and inf == c, "histogram %s" % h)
        check(all(lab in l for l in m.splitlines() if l and not l.startswith("#")),
              "every series carries model_name and engine labels")

        # SIGTERM with a request in flight
        task = asyncio.create_task(post(sess, srv, "/v1/completions",
                                        {"prompt": "s t", "max_tokens": 3000,
                                         "ignore_eos": True}, rid="inflight-term"))
        await asyncio.sleep(0.3)
        t0 = time.time()
        srv.proc.send_signal(signal.SIGTERM)
        try:
            srv.proc.wait(3)
        except subprocess.TimeoutExpired:
            pass
        dt = time.time() - t0
        check(srv.proc.poll() is not None and dt < 1.5, "SIGTERM exits quickly (%.2fs)" % dt)
        try:
            await asyncio.wait_for(task, 3)
        except Exception:
            pass

        gt = srv.gt_by_id()
        check(all(not r["pathologies"] for r in gt.values()), "no pathologies with --bugs none")
        r = gt.get("c-basic")
        check(r is not None and r["finish_reason"] == "length" and r["prompt_tokens"] == 4
              and r["output_tokens"] == 8 and not r["client_disconnected"]
              and isinstance(r["e2e_s"], float), "ground truth for a completion")
        r = gt.get("c-natural")
        check(r is not None and r["finish_reason"] == "stop", "ground truth natural stop")
        r = gt.get("chat-stream")
        check(r is not None and r["output_tokens"] == 10 and r["prompt_tokens"] == 11,
              "ground truth for a stream with n=2")
        r = gt.get("err-long")
        check(r is not None and r["finish_reason"] == "error" and r["output_tokens"] == 0,
              "ground truth for a validation error")
        r = gt.get("drop-1")
        check(r is not None and r["finish_reason"] == "abort" and r["client_disconnected"]
              and r["output_tokens"] >= 3, "ground truth for a client disconnect")
        r = gt.get("inflight-term")
        check(r is not None and r["finish_reason"] == "abort" and not r["client_disconnected"],
              "ground truth for SIGTERM abort")
        check(all(gt.get("fcfs-%d" % i, {}).get("prompt_tokens") == 3001 for i in range(6)),
              "ground truth prompt tokens")
        keys = {"request_id", "finish_reason", "client_disconnected", "e2e_s", "prompt_tokens",
                "output_tokens", "pathologies"}
        check(all(set(r) == keys for r in srv.gt_lines()), "ground truth keys")
    finally:
        srv.stop()


# ---------------------------------------------------------------------------
# Part 2: planted bugs
# ---------------------------------------------------------------------------
async def scen_leak(sess, srv):
    keeper = asyncio.create_task(post(sess, srv, "/v1/completions",
                                      {"prompt": words(100, "k"), "max_tokens": 150,
                                       "ignore_eos": True}, rid="leak-keeper"))
    await asyncio.sleep(0.12)
    await send_and_drop(srv, "/v1/completions",
                        {"prompt": words(5000, "x"), "max_tokens": 5, "stream": True},
                        "leak-drop", after_s=0.045)
    await asyncio.sleep(0.05)
    kv = metric_value(await metrics(sess, srv), "vllm:kv_cache_usage_perc")
    tasks = []
    for i in range(3):
        tasks.append(asyncio.create_task(post(
            sess, srv, "/v1/completions",
            {"prompt": words(4500, "l%d_" % i), "max_tokens": 20, "ignore_eos": True},
            rid="leak-%d" % i)))
        await asyncio.sleep(0.005)
    await asyncio.gather(*tasks)
    await keeper
    m = await wait_idle(sess, srv)
    return {"kv_after_drop": kv, "kv_idle": metric_value(m, "vllm:kv_cache_usage_perc")}


async def scen_requeue(sess, srv):
    tasks = []
    for i in range(12):
        tasks.append(asyncio.create_task(post(
            sess, srv, "/v1/completions",
            {"prompt": words(1200, "g%d_" % i), "max_tokens": 120, "ignore_eos": True},
            rid="rq-g%d" % i)))
        await asyncio.sleep(0.003)
    await asyncio.sleep(0.15)
    for i in range(8):
        tasks.append(asyncio.create_task(post(
            sess, srv, "/v1/completions",
            {"prompt": words(1200, "w%d_" % i), "max_tokens": 60, "ignore_eos": True},
            rid="rq-q%d" % i)))
        await asyncio.sleep(0.003)
    await asyncio.gather(*tasks)
    m = await wait_idle(sess, srv)
    return {"preemptions": metric_value(m, "vllm:num_preemptions_total")}


async def scen_seed(sess, srv, with_seed=True):
    tasks = []
    for i in range(9):
        body = {"prompt": words(50, "s%d_" % i), "max_tokens": 60, "ignore_eos": True,
                "stream": True}
        if i == 8 and with_seed:
            body["seed"] = 1234
        tasks.append(asyncio.create_task(sse(sess, srv, "/v1/completions", body,
                                             "seed-%d" % i)))
    res = await asyncio.gather(*tasks)
    gaps = []
    for st, evs, _ in res[:8]:
        ts = [t for t, e in evs if e != "data: [DONE]"]
        gaps.extend(b - a for a, b in zip(ts, ts[1:]))
    gaps.sort()
    return {"itl_median": gaps[len(gaps) // 2] if gaps else 0.0}


async def scen_prefix(sess, srv):
    prefix = words(1500, "p")
    await post(sess, srv, "/v1/completions", {"prompt": prefix + " warm", "max_tokens": 1},
               rid="pfx-warm")
    await asyncio.sleep(0.05)
    tasks = [asyncio.create_task(post(
        sess, srv, "/v1/completions",
        {"prompt": prefix + " " + words(8, "u%d_" % i), "max_tokens": 4, "ignore_eos": True},
        rid="pfx-%d" % i)) for i in range(24)]
    await asyncio.gather(*tasks)
    m = await wait_idle(sess, srv)
    return {"hits": metric_value(m, "vllm:prefix_cache_hits_total")}


async def scen_victim(sess, srv):
    tasks = []
    for i in range(3):
        tasks.append(asyncio.create_task(post(
            sess, srv, "/v1/completions",
            {"prompt": words(5087, "v%d_" % i), "max_tokens": 100, "ignore_eos": True},
            rid="vic-%d" % i)))
        await asyncio.sleep(0.005)
    await asyncio.gather(*tasks)
    m = await wait_idle(sess, srv)
    return {"preemptions": metric_value(m, "vllm:num_preemptions_total")}


async def run_pair(sess, bug, scen, **kw):
    out = {}
    for mode in ("none", bug):
        srv = Srv(mode)
        try:
            await srv.ready(sess)
            # absorb the cold start
            await post(sess, srv, "/v1/completions", {"prompt": "warm up", "max_tokens": 3,
                                                      "ignore_eos": True}, rid="warmup")
            res = await scen(sess, srv, **kw)
        finally:
            srv.stop()
        res["gt"] = srv.gt_by_id()
        out[mode] = res
    return out["none"], out[bug]


def tagged(gt, bug):
    return sorted(r for r, v in gt.items() if bug in v["pathologies"])


def e2e(gt, rid):
    return gt[rid]["e2e_s"] if rid in gt else float("nan")


async def part_bugs(sess):
    print("[bug1] leak scenario", flush=True)
    c, b = await run_pair(sess, "bug1", scen_leak)
    check(not any(v["pathologies"] for v in c["gt"].values()), "bug1: clean run untagged")
    check(b["kv_after_drop"] - c["kv_after_drop"] > 0.08,
          "bug1: KV usage stays high after a mid-prefill cancel (%.3f vs %.3f)"
          % (b["kv_after_drop"], c["kv_after_drop"]))
    check(e2e(b["gt"], "leak-2") > e2e(c["gt"], "leak-2") + 0.04,
          "bug1: later long request slower (%.3f vs %.3f)"
          % (e2e(b["gt"], "leak-2"), e2e(c["gt"], "leak-2")))
    check("leak-2" in tagged(b["gt"], "bug1"), "bug1: victim tagged %s" % tagged(b["gt"], "bug1"))
    check(b["kv_idle"] < 0.01, "bug1: leaked blocks reclaimed when idle")
    check(b["gt"].get("leak-drop", {}).get("finish_reason") == "abort", "bug1: drop recorded")

    print("[bug2] requeue scenario", flush=True)
    c, b = await run_pair(sess, "bug2", scen_requeue)
    tb = tagged(b["gt"], "bug2")
    check(c["preemptions"] >= 1 and b["preemptions"] > c["preemptions"],
          "bug2: preemptions (%s clean, %s buggy)" % (c["preemptions"], b["preemptions"]))
    rids = ["rq-g%d" % i for i in range(12)] + ["rq-q%d" % i for i in range(8)]
    mc = sum(e2e(c["gt"], r) for r in rids) / len(rids)
    mb = sum(e2e(b["gt"], r) for r in rids) / len(rids)
    check(mb > 1.08 * mc, "bug2: mean e2e inflated (%.3f vs %.3f)" % (mb, mc))
    check(len(tb) >= 5 and any(r.startswith("rq-q") for r in tb),
          "bug2: requests tagged %s" % tb)
    check(not any(v["pathologies"] for v in c["gt"].values()), "bug2: clean run untagged")

    print("[bug3] seed scenario", flush=True)
    c, b = await run_pair(sess, "bug3", scen_seed)
    check(b["itl_median"] > 1.3 * c["itl_median"],
          "bug3: batch ITL inflated by a seeded request (%.4f vs %.4f)"
          % (b["itl_median"], c["itl_median"]))
    tb = tagged(b["gt"], "bug3")
    check(len([r for r in tb if r != "seed-8"]) >= 6, "bug3: co-batched requests tagged %s" % tb)
    srv = Srv("bug3")
    try:
        await srv.ready(sess)
        await post(sess, srv, "/v1/completions", {"prompt": "warm up", "max_tokens": 3},
                   rid="warmup")
        ctl = await scen_seed(sess, srv, with_seed=False)
    finally:
        srv.stop()
    check(not any(v["pathologies"] for v in srv.gt_lines()), "bug3: silent without seeds")
    check(ctl["itl_median"] < 1.2 * c["itl_median"], "bug3: no slowdown without seeds "
          "(%.4f vs %.4f)" % (ctl["itl_median"], c["itl_median"]))

    print("[bug4] shared-prefix burst scenario", flush=True)
    c, b = await run_pair(sess, "bug4", scen_prefix)
    ce = sorted(v["e2e_s"] for k, v in c["gt"].items() if k.startswith("pfx-") and k != "pfx-warm")
    be = sorted(v["e2e_s"] for k, v in b["gt"].items() if k.startswith("pfx-") and k != "pfx-warm")
    check(c["hits"] > 20000 and b["hits"] > 20000, "bug4: prefix cache hits")
    check(be[-1] > ce[-1] * 1.3 and be[-1] > ce[-1] + 0.02,
          "bug4: burst tail latency inflated (%.3f vs %.3f)" % (be[-1], ce[-1]))
    tb = tagged(b["gt"], "bug4")
    check(len(tb) >= 3, "bug4: delayed burst requests tagged %s" % tb)
    check(not any(v["pathologies"] for v in c["gt"].values()), "bug4: clean run untagged")

    print("[bug5] preemption victim scenario", flush=True)
    c, b = await run_pair(sess, "bug5", scen_victim)
    check(c["preemptions"] >= 1 and b["preemptions"] >= 1, "bug5: scenario preempts")
    check(e2e(b["gt"], "vic-0") > e2e(c["gt"], "vic-0") + 0.1,
          "bug5: oldest request pays the preemption (%.3f vs %.3f)"
          % (e2e(b["gt"], "vic-0"), e2e(c["gt"], "vic-0")))
    check("vic-0" in tagged(b["gt"], "bug5"), "bug5: victim tagged %s" % tagged(b["gt"], "bug5"))
    check(not any(v["pathologies"] for v in c["gt"].values()), "bug5: clean run untagged")


# ---------------------------------------------------------------------------
# Part 3: everything on, mixed workload, no crash
# ---------------------------------------------------------------------------
async def part_all(sess):
    print("[all] mixed workload with --bugs all", flush=True)
    srv = Srv("all")
    try:
        await srv.ready(sess)
        tasks = []
        n_sent = 0
        for i in range(16):
            kind = i % 4
            if kind == 0:
                body = {"prompt": words(900 + 200 * i, "m%d_" % i), "max_tokens": 40,
                        "ignore_eos": True, "stream": True, "n": 2, "seed": i}
                tasks.append(asyncio.create_task(sse(sess, srv, "/v1/completions", body,
                                                     "all-%d" % i)))
            elif kind == 1:
                body = {"messages": [{"role": "user", "content": words(300, "c%d_" % i)}],
                        "max_tokens": 30, "logprobs": True, "top_logprobs": 5}
                tasks.append(asyncio.create_task(post(sess, srv, "/v1/chat/completions",
                                                      body, "all-%d" % i)))
            elif kind == 2:
                tasks.append(asyncio.create_task(send_and_drop(
                    srv, "/v1/completions", {"prompt": words(3000, "d%d_" % i),
                                             "max_tokens": 50, "stream": True},
                    "all-%d" % i, after_s=0.03)))
            else:
                body = {"prompt": words(200, "common") + " " + words(20, "e%d_" % i),
                        "max_tokens": 200, "ignore_eos": True}
                tasks.append(asyncio.create_task(post(sess, srv, "/v1/completions", body,
                                                      "all-%d" % i)))
            n_sent += 1
            await asyncio.sleep(0.01)
        res = await asyncio.gather(*tasks, return_exceptions=True)
        st_ok = all(r is None or (isinstance(r, tuple) and r[0] == 200) for r in res)
        check(st_ok, "all bugs: every request answered 200")
        await wait_idle(sess, srv)
        async with sess.get(srv.url + "/health") as r:
            check(r.status == 200, "all bugs: server healthy")
    finally:
        srv.stop()
    ids = {r["request_id"] for r in srv.gt_lines()}
    check(len(ids) == n_sent, "all bugs: one ground-truth line per request (%d/%d)"
          % (len(ids), n_sent))


async def main():
    t0 = time.time()
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as sess:
        await part_clean(sess)
        await part_bugs(sess)
        await part_all(sess)
    dt = time.time() - t0
    print("%d passed, %d failed" % (NPASS, len(FAILS)))
    print("runtime %.1fs" % dt)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
