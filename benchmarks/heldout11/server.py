#!/usr/bin/env python3
"""Simulated vLLM-style OpenAI-compatible inference server (no GPU).

Single file, Python 3.11, stdlib + aiohttp only.  See README.md.

    python server.py --port 8000 [--host 127.0.0.1] [--seed 0]
                     [--bugs none|all|bug1,bug3] [--ground-truth gt.jsonl]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import random
import signal
import sys
import time
import uuid
import zlib

from aiohttp import web

# --------------------------------------------------------------------------
# Engine configuration (see README.md, "Configuration")
# --------------------------------------------------------------------------
MODEL_NAME = "simlab/quokka-7b-chat"
SERVER_VERSION = "0.8.5"

BLOCK_SIZE = 16                     # tokens per KV block
NUM_GPU_BLOCKS = 1500               # 1500 * 16 = 24,000 tokens of KV cache
MAX_NUM_BATCHED_TOKENS = 4096       # per-step token budget
MAX_NUM_SEQS = 64                   # max running sequences
MAX_MODEL_LEN = 8192                # prompt + output limit
LONG_PREFILL_TOKEN_THRESHOLD = 0    # 0 = no per-request prefill cap
ENABLE_PREFIX_CACHING = True
PREEMPTION_MODE = "recompute"

# Cost model (seconds)
STEP_OVERHEAD_S = 0.012
PREFILL_PER_TOKEN_S = 1.5e-6
DECODE_PER_SEQ_S = 40e-6
LOGPROBS_PER_ROW_S = 25e-6
LOGPROBS_PER_TOP_S = 5e-6
JITTER = 0.03                       # uniform +-3 %

# Tokenizer / sampler
VOCAB_SIZE = 32000
BOS_ID = 1
EOS_ID = 2
CHAT_START_ID = 3
CHAT_END_HEADER_ID = 4
CHAT_EOT_ID = 5
FIRST_WORD_ID = 1000
EOS_P = 1.0 / 100.0                 # per-token EOS probability (mean 100)
MAX_N = 8
MAX_LOGPROBS = 5

# Tool-evaluation switches (documented in BUGS.md only)
ALL_BUGS = ("bug1", "bug2", "bug3", "bug4", "bug5")
BUG2_LONG_PREFILL_TOKENS = 2048
BUG4_FULL_VOCAB_PER_ROW_S = 600e-6

_SYLLABLES = ["ka", "lo", "mi", "ren", "tu", "sa", "vo", "pel",
              "dri", "nu", "qua", "zen", "fi", "mor", "tas", "bel"]


def word_for_id(tid: int) -> str:
    x = (tid * 2654435761) & 0xFFFFFFFF
    n = 2 + x % 3
    x //= 3
    parts = []
    for _ in range(n):
        parts.append(_SYLLABLES[x % 16])
        x //= 16
    return "".join(parts)


def word_id(word: str) -> int:
    return FIRST_WORD_ID + zlib.crc32(word.encode("utf-8")) % (VOCAB_SIZE - FIRST_WORD_ID)


def text_to_ids(text: str) -> list[int]:
    return [word_id(w) for w in text.split()]


# --------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
                640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
               30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
               7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000,
                 10000]


class Histogram:
    def __init__(self, buckets):
        self.buckets = [float(b) for b in buckets]
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
                return
        self.counts[-1] += 1


class Metrics:
    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.success = collections.Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.queue = Histogram(E2E_BUCKETS)
        self.req_prompt = Histogram(TOKEN_BUCKETS)
        self.req_gen = Histogram(TOKEN_BUCKETS)

    def render(self, engine: "Engine") -> str:
        lab = 'model_name="%s"' % MODEL_NAME
        out = []

        def f(v):
            return repr(float(v))

        def simple(name, typ, help_, value, extra=""):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {typ}")
            labels = lab + ("," + extra if extra else "")
            out.append(f"{name}{{{labels}}} {f(value)}")

        def hist(name, help_, h: Histogram):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} histogram")
            acc = 0
            for b, c in zip(h.buckets, h.counts):
                acc += c
                out.append(f'{name}_bucket{{le="{f(b)}",{lab}}} {f(acc)}')
            acc += h.counts[-1]
            out.append(f'{name}_bucket{{le="+Inf",{lab}}} {f(acc)}')
            out.append(f"{name}_count{{{lab}}} {f(h.count)}")
            out.append(f"{name}_sum{{{lab}}} {f(h.sum)}")

        usage = engine.kv.usage()
        out.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig")
        out.append("# TYPE vllm:cache_config_info gauge")
        out.append('vllm:cache_config_info{block_size="%d",enable_prefix_caching="%s",'
                   'num_gpu_blocks="%d",max_num_batched_tokens="%d",max_num_seqs="%d",'
                   'max_model_len="%d",preemption_mode="%s",%s} 1.0'
                   % (BLOCK_SIZE, ENABLE_PREFIX_CACHING, NUM_GPU_BLOCKS,
                      MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, MAX_MODEL_LEN,
                      PREEMPTION_MODE, lab))
        simple("vllm:num_requests_running", "gauge",
               "Number of requests in model execution batches.", len(engine.running))
        simple("vllm:num_requests_waiting", "gauge",
               "Number of requests waiting to be processed.", len(engine.waiting))
        simple("vllm:gpu_cache_usage_perc", "gauge",
               "GPU KV-cache usage. 1 means 100 percent usage.", usage)
        simple("vllm:kv_cache_usage_perc", "gauge",
               "KV-cache usage. 1 means 100 percent usage.", usage)
        simple("vllm:num_preemptions_total", "counter",
               "Cumulative number of preemption from the engine.", self.preemptions)
        simple("vllm:prompt_tokens_total", "counter",
               "Number of prefill tokens processed.", self.prompt_tokens)
        simple("vllm:generation_tokens_total", "counter",
               "Number of generation tokens processed.", self.generation_tokens)
        simple("vllm:prefix_cache_queries_total", "counter",
               "Prefix cache queries, in terms of number of queried tokens.",
               self.prefix_queries)
        simple("vllm:prefix_cache_hits_total", "counter",
               "Prefix cache hits, in terms of number of cached tokens.",
               self.prefix_hits)
        name = "vllm:request_success_total"
        out.append(f"# HELP {name} Count of successfully processed requests.")
        out.append(f"# TYPE {name} counter")
        for reason in ("stop", "length", "abort"):
            out.append(f'{name}{{finished_reason="{reason}",{lab}}} '
                       f'{f(self.success.get(reason, 0))}')
        hist("vllm:time_to_first_token_seconds",
             "Histogram of time to first token in seconds.", self.ttft)
        hist("vllm:inter_token_latency_seconds",
             "Histogram of inter-token latency in seconds.", self.itl)
        hist("vllm:time_per_output_token_seconds",
             "Histogram of time per output token in seconds.", self.itl)
        hist("vllm:e2e_request_latency_seconds",
             "Histogram of end to end request latency in seconds.", self.e2e)
        hist("vllm:request_queue_time_seconds",
             "Histogram of time spent in WAITING phase for request.", self.queue)
        hist("vllm:request_prompt_tokens",
             "Number of prefill tokens processed.", self.req_prompt)
        hist("vllm:request_generation_tokens",
             "Number of generation tokens processed.", self.req_gen)
        return "\n".join(out) + "\n"


# --------------------------------------------------------------------------
# Paged KV cache with prefix caching (block-hash chain, LRU eviction)
# --------------------------------------------------------------------------
class Block:
    __slots__ = ("id", "ref", "hash")

    def __init__(self, bid):
        self.id = bid
        self.ref = 0
        self.hash = None


class KVCacheManager:
    def __init__(self, num_blocks: int, metrics: Metrics):
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free queue, LRU order: evict from the front, freed blocks go to the end
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict(
            (i, None) for i in range(num_blocks))
        self.cached: dict[int, Block] = {}
        self.metrics = metrics

    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks)

    def get_computed_blocks(self, seq: "Seq") -> list[Block]:
        if not ENABLE_PREFIX_CACHING:
            return []
        limit = (seq.num_tokens - 1) // BLOCK_SIZE  # always recompute >= 1 token
        out = []
        for i in range(limit):
            b = self.cached.get(seq.block_hash(i))
            if b is None:
                break
            out.append(b)
        return out

    def blocks_needed(self, seq: "Seq", ntok: int, computed=()) -> int:
        total = seq.num_computed + len(computed) * BLOCK_SIZE + ntok
        need_total = -(-total // BLOCK_SIZE)
        need_new = need_total - len(seq.blocks) - len(computed)
        reuse_free = sum(1 for b in computed if b.ref == 0)
        return max(0, need_new) + reuse_free

    def can_allocate(self, seq: "Seq", ntok: int, computed=()) -> bool:
        return self.blocks_needed(seq, ntok, computed) <= len(self.free)

    def allocate(self, seq: "Seq", ntok: int, computed=()) -> bool:
        if not self.can_allocate(seq, ntok, computed):
            return False
        for b in computed:
            if b.ref == 0:
                del self.free[b.id]
            b.ref += 1
            seq.blocks.append(b)
        seq.num_computed += len(computed) * BLOCK_SIZE
        total = seq.num_computed + ntok
        need_total = -(-total // BLOCK_SIZE)
        while len(seq.blocks) < need_total:
            bid, _ = self.free.popitem(last=False)
            b = self.blocks[bid]
            if b.hash is not None and self.cached.get(b.hash) is b:
                del self.cached[b.hash]
            b.hash = None
            b.ref = 1
            seq.blocks.append(b)
        if ENABLE_PREFIX_CACHING:
            full = min(total, seq.num_tokens) // BLOCK_SIZE
            for i in range(seq.num_cached_blocks, full):
                b = seq.blocks[i]
                if b.hash is None:
                    h = seq.block_hash(i)
                    if h not in self.cached:
                        b.hash = h
                        self.cached[h] = b
            seq.num_cached_blocks = max(seq.num_cached_blocks, full)
        return True

    def free_seq(self, seq: "Seq") -> None:
        for b in reversed(seq.blocks):
            b.ref -= 1
            if b.ref == 0:
                self.free[b.id] = None
        seq.blocks = []
        seq.num_cached_blocks = 0


# --------------------------------------------------------------------------
# Requests and sequences
# --------------------------------------------------------------------------
class ApiRequest:
    def __init__(self, rid, seq_no, kind, prompt_ids, p, is_disconnected):
        self.id = rid
        self.seq_no = seq_no
        self.kind = kind                      # "completion" | "chat"
        self.prompt_ids = prompt_ids
        self.n = p["n"]
        self.stream = p["stream"]
        self.include_usage = p["include_usage"]
        self.continuous_usage = p["continuous_usage"]
        self.max_tokens = p["max_tokens"]
        self.min_tokens = p["min_tokens"]
        self.ignore_eos = p["ignore_eos"]
        self.temperature = p["temperature"]
        self.seed = p["seed"]
        self.logprobs = p["logprobs"]         # None or top-k (0..5)
        self.client_request_id = p.get("client_request_id")
        self.created = int(time.time())
        self.arrival = time.time()
        self.first_token_time = None
        self.first_scheduled_time = None
        self.finish_time = None
        self.finished = False
        self.aborted = False
        self.client_disconnected = False
        self.zombie = False
        self.delayed_by: set[str] = set()
        self.is_disconnected = is_disconnected
        self.queue: asyncio.Queue = asyncio.Queue()
        self.seqs: list[Seq] = []


class Seq:
    def __init__(self, req: ApiRequest, index: int, rng: random.Random,
                 lp_rng: random.Random):
        self.req = req
        self.index = index
        self.num_prompt = len(req.prompt_ids)
        self.all_ids = list(req.prompt_ids)
        self.hashes: list[int] = []
        self.num_computed = 0
        self.blocks: list[Block] = []
        self.num_cached_blocks = 0
        self.status = "waiting"               # waiting | running | finished
        self.ever_scheduled = False
        self.num_preemptions = 0
        self.finish_reason = None
        self.first_token_time = None
        self.last_token_time = None
        self.max_itl = 0.0
        self.text_len = 0
        self.zombie = False
        self.rng = rng
        self.lp_rng = lp_rng
        if req.ignore_eos:
            self.natural_len = None
        else:
            u = 1.0 - rng.random()
            g = 1 + int(math.floor(math.log(u) / math.log(1.0 - EOS_P)))
            self.natural_len = req.min_tokens + g

    @property
    def num_tokens(self) -> int:
        return len(self.all_ids)

    @property
    def num_output(self) -> int:
        return len(self.all_ids) - self.num_prompt

    def is_decode(self) -> bool:
        return self.num_output > 0 and self.num_computed == self.num_tokens - 1

    def block_hash(self, i: int) -> int:
        hs = self.hashes
        while len(hs) <= i:
            j = len(hs)
            parent = hs[-1] if hs else 0
            hs.append(hash((parent, tuple(self.all_ids[j * BLOCK_SIZE:(j + 1) * BLOCK_SIZE]))))
        return hs[i]


# --------------------------------------------------------------------------
# Engine
# --------------------------------------------------------------------------
class Engine:
    def __init__(self, bugs: set[str], seed: int, gt_file, metrics: Metrics):
        self.bugs = bugs
        self.seed = seed
        self.gt = gt_file
        self.metrics = metrics
        self.kv = KVCacheManager(NUM_GPU_BLOCKS, metrics)
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []
        self.active: dict[str, ApiRequest] = {}
        self.wake = asyncio.Event()
        self.jitter_rng = random.Random(seed * 7919 + 17)
        self.step_no = 0
        self.seq_counter = 0

    # ---- request intake -------------------------------------------------
    def make_request(self, kind, prompt_ids, p, is_disconnected) -> ApiRequest:
        self.seq_counter += 1
        prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
        rid = prefix + uuid.uuid4().hex
        req = ApiRequest(rid, self.seq_counter, kind, prompt_ids, p, is_disconnected)
        for i in range(req.n):
            if req.temperature == 0.0:
                key = "greedy-%d" % hash(tuple(prompt_ids))
            elif req.seed is not None:
                key = "seed-%d-%d" % (req.seed, i)
            else:
                key = "srv-%d-%d-%d" % (self.seed, req.seq_no, i)
            req.seqs.append(Seq(req, i, random.Random(key), random.Random(key + "-lp")))
        return req

    def add(self, req: ApiRequest) -> None:
        self.active[req.id] = req
        for s in req.seqs:
            self.waiting.append(s)
        self.wake.set()

    # ---- abort / finish -------------------------------------------------
    def abort(self, req: ApiRequest, disconnected: bool) -> None:
        if req.finished:
            return
        if disconnected:
            req.client_disconnected = True
        for s in req.seqs:
            if s.status == "finished":
                continue
            if s.status == "waiting":
                try:
                    self.waiting.remove(s)
                except ValueError:
                    pass
            elif s.status == "running":
                try:
                    self.running.remove(s)
                except ValueError:
                    pass
            self.kv.free_seq(s)
            s.status = "finished"
            s.finish_reason = "abort"
        req.aborted = True
        self._finish_request(req)

    def abort_all(self) -> None:
        for req in list(self.active.values()):
            self.abort(req, disconnected=False)

    def _finish_request(self, req: ApiRequest) -> None:
        req.finished = True
        req.finish_time = time.time()
        self.active.pop(req.id, None)
        m = self.metrics
        reason = "abort" if req.aborted else (req.seqs[0].finish_reason or "abort")
        m.success[reason] += 1
        m.e2e.observe(req.finish_time - req.arrival)
        completion_tokens = sum(s.num_output for s in req.seqs)
        m.req_gen.observe(completion_tokens)
        if self.gt is not None:
            line = {
                "request_id": req.id,
                "seq_no": req.seq_no,
                "client_request_id": req.client_request_id,
                "endpoint": "/v1/completions" if req.kind == "completion" else "/v1/chat/completions",
                "arrival_time": req.arrival,
                "first_token_time": req.first_token_time,
                "finish_time": req.finish_time,
                "prompt_tokens": len(req.prompt_ids),
                "completion_tokens": completion_tokens,
                "n": req.n,
                "stream": req.stream,
                "max_tokens": req.max_tokens,
                "finish_reason": reason,
                "finish_reasons": [s.finish_reason for s in req.seqs],
                "client_disconnected": req.client_disconnected,
                "num_preemptions": sum(s.num_preemptions for s in req.seqs),
                "max_itl": round(max((s.max_itl for s in req.seqs), default=0.0), 6),
                "delayed_by": sorted(req.delayed_by),
            }
            try:
                self.gt.write(json.dumps(line) + "\n")
                self.gt.flush()
            except Exception:
                pass
        req.queue.put_nowait(None)

    def _tag(self, req: ApiRequest, bug: str) -> None:
        req.delayed_by.add(bug)

    # ---- main loop ------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.waiting and not self.running:
                self.wake.clear()
                await self.wake.wait()
            t0 = loop.time()
            self._check_disconnects()
            if not self.waiting and not self.running:
                continue
            try:
                sched = self._schedule()
                cost = self._cost(sched)
            except Exception as e:  # never let the engine die
                print("engine error in schedule: %r" % (e,), file=sys.stderr)
                sched, cost = {}, STEP_OVERHEAD_S
            self.step_no += 1
            delay = t0 + cost - loop.time()
            await asyncio.sleep(max(0.0, delay))
            try:
                self._update(sched)
            except Exception as e:
                print("engine error in update: %r" % (e,), file=sys.stderr)

    def _check_disconnects(self) -> None:
        for req in list(self.active.values()):
            if req.finished or req.zombie:
                continue
            try:
                gone = req.is_disconnected()
            except Exception:
                gone = False
            if not gone:
                continue
            if "bug3" in self.bugs and not req.stream:
                # abort is not propagated for non-streaming requests
                req.zombie = True
                req.client_disconnected = True
                self._tag(req, "bug3")
                for s in req.seqs:
                    s.zombie = True
            else:
                self.abort(req, disconnected=True)

    # ---- scheduler ------------------------------------------------------
    def _preempt(self, victim: Seq) -> None:
        self.running.remove(victim)
        self.kv.free_seq(victim)
        victim.num_computed = 0
        victim.status = "waiting"
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        self.metrics.preemptions += 1

    def _zombie_blocks(self) -> int:
        cnt = collections.Counter()
        for s in self.running:
            if s.zombie:
                for b in s.blocks:
                    cnt[b.id] += 1
        return sum(1 for bid, c in cnt.items() if self.kv.blocks[bid].ref == c)

    def _has_zombies(self) -> bool:
        return "bug3" in self.bugs and any(s.zombie for s in self.running)

    def _long_prefill_pending(self) -> bool:
        for s in self.running:
            if not s.is_decode() and s.num_tokens - s.num_computed > BUG2_LONG_PREFILL_TOKENS:
                return True
        if self.waiting and len(self.running) < MAX_NUM_SEQS:
            head = self.waiting[0]
            computed = self.kv.get_computed_blocks(head)
            need = head.num_tokens - len(computed) * BLOCK_SIZE
            if need > BUG2_LONG_PREFILL_TOKENS and self.kv.can_allocate(
                    head, min(need, MAX_NUM_BATCHED_TOKENS), computed):
                return True
        return False

    def _schedule(self, allow_bug2: bool = True) -> dict:
        budget = MAX_NUM_BATCHED_TOKENS
        sched: dict[Seq, int] = {}
        preempted_any = False
        prefill_only = allow_bug2 and "bug2" in self.bugs and self._long_prefill_pending()

        # 1) running requests first, in admission order
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status != "running":
                continue
            if prefill_only and seq.is_decode():
                continue                    # prefill-only step: decode skipped
            ntok = min(seq.num_tokens - seq.num_computed, budget)
            if LONG_PREFILL_TOKEN_THRESHOLD:
                ntok = min(ntok, LONG_PREFILL_TOKEN_THRESHOLD)
            if ntok <= 0:
                continue
            ok = True
            while not self.kv.allocate(seq, ntok):
                victim = self.running[-1]
                if self._has_zombies() and not victim.zombie:
                    short = self.kv.blocks_needed(seq, ntok) - len(self.kv.free)
                    if self._zombie_blocks() >= short:
                        self._tag(victim.req, "bug3")
                if victim in sched:
                    budget += sched.pop(victim)
                self._preempt(victim)
                preempted_any = True
                if victim is seq:
                    ok = False
                    break
            if not ok:
                break
            sched[seq] = ntok
            budget -= ntok

        # 2) waiting requests in arrival order (not in a step that preempted)
        if not preempted_any:
            self._admit(budget, sched)

        if prefill_only:
            if not sched:
                # nothing prefill-like could run: plain step instead (no deadlock)
                return self._schedule(allow_bug2=False)
            # decodes the clean running pass (admission order) would have scheduled
            b = MAX_NUM_BATCHED_TOKENS
            for seq in self.running:
                if b <= 0:
                    break
                if seq.is_decode():
                    if seq not in sched:
                        self._tag(seq.req, "bug2")
                    b -= 1
                else:
                    b -= min(seq.num_tokens - seq.num_computed, b)
        return sched

    def _admit(self, budget: int, sched: dict) -> None:
        waiting = self.waiting
        running = self.running
        bug1 = "bug1" in self.bugs
        bug5 = "bug5" in self.bugs
        phantom = 0
        stop = "empty"
        gang_skipped: set = set()
        i = 0
        while i < len(waiting):
            if budget <= 0:
                stop = "budget"
                break
            if len(running) >= MAX_NUM_SEQS:
                stop = "seats"
                break
            seq = waiting[i]
            req = seq.req
            if req in gang_skipped:
                i += 1
                continue
            computed = self.kv.get_computed_blocks(seq)
            ncached = len(computed) * BLOCK_SIZE
            need = seq.num_tokens - ncached
            ntok = min(need, budget)
            if LONG_PREFILL_TOKEN_THRESHOLD:
                ntok = min(ntok, LONG_PREFILL_TOKEN_THRESHOLD)
            if bug5 and req.n > 1 and not seq.ever_scheduled:
                group = [s for s in req.seqs if s.status == "waiting" and not s.ever_scheduled]
                if len(running) + len(group) > MAX_NUM_SEQS:
                    if self.kv.can_allocate(seq, ntok, computed):
                        self._tag(req, "bug5")
                    gang_skipped.add(req)
                    i += 1
                    continue
            if not self.kv.allocate(seq, ntok, computed):
                stop = "kv"
                if self._has_zombies():
                    short = self.kv.blocks_needed(seq, ntok, computed) - len(self.kv.free)
                    if self._zombie_blocks() >= short:
                        self._tag(req, "bug3")
                break
            if bug1 and phantom > 0 and ntok < need and ntok < budget + phantom:
                self._tag(req, "bug1")      # chunk shrunk by phantom charge
            del waiting[i]
            seq.status = "running"
            if not seq.ever_scheduled:
                seq.ever_scheduled = True
                self.metrics.prefix_queries += seq.num_tokens
                self.metrics.prefix_hits += ncached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
                self.metrics.queue.observe(req.first_scheduled_time - req.arrival)
            running.append(seq)
            sched[seq] = ntok
            charge = ntok
            if bug1 and ncached:
                charge += ncached           # cached tokens charged to the budget
                phantom += ncached
            budget -= charge
        else:
            stop = "empty"

        if bug1 and phantom > 0 and stop == "budget":
            # requests the clean budget would still have admitted this step
            real = budget + phantom
            seats = MAX_NUM_SEQS - len(running)
            free_blocks = len(self.kv.free)
            for j in range(i, len(waiting)):
                if real <= 0 or seats <= 0:
                    break
                s = waiting[j]
                comp = self.kv.get_computed_blocks(s)
                nt = min(s.num_tokens - len(comp) * BLOCK_SIZE, real)
                nb = self.kv.blocks_needed(s, nt, comp)
                if nb > free_blocks:
                    break
                free_blocks -= nb
                self._tag(s.req, "bug1")
                real -= nt
                seats -= 1
        if stop == "seats" and self._has_zombies():
            zseats = sum(1 for s in running if s.zombie)
            for j in range(i, min(len(waiting), i + zseats)):
                if not waiting[j].zombie:
                    self._tag(waiting[j].req, "bug3")

    # ---- cost model -----------------------------------------------------
    def _cost(self, sched: dict) -> float:
        prefill_tokens = 0
        decode_rows = 0
        lp_cost = 0.0
        sampling_rows = 0
        lp_rows = 0
        for seq, ntok in sched.items():
            if seq.is_decode() and ntok == 1:
                decode_rows += 1
            else:
                prefill_tokens += ntok
            if seq.num_computed + ntok >= seq.num_tokens:
                sampling_rows += 1
                k = seq.req.logprobs
                if k is not None:
                    lp_rows += 1
                    lp_cost += LOGPROBS_PER_ROW_S + LOGPROBS_PER_TOP_S * k
        cost = (STEP_OVERHEAD_S + PREFILL_PER_TOKEN_S * prefill_tokens
                + DECODE_PER_SEQ_S * decode_rows + lp_cost)
        if "bug4" in self.bugs and 0 < lp_rows < sampling_rows:
            # mixed batch: full-vocab logprobs for every row in the batch
            cost += BUG4_FULL_VOCAB_PER_ROW_S * len(sched)
            for req in self.active.values():
                self._tag(req, "bug4")
        return cost * (1.0 + self.jitter_rng.uniform(-JITTER, JITTER))

    # ---- model output ---------------------------------------------------
    def _update(self, sched: dict) -> None:
        now = time.time()
        events: dict[ApiRequest, list] = {}
        m = self.metrics
        for seq, ntok in sched.items():
            if seq.status != "running":
                continue                      # aborted during the step
            seq.num_computed += ntok
            if seq.num_computed < seq.num_tokens:
                continue
            req = seq.req
            pos = seq.num_output + 1
            if seq.natural_len is not None and pos >= seq.natural_len:
                tid = EOS_ID
            else:
                tid = seq.rng.randrange(FIRST_WORD_ID, VOCAB_SIZE)
            first_of_seq = seq.num_output == 0
            seq.all_ids.append(tid)
            m.generation_tokens += 1
            if tid == EOS_ID:
                text = ""
            else:
                w = word_for_id(tid)
                text = w if (req.kind == "chat" and first_of_seq) else " " + w
            lp = None
            if req.logprobs is not None:
                lp = self._logprobs(seq, tid, text)
            offset = seq.text_len
            seq.text_len += len(text)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if req.first_token_time is None:
                req.first_token_time = now
                m.ttft.observe(now - req.arrival)
                m.prompt_tokens += len(req.prompt_ids)
                m.req_prompt.observe(len(req.prompt_ids))
            if seq.last_token_time is not None:
                gap = now - seq.last_token_time
                m.itl.observe(gap)
                if gap > seq.max_itl:
                    seq.max_itl = gap
            seq.last_token_time = now
            fr = None
            if tid == EOS_ID:
                fr = "stop"
            elif seq.num_output >= req.max_tokens or seq.num_tokens >= MAX_MODEL_LEN:
                fr = "length"
            if fr is not None:
                seq.status = "finished"
                seq.finish_reason = fr
                try:
                    self.running.remove(seq)
                except ValueError:
                    pass
                self.kv.free_seq(seq)
            events.setdefault(req, []).append((seq.index, tid, text, lp, fr, offset))
        for req, evs in events.items():
            if req.finished:
                continue
            req.queue.put_nowait(evs)
            if all(s.status == "finished" for s in req.seqs):
                self._finish_request(req)

    def _logprobs(self, seq: Seq, tid: int, text: str):
        r = seq.lp_rng
        k = seq.req.logprobs
        chosen = -round(r.random() * 1.2, 4)
        tops = [(text, chosen)]
        lp = chosen
        for _ in range(max(0, k - 1)):
            lp = round(lp - 0.2 - r.random() * 2.0, 4)
            alt = " " + word_for_id(r.randrange(FIRST_WORD_ID, VOCAB_SIZE))
            tops.append((alt, lp))
        return (chosen, tops)


# --------------------------------------------------------------------------
# Request parsing
# --------------------------------------------------------------------------
class ApiError(Exception):
    def __init__(self, message, status=400, etype="BadRequestError", param=None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.etype = etype
        self.param = param


def error_response(message, status=400, etype="BadRequestError", param=None):
    return web.json_response(
        {"error": {"message": message, "type": etype, "param": param, "code": status}},
        status=status)


def _get_int(body, key, default, lo=None, hi=None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (
            isinstance(v, float) and not v.is_integer()):
        raise ApiError(f"'{key}' must be an integer, got {v!r}", param=key)
    v = int(v)
    if lo is not None and v < lo:
        raise ApiError(f"'{key}' must be at least {lo}, got {v}", param=key)
    if hi is not None and v > hi:
        raise ApiError(f"'{key}' must be at most {hi}, got {v}", param=key)
    return v


def _get_bool(body, key, default):
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"'{key}' must be a boolean, got {v!r}", param=key)
    return v


def _ids_from_list(lst):
    if not lst:
        raise ApiError("prompt must not be empty", param="prompt")
    for t in lst:
        if isinstance(t, bool) or not isinstance(t, int):
            raise ApiError("prompt token ids must be integers", param="prompt")
        if t < 0 or t >= VOCAB_SIZE:
            raise ApiError(f"Token id {t} is out of vocabulary", param="prompt")
    return list(lst)


def parse_completion_prompt(body):
    if "prompt" not in body or body["prompt"] is None:
        raise ApiError("'prompt' is required", param="prompt")
    p = body["prompt"]
    if isinstance(p, str):
        return [BOS_ID] + text_to_ids(p)
    if isinstance(p, list):
        if p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return _ids_from_list(p)
        if len(p) == 1:
            if isinstance(p[0], str):
                return [BOS_ID] + text_to_ids(p[0])
            if isinstance(p[0], list):
                return _ids_from_list(p[0])
        if len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
            raise ApiError("Batched prompts are not supported by this server; "
                           "send one prompt per request", param="prompt")
    raise ApiError("'prompt' must be a string, a list of token ids, or a "
                   "one-element list of either", param="prompt")


def _content_text(content):
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise ApiError("only text content parts are supported", param="messages")
        return " ".join(parts)
    raise ApiError("message content must be a string or a list of text parts", param="messages")


def parse_chat_prompt(body):
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    ids = [BOS_ID]
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError("each message must be an object with a 'role'", param="messages")
        if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
            raise ApiError(f"unknown role {m['role']!r}", param="messages")
        ids += [CHAT_START_ID, word_id("<" + m["role"] + ">"), CHAT_END_HEADER_ID]
        ids += text_to_ids(_content_text(m.get("content")))
        ids.append(CHAT_EOT_ID)
    ids += [CHAT_START_ID, word_id("<assistant>"), CHAT_END_HEADER_ID]
    return ids


def parse_params(body, kind):
    model = body.get("model")
    if model is not None and model != MODEL_NAME:
        raise ApiError(f"The model `{model}` does not exist.", status=404,
                       etype="NotFoundError", param="model")
    prompt_ids = parse_completion_prompt(body) if kind == "completion" else parse_chat_prompt(body)
    p = {}
    p["stream"] = _get_bool(body, "stream", False)
    so = body.get("stream_options")
    p["include_usage"] = False
    p["continuous_usage"] = False
    if so is not None:
        if not isinstance(so, dict):
            raise ApiError("'stream_options' must be an object", param="stream_options")
        if not p["stream"]:
            raise ApiError("Stream options can only be defined when `stream=True`.",
                           param="stream_options")
        p["include_usage"] = _get_bool(so, "include_usage", False)
        p["continuous_usage"] = _get_bool(so, "continuous_usage_stats", False)
    p["n"] = _get_int(body, "n", 1, 1, MAX_N)
    max_key = "max_tokens"
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        max_key = "max_completion_tokens"
    mt = _get_int(body, max_key, None, 1, None)
    plen = len(prompt_ids)
    if plen >= MAX_MODEL_LEN and mt is None:
        raise ApiError(
            f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, "
            f"your request has {plen} input tokens. Please reduce the length of the "
            f"input messages.", param="prompt")
    if mt is None:
        mt = MAX_MODEL_LEN - plen
    if plen + mt > MAX_MODEL_LEN:
        raise ApiError(
            f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, "
            f"you requested {plen + mt} tokens ({plen} in the messages, {mt} in the "
            f"completion). Please reduce the length of the messages or completion.",
            param="max_tokens")
    p["max_tokens"] = mt
    p["min_tokens"] = _get_int(body, "min_tokens", 0, 0, mt)
    p["ignore_eos"] = _get_bool(body, "ignore_eos", False)
    t = body.get("temperature", 1.0)
    if t is None:
        t = 1.0
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0 or t > 2:
        raise ApiError("'temperature' must be a number between 0 and 2", param="temperature")
    p["temperature"] = float(t)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError("'seed' must be an integer", param="seed")
    p["seed"] = seed
    if kind == "completion":
        lp = body.get("logprobs")
        if lp is None:
            p["logprobs"] = None
        else:
            p["logprobs"] = _get_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    else:
        want = _get_bool(body, "logprobs", False)
        top = body.get("top_logprobs")
        if top is not None:
            top = _get_int(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
            if top > 0 and not want:
                raise ApiError("when using `top_logprobs`, `logprobs` must be set to true.",
                               param="top_logprobs")
        p["logprobs"] = (top or 0) if want else None
    return prompt_ids, p


# --------------------------------------------------------------------------
# Response formatting
# --------------------------------------------------------------------------
def _usage(req: ApiRequest) -> dict:
    c = sum(s.num_output for s in req.seqs)
    pt = len(req.prompt_ids)
    return {"prompt_tokens": pt, "total_tokens": pt + c, "completion_tokens": c}


def _cmpl_logprobs(entries):
    return {
        "text_offset": [e[3] for e in entries],
        "token_logprobs": [e[1][0] for e in entries],
        "tokens": [e[0] for e in entries],
        "top_logprobs": [{t: v for t, v in e[1][1]} for e in entries],
    }


def _chat_logprobs(entries, k):
    content = []
    for text, (chosen, tops), _tid, _off in entries:
        content.append({
            "token": text, "logprob": chosen, "bytes": list(text.encode()),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                             for t, v in tops[:k]],
        })
    return {"content": content}


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def handle_generate(request: web.Request, kind: str):
    engine: Engine = request.app["engine"]
    try:
        body = await request.json()
    except Exception:
        return error_response("Invalid JSON in request body")
    if not isinstance(body, dict):
        return error_response("Request body must be a JSON object")
    try:
        prompt_ids, p = parse_params(body, kind)
    except ApiError as e:
        return error_response(e.message, e.status, e.etype, e.param)
    p["client_request_id"] = request.headers.get("X-Request-Id")

    def is_disconnected(r=request):
        tr = r.transport
        return tr is None or tr.is_closing()

    req = engine.make_request(kind, prompt_ids, p, is_disconnected)
    engine.add(req)
    try:
        if req.stream:
            return await _stream(request, req, engine)
        return await _full(request, req, engine)
    except asyncio.CancelledError:
        engine.abort(req, disconnected=True)
        raise


async def _stream(request, req: ApiRequest, engine: Engine):
    resp = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache"})
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    head = {"id": req.id, "object": obj, "created": req.created, "model": MODEL_NAME}
    try:
        await resp.prepare(request)
        first = True
        while True:
            evs = await req.queue.get()
            if evs is None:
                break
            buf = []
            if req.kind == "chat" and first:
                for i in range(req.n):
                    c = dict(head)
                    c["choices"] = [{"index": i, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]
                    buf.append(_sse(c))
            first = False
            for idx, tid, text, lp, fr, off in evs:
                c = dict(head)
                if req.kind == "completion":
                    ch = {"index": idx, "text": text,
                          "logprobs": _cmpl_logprobs([(text, lp, tid, off)]) if lp else None,
                          "finish_reason": fr, "stop_reason": None}
                else:
                    ch = {"index": idx, "delta": {"content": text},
                          "logprobs": _chat_logprobs([(text, lp, tid, off)], req.logprobs) if lp else None,
                          "finish_reason": fr, "stop_reason": None}
                c["choices"] = [ch]
                if req.include_usage and req.continuous_usage:
                    c["usage"] = _usage(req)
                buf.append(_sse(c))
            await resp.write(b"".join(buf))
        if req.aborted:
            return resp
        if req.include_usage:
            c = dict(head)
            c["choices"] = []
            c["usage"] = _usage(req)
            await resp.write(_sse(c))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except (ConnectionError, RuntimeError, OSError):
        engine.abort(req, disconnected=True)
    return resp


async def _full(request, req: ApiRequest, engine: Engine):
    per_choice = [[] for _ in range(req.n)]
    while True:
        evs = await req.queue.get()
        if evs is None:
            break
        for idx, tid, text, lp, fr, off in evs:
            per_choice[idx].append((text, lp, tid, off))
    if req.aborted:
        return error_response("Request aborted", 400)
    choices = []
    for s in req.seqs:
        entries = per_choice[s.index]
        text = "".join(e[0] for e in entries)
        lp = None
        if req.logprobs is not None:
            lp = (_cmpl_logprobs(entries) if req.kind == "completion"
                  else _chat_logprobs(entries, req.logprobs))
        if req.kind == "completion":
            choices.append({"index": s.index, "text": text, "logprobs": lp,
                            "finish_reason": s.finish_reason, "stop_reason": None,
                            "prompt_logprobs": None})
        else:
            choices.append({"index": s.index,
                            "message": {"role": "assistant", "content": text,
                                        "tool_calls": []},
                            "logprobs": lp, "finish_reason": s.finish_reason,
                            "stop_reason": None})
    body = {"id": req.id,
            "object": "text_completion" if req.kind == "completion" else "chat.completion",
            "created": req.created, "model": MODEL_NAME, "choices": choices,
            "usage": _usage(req)}
    if req.kind == "chat":
        body["prompt_logprobs"] = None
    return web.json_response(body)


async def handle_completions(request):
    return await handle_generate(request, "completion")


async def handle_chat(request):
    return await handle_generate(request, "chat")


async def handle_health(request):
    return web.Response(status=200)


async def handle_version(request):
    return web.json_response({"version": SERVER_VERSION})


async def handle_models(request):
    return web.json_response({"object": "list", "data": [{
        "id": MODEL_NAME, "object": "model", "created": request.app["started"],
        "owned_by": "vllm", "root": MODEL_NAME, "parent": None,
        "max_model_len": MAX_MODEL_LEN,
        "permission": [{"id": "modelperm-" + uuid.uuid4().hex, "object": "model_permission",
                        "created": request.app["started"], "allow_create_engine": False,
                        "allow_sampling": True, "allow_logprobs": True,
                        "allow_search_indices": False, "allow_view": True,
                        "allow_fine_tuning": False, "organization": "*", "group": None,
                        "is_blocking": False}]}]})


async def handle_metrics(request):
    text = request.app["metrics"].render(request.app["engine"])
    return web.Response(body=text.encode("utf-8"), headers={
        "Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def parse_bugs(s: str) -> set[str]:
    s = (s or "none").strip().lower()
    if s in ("", "none"):
        return set()
    if s == "all":
        return set(ALL_BUGS)
    out = set()
    for part in s.split(","):
        part = part.strip()
        if not part:
            continue
        if part not in ALL_BUGS:
            raise SystemExit(f"unknown bug switch {part!r}; valid: none, all, {', '.join(ALL_BUGS)}")
        out.add(part)
    return out


async def amain(args) -> None:
    bugs = parse_bugs(args.bugs)
    gt = open(args.ground_truth, "w", buffering=1) if args.ground_truth else None
    metrics = Metrics()
    engine = Engine(bugs, args.seed, gt, metrics)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app["engine"] = engine
    app["metrics"] = metrics
    app["started"] = int(time.time())
    app.router.add_get("/health", handle_health)
    app.router.add_get("/version", handle_version)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=2048)
    await site.start()
    loop = asyncio.get_running_loop()
    engine_task = loop.create_task(engine.run())

    def shutdown(signame):
        try:
            engine.abort_all()
            if gt is not None:
                gt.flush()
                gt.close()
        finally:
            os._exit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown, sig.name)
    port = args.port
    try:
        port = site._server.sockets[0].getsockname()[1]
    except Exception:
        pass
    print(f"INFO: simulated vLLM {SERVER_VERSION} serving {MODEL_NAME} on "
          f"http://{args.host}:{port} (bugs: {','.join(sorted(bugs)) or 'none'})", flush=True)
    await engine_task


def main():
    ap = argparse.ArgumentParser(description="Simulated vLLM OpenAI-compatible server")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bugs", default="none",
                    help="none | all | comma list (bug1..bug5); for tool evaluation")
    ap.add_argument("--ground-truth", default=None, help="write per-request JSONL here")
    args = ap.parse_args()
    try:
        asyncio.run(amain(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
