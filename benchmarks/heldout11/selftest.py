#!/usr/bin/env python3
"""Self-test for server.py.

    python selftest.py [-v] [--only NAME[,NAME]]

Starts the server on free 127.0.0.1 ports (clean, each bug alone, and all
bugs), checks the API surface, SSE framing, metrics, disconnect handling,
SIGTERM, FCFS under a burst, preemption, and that each bug's trigger produces
its effect with --bugs bugN and not with --bugs none.  Every server it starts
is killed before it exits.  Exit status 0 when every check passed.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import shutil
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
MODEL = "simlab/quokka-7b-chat"
METRIC_NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:request_success_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
]

VERBOSE = False
RESULTS: list[tuple[str, bool, str]] = []
ALL_PROCS: list[subprocess.Popen] = []


def check(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append((name, bool(ok), detail))
    if VERBOSE or not ok:
        if ok and len(detail) > 100:
            detail = detail[:100] + "..."
        print(("PASS " if ok else "FAIL ") + name + (f"  [{detail}]" if detail else ""),
              flush=True)
    return bool(ok)


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}w{i}" for i in range(n))


def uniq(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


@atexit.register
def _kill_all():
    for p in ALL_PROCS:
        if p.poll() is None:
            p.kill()
            try:
                p.wait(2)
            except Exception:
                pass


class Server:
    def __init__(self, bugs: str, tmp: str, name: str):
        self.bugs = bugs
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.gt_path = os.path.join(tmp, f"gt-{name}.jsonl")
        self.log_path = os.path.join(tmp, f"log-{name}.txt")
        self.name = name
        self.proc = None

    async def start(self, session):
        logf = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, SERVER, "--port", str(self.port), "--host", "127.0.0.1",
             "--seed", "1", "--bugs", self.bugs, "--ground-truth", self.gt_path],
            stdout=logf, stderr=subprocess.STDOUT)
        ALL_PROCS.append(self.proc)
        deadline = time.time() + 15
        while time.time() < deadline:
            try:
                async with session.get(self.base + "/health") as r:
                    if r.status == 200:
                        return self
            except Exception:
                pass
            await asyncio.sleep(0.05)
        raise RuntimeError(f"server {self.name} did not start")

    def stop(self) -> float:
        """SIGTERM, wait; returns seconds it took to exit."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        t = time.time()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(3)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return time.time() - t

    def gt(self) -> dict:
        out = {}
        try:
            with open(self.gt_path) as f:
                for line in f:
                    line = line.strip()
                    if line:
                        d = json.loads(line)
                        out[d.get("client_request_id") or d["request_id"]] = d
        except FileNotFoundError:
            pass
        return out

    def log(self) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()
        except FileNotFoundError:
            return ""


# --------------------------------------------------------------------------
# HTTP helpers
# --------------------------------------------------------------------------
async def post_json(session, srv, path, body, rid=None, timeout=60):
    headers = {"X-Request-Id": rid} if rid else {}
    async with session.post(srv.base + path, json=body, headers=headers,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        txt = await r.text()
        try:
            return r.status, json.loads(txt)
        except Exception:
            return r.status, txt


async def post_stream(session, srv, path, body, rid=None, timeout=60):
    """Returns (status, content_type, raw_text, events(list of str), t_first)."""
    headers = {"X-Request-Id": rid} if rid else {}
    t_first = None
    raw = b""
    async with session.post(srv.base + path, json=body, headers=headers,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        ctype = r.headers.get("Content-Type", "")
        async for chunk in r.content.iter_any():
            if t_first is None:
                t_first = time.time()
            raw += chunk
        status = r.status
    text = raw.decode()
    events = text.split("\n\n")
    return status, ctype, text, events, t_first


async def raw_open(srv, path, body, rid):
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: {rid}\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    writer.write(head + data)
    await writer.drain()
    return reader, writer


async def raw_close(writer) -> float:
    t = time.time()
    writer.close()
    try:
        await writer.wait_closed()
    except Exception:
        pass
    return t


async def metrics(session, srv) -> dict:
    async with session.get(srv.base + "/metrics") as r:
        txt = await r.text()
    vals = {}
    for line in txt.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, v = line.rpartition(" ")
        vals[name] = float(v)
    vals["__text__"] = txt
    return vals


def mval(m: dict, name: str, extra: str = "") -> float:
    key = f'{name}{{{extra + "," if extra else ""}model_name="{MODEL}"}}'
    return m.get(key, float("nan"))


async def wait_idle(session, srv, timeout=30.0):
    t = time.time() + timeout
    while time.time() < t:
        m = await metrics(session, srv)
        if mval(m, "vllm:num_requests_running") == 0 and mval(m, "vllm:num_requests_waiting") == 0:
            return True
        await asyncio.sleep(0.05)
    return False


def ttft(d):
    return d["first_token_time"] - d["arrival_time"]


# --------------------------------------------------------------------------
# API surface
# --------------------------------------------------------------------------
async def api_checks(session, srv, label):
    P = f"[{label}] "
    async with session.get(srv.base + "/health") as r:
        check(P + "GET /health is 200", r.status == 200)
    async with session.get(srv.base + "/version") as r:
        v = await r.json()
        check(P + "GET /version has version 0.x.y", r.status == 200 and
              isinstance(v.get("version"), str) and v["version"].startswith("0."), str(v))
    async with session.get(srv.base + "/v1/models") as r:
        v = await r.json()
        check(P + "GET /v1/models lists one model", r.status == 200 and v.get("object") == "list"
              and len(v.get("data", [])) == 1 and v["data"][0]["id"] == MODEL)
    m = await metrics(session, srv)
    missing = [n for n in METRIC_NAMES if n not in m["__text__"]]
    check(P + "/metrics exposes vLLM metric names", not missing, f"missing={missing}")
    check(P + "/metrics uses model_name label", f'model_name="{MODEL}"' in m["__text__"])

    tag = uniq("api")
    # completions, non-stream
    st, b = await post_json(session, srv, "/v1/completions",
                            {"model": MODEL, "prompt": f"{tag} alpha beta", "max_tokens": 7,
                             "ignore_eos": True})
    ok = (st == 200 and b.get("object") == "text_completion" and b["id"].startswith("cmpl-")
          and b["usage"] == {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}
          and b["choices"][0]["finish_reason"] == "length"
          and len(b["choices"][0]["text"].split()) == 7)
    check(P + "completions non-stream: usage/finish_reason/text", ok, str(b)[:300])
    # token-id prompt
    st, b = await post_json(session, srv, "/v1/completions",
                            {"prompt": [11, 12, 13, 14, 15], "max_tokens": 3, "ignore_eos": True})
    check(P + "completions token-id prompt counts one token per id",
          st == 200 and b["usage"]["prompt_tokens"] == 5 and b["usage"]["completion_tokens"] == 3,
          str(b)[:200])
    # completions stream with usage
    st, ctype, text, ev, _ = await post_stream(
        session, srv, "/v1/completions",
        {"prompt": f"{tag} stream me", "max_tokens": 5, "ignore_eos": True, "stream": True,
         "stream_options": {"include_usage": True}})
    framing = (text.endswith("data: [DONE]\n\n") and ev[-1] == "" and ev[-2] == "data: [DONE]"
               and all(e.startswith("data: ") for e in ev[:-1]))
    check(P + "completions stream: SSE framing 'data: {json}\\n\\n' ... 'data: [DONE]\\n\\n'",
          st == 200 and framing and ctype.startswith("text/event-stream"), text[-200:])
    chunks = [json.loads(e[6:]) for e in ev[:-2]]
    toks = [c for c in chunks if c["choices"]]
    usage = chunks[-1]
    check(P + "completions stream: one chunk per token, final usage chunk",
          len(toks) == 5 and toks[-1]["choices"][0]["finish_reason"] == "length"
          and all(c["object"] == "text_completion" for c in chunks)
          and usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
          and usage["usage"]["prompt_tokens"] == 4, str(chunks[-2:])[:300])
    # chat stream
    st, ctype, text, ev, _ = await post_stream(
        session, srv, "/v1/chat/completions",
        {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": f"{tag} hi"}],
         "max_tokens": 4, "ignore_eos": True, "stream": True,
         "stream_options": {"include_usage": True}})
    chunks = [json.loads(e[6:]) for e in ev[:-2]]
    ok = (st == 200 and text.endswith("data: [DONE]\n\n")
          and chunks[0]["choices"][0]["delta"].get("role") == "assistant"
          and all(c["object"] == "chat.completion.chunk" for c in chunks)
          and sum(1 for c in chunks if c["choices"] and "content" in c["choices"][0]["delta"]
                  and "role" not in c["choices"][0]["delta"]) == 4
          and chunks[-2]["choices"][0]["finish_reason"] == "length"
          and chunks[-1]["usage"]["prompt_tokens"] == 1 + (4 + 2) + (4 + 2) + 3)
    check(P + "chat stream: role chunk, content deltas, finish_reason, usage", ok,
          str(chunks[:2])[:300])
    # chat non-stream
    st, b = await post_json(session, srv, "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": f"{tag} yo"}],
                             "max_tokens": 3, "ignore_eos": True})
    check(P + "chat non-stream: message + usage",
          st == 200 and b["object"] == "chat.completion" and b["id"].startswith("chatcmpl-")
          and b["choices"][0]["message"]["role"] == "assistant"
          and len(b["choices"][0]["message"]["content"].split()) == 3
          and b["usage"]["completion_tokens"] == 3, str(b)[:200])
    # n > 1
    st, b = await post_json(session, srv, "/v1/completions",
                            {"prompt": f"{tag} many", "max_tokens": 4, "ignore_eos": True, "n": 3})
    check(P + "n=3: three choices, completion_tokens = n*max_tokens",
          st == 200 and sorted(c["index"] for c in b["choices"]) == [0, 1, 2]
          and b["usage"]["completion_tokens"] == 12, str(b)[:200])
    st, ctype, text, ev, _ = await post_stream(
        session, srv, "/v1/completions",
        {"prompt": f"{tag} many s", "max_tokens": 3, "ignore_eos": True, "n": 2, "stream": True})
    chunks = [json.loads(e[6:]) for e in ev[:-2]]
    check(P + "n=2 stream: chunks for both indices",
          sorted({c["choices"][0]["index"] for c in chunks}) == [0, 1] and len(chunks) == 6)
    # logprobs
    st, b = await post_json(session, srv, "/v1/completions",
                            {"prompt": f"{tag} lp", "max_tokens": 3, "ignore_eos": True,
                             "logprobs": 2})
    lp = b["choices"][0]["logprobs"] if st == 200 else None
    check(P + "completions logprobs=2 structure",
          lp is not None and len(lp["tokens"]) == 3 and len(lp["token_logprobs"]) == 3
          and all(len(t) == 2 for t in lp["top_logprobs"]) and len(lp["text_offset"]) == 3,
          str(lp)[:200])
    st, b = await post_json(session, srv, "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": f"{tag} lp"}],
                             "max_tokens": 2, "ignore_eos": True, "logprobs": True,
                             "top_logprobs": 3})
    lp = b["choices"][0]["logprobs"] if st == 200 else None
    check(P + "chat logprobs + top_logprobs=3 structure",
          lp is not None and len(lp["content"]) == 2
          and all(len(c["top_logprobs"]) == 3 for c in lp["content"]), str(lp)[:200])
    # determinism
    body = {"prompt": f"{tag} seeded", "max_tokens": 6, "ignore_eos": True, "seed": 42}
    _, b1 = await post_json(session, srv, "/v1/completions", body)
    _, b2 = await post_json(session, srv, "/v1/completions", body)
    check(P + "same seed gives same text", b1["choices"][0]["text"] == b2["choices"][0]["text"])
    _, b = await post_json(session, srv, "/v1/completions",
                           {"prompt": f"{tag} greedy", "max_tokens": 5, "ignore_eos": True,
                            "temperature": 0, "n": 2})
    check(P + "temperature=0: identical choices",
          b["choices"][0]["text"] == b["choices"][1]["text"])
    # errors
    bad = [
        ("n=9", "/v1/completions", {"prompt": "a", "n": 9, "max_tokens": 2}, 400),
        ("n=0", "/v1/completions", {"prompt": "a", "n": 0, "max_tokens": 2}, 400),
        ("logprobs=6", "/v1/completions", {"prompt": "a", "logprobs": 6, "max_tokens": 2}, 400),
        ("prompt+max_tokens > 8192", "/v1/completions",
         {"prompt": words(100, "e"), "max_tokens": 8100}, 400),
        ("missing prompt", "/v1/completions", {"max_tokens": 2}, 400),
        ("empty messages", "/v1/chat/completions", {"messages": [], "max_tokens": 2}, 400),
        ("max_tokens=0", "/v1/completions", {"prompt": "a", "max_tokens": 0}, 400),
        ("unknown model", "/v1/completions", {"model": "nope", "prompt": "a"}, 404),
    ]
    for name, path, body, code in bad:
        st, b = await post_json(session, srv, path, body)
        check(P + f"error {name} -> {code} with OpenAI error shape",
              st == code and isinstance(b, dict) and isinstance(b.get("error"), dict)
              and b["error"].get("code") == code and "message" in b["error"]
              and "type" in b["error"], f"{st} {str(b)[:160]}")
    async with session.post(srv.base + "/v1/completions", data=b"{not json",
                            headers={"Content-Type": "application/json"}) as r:
        check(P + "invalid JSON -> 400", r.status == 400)
    # natural EOS / min_tokens
    reqs = [post_json(session, srv, "/v1/completions",
                      {"prompt": f"{tag} eos {i}", "max_tokens": 150, "seed": 1000 + i,
                       "min_tokens": 20 if i % 2 else 0})
            for i in range(16)]
    res = await asyncio.gather(*reqs)
    stops = [b for st, b in res if b["choices"][0]["finish_reason"] == "stop"]
    ok_min = all(b["usage"]["completion_tokens"] >= 20 for i, (st, b) in enumerate(res) if i % 2)
    check(P + "ignore_eos=false: some requests stop early at EOS (finish_reason=stop)",
          len(stops) >= 3 and all(b["usage"]["completion_tokens"] < 150 for b in stops),
          f"stops={len(stops)}")
    check(P + "min_tokens respected", ok_min)
    m2 = await metrics(session, srv)
    check(P + "metrics counters advanced",
          mval(m2, "vllm:generation_tokens_total") > mval(m, "vllm:generation_tokens_total")
          and mval(m2, "vllm:request_success_total", 'finished_reason="stop"') >= 3)
    gt = srv.gt()
    check(P + "ground truth lines have required fields",
          gt and all(all(k in d for k in ("request_id", "arrival_time", "first_token_time",
                                           "finish_time", "prompt_tokens", "completion_tokens",
                                           "finish_reason", "client_disconnected",
                                           "num_preemptions", "delayed_by"))
                     for d in gt.values()))


async def disconnect_checks(session, srv, label):
    P = f"[{label}] "
    for stream in (True, False):
        rid = uniq("disc")
        r, w = await raw_open(srv, "/v1/completions",
                              {"prompt": f"{rid} go", "max_tokens": 3000, "ignore_eos": True,
                               "stream": stream}, rid)
        await asyncio.sleep(0.25)
        if stream:
            await r.read(200)
        t_close = await raw_close(w)
        await asyncio.sleep(0.15)
        d = srv.gt().get(rid)
        m = await metrics(session, srv)
        kind = "stream" if stream else "non-stream"
        check(P + f"{kind} disconnect: request aborted, ground truth client_disconnected",
              d is not None and d["finish_reason"] == "abort" and d["client_disconnected"]
              and d["completion_tokens"] < 100, str(d)[:200])
        check(P + f"{kind} disconnect: aborted within one engine step",
              d is not None and d["finish_time"] - t_close < 0.08,
              f"{(d['finish_time'] - t_close) if d else None}")
        check(P + f"{kind} disconnect: KV freed / nothing running",
              mval(m, "vllm:num_requests_running") == 0 and mval(m, "vllm:kv_cache_usage_perc") == 0.0,
              f"running={mval(m, 'vllm:num_requests_running')} "
              f"usage={mval(m, 'vllm:kv_cache_usage_perc')}")


async def fcfs_check(session, srv, label):
    P = f"[{label}] "
    tag = uniq("fcfs")
    reqs = [post_json(session, srv, "/v1/completions",
                      {"prompt": f"{tag} {i} " + words(30, tag), "max_tokens": 20,
                       "ignore_eos": True}, rid=f"{tag}-{i}")
            for i in range(100)]
    await asyncio.gather(*reqs)
    gt = srv.gt()
    lines = sorted((gt[f"{tag}-{i}"] for i in range(100)), key=lambda d: d["seq_no"])
    firsts = [d["first_token_time"] for d in lines]
    mono = all(b >= a for a, b in zip(firsts, firsts[1:]))
    check(P + "burst of 100 (> 64 seats): first tokens in arrival order (FCFS)", mono)
    check(P + "burst: no bug tags in clean mode", all(not d["delayed_by"] for d in lines))


async def preemption_check(session, srv, label):
    P = f"[{label}] "
    tag = uniq("pre")
    m0 = await metrics(session, srv)
    reqs = []
    for i in range(5):
        reqs.append(asyncio.ensure_future(post_json(
            session, srv, "/v1/completions",
            {"prompt": f"{tag}{i} " + words(4699, f"{tag}{i}"), "max_tokens": 120,
             "ignore_eos": True}, rid=f"{tag}-{i}")))
        await asyncio.sleep(0.01)
    res = await asyncio.gather(*reqs)
    m1 = await metrics(session, srv)
    gt = srv.gt()
    lines = [gt[f"{tag}-{i}"] for i in range(5)]
    npre = [d["num_preemptions"] for d in lines]
    check(P + "KV pressure causes recompute preemption (metric + ground truth)",
          mval(m1, "vllm:num_preemptions_total") > mval(m0, "vllm:num_preemptions_total")
          and sum(npre) > 0, f"preemptions={npre}")
    check(P + "preemption victim is the most recently admitted request",
          npre[-1] > 0 and npre[0] == 0, f"{npre}")
    check(P + "preempted requests still complete all tokens",
          all(st == 200 and b["usage"]["completion_tokens"] == 120 for st, b in res))


async def sigterm_check(session, tmp):
    srv = await Server("none", tmp, "sigterm").start(session)
    rid = uniq("term")
    r, w = await raw_open(srv, "/v1/completions",
                          {"prompt": "x", "max_tokens": 5000, "ignore_eos": True,
                           "stream": True}, rid)
    await asyncio.sleep(0.2)
    dt = srv.stop()
    await raw_close(w)
    d = srv.gt().get(rid)
    check("[sigterm] server exits within a second of SIGTERM", dt < 1.0, f"{dt:.2f}s")
    check("[sigterm] in-flight request written to ground truth as abort",
          d is not None and d["finish_reason"] == "abort", str(d)[:160])


# --------------------------------------------------------------------------
# Bug scenarios: each returns (metric, tagged_count, detail)
# --------------------------------------------------------------------------
async def scen_bug1(session, srv):
    """Burst of requests sharing a long cached prefix (> token budget)."""
    tag = uniq("b1")
    prefix = f"{tag} " + words(4200, tag)
    await post_json(session, srv, "/v1/completions",
                    {"prompt": prefix + " warm", "max_tokens": 1, "ignore_eos": True})
    rids = [f"{tag}-{i}" for i in range(16)]
    await asyncio.gather(*[post_json(session, srv, "/v1/completions",
                                     {"prompt": prefix + " " + words(20, f"{tag}s{i}"),
                                      "max_tokens": 4, "ignore_eos": True}, rid=r)
                           for i, r in enumerate(rids)])
    gt = srv.gt()
    ds = [gt[r] for r in rids]
    mean_ttft = sum(ttft(d) for d in ds) / len(ds)
    tagged = sum("bug1" in d["delayed_by"] for d in ds)
    return mean_ttft, tagged, f"mean TTFT {mean_ttft*1000:.1f} ms"


async def scen_bug2(session, srv):
    """Short decodes running when prompts longer than the budget arrive."""
    tag = uniq("b2")
    dec = [f"{tag}-d{i}" for i in range(8)]
    futs = [asyncio.ensure_future(post_json(
        session, srv, "/v1/completions",
        {"prompt": f"{tag}d{i} " + words(20, f"{tag}d{i}"), "max_tokens": 80,
         "ignore_eos": True}, rid=r)) for i, r in enumerate(dec)]
    await asyncio.sleep(0.2)
    longs = [asyncio.ensure_future(post_json(
        session, srv, "/v1/completions",
        {"prompt": f"{tag}L{i} " + words(7000, f"{tag}L{i}"), "max_tokens": 1},
        rid=f"{tag}-L{i}")) for i in range(3)]
    await asyncio.gather(*futs, *longs)
    gt = srv.gt()
    ds = [gt[r] for r in dec]
    worst = max(d["max_itl"] for d in ds)
    tagged = sum("bug2" in d["delayed_by"] for d in ds)
    return worst, tagged, f"max inter-token gap {worst*1000:.1f} ms"


async def scen_bug3(session, srv):
    """Non-streaming clients with long generations disconnect; then a probe."""
    tag = uniq("b3")
    conns = []
    for i in range(6):
        conns.append(await raw_open(srv, "/v1/completions",
                                    {"prompt": f"{tag}z{i} " + words(3899, f"{tag}z{i}"),
                                     "max_tokens": 4000, "ignore_eos": True}, f"{tag}-z{i}"))
    await asyncio.sleep(0.5)
    for r, w in conns:
        await raw_close(w)
    await asyncio.sleep(0.1)
    m = await metrics(session, srv)
    running_after = mval(m, "vllm:num_requests_running")
    probe = f"{tag}-probe"
    t0 = time.time()
    try:
        st, ctype, text, ev, t_first = await post_stream(
            session, srv, "/v1/completions",
            {"prompt": f"{tag}p " + words(2000, f"{tag}p"), "max_tokens": 4,
             "ignore_eos": True, "stream": True}, rid=probe, timeout=2.5)
        probe_ttft = (t_first - t0) if t_first else 2.5
    except asyncio.TimeoutError:
        probe_ttft = 2.5
    await asyncio.sleep(0.1)
    gt = srv.gt()
    tagged = int("bug3" in gt.get(probe, {}).get("delayed_by", []))
    return probe_ttft, tagged, (f"probe TTFT {probe_ttft*1000:.0f} ms, running after "
                                f"disconnect={running_after:.0f}")


async def scen_bug4(session, srv):
    """Many decodes batched with one logprobs request."""
    tag = uniq("b4")
    rids = [f"{tag}-{i}" for i in range(56)]
    futs = [post_json(session, srv, "/v1/completions",
                      {"prompt": f"{tag}{i} " + words(20, f"{tag}{i}"), "max_tokens": 40,
                       "ignore_eos": True}, rid=r) for i, r in enumerate(rids)]
    futs.append(post_json(session, srv, "/v1/completions",
                          {"prompt": f"{tag} lp " + words(20, tag), "max_tokens": 50,
                           "ignore_eos": True, "logprobs": 1}, rid=f"{tag}-lp"))
    await asyncio.gather(*futs)
    gt = srv.gt()
    ds = [gt[r] for r in rids]
    itl = sum((d["finish_time"] - d["first_token_time"]) / (d["completion_tokens"] - 1)
              for d in ds) / len(ds)
    tagged = sum("bug4" in d["delayed_by"] for d in ds)
    return itl, tagged, f"mean ITL {itl*1000:.1f} ms"


async def scen_bug5(session, srv):
    """An n=8 request arriving when only a few seats are free."""
    tag = uniq("b5")
    hogs = [asyncio.ensure_future(post_json(
        session, srv, "/v1/completions",
        {"prompt": f"{tag}h{i} " + words(10, f"{tag}h{i}"), "max_tokens": 60,
         "ignore_eos": True}, rid=f"{tag}-h{i}")) for i in range(60)]
    await asyncio.sleep(0.25)
    par = asyncio.ensure_future(post_json(
        session, srv, "/v1/completions",
        {"prompt": f"{tag} par " + words(10, tag), "max_tokens": 4, "ignore_eos": True,
         "n": 8}, rid=f"{tag}-par"))
    await asyncio.sleep(0.03)
    singles = [asyncio.ensure_future(post_json(
        session, srv, "/v1/completions",
        {"prompt": f"{tag}s{i} " + words(10, f"{tag}s{i}"), "max_tokens": 4,
         "ignore_eos": True}, rid=f"{tag}-s{i}")) for i in range(4)]
    await asyncio.gather(*hogs, par, *singles)
    d = srv.gt()[f"{tag}-par"]
    return ttft(d), int("bug5" in d["delayed_by"]), f"n=8 TTFT {ttft(d)*1000:.0f} ms"


BUG_SCENARIOS = {
    "bug1": (scen_bug1, "shared long prefix burst: mean TTFT"),
    "bug2": (scen_bug2, "long prompts during decodes: max inter-token gap"),
    "bug3": (scen_bug3, "non-stream disconnects then probe: probe TTFT"),
    "bug4": (scen_bug4, "decodes co-batched with logprobs: mean ITL"),
    "bug5": (scen_bug5, "n=8 with few free seats: TTFT"),
}


async def bug_check(session, tmp, clean, bug):
    fn, what = BUG_SCENARIOS[bug]
    base, base_tags, base_detail = await fn(session, clean)
    await wait_idle(session, clean)
    srv = await Server(bug, tmp, bug).start(session)
    try:
        val, tags, detail = await fn(session, srv)
    finally:
        srv.stop()
    ratio = val / base if base > 0 else float("inf")
    check(f"[{bug}] {what}: clean {base_detail}; --bugs {bug} {detail}; ratio >= 2",
          ratio >= 2.0, f"ratio={ratio:.2f}")
    check(f"[{bug}] ground truth tags affected requests with {bug}, none in clean mode",
          tags > 0 and base_tags == 0, f"tagged={tags} clean_tagged={base_tags}")
    errs = [l for l in srv.log().splitlines() if "Traceback" in l or "engine error" in l]
    check(f"[{bug}] no engine errors with --bugs {bug}", not errs, "; ".join(errs[:3]))


async def guarded(name, coro):
    """Run one section; an exception becomes a failed check, not a crash."""
    try:
        await coro
    except Exception as e:  # noqa: BLE001
        check(f"[{name}] section ran without exception", False, f"{type(e).__name__}: {e}")


async def all_bugs_section(session, tmp):
    allsrv = await Server("all", tmp, "all").start(session)
    try:
        await api_checks(session, allsrv, "all-bugs")
        await fcfs_check_allbugs(session, allsrv)
    finally:
        allsrv.stop()
    errs = [l for l in allsrv.log().splitlines() if "Traceback" in l or "engine error" in l]
    check("[all-bugs] no engine errors", not errs, "; ".join(errs[:3]))


async def main_async(only):
    t_start = time.time()
    tmp = tempfile.mkdtemp(prefix="h11selftest-")
    conn = aiohttp.TCPConnector(limit=0)
    want = lambda k: not only or k in only  # noqa: E731
    async with aiohttp.ClientSession(connector=conn) as session:
        clean = await Server("none", tmp, "clean").start(session)
        try:
            if want("api"):
                await guarded("api", api_checks(session, clean, "clean"))
            if want("disconnect"):
                await guarded("disconnect", disconnect_checks(session, clean, "clean"))
            if want("fcfs"):
                await wait_idle(session, clean)
                await guarded("fcfs", fcfs_check(session, clean, "clean"))
            if want("preempt"):
                await wait_idle(session, clean)
                await guarded("preempt", preemption_check(session, clean, "clean"))
            for bug in BUG_SCENARIOS:
                if want(bug):
                    await wait_idle(session, clean)
                    await guarded(bug, bug_check(session, tmp, clean, bug))
            if want("sigterm"):
                await guarded("sigterm", sigterm_check(session, tmp))
            if want("all"):
                await guarded("all-bugs", all_bugs_section(session, tmp))
        finally:
            clean.stop()
            errs = [l for l in clean.log().splitlines() if "Traceback" in l or "engine error" in l]
            check("[clean] no engine errors", not errs, "; ".join(errs[:3]))
            gt = clean.gt()
            check("[clean] ground truth: no request tagged in clean mode",
                  all(not d["delayed_by"] for d in gt.values()),
                  str([d for d in gt.values() if d["delayed_by"]][:2])[:200])
    if all(ok for _, ok, _ in RESULTS):
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"server logs and ground truth kept in {tmp}", flush=True)
    return time.time() - t_start


async def fcfs_check_allbugs(session, srv):
    """Mixed workload on the all-bugs server: must complete, server stays healthy."""
    tag = uniq("mix")
    futs = []
    for i in range(30):
        body = {"prompt": f"{tag}{i} " + words(50 + 40 * i, f"{tag}{i}"), "max_tokens": 10,
                "ignore_eos": True, "n": 1 + (i % 3), "logprobs": 1 if i % 5 == 0 else None,
                "stream": bool(i % 2)}
        if body["stream"]:
            futs.append(post_stream(session, srv, "/v1/completions", body, rid=f"{tag}-{i}"))
        else:
            futs.append(post_json(session, srv, "/v1/completions", body, rid=f"{tag}-{i}"))
    res = await asyncio.gather(*futs, return_exceptions=True)
    check("[all-bugs] mixed workload completes", all(not isinstance(r, Exception) and r[0] == 200
                                                    for r in res))
    async with session.get(srv.base + "/health") as r:
        check("[all-bugs] healthy after mixed workload", r.status == 200)


def main():
    global VERBOSE
    ap = argparse.ArgumentParser()
    ap.add_argument("-v", action="store_true", help="list every check")
    ap.add_argument("--only", default="", help="comma list: api,disconnect,fcfs,preempt,"
                    "bug1..bug5,sigterm,all")
    a = ap.parse_args()
    VERBOSE = a.v
    only = set(x for x in a.only.split(",") if x)
    t0 = time.time()
    dt = None
    try:
        dt = asyncio.run(main_async(only))
    except Exception as e:  # noqa: BLE001
        check("selftest harness ran without exception", False, f"{type(e).__name__}: {e}")
    finally:
        _kill_all()
    if dt is None:
        dt = time.time() - t0
    failed = [r for r in RESULTS if not r[1]]
    print(f"{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed in {dt:.1f}s"
          + ("" if not failed else f"; FAILED: {len(failed)}"), flush=True)
    sys.exit(0 if not failed else 1)


if __name__ == "__main__":
    main()
