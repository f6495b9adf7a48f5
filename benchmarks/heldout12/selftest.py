#!/usr/bin/env python3
"""Self-test for server.py (run with the same interpreter that has aiohttp).

Starts a clean server (--bugs none) and an all-bugs server (--bugs all) on free
127.0.0.1 ports, checks the API, SSE streams, metrics, ground truth, client
disconnects and SIGTERM handling, then replays one traffic mix per planted bug
against both servers at once and checks that the bug fired (ground-truth tag)
and harmed its victim (>= 2x versus the clean server on the same traffic).
Exits non-zero on any failure.  Always stops the servers it started.
"""
import asyncio
import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.join(HERE, "server.py")
PROCS = []
FAILS = []
T0 = time.monotonic()


def log(msg):
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def check(cond, msg):
    if cond:
        log("ok   " + msg)
    else:
        log("FAIL " + msg)
        FAILS.append(msg)
    return cond


def start_server(bugs, gt):
    p = subprocess.Popen([sys.executable, SERVER, "--port", "0", "--seed", "7", "--bugs", bugs,
                          "--ground-truth", gt], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True, text=True)
    PROCS.append(p)
    deadline = time.monotonic() + 15
    line = ""
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if "port=" in line:
            break
        if p.poll() is not None:
            break
    if "port=" not in line:
        raise RuntimeError(f"server ({bugs}) did not start: {line!r}")
    port = int(line.split("port=")[1].split()[0])
    log(f"started server bugs={bugs} pid={p.pid} port={port}: {line.strip()}")
    return p, port


def stop_proc(p, sig=signal.SIGTERM, wait=3.0):
    if p.poll() is not None:
        return p.returncode
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        return p.returncode
    try:
        return p.wait(wait)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return p.wait(3)


def stop_all():
    for p in PROCS:
        try:
            stop_proc(p)
        except Exception:
            pass


def words(tag, n):
    return " ".join(f"{tag}_{i}" for i in range(n))


def read_gt(path):
    out = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                r = json.loads(line)
                out[r["request_id"]] = r
    return out


class Client:
    def __init__(self, session, port):
        self.s = session
        self.base = f"http://127.0.0.1:{port}"

    async def get(self, path):
        async with self.s.get(self.base + path) as r:
            return r.status, await r.text(), r.headers

    async def post(self, path, body, rid=None):
        h = {"X-Request-Id": rid} if rid else {}
        t = time.monotonic()
        async with self.s.post(self.base + path, json=body, headers=h) as r:
            txt = await r.text()
            try:
                js = json.loads(txt)
            except ValueError:
                js = None
            return r.status, js, r.headers, time.monotonic() - t

    async def stream(self, path, body, rid, cancel_after=None, on_token=None):
        body = dict(body, stream=True)
        t0 = time.monotonic()
        res = {"t0": t0, "times": {}, "finish": {}, "done": False, "usage": None, "chunks": 0,
               "status": None, "headers": None, "text": {}}
        async with self.s.post(self.base + path, json=body, headers={"X-Request-Id": rid}) as r:
            res["status"] = r.status
            res["headers"] = r.headers
            ntok = 0
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res["done"] = True
                    break
                d = json.loads(data)
                res["chunks"] += 1
                if d.get("usage"):
                    res["usage"] = d["usage"]
                for c in d.get("choices", []):
                    i = c["index"]
                    if "delta" in c and c["delta"].get("role") and not c.get("finish_reason"):
                        continue
                    piece = c.get("text") if "text" in c else c.get("delta", {}).get("content", "")
                    if c.get("finish_reason") == "abort" and not piece:
                        res["finish"][i] = "abort"
                        continue
                    res["times"].setdefault(i, []).append(time.monotonic())
                    res["text"][i] = res["text"].get(i, "") + (piece or "")
                    if c.get("finish_reason"):
                        res["finish"][i] = c["finish_reason"]
                    ntok += 1
                    if on_token:
                        on_token(ntok)
                if cancel_after is not None and ntok >= cancel_after:
                    r.close()
                    res["cancelled"] = True
                    break
        return res


def ttft(res, idx=0):
    ts = res["times"].get(idx)
    return ts[0] - res["t0"] if ts else None


def gaps(res, idx=0):
    ts = res["times"].get(idx, [])
    return [b - a for a, b in zip(ts, ts[1:])]


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


async def wait_idle(c, timeout=15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        _, txt, _ = await c.get("/metrics")
        vals = {}
        for ln in txt.splitlines():
            if ln.startswith("vllm:num_requests_running{") or ln.startswith("vllm:num_requests_waiting{") \
                    or ln.startswith("vllm:kv_cache_usage_perc{"):
                vals[ln.split("{")[0]] = float(ln.rsplit(" ", 1)[1])
        if vals.get("vllm:num_requests_running") == 0 and vals.get("vllm:num_requests_waiting") == 0:
            return vals
        await asyncio.sleep(0.05)
    return None


# ----------------------------------------------------------------------------
async def api_checks(c):
    st, txt, _ = await c.get("/health")
    check(st == 200, "GET /health -> 200")
    st, txt, _ = await c.get("/version")
    check(st == 200 and "version" in json.loads(txt), "GET /version")
    st, txt, _ = await c.get("/v1/models")
    models = json.loads(txt)
    model = models["data"][0]["id"]
    check(st == 200 and models["object"] == "list" and models["data"][0]["max_model_len"] == 8192,
          f"GET /v1/models ({model})")
    text = "Hello, world! It's 42 <|im_start|> tokens."
    st, tk, _, _ = await c.post("/tokenize", {"prompt": text, "return_token_strs": True})
    check(st == 200 and tk["count"] == 11 and len(tk["tokens"]) == 11 and tk["max_model_len"] == 8192,
          f"/tokenize count=11 (got {tk and tk.get('count')}, strs={tk and tk.get('token_strs')})")
    st, dt, _, _ = await c.post("/detokenize", {"tokens": tk["tokens"]})
    st2, tk2, _, _ = await c.post("/tokenize", {"prompt": dt["prompt"]})
    check(st == 200 and tk2["tokens"] == tk["tokens"], "/detokenize round-trips through /tokenize")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    st, tkc, _, _ = await c.post("/tokenize", {"messages": msgs})
    # <|im_start|> system \n? no: newline is whitespace -> tokens: im_start, system, be, brief, im_end,
    # im_start, user, hi, there, im_end, im_start, assistant = 12
    check(st == 200 and tkc["count"] == 12, f"/tokenize messages count=12 (got {tkc.get('count')})")

    # non-stream completion, X-Request-Id echo, usage
    st, js, hd, _ = await c.post("/v1/completions", {"model": model, "prompt": words("api", 20),
                                                       "max_tokens": 8, "ignore_eos": True}, rid="api-c1")
    check(st == 200 and hd.get("X-Request-Id") == "api-c1" and js["object"] == "text_completion"
          and js["usage"]["prompt_tokens"] == 20 and js["usage"]["completion_tokens"] == 8
          and js["choices"][0]["finish_reason"] == "length", "POST /v1/completions non-stream + X-Request-Id")
    st, tkx, _, _ = await c.post("/tokenize", {"prompt": js["choices"][0]["text"]})
    check(tkx["count"] == 8, "completion text re-tokenizes to completion_tokens")
    # chat non-stream, n=2, logprobs
    st, js, hd, _ = await c.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "n": 2,
                                                          "logprobs": True, "top_logprobs": 3,
                                                          "ignore_eos": True}, rid="api-chat1")
    ok = (st == 200 and js["object"] == "chat.completion" and len(js["choices"]) == 2
          and js["choices"][1]["message"]["role"] == "assistant"
          and len(js["choices"][0]["logprobs"]["content"]) == 5
          and len(js["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
          and js["usage"]["prompt_tokens"] == 12 and js["usage"]["completion_tokens"] == 10)
    check(ok, "POST /v1/chat/completions n=2 logprobs/top_logprobs")
    # completions logprobs int
    st, js, _, _ = await c.post("/v1/completions", {"prompt": "a b c", "max_tokens": 3, "logprobs": 2,
                                                    "ignore_eos": True}, rid="api-c2")
    lp = js["choices"][0]["logprobs"]
    check(st == 200 and len(lp["tokens"]) == 3 and len(lp["top_logprobs"][0]) == 2, "completions logprobs=2")
    # natural EOS: ignore_eos false stops at or before max_tokens with 'stop' or 'length'
    st, js, _, _ = await c.post("/v1/completions", {"prompt": words("eos", 10), "max_tokens": 2000,
                                                    "n": 4}, rid="api-eos")
    frs = [ch["finish_reason"] for ch in js["choices"]]
    check(st == 200 and all(f == "stop" for f in frs), f"natural EOS -> finish_reason stop ({frs})")
    # streaming completions with usage
    res = await c.stream("/v1/completions", {"prompt": words("s", 30), "max_tokens": 6, "ignore_eos": True,
                                             "stream_options": {"include_usage": True}}, "api-s1")
    check(res["status"] == 200 and res["done"] and len(res["times"].get(0, [])) == 6
          and res["finish"].get(0) == "length" and res["usage"]["completion_tokens"] == 6
          and res["headers"].get("X-Request-Id") == "api-s1"
          and res["headers"].get("Content-Type", "").startswith("text/event-stream"),
          "stream completions: 6 token chunks, usage chunk, [DONE]")
    # streaming chat n=2 with role chunks
    res = await c.stream("/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "n": 2,
                                                  "ignore_eos": True}, "api-s2")
    check(res["done"] and len(res["times"].get(0, [])) == 4 and len(res["times"].get(1, [])) == 4,
          "stream chat n=2: both choices stream 4 tokens + [DONE]")
    # errors
    st, js, _, _ = await c.post("/v1/completions", {"prompt": words("e", 7000), "max_tokens": 2000}, rid="api-e1")
    check(st == 400 and js["error"]["type"] == "BadRequestError" and js["error"]["code"] == 400
          and "maximum context length is 8192" in js["error"]["message"], "400 for prompt+max_tokens > 8192")
    st, js, _, _ = await c.post("/v1/completions", {"model": "nope", "prompt": "x"}, rid="api-e2")
    check(st == 404 and js["error"]["code"] == 404, "404 for unknown model")
    st, js, _, _ = await c.post("/v1/completions", {"prompt": "x", "n": 40}, rid="api-e3")
    check(st == 400, "400 for n > 16")
    # metrics
    st, txt, _ = await c.get("/metrics")
    need = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
            "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
            "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
            "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
            "vllm:request_success_total"]
    missing = [m for m in need if m not in txt]
    check(st == 200 and not missing, f"/metrics has vLLM V1 names (missing: {missing})")
    return ["api-c1", "api-chat1", "api-c2", "api-eos", "api-s1", "api-s2", "api-e1", "api-e2", "api-e3"]


async def disconnect_check(c, tag):
    rid = f"{tag}-disc"
    res = await c.stream("/v1/completions", {"prompt": words("disc" + tag, 500), "max_tokens": 1500,
                                             "ignore_eos": True}, rid, cancel_after=5)
    await asyncio.sleep(0.3)
    vals = await wait_idle(c, 5)
    check(res.get("cancelled") and vals is not None and vals["vllm:kv_cache_usage_perc"] == 0.0,
          f"[{tag}] client disconnect mid-stream aborts the request and frees its KV blocks")
    return rid


# ----------------------------------------------------------------------------
# traffic mixes; each is run against both servers at once
async def mix_queue_reorder(c, tag):
    """A holder keeps a 4000-token prefix cached; a 7000-token blocker, then a
    unique 7000-token request U, then 10 requests sharing the prefix, arrive
    within ~150 ms."""
    P = words("pre", 4000)
    hold_task = asyncio.ensure_future(c.stream("/v1/completions", {"prompt": P, "max_tokens": 3000,
                                                                   "ignore_eos": True}, f"{tag}-q-hold",
                                               cancel_after=10 ** 9))
    await asyncio.sleep(0.15)
    tasks = [asyncio.ensure_future(c.stream("/v1/completions", {"prompt": words("blk", 7000), "max_tokens": 2,
                                                                "ignore_eos": True}, f"{tag}-q-B"))]
    await asyncio.sleep(0.04)
    tasks.append(asyncio.ensure_future(c.stream("/v1/completions", {"prompt": words("uniq", 7000),
                                                                    "max_tokens": 2, "ignore_eos": True},
                                                f"{tag}-q-U")))
    for i in range(10):
        await asyncio.sleep(0.01)
        tasks.append(asyncio.ensure_future(c.post("/v1/completions", {"prompt": P + " " + words(f"sfx{i}", 3000),
                                                                      "max_tokens": 2, "ignore_eos": True},
                                                  rid=f"{tag}-q-F{i}")))
    res = await asyncio.gather(*tasks)
    hold_task.cancel()
    try:
        await hold_task
    except (asyncio.CancelledError, Exception):
        pass
    return {"U_ttft": ttft(res[1])}


async def mix_preempt(c, tag):
    """Five 7500-token streams fill the KV cache and then grow until a decode
    cannot get a block; sixteen 1000-token requests queue up meanwhile."""
    bigs = []
    for i in range(5):
        bigs.append(asyncio.ensure_future(c.stream("/v1/completions", {"prompt": words(f"big{i}", 7500),
                                                                       "max_tokens": 200 if i == 0 else 300,
                                                                       "ignore_eos": True},
                                                   f"{tag}-p-big{i}")))
        await asyncio.sleep(0.01)
    await asyncio.sleep(2.4)
    meds = []
    for i in range(16):
        meds.append(asyncio.ensure_future(c.post("/v1/completions", {"prompt": words(f"med{i}", 1000),
                                                                     "max_tokens": 150, "ignore_eos": True},
                                                 rid=f"{tag}-p-med{i}")))
        await asyncio.sleep(0.005)
    res = await asyncio.gather(*bigs)
    await asyncio.gather(*meds)
    return {"big_max_gap": {f"{tag}-p-big{i}": max(gaps(r)) for i, r in enumerate(res)}}


async def mix_prefix_reuse(c, tag):
    """Same 3000-token prompt sent twice, 'later', with a small unrelated request between."""
    P = words("doc", 3000)
    await c.post("/v1/completions", {"prompt": P + " " + words("qa", 10), "max_tokens": 2, "ignore_eos": True},
                 rid=f"{tag}-r-A1")
    await c.post("/v1/completions", {"prompt": words("other", 100), "max_tokens": 2, "ignore_eos": True},
                 rid=f"{tag}-r-Z")
    res = await c.stream("/v1/completions", {"prompt": P + " " + words("qb", 10), "max_tokens": 2,
                                             "ignore_eos": True}, f"{tag}-r-A2")
    return {"A2_ttft": ttft(res)}


async def mix_parallel_stream(c, tag):
    """One streaming request with n=3."""
    res = await c.stream("/v1/completions", {"prompt": words("par", 200), "max_tokens": 40, "n": 3,
                                             "ignore_eos": True}, f"{tag}-n-S")
    ok = res["done"] and all(len(res["times"].get(i, [])) == 40 for i in range(3))
    return {"c1_ttft": ttft(res, 1), "ok": ok}


async def mix_logprobs(c, tag):
    """Twelve ordinary streams plus one with logprobs=5, all at once."""
    tasks = [asyncio.ensure_future(c.stream("/v1/completions", {"prompt": words(f"lp{i}", 50), "max_tokens": 60,
                                                                "ignore_eos": True}, f"{tag}-l-{i}"))
             for i in range(12)]
    tasks.append(asyncio.ensure_future(c.stream("/v1/completions", {"prompt": words("lpx", 50), "max_tokens": 60,
                                                                    "ignore_eos": True, "logprobs": 5},
                                                f"{tag}-l-X")))
    res = await asyncio.gather(*tasks)
    return {"victim_itl": median([median(gaps(r)) for r in res[:12]])}


async def sigterm_check(proc, c, tag):
    got = {}

    async def reader():
        return await c.stream("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 2000, "ignore_eos": True}, f"{tag}-term",
                              on_token=lambda n: got.setdefault("t", n))
    t = asyncio.ensure_future(reader())
    while "t" not in got:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    ts = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    res = await asyncio.wait_for(t, 5)
    rc = await asyncio.get_running_loop().run_in_executor(None, lambda: proc.wait(5))
    took = time.monotonic() - ts
    check(res["done"] and res["finish"].get(0) == "abort" and took < 2.0,
          f"[{tag}] SIGTERM: stream ends with finish_reason abort + [DONE]; exit in {took:.2f}s (rc={rc})")
    return f"{tag}-term"


# ----------------------------------------------------------------------------
async def amain(tmp):
    gt_clean = os.path.join(tmp, "gt_clean.jsonl")
    gt_bug = os.path.join(tmp, "gt_bug.jsonl")
    p_clean, port_clean = start_server("none", gt_clean)
    p_bug, port_bug = start_server("all", gt_bug)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as s1, aiohttp.ClientSession(timeout=timeout) as s2:
        cc, cb = Client(s1, port_clean), Client(s2, port_bug)
        sent_clean = await api_checks(cc)
        sent_clean.append(await disconnect_check(cc, "clean"))
        results = {}
        for name, fn in [("reorder", mix_queue_reorder), ("preempt", mix_preempt),
                         ("prefix", mix_prefix_reuse), ("parallel", mix_parallel_stream),
                         ("logprobs", mix_logprobs)]:
            await asyncio.gather(wait_idle(cc), wait_idle(cb))
            rc, rb = await asyncio.gather(fn(cc, "clean"), fn(cb, "bug"))
            results[name] = (rc, rb)
            log(f"mix {name}: clean={rc} bug={rb}")
        await asyncio.gather(wait_idle(cc), wait_idle(cb))
        sent_clean.append(await sigterm_check(p_clean, cc, "clean"))
        stop_proc(p_bug)

    g_c = read_gt(gt_clean)
    g_b = read_gt(gt_bug)
    # ground-truth format
    fields = {"request_id", "pathologies", "client_disconnected", "finish_reason", "e2e_s",
              "prompt_tokens", "output_tokens"}
    check(all(set(r) == fields for r in list(g_c.values()) + list(g_b.values())),
          "ground-truth lines have exactly the documented fields")
    check(all(not r["pathologies"] for r in g_c.values()),
          f"clean server tags no request ({sum(1 for r in g_c.values() if r['pathologies'])} tagged of {len(g_c)})")
    missing = [r for r in sent_clean if r not in g_c]
    check(not missing, f"every clean request recorded in ground truth (missing {missing})")
    d = g_c.get("clean-disc", {})
    check(d.get("client_disconnected") is True and d.get("finish_reason") == "abort",
          "ground truth: disconnect recorded (client_disconnected=true, finish_reason=abort)")
    tm = g_c.get("clean-term", {})
    check(tm.get("finish_reason") == "abort" and tm.get("client_disconnected") is False,
          "ground truth: SIGTERM abort recorded")
    e = g_c.get("api-e1", {})
    check(e.get("finish_reason") == "error" and e.get("output_tokens") == 0, "ground truth: rejected request recorded")
    c1 = g_c.get("api-c1", {})
    check(c1.get("prompt_tokens") == 20 and c1.get("output_tokens") == 8 and c1.get("finish_reason") == "length",
          "ground truth: token counts and finish_reason")

    def tags(rid):
        return g_b.get(rid, {}).get("pathologies", [])

    # bug1
    rc, rb = results["reorder"]
    ratio = rb["U_ttft"] / rc["U_ttft"]
    check("bug1" in tags("bug-q-U") and ratio >= 2.0,
          f"bug1 fires on the shared-prefix burst: U tagged={tags('bug-q-U')}, TTFT {rc['U_ttft']:.3f}s -> "
          f"{rb['U_ttft']:.3f}s ({ratio:.1f}x)")
    # bug2
    rc, rb = results["preempt"]
    victims = [k for k in rb["big_max_gap"] if "bug2" in tags(k)]
    clean_gap = max(rc["big_max_gap"].values())
    vg = max((rb["big_max_gap"][k] for k in victims), default=0.0)
    check(bool(victims) and vg >= 2 * clean_gap,
          f"bug2 fires under KV pressure: victims={victims}, max inter-token gap clean {clean_gap:.3f}s -> "
          f"{vg:.3f}s ({vg / max(clean_gap, 1e-9):.1f}x)")
    # bug3
    rc, rb = results["prefix"]
    ratio = rb["A2_ttft"] / rc["A2_ttft"]
    check("bug3" in tags("bug-r-A2") and ratio >= 2.0,
          f"bug3 fires on prefix reuse: tagged={tags('bug-r-A2')}, TTFT {rc['A2_ttft']:.3f}s -> "
          f"{rb['A2_ttft']:.3f}s ({ratio:.1f}x)")
    # bug4
    rc, rb = results["parallel"]
    ratio = rb["c1_ttft"] / rc["c1_ttft"]
    check(rc["ok"] and rb["ok"] and "bug4" in tags("bug-n-S") and ratio >= 2.0,
          f"bug4 fires on n=3 stream: tagged={tags('bug-n-S')}, choice-1 first token {rc['c1_ttft']:.3f}s -> "
          f"{rb['c1_ttft']:.3f}s ({ratio:.1f}x)")
    # bug5
    rc, rb = results["logprobs"]
    ratio = rb["victim_itl"] / rc["victim_itl"]
    tagged = sum(1 for i in range(12) if "bug5" in tags(f"bug-l-{i}"))
    check(tagged == 12 and ratio >= 2.0,
          f"bug5 fires on logprobs in a batch: {tagged}/12 co-scheduled tagged, median ITL "
          f"{rc['victim_itl'] * 1e3:.1f}ms -> {rb['victim_itl'] * 1e3:.1f}ms ({ratio:.1f}x)")
    # precision: requests outside the bug mixes must be untagged on the bug server
    stray = [k for k, r in g_b.items() if r["pathologies"] and not any(
        k.startswith(p) for p in ("bug-q-", "bug-p-", "bug-r-", "bug-n-", "bug-l-"))]
    check(not stray, f"bug server: no stray tags outside the bug mixes ({stray})")
    tagged_all = {k: r["pathologies"] for k, r in g_b.items() if r["pathologies"]}
    log(f"bug-server tagged requests: {tagged_all}")


def main():
    def on_alarm(signum, frame):
        raise TimeoutError("selftest exceeded its time limit")

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, on_term)
    signal.alarm(150)
    atexit.register(stop_all)
    rc = 1
    try:
        with tempfile.TemporaryDirectory() as tmp:
            asyncio.run(amain(tmp))
        rc = 1 if FAILS else 0
    except BaseException as e:  # noqa
        log(f"FAIL selftest aborted: {type(e).__name__}: {e}")
        FAILS.append(str(e))
        rc = 1
    finally:
        signal.alarm(0)
        stop_all()
    log(f"{'PASSED' if rc == 0 else 'FAILED'} ({len(FAILS)} failures) in {time.monotonic() - T0:.1f}s")
    sys.exit(rc)


if __name__ == "__main__":
    main()
