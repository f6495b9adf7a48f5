#!/usr/bin/env python3
"""simllm: a GPU-free, real-time simulator of a vLLM-V1-like LLM inference server.

No model is run: tokens are fake words, and every engine step sleeps for the duration
given by a cost model.  See README.md for the behaviour of the engine (scheduler, KV
cache, prefix cache, cost model, API).  Only the standard library and aiohttp are used.
"""
import argparse
import asyncio
import bisect
import json
import random
import signal
import sys
import time
import uuid
import zlib
from collections import OrderedDict, deque

from aiohttp import web

MODEL_NAME = "simllm-8b"
VERSION = "0.11.2+sim"
BLOCK_SIZE = 16
TRACE = bool(__import__("os").environ.get("SIMLLM_TRACE"))
ALL_BUGS = ["bug1", "bug2", "bug3", "bug4", "bug5", "bug6", "bug7", "bug8"]

# ----------------------------------------------------------------------------------------
# Cost model constants (seconds).  Calibrated to public figures for an 8B dense model in
# bf16 on one H100-class GPU (weights-read floor ~5.6 ms, ~18 us per token when
# compute-bound, ~55 us of decode attention per 1k context tokens).
# ----------------------------------------------------------------------------------------
CPU_STEP = 0.35e-3        # scheduler + input preparation, per step
CPU_SEQ = 6e-6            # per scheduled sequence
LAUNCH_GRAPH = 0.25e-3    # launch overhead, decode-only batch replayed from a CUDA graph
LAUNCH_PIECEWISE = 0.5e-3 # mixed batch within the capture range (piecewise graphs)
LAUNCH_EAGER = 1.0e-3     # batch above the capture range (eager)
W_FLOOR = 5.6e-3          # weight streaming floor per forward pass
TAU = 18e-6               # per-token linear-layer compute when compute bound
ATT_DEC = 55e-9           # decode attention, per context token per sequence
ATT_PRE = 0.8e-9          # prefill attention, per (query token x context token) pair
SAMPLE = 10e-6            # sampler, per sampled sequence
LOGPROB_SEQ = 35e-6       # logprob gather, per sampled sequence that asked for logprobs
LOGPROB_K = 1.5e-6        # per requested top-logprob
SEEDED_SEQ = 25e-6        # per-request torch.Generator draw for a seeded sequence
WARM_DECODE = 8e-3        # first decode step ever with a given padded batch size
WARM_MIXED = 20e-3        # first mixed/prefill step ever with a given token bucket ...
WARM_MIXED_TOK = 10e-6    # ... plus this per token of the bucket
JITTER_SIGMA = 0.03

# Frontend (API server process) costs, serialized on one frontend "CPU".
FE_REQ = 150e-6           # request parsing + validation
FE_TOK = 0.6e-6           # tokenization, per prompt token
FE_OUT = 18e-6            # output processing (detokenize + bookkeeping), per request per step
FE_SSE = 12e-6            # extra per streamed chunk (JSON + SSE framing)
FE_LP = 2.5e-6            # per logprob entry serialized (per token x (k+1))

# Bug constants (only used when the corresponding bug is enabled).
B1_ROW_SAMPLE = 300e-6
B4_IDLE_S = 3.0
B4_WAKE = 0.25
B7_HOLD_S = 12.0
B8_LP_REPROC = 2.0e-6

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0]
REQ_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITER_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


# ----------------------------------------------------------------------------------------
# Tokenizer: one token per whitespace-separated word.
# ----------------------------------------------------------------------------------------
def _make_vocab(n=4096):
    cons = "bcdfghjklmnprstvwz"
    vows = "aeiou"
    rng = random.Random(1234)
    seen, words = set(), []
    while len(words) < n:
        w = "".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.choice((1, 2, 2, 3))))
        if rng.random() < 0.3:
            w += rng.choice(cons)
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


VOCAB = _make_vocab()
VOCAB_BASE = 1000
SPECIALS = {"<|begin|>": 1, "<|end|>": 2, "<|system|>": 3, "<|user|>": 4, "<|assistant|>": 5,
            "<|tool|>": 6, "<|developer|>": 7}
EOS_ID = 2
ROLE_TOKENS = {"system": 3, "user": 4, "assistant": 5, "tool": 6, "developer": 7}


class Tokenizer:
    def __init__(self):
        self.word2id = {w: VOCAB_BASE + i for i, w in enumerate(VOCAB)}
        self.word2id.update(SPECIALS)
        self.id2word = {v: k for k, v in self.word2id.items()}
        self.extra_cap = 300000

    def _id(self, w):
        i = self.word2id.get(w)
        if i is None:
            i = 100000 + zlib.crc32(w.encode("utf-8", "surrogatepass")) % 900000
            if len(self.id2word) < self.extra_cap:
                self.id2word.setdefault(i, w)
        return i

    def encode(self, text):
        return [self._id(w) for w in text.split()]

    def decode(self, ids):
        return " ".join(self.id2word.get(i, "<unk%d>" % i) for i in ids if i != EOS_ID)

    def piece(self, tid):
        if tid == EOS_ID:
            return ""
        return " " + self.id2word.get(tid, "<unk%d>" % tid)

    @staticmethod
    def message_text(content):
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            parts = []
            for p in content:
                if isinstance(p, dict) and isinstance(p.get("text"), str):
                    parts.append(p["text"])
                elif isinstance(p, str):
                    parts.append(p)
            return " ".join(parts)
        return str(content)

    def encode_chat(self, messages, add_generation_prompt=True):
        ids = []
        for m in messages:
            if not isinstance(m, dict):
                raise ValueError("each message must be an object")
            role = m.get("role", "user")
            ids.append(ROLE_TOKENS.get(role, 4))
            ids.extend(self.encode(self.message_text(m.get("content"))))
            ids.append(EOS_ID)
        if add_generation_prompt:
            ids.append(5)
        return ids


TOKENIZER = Tokenizer()


# ----------------------------------------------------------------------------------------
# Prometheus helpers
# ----------------------------------------------------------------------------------------
class Histogram:
    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v):
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def render(self, name, labels, out):
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append('%s_bucket{%s,le="%s"} %d' % (name, labels, float(b), acc))
        out.append('%s_bucket{%s,le="+Inf"} %d' % (name, labels, self.count))
        out.append("%s_count{%s} %d" % (name, labels, self.count))
        out.append("%s_sum{%s} %r" % (name, labels, self.sum))


# ----------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------
WAITING, RUNNING, PREEMPTED, FINISHED = 0, 1, 2, 3


class ClientRequest:
    """One HTTP request (n engine requests = children)."""

    def __init__(self, rid, arrival, kind, stream, n, prompt_len):
        self.rid = rid
        self.arrival = arrival
        self.kind = kind
        self.stream = stream
        self.n = n
        self.prompt_len = prompt_len
        self.children = []
        self.items = []
        self.event = asyncio.Event()
        self.done = 0
        self.disconnected = False
        self.finalized = False
        self.fut = asyncio.get_running_loop().create_future()
        self.tok_late = 0.0  # frontend tokenization lateness caused by bug8

    def push(self, item):
        self.items.append(item)
        self.event.set()

    async def get(self):
        while not self.items:
            self.event.clear()
            await self.event.wait()
        items, self.items = self.items, []
        return items


class Req:
    """One engine request (a sequence)."""

    def __init__(self, parent, index, prompt, max_tokens, min_tokens, ignore_eos, temperature,
                 seed, logprobs, order, rng_seed):
        self.parent = parent
        self.index = index
        self.prompt = prompt
        self.num_prompt = len(prompt)
        self.out = []
        self.num_computed = 0
        self.blocks = []
        self.hashes = []
        self.num_cached_blocks = 0
        self.status = WAITING
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        self.seeded = seed is not None and temperature > 0
        self.logprobs = logprobs  # None or int k
        self.order = order
        self.rng = random.Random(rng_seed)
        nat = 1 + int(self.rng.expovariate(1.0 / 120.0))
        self.eos_at = max(nat, min_tokens)
        self.finish_reason = None
        self.t_sched = None
        self.t_first_gen = None
        self.t_first = None
        self.t_last = None
        self.t_end = None
        self.lost = {}
        self.lost_first = None
        self.fe_late_first = 0.0
        self.fe_late_last = 0.0
        self.zombie = False
        self.abort_requested = False
        self.misplaced = False
        self.jumpers = None
        self.redundant_left = 0
        self.prefill_chunks = 0
        self.withheld = None
        self.num_preemptions = 0
        self.cached_tokens = 0

    @property
    def num_tokens(self):
        return self.num_prompt + len(self.out)

    def token_slice(self, a, b):
        p = self.num_prompt
        if b <= p:
            return tuple(self.prompt[a:b])
        if a >= p:
            return tuple(self.out[a - p:b - p])
        return tuple(self.prompt[a:]) + tuple(self.out[:b - p])

    def ensure_hashes(self, nblocks):
        hs = self.hashes
        while len(hs) < nblocks:
            i = len(hs)
            parent = hs[-1] if hs else None
            hs.append(hash((parent, self.token_slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE))))

    def next_token(self):
        if not self.ignore_eos and len(self.out) + 1 >= self.eos_at:
            return EOS_ID
        return VOCAB_BASE + self.rng.randrange(len(VOCAB))

    def charge(self, bug, dt):
        self.lost[bug] = self.lost.get(bug, 0.0) + dt


# ----------------------------------------------------------------------------------------
# KV cache: paged blocks, ref counts, prefix cache by chained full-block hashes, LRU free
# queue (cached blocks with ref 0 stay revivable until evicted).
# ----------------------------------------------------------------------------------------
class KVPool:
    def __init__(self, n):
        self.n = n
        self.ref = [0] * n
        self.bhash = [None] * n
        self.free = OrderedDict((i, None) for i in range(n))
        self.cache = {}
        self.withheld = {}  # bug5 bookkeeping only
        self.leaked = 0     # bug7 bookkeeping only

    def num_free(self):
        return len(self.free)

    def used_by_requests(self):
        return self.n - len(self.free) - self.leaked

    def lookup(self, req):
        max_blocks = (req.num_tokens - 1) // BLOCK_SIZE
        if max_blocks <= 0:
            return [], 0
        req.ensure_hashes(max_blocks)
        hit = []
        cache = self.cache
        for i in range(max_blocks):
            b = cache.get(req.hashes[i])
            if b is None:
                break
            hit.append(b)
        cf = len(hit)
        if self.withheld:
            wh = self.withheld
            for i in range(len(hit), max_blocks):
                h = req.hashes[i]
                if h in cache or h in wh:
                    cf += 1
                else:
                    break
        return hit, cf

    def blocks_needed(self, req, num_new, computed_blocks=()):
        total = req.num_computed + len(computed_blocks) * BLOCK_SIZE + num_new
        n_new = -(-total // BLOCK_SIZE) - len(req.blocks) - len(computed_blocks)
        ev = 0
        for b in computed_blocks:
            if self.ref[b] == 0:
                ev += 1
        return max(n_new, 0) + ev, max(n_new, 0)

    def allocate(self, req, num_new, computed_blocks=()):
        need, n_new = self.blocks_needed(req, num_new, computed_blocks)
        if need > len(self.free):
            return False, need
        ref, free = self.ref, self.free
        for b in computed_blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1
            req.blocks.append(b)
        if computed_blocks:
            req.num_cached_blocks = len(req.blocks)
        bhash, cache = self.bhash, self.cache
        for _ in range(n_new):
            b, _ = free.popitem(last=False)
            h = bhash[b]
            if h is not None:
                if cache.get(h) == b:
                    del cache[h]
                bhash[b] = None
            ref[b] = 1
            req.blocks.append(b)
        return True, need

    def cache_blocks(self, req, upto_tokens, withhold=False):
        nfull = min(upto_tokens, req.num_tokens) // BLOCK_SIZE
        start = req.num_cached_blocks
        if nfull <= start:
            return
        req.ensure_hashes(nfull)
        if withhold:
            if req.withheld is None:
                req.withheld = []
            for i in range(len(req.withheld) + start, nfull):
                h = req.hashes[i]
                self.withheld[h] = self.withheld.get(h, 0) + 1
                req.withheld.append(h)
            return
        bhash, cache = self.bhash, self.cache
        for i in range(start, nfull):
            b = req.blocks[i]
            if bhash[b] is None:
                h = req.hashes[i]
                if h not in cache:
                    cache[h] = b
                    bhash[b] = h
        req.num_cached_blocks = nfull
        if req.withheld:
            self.drop_withheld(req)

    def drop_withheld(self, req):
        if req.withheld:
            wh = self.withheld
            for h in req.withheld:
                c = wh.get(h, 0) - 1
                if c > 0:
                    wh[h] = c
                else:
                    wh.pop(h, None)
        req.withheld = None

    def free_blocks(self, blocks):
        ref, free = self.ref, self.free
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None

    def free_req(self, req):
        self.drop_withheld(req)
        self.free_blocks(req.blocks)
        req.blocks = []
        req.num_cached_blocks = 0


# ----------------------------------------------------------------------------------------
# Frontend: a serial CPU resource (API-server process) for tokenization and output
# processing.  A second, counterfactual clock without bug8's extra cost is kept for the
# ground-truth delay estimate.
# ----------------------------------------------------------------------------------------
class Frontend:
    def __init__(self):
        self.t = 0.0
        self.cf = 0.0

    def charge(self, now, cost, cf_cost):
        self.t = max(self.t, now) + cost
        self.cf = max(self.cf, now) + cf_cost
        return self.t, max(0.0, self.t - self.cf)


# ----------------------------------------------------------------------------------------
# Engine
# ----------------------------------------------------------------------------------------
class Engine:
    def __init__(self, args, bugs, gt_file):
        self.bugs = bugs
        self.b = {name: (name in bugs) for name in ALL_BUGS}
        self.num_blocks = args.num_gpu_blocks
        self.max_num_seqs = args.max_num_seqs
        self.max_batched = args.max_num_batched_tokens
        self.max_model_len = args.max_model_len
        self.kv = KVPool(self.num_blocks)
        self.waiting = deque()
        self.running = []
        self.aborts = []
        self.leaks = []  # bug7: (reclaim_time, blocks)
        self.rng = random.Random(args.seed)
        self.seed = args.seed
        self.wake = asyncio.Event()
        self.stopping = False
        self.fe = Frontend()
        self.order = 0
        self.graph_cap = min(2 * self.max_num_seqs, 512)
        self.shapes_ever = set()
        self.shapes_warm = set()
        self.last_step_end = None
        self.latch = False  # bug6
        self.pending_stall = None
        self.misplaced = []  # bug3
        self.gt = open(gt_file, "a", buffering=1) if gt_file else None
        self.loop = asyncio.get_running_loop()
        # metrics
        self.c_preempt = 0
        self.c_pc_queries = 0
        self.c_pc_hits = 0
        self.c_prompt = 0
        self.c_gen = 0
        self.c_success = {"stop": 0, "length": 0, "abort": 0}
        self.h_ttft = Histogram(TTFT_BUCKETS)
        self.h_itl = Histogram(ITL_BUCKETS)
        self.h_e2e = Histogram(REQ_BUCKETS)
        self.h_queue = Histogram(REQ_BUCKETS)
        self.h_iter = Histogram(ITER_BUCKETS)
        self.h_prompt = Histogram([1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000])
        self.h_gen = Histogram([1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000])

    # -------------------------------------------------------------------- API side
    def next_order(self):
        self.order += 1
        return self.order

    def add(self, req, now):
        req.t_queued = now
        self.waiting.append(req)
        self.wake.set()

    def abort(self, req):
        if req.status == FINISHED or req.abort_requested:
            return
        req.abort_requested = True
        self.aborts.append(req)
        self.wake.set()

    # -------------------------------------------------------------------- engine loop
    async def run(self):
        while not self.stopping:
            try:
                await self._run()
            except asyncio.CancelledError:
                raise
            except Exception:
                import traceback
                traceback.print_exc()
                await asyncio.sleep(0.01)

    async def _run(self):
        loop = self.loop
        while not self.stopping:
            now = loop.time()
            if self.aborts:
                self._process_aborts(now)
            if self.leaks:
                self._reclaim_leaks(now)
            if not self.running and not self.waiting:
                self.wake.clear()
                timeout = None
                if self.leaks:
                    timeout = max(0.01, self.leaks[0][0] - now)
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
                continue
            if self.pending_stall is not None:
                t0, pre, blk, need, wp = self.pending_stall
                self.pending_stall = None
                self._account(t0, now - t0, 1.0, [], pre, blk, need, wp, None, None, 0.0, {})
            plan = self._schedule(now)
            if plan is None:
                # Nothing could be scheduled (e.g. KV exhausted by held blocks): wait for an
                # event instead of spinning.
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), 0.05)
                except asyncio.TimeoutError:
                    pass
                continue
            await asyncio.sleep(plan[0])
            end = loop.time()
            self.last_step_end = end
            self._update(plan, end)

    def _process_aborts(self, now):
        aborts, self.aborts = self.aborts, []
        removed_running = False
        for r in aborts:
            if r.status == FINISHED:
                continue
            if r.status == RUNNING:
                removed_running = True
                if (self.b["bug7"] and r.blocks and r.num_computed < r.num_prompt):
                    self.kv.drop_withheld(r)
                    self.leaks.append((now + B7_HOLD_S, r.blocks))
                    self.kv.leaked += len(r.blocks)
                    r.blocks = []
                    r.num_cached_blocks = 0
                else:
                    self.kv.free_req(r)
            else:
                try:
                    self.waiting.remove(r)
                except ValueError:
                    pass
                self.kv.free_req(r)
            r.status = FINISHED
            r.finish_reason = "abort"
            r.t_end = now
            self._finish_child(r, now)
        if removed_running:
            self.running = [r for r in self.running if r.status == RUNNING]
            self.latch = False

    def _reclaim_leaks(self, now):
        while self.leaks and self.leaks[0][0] <= now:
            _, blocks = self.leaks.pop(0)
            self.kv.leaked -= len(blocks)
            self.kv.free_blocks(blocks)
            self.wake.set()

    def _preempt(self, victim, now):
        self.kv.free_req(victim)
        victim.status = PREEMPTED
        victim.num_computed = 0
        victim.num_preemptions += 1
        victim.prefill_chunks = 0
        victim.redundant_left = 0
        self.c_preempt += 1
        self.latch = False
        if self.b["bug3"]:
            self.waiting.append(victim)
            if not victim.misplaced:
                victim.misplaced = True
                self.misplaced.append(victim)
        else:
            self.waiting.appendleft(victim)

    def _schedule(self, now):
        kv = self.kv
        b = self.b
        budget = self.max_batched
        sched = []
        preempted = []
        running = self.running

        # 1) RUNNING requests first, in admission order.
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = min(r.num_tokens - r.num_computed, budget)
            if n <= 0:
                i += 1
                continue
            while True:
                ok, need = kv.allocate(r, n)
                if ok:
                    break
                victim = running.pop()
                self._preempt(victim, now)
                preempted.append((victim, need))
                if victim is r:
                    break
            if not ok:
                break
            self._cache_after_alloc(r, n)
            sched.append((r, n))
            budget -= n
            i += 1

        # 2) WAITING requests, FCFS, only if nothing was preempted in this step.
        blocked = None
        head_need = 0
        admitted = 0
        wait_phase = None
        if not preempted:
            waiting = self.waiting
            wait_phase = (budget, kv.num_free(), len(running))
            if b["bug6"] and self.latch and waiting:
                blocked = "latch"
            else:
                while waiting and budget > 0:
                    if len(running) >= self.max_num_seqs:
                        blocked = "seqs"
                        break
                    r = waiting[0]
                    hits, cf = kv.lookup(r) if r.num_computed == 0 else ([], 0)
                    ncomp = len(hits) * BLOCK_SIZE
                    n = min(r.num_tokens - ncomp, budget)
                    ok, need = kv.allocate(r, n, hits)
                    if not ok:
                        blocked = "kv"
                        head_need = need
                        break
                    waiting.popleft()
                    self.c_pc_queries += r.num_tokens
                    self.c_pc_hits += ncomp
                    if r.num_preemptions == 0:
                        r.cached_tokens = ncomp
                    if b["bug5"] and cf > len(hits):
                        r.redundant_left = (cf - len(hits)) * BLOCK_SIZE
                    r.num_computed = ncomp
                    r.status = RUNNING
                    if r.t_sched is None:
                        r.t_sched = now
                        self.h_queue.observe(now - r.arrival_engine)
                    running.append(r)
                    if self.misplaced:
                        self._note_jumper(r)
                    self._cache_after_alloc(r, n)
                    sched.append((r, n))
                    budget -= n
                    admitted += 1

        if not sched:
            if self.bugs:
                self.pending_stall = (now, preempted, blocked, head_need, wait_phase)
            return None

        # 3) Step duration from the cost model.
        N = 0
        B = len(sched)
        decode_only = True
        ctx_dec = 0
        pre = 0.0
        n_samp = n_lp = sum_k = n_seed = 0
        z = None
        if b["bug2"]:
            z = [0, 0, 0, 0.0, 0, 0, 0, 0]  # N, B, ctx_dec, pre, samp, lp, k, seed
        for r, n in sched:
            N += n
            nc = r.num_computed
            is_dec = (n == 1 and nc == r.num_tokens - 1 and r.out)
            samples = nc + n >= r.num_tokens
            if is_dec:
                ctx_dec += nc + 1
            else:
                decode_only = False
                pre += n * (nc + n * 0.5)
            if samples:
                n_samp += 1
                if r.logprobs is not None:
                    n_lp += 1
                    sum_k += r.logprobs
                if r.seeded:
                    n_seed += 1
            if z is not None and r.zombie:
                z[0] += n
                z[1] += 1
                if is_dec:
                    z[2] += nc + 1
                else:
                    z[3] += n * (nc + n * 0.5)
                if samples:
                    z[4] += 1
                    if r.logprobs is not None:
                        z[5] += 1
                        z[6] += r.logprobs
                    if r.seeded:
                        z[7] += 1
        base = self._cost(N, B, decode_only, ctx_dec, pre, n_samp, n_lp, sum_k, n_seed)

        # warm-up of never-seen shapes (legitimate), and bug extras
        extras = {}
        if decode_only and B <= self.graph_cap:
            key = ("d", self._pad(B))
        else:
            key = ("m", 1 << max(6, (N - 1).bit_length()))
        warm = 0.0
        if b["bug4"] and self.last_step_end is not None and now - self.last_step_end >= B4_IDLE_S:
            self.shapes_warm.clear()
            extras["bug4"] = B4_WAKE
        if key not in self.shapes_warm:
            self.shapes_warm.add(key)
            c = WARM_DECODE if key[0] == "d" else WARM_MIXED + WARM_MIXED_TOK * key[1]
            if key in self.shapes_ever:
                extras["bug4"] = extras.get("bug4", 0.0) + c
            else:
                self.shapes_ever.add(key)
                warm = c
        if b["bug1"] and n_seed > 0:
            extras["bug1"] = n_samp * B1_ROW_SAMPLE
        jitter = self.rng.lognormvariate(0.0, JITTER_SIGMA)
        T = (base + warm + sum(extras.values())) * jitter

        # 4) Ground-truth bookkeeping of time lost to enabled bugs (no effect on behaviour).
        if self.bugs:
            self._account(now, T, jitter, sched, preempted, blocked, head_need, wait_phase, z,
                          (N, B, decode_only, ctx_dec, pre, n_samp, n_lp, sum_k, n_seed), base,
                          extras)
        self.h_iter.observe(N)
        if TRACE:
            print("%.3f T=%.4f N=%d run=%d wait=%d free=%d pre=%s blk=%s adm=%d sched=%s" % (
                now, T, N, len(self.running), len(self.waiting), kv.num_free(),
                [v.parent.rid for v, _ in preempted],
                "skip" if blocked == "latch" else blocked, admitted,
                " ".join("%s:%d" % (r.parent.rid, n) for r, n in sched if n > 1 or len(sched) < 6)),
                file=sys.stderr)
        return (T, sched)

    def _note_jumper(self, r):
        if r.misplaced:
            r.misplaced = False
            r.jumpers = None
            self.misplaced = [m for m in self.misplaced if m is not r]
        for m in self.misplaced:
            if m.jumpers is None:
                m.jumpers = []
            m.jumpers.append(r)

    def _cache_after_alloc(self, r, n):
        # Full blocks are registered in the prefix cache as soon as they are allocated for
        # computation (as vLLM does), so concurrent requests can share them.
        self.kv.cache_blocks(r, r.num_computed + n, withhold=self.b["bug5"])

    @staticmethod
    def _pad(B):
        if B <= 1:
            return 1
        if B <= 2:
            return 2
        if B <= 4:
            return 4
        return -(-B // 8) * 8

    def _cost(self, N, B, decode_only, ctx_dec, pre, n_samp, n_lp, sum_k, n_seed):
        if decode_only and B <= self.graph_cap:
            lin = max(W_FLOOR, self._pad(B) * TAU)
            launch = LAUNCH_GRAPH
        else:
            lin = max(W_FLOOR, N * TAU)
            launch = LAUNCH_PIECEWISE if N <= self.graph_cap else LAUNCH_EAGER
        return (CPU_STEP + CPU_SEQ * B + launch + lin + ctx_dec * ATT_DEC + pre * ATT_PRE
                + SAMPLE * n_samp + LOGPROB_SEQ * n_lp + LOGPROB_K * sum_k + SEEDED_SEQ * n_seed)

    def _account(self, now, T, jitter, sched, preempted, blocked, head_need, wait_phase, z, agg,
                 base, extras):
        live = None

        def all_live():
            nonlocal live
            if live is None:
                live = self.running + list(self.waiting)
            return live

        # Extra step time (bug1 sampler path, bug4 wake/re-warm) delays every live request.
        for bug, dt in extras.items():
            if dt > 0:
                for r in all_live():
                    r.charge(bug, dt * jitter)

        kv = self.kv
        # bug2: zombies (disconnected but still running) use step time, seats and blocks.
        if self.b["bug2"]:
            zr = [r for r in self.running if r.zombie]
            if z is not None and z[1] > 0:
                N, B, dec_only, ctx_dec, pre, n_samp, n_lp, sum_k, n_seed = agg
                nz = self._cost(N - z[0], B - z[1], dec_only, ctx_dec - z[2], pre - z[3],
                                n_samp - z[4], n_lp - z[5], sum_k - z[6], n_seed - z[7]) \
                    if B - z[1] > 0 else 0.0
                dt = (base - nz) * jitter
                if dt > 0:
                    for r in all_live():
                        if not r.zombie:
                            r.charge("bug2", dt)
            zb = sum(len(r.blocks) for r in zr)
            hit = False
            if blocked == "seqs" and zr:
                hit = True
            elif blocked == "kv" and zb and kv.num_free() + zb >= head_need:
                hit = True
            if preempted and zb:
                hit = True
                for v, _ in preempted:
                    if not v.zombie:
                        v.charge("bug2", T)
            if hit:
                for r in self.waiting:
                    if not r.zombie:
                        r.charge("bug2", T)
        # bug7: leaked blocks make admission fail / force preemption.
        if self.b["bug7"] and kv.leaked:
            hit = False
            if blocked == "kv" and kv.num_free() + kv.leaked >= head_need:
                hit = True
            if preempted:
                hit = True
            if hit:
                for r in self.waiting:
                    r.charge("bug7", T)
        # bug3: a preempted request re-queued behind newer ones loses every step in which it
        # would have been admissible at the head of the queue (its correct position), and
        # every step in which requests that jumped ahead of it are still holding resources.
        if self.misplaced:
            self.misplaced = [m for m in self.misplaced if m.misplaced and m.status == PREEMPTED]
            for m in self.misplaced:
                hit = False
                if m.jumpers:
                    for j in m.jumpers:
                        if j.status == RUNNING:
                            hit = True
                            break
                if not hit and wait_phase is not None:
                    w_budget, w_free, w_running = wait_phase
                    if w_budget > 0 and w_running < self.max_num_seqs:
                        need = -(-min(m.num_tokens, w_budget) // BLOCK_SIZE)
                        hit = need <= w_free
                if hit:
                    m.charge("bug3", T)
        # bug6: admission skipped because of the stale latch.
        if blocked == "latch" and self.waiting:
            head = self.waiting[0]
            budget_left = self.max_batched - sum(n for _, n in sched)
            if budget_left > 0 and len(self.running) < self.max_num_seqs:
                n = min(head.num_tokens, budget_left)
                need = -(-n // BLOCK_SIZE)
                if need <= kv.num_free():
                    for r in self.waiting:
                        r.charge("bug6", T)
        # bug5: redundant prefill of prefix blocks that should have been cache hits.
        if self.b["bug5"]:
            marginal = 0.0
            victims = []
            for r, n in sched:
                if r.redundant_left > 0:
                    red = min(n, r.redundant_left)
                    r.redundant_left -= red
                    victims.append((r, red / n))
                    marginal += red * TAU
            if victims:
                vs = set()
                for r, frac in victims:
                    r.charge("bug5", T * frac)
                    vs.add(id(r))
                for r in all_live():
                    if id(r) not in vs:
                        r.charge("bug5", marginal * jitter)

    def _update(self, plan, now):
        T, sched = plan
        outputs = []
        finished_any = False
        for r, n in sched:
            if r.status != RUNNING:
                continue
            if r.num_computed < r.num_prompt:
                r.prefill_chunks += 1
            r.num_computed += n
            if r.num_computed < r.num_tokens:
                continue
            if self.b["bug6"] and r.prefill_chunks >= 2 and not r.out:
                self.latch = True
            tok = r.next_token()
            r.out.append(tok)
            self.c_gen += 1
            if len(r.out) == 1:
                r.t_first_gen = now
                r.lost_first = dict(r.lost)
                self.c_prompt += r.num_prompt
            fin = None
            if tok == EOS_ID:
                fin = "stop"
            elif len(r.out) >= r.max_tokens or r.num_tokens >= self.max_model_len:
                fin = "length"
            if fin:
                r.status = FINISHED
                r.finish_reason = fin
                if r.withheld is not None:
                    self.kv.cache_blocks(r, r.num_computed)
                self.kv.free_req(r)
                finished_any = True
            outputs.append((r, tok, fin))
        if finished_any:
            self.running = [r for r in self.running if r.status == RUNNING]
            self.latch = False
        if outputs:
            self._emit(outputs, now)

    # -------------------------------------------------------------------- outputs
    def _emit(self, outputs, now):
        cost = cf = 0.0
        b8 = self.b["bug8"]
        for r, tok, fin in outputs:
            stream = r.parent.stream
            c = FE_OUT + (FE_SSE if stream else 0.0)
            if r.logprobs is not None:
                c += FE_LP * (r.logprobs + 1)
            cf += c
            if b8 and stream and r.logprobs is not None:
                c += B8_LP_REPROC * (r.logprobs + 1) * len(r.out)
            cost += c
        t_done, late = self.fe.charge(now, cost, cf)
        self.loop.call_at(t_done, self._deliver, outputs, late)

    def _deliver(self, outputs, late):
        now = self.loop.time()
        for r, tok, fin in outputs:
            if r.t_first is None:
                r.t_first = now
                r.fe_late_first = late
                self.h_ttft.observe(now - r.parent.arrival)
            else:
                self.h_itl.observe(now - r.t_last)
            r.t_last = now
            r.parent.push((r.index, tok, fin))
            if fin:
                r.fe_late_last = late
                r.t_end = now
                self._finish_child(r, now)

    def _finish_child(self, r, now):
        self.c_success[r.finish_reason] = self.c_success.get(r.finish_reason, 0) + 1
        self.h_prompt.observe(r.num_prompt)
        self.h_gen.observe(len(r.out))
        p = r.parent
        p.done += 1
        if p.done >= len(p.children):
            self._finalize(p, now)

    def _finalize(self, p, now):
        if p.finalized:
            return
        p.finalized = True
        self.h_e2e.observe(now - p.arrival)
        if not p.fut.done():
            p.fut.set_result(True)
        p.event.set()
        if self.gt is None:
            return
        tags = set()
        for r in p.children:
            tags |= self._tags(r, p)
        frs = [r.finish_reason for r in p.children]
        if "abort" in frs:
            fr = "abort"
        elif "length" in frs:
            fr = "length"
        else:
            fr = "stop"
        rec = {"request_id": p.rid, "pathologies": sorted(tags),
               "client_disconnected": bool(p.disconnected), "finish_reason": fr,
               "e2e_s": round(now - p.arrival, 4)}
        self.gt.write(json.dumps(rec) + "\n")
        self.gt.flush()

    def _tags(self, r, p):
        tags = set()
        if not self.bugs:
            return tags
        if r.zombie:
            tags.add("bug2")
        end = r.t_end if r.t_end is not None else self.loop.time()
        e2e = end - p.arrival
        ttft = (r.t_first - p.arrival) if r.t_first is not None else e2e
        first = r.lost_first if r.lost_first is not None else r.lost
        for bug in self.bugs:
            d_e2e = r.lost.get(bug, 0.0)
            d_ttft = first.get(bug, 0.0)
            if bug == "bug8":
                d_e2e += p.tok_late + r.fe_late_last
                d_ttft += p.tok_late + r.fe_late_first
            if material(d_ttft, ttft) or material(d_e2e, e2e):
                tags.add(bug)
        return tags

    # -------------------------------------------------------------------- metrics
    def metrics_text(self):
        L = 'engine="0",model_name="%s"' % MODEL_NAME
        out = []

        def g(name, typ, hlp, val, labels=L):
            out.append("# HELP %s %s" % (name, hlp))
            out.append("# TYPE %s %s" % (name, typ))
            out.append("%s{%s} %r" % (name, labels, float(val)))

        g("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
          len(self.running))
        g("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
          len(self.waiting))
        g("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
          self.kv.used_by_requests() / self.num_blocks)
        g("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
          self.c_preempt)
        g("vllm:prefix_cache_queries_total", "counter",
          "Prefix cache queries, in terms of number of queried tokens.", self.c_pc_queries)
        g("vllm:prefix_cache_hits_total", "counter",
          "Prefix cache hits, in terms of number of cached tokens.", self.c_pc_hits)
        g("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", self.c_prompt)
        g("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
          self.c_gen)
        out.append("# HELP vllm:request_success_total Count of successfully processed requests.")
        out.append("# TYPE vllm:request_success_total counter")
        for k in ("stop", "length", "abort"):
            out.append('vllm:request_success_total{%s,finished_reason="%s"} %r'
                       % (L, k, float(self.c_success.get(k, 0))))
        out.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig")
        out.append("# TYPE vllm:cache_config_info gauge")
        out.append('vllm:cache_config_info{block_size="%d",cache_dtype="auto",'
                   'enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",'
                   'model_name="%s",num_gpu_blocks="%d",prefix_caching_hash_algo="builtin"} 1.0'
                   % (BLOCK_SIZE, MODEL_NAME, self.num_blocks))
        for name, h, hlp in (
                ("vllm:time_to_first_token_seconds", self.h_ttft, "Histogram of time to first token in seconds."),
                ("vllm:inter_token_latency_seconds", self.h_itl, "Histogram of inter-token latency in seconds."),
                ("vllm:e2e_request_latency_seconds", self.h_e2e, "Histogram of e2e request latency in seconds."),
                ("vllm:request_queue_time_seconds", self.h_queue, "Histogram of time spent in WAITING phase for request."),
                ("vllm:iteration_tokens_total", self.h_iter, "Histogram of number of tokens per engine_step."),
                ("vllm:request_prompt_tokens", self.h_prompt, "Number of prefill tokens processed."),
                ("vllm:request_generation_tokens", self.h_gen, "Number of generation tokens processed.")):
            out.append("# HELP %s %s" % (name, hlp))
            out.append("# TYPE %s histogram" % name)
            h.render(name, L, out)
        return "\n".join(out) + "\n"


def material(delay, latency):
    """A delay is material when it is >= 30 ms and >= 20% of the latency the request would
    otherwise have had."""
    return delay >= 0.03 and delay >= 0.2 * max(latency - delay, 0.0)


# ----------------------------------------------------------------------------------------
# HTTP API
# ----------------------------------------------------------------------------------------
def err(status, msg, typ="BadRequestError", param=None):
    return web.json_response({"error": {"message": msg, "type": typ, "param": param,
                                        "code": status}}, status=status)


class BadRequest(Exception):
    pass


def _int(body, key, default, lo=None, hi=None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise BadRequest("%s must be an integer" % key)
    v = int(v)
    if lo is not None and v < lo:
        raise BadRequest("%s must be at least %d, got %d." % (key, lo, v))
    if hi is not None and v > hi:
        raise BadRequest("%s must be at most %d, got %d." % (key, hi, v))
    return v


def _float(body, key, default):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest("%s must be a number" % key)
    return float(v)


class Server:
    def __init__(self, args, bugs):
        self.args = args
        self.bugs = bugs
        self.engine = None
        self.created = int(time.time())

    async def startup(self, app):
        self.engine = Engine(self.args, self.bugs, self.args.ground_truth)
        self.engine_task = asyncio.get_running_loop().create_task(self.engine.run())

    async def cleanup(self, app):
        self.engine.stopping = True
        self.engine.wake.set()
        self.engine_task.cancel()
        try:
            await self.engine_task
        except (asyncio.CancelledError, Exception):
            pass
        if self.engine.gt:
            self.engine.gt.close()

    # ------------------------------------------------------------ simple endpoints
    async def health(self, request):
        return web.Response(status=200)

    async def version(self, request):
        return web.json_response({"version": VERSION})

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{
            "id": MODEL_NAME, "object": "model", "created": self.created, "owned_by": "vllm",
            "root": MODEL_NAME, "parent": None, "max_model_len": self.args.max_model_len,
            "permission": []}]})

    async def metrics(self, request):
        return web.Response(text=self.engine.metrics_text(),
                            content_type="text/plain", charset="utf-8")

    async def tokenize(self, request):
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("body must be a JSON object")
            if "messages" in body:
                ids = TOKENIZER.encode_chat(body["messages"], body.get("add_generation_prompt", True))
            elif isinstance(body.get("prompt"), str):
                ids = TOKENIZER.encode(body["prompt"])
            else:
                raise BadRequest("either 'prompt' (string) or 'messages' is required")
        except (BadRequest, ValueError) as e:
            return err(400, str(e))
        res = {"count": len(ids), "max_model_len": self.args.max_model_len, "tokens": ids}
        if body.get("return_token_strs"):
            res["token_strs"] = [TOKENIZER.piece(i).strip() or "<|end|>" for i in ids]
        return web.json_response(res)

    async def detokenize(self, request):
        try:
            body = await request.json()
            toks = body.get("tokens")
            if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
                raise BadRequest("'tokens' must be a list of integers")
        except (BadRequest, ValueError, AttributeError) as e:
            return err(400, str(e))
        return web.json_response({"prompt": TOKENIZER.decode(toks)})

    # ------------------------------------------------------------ generation
    async def completions(self, request):
        return await self._generate(request, "cmpl")

    async def chat(self, request):
        return await self._generate(request, "chat")

    def _parse(self, body, kind):
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        mml = self.args.max_model_len
        if kind == "cmpl":
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
                p = p[0]
            if isinstance(p, str):
                prompt = TOKENIZER.encode(p)
            elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                prompt = list(p)
            else:
                raise BadRequest("'prompt' must be a string or a list of token ids")
            max_tokens = _int(body, "max_tokens", 16, lo=1)
            lp = body.get("logprobs")
            logprobs = None if lp is None else _int(body, "logprobs", 0, lo=0, hi=20)
            if body.get("echo"):
                raise BadRequest("echo is not supported by this server")
        else:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise BadRequest("'messages' must be a non-empty list")
            try:
                prompt = TOKENIZER.encode_chat(msgs, body.get("add_generation_prompt", True))
            except ValueError as e:
                raise BadRequest(str(e))
            mt = body.get("max_completion_tokens")
            if mt is None:
                mt = body.get("max_tokens")
            if mt is None:
                max_tokens = max(1, mml - len(prompt))
            else:
                max_tokens = _int({"max_tokens": mt}, "max_tokens", 16, lo=1)
            logprobs = None
            if body.get("logprobs"):
                logprobs = _int(body, "top_logprobs", 0, lo=0, hi=20)
        if len(prompt) == 0:
            raise BadRequest("The prompt cannot be empty.")
        if len(prompt) >= mml:
            raise BadRequest("This model's maximum context length is %d tokens. However, your "
                             "request has %d input tokens. Please reduce the length of the "
                             "input messages." % (mml, len(prompt)))
        if len(prompt) + max_tokens > mml:
            raise BadRequest("This model's maximum context length is %d tokens. However, you "
                             "requested %d tokens (%d in the messages, %d in the completion). "
                             "Please reduce the length of the messages or completion."
                             % (mml, len(prompt) + max_tokens, len(prompt), max_tokens))
        n = _int(body, "n", 1, lo=1, hi=64)
        min_tokens = _int(body, "min_tokens", 0, lo=0)
        if min_tokens > max_tokens:
            raise BadRequest("min_tokens must be less than or equal to max_tokens=%d, got %d."
                             % (max_tokens, min_tokens))
        temperature = _float(body, "temperature", 1.0)
        if temperature < 0:
            raise BadRequest("temperature must be non-negative, got %s." % temperature)
        seed = body.get("seed")
        if seed is not None:
            seed = _int(body, "seed", 0)
        ignore_eos = bool(body.get("ignore_eos", False))
        stream = bool(body.get("stream", False))
        so = body.get("stream_options") or {}
        include_usage = bool(so.get("include_usage", False)) if isinstance(so, dict) else False
        return dict(prompt=prompt, max_tokens=max_tokens, min_tokens=min_tokens, n=n,
                    temperature=temperature, seed=seed, ignore_eos=ignore_eos, stream=stream,
                    include_usage=include_usage, logprobs=logprobs)

    async def _generate(self, request, kind):
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        hdrs = {"X-Request-Id": rid}
        try:
            body = await request.json()
        except Exception:
            return err(400, "Invalid JSON body")
        try:
            P = self._parse(body, kind)
        except BadRequest as e:
            r = err(400, str(e))
            r.headers["X-Request-Id"] = rid
            return r
        eng = self.engine
        prompt = P["prompt"]
        parent = ClientRequest(rid, arrival, kind, P["stream"], P["n"], len(prompt))
        parent.include_usage = P["include_usage"]
        try:
            # frontend: parse + tokenize on the serialized API-server CPU
            c = FE_REQ + FE_TOK * len(prompt)
            t_done, late = eng.fe.charge(loop.time(), c, c)
            parent.tok_late = late
            dt = t_done - loop.time()
            if dt > 0:
                await asyncio.sleep(dt)
            now = loop.time()
            if P["seed"] is not None:
                base_seed = P["seed"]
            elif P["temperature"] == 0:
                base_seed = zlib.crc32(repr(prompt[:64]).encode()) ^ len(prompt)
            else:
                base_seed = eng.rng.getrandbits(48)
            for i in range(P["n"]):
                child = Req(parent, i, prompt, P["max_tokens"], P["min_tokens"], P["ignore_eos"],
                            P["temperature"], P["seed"], P["logprobs"], eng.next_order(),
                            (base_seed * 1000003 + i) & 0xFFFFFFFFFFFF)
                child.arrival_engine = now
                parent.children.append(child)
            for child in parent.children:
                eng.add(child, now)
        except asyncio.CancelledError:
            parent.disconnected = True
            if not parent.children:
                self._finalize_unstarted(parent)
            else:
                self._on_disconnect(parent)
            raise
        if P["stream"]:
            return await self._stream(request, parent, kind, hdrs, P)
        return await self._full(request, parent, kind, hdrs, P)

    def _finalize_unstarted(self, parent):
        eng = self.engine
        if parent.finalized or eng.gt is None:
            parent.finalized = True
            return
        parent.finalized = True
        rec = {"request_id": parent.rid, "pathologies": [], "client_disconnected": True,
               "finish_reason": "abort",
               "e2e_s": round(asyncio.get_running_loop().time() - parent.arrival, 4)}
        eng.gt.write(json.dumps(rec) + "\n")
        eng.gt.flush()

    def _on_disconnect(self, parent):
        parent.disconnected = True
        eng = self.engine
        for c in parent.children:
            if c.status == FINISHED:
                continue
            if eng.b["bug2"] and not parent.stream:
                c.zombie = True
            else:
                eng.abort(c)

    def _logprobs_cmpl(self, r_index, toks, k, start):
        tokens, tlp, tops, offs = [], [], [], []
        off = 0
        for j, t in enumerate(toks):
            piece = TOKENIZER.piece(t)
            lp = fake_lp(t, start + j)
            tokens.append(piece)
            tlp.append(lp)
            top = {piece: lp}
            for m in range(1, k):
                alt = TOKENIZER.piece(VOCAB_BASE + (t * 31 + m * 7) % len(VOCAB))
                top.setdefault(alt, lp - 0.5 * m - 0.1)
            tops.append(top)
            offs.append(off)
            off += len(piece)
        return {"text_offset": offs, "token_logprobs": tlp, "tokens": tokens, "top_logprobs": tops}

    def _logprobs_chat(self, toks, k, start):
        content = []
        for j, t in enumerate(toks):
            piece = TOKENIZER.piece(t)
            lp = fake_lp(t, start + j)
            top = [{"token": piece, "logprob": lp, "bytes": list(piece.encode())}]
            for m in range(1, k):
                alt = TOKENIZER.piece(VOCAB_BASE + (t * 31 + m * 7) % len(VOCAB))
                top.append({"token": alt, "logprob": lp - 0.5 * m - 0.1, "bytes": list(alt.encode())})
            content.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()),
                            "top_logprobs": top})
        return {"content": content}

    async def _stream(self, request, parent, kind, hdrs, P):
        resp = web.StreamResponse(status=200, headers=dict(hdrs, **{
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}))
        created = int(time.time())
        cid = ("cmpl-" if kind == "cmpl" else "chatcmpl-") + parent.rid
        obj = "text_completion" if kind == "cmpl" else "chat.completion.chunk"
        n = parent.n
        counts = [0] * n
        first_sent = [False] * n
        k = P["logprobs"]
        try:
            await resp.prepare(request)
            finished = 0
            while finished < n:
                items = await parent.get()
                grouped = {}
                for idx, tok, fin in items:
                    g = grouped.get(idx)
                    if g is None:
                        g = grouped[idx] = [[], None]
                    g[0].append(tok)
                    if fin:
                        g[1] = fin
                buf = []
                if kind == "chat" and not first_sent[0]:
                    for idx in range(n):
                        first_sent[idx] = True
                        buf.append(sse({"id": cid, "object": obj, "created": created,
                                        "model": MODEL_NAME, "choices": [{
                                            "index": idx, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}))
                for idx in sorted(grouped):
                    toks, fin = grouped[idx]
                    start = counts[idx]
                    counts[idx] += len(toks)
                    text = "".join(TOKENIZER.piece(t) for t in toks)
                    if kind == "cmpl":
                        ch = {"index": idx, "text": text,
                              "logprobs": self._logprobs_cmpl(idx, toks, max(k, 1), start) if k is not None else None,
                              "finish_reason": fin, "stop_reason": None}
                    else:
                        ch = {"index": idx, "delta": {"content": text},
                              "logprobs": self._logprobs_chat(toks, k, start) if k is not None else None,
                              "finish_reason": fin}
                        if fin:
                            ch["stop_reason"] = None
                    if fin:
                        finished += 1
                    buf.append(sse({"id": cid, "object": obj, "created": created,
                                    "model": MODEL_NAME, "choices": [ch]}))
                if buf:
                    await resp.write(b"".join(buf))
            tail = []
            if parent.include_usage:
                comp = sum(counts)
                tail.append(sse({"id": cid, "object": obj, "created": created, "model": MODEL_NAME,
                                 "choices": [], "usage": {"prompt_tokens": parent.prompt_len,
                                                          "total_tokens": parent.prompt_len + comp,
                                                          "completion_tokens": comp}}))
            tail.append(b"data: [DONE]\n\n")
            await resp.write(b"".join(tail))
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            self._on_disconnect(parent)
            raise
        return resp

    async def _full(self, request, parent, kind, hdrs, P):
        try:
            await parent.fut
        except asyncio.CancelledError:
            self._on_disconnect(parent)
            raise
        created = int(time.time())
        k = P["logprobs"]
        choices = []
        comp = 0
        for c in parent.children:
            toks = c.out
            comp += len(toks)
            text = "".join(TOKENIZER.piece(t) for t in toks)
            if kind == "cmpl":
                choices.append({"index": c.index, "text": text,
                                "logprobs": self._logprobs_cmpl(c.index, toks, max(k, 1), 0) if k is not None else None,
                                "finish_reason": c.finish_reason, "stop_reason": None,
                                "prompt_logprobs": None})
            else:
                choices.append({"index": c.index,
                                "message": {"role": "assistant", "content": text, "tool_calls": []},
                                "logprobs": self._logprobs_chat(toks, k, 0) if k is not None else None,
                                "finish_reason": c.finish_reason, "stop_reason": None})
        body = {"id": ("cmpl-" if kind == "cmpl" else "chatcmpl-") + parent.rid,
                "object": "text_completion" if kind == "cmpl" else "chat.completion",
                "created": created, "model": MODEL_NAME, "choices": choices,
                "usage": {"prompt_tokens": parent.prompt_len,
                          "total_tokens": parent.prompt_len + comp, "completion_tokens": comp}}
        return web.json_response(body, headers=hdrs)


def fake_lp(t, pos):
    return -round(((t * 2654435761 + pos * 40503) % 997) / 450.0, 4)


def sse(obj):
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def parse_bugs(s):
    s = (s or "none").strip().lower()
    if s in ("", "none"):
        return []
    if s == "all":
        return list(ALL_BUGS)
    out = []
    for x in s.split(","):
        x = x.strip()
        if not x:
            continue
        if x not in ALL_BUGS:
            raise SystemExit("unknown bug %r (known: %s)" % (x, ", ".join(ALL_BUGS)))
        if x not in out:
            out.append(x)
    return out


async def amain(args):
    bugs = parse_bugs(args.bugs)
    srv = Server(args, bugs)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(srv.startup)
    app.on_cleanup.append(srv.cleanup)
    app.router.add_get("/health", srv.health)
    app.router.add_get("/version", srv.version)
    app.router.add_get("/v1/models", srv.models)
    app.router.add_get("/metrics", srv.metrics)
    app.router.add_post("/tokenize", srv.tokenize)
    app.router.add_post("/detokenize", srv.detokenize)
    app.router.add_post("/v1/completions", srv.completions)
    app.router.add_post("/v1/chat/completions", srv.chat)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_address=True)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print("simllm %s listening on http://%s:%d (model=%s, bugs=%s)"
          % (VERSION, args.host, args.port, MODEL_NAME, ",".join(bugs) or "none"),
          file=sys.stderr, flush=True)
    await stop.wait()
    await runner.cleanup()


def main(argv=None):
    ap = argparse.ArgumentParser(description="vLLM-like LLM inference server simulator")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--bugs", default="none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ground-truth", default=None)
    ap.add_argument("--num-gpu-blocks", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=8192)
    args = ap.parse_args(argv)
    if args.num_gpu_blocks < 4 or args.max_num_seqs < 1 or args.max_num_batched_tokens < 16 \
            or args.max_model_len < 32:
        raise SystemExit("invalid engine configuration")
    if args.max_model_len > args.num_gpu_blocks * BLOCK_SIZE:
        raise SystemExit("max_model_len (%d) exceeds KV capacity (%d tokens)"
                         % (args.max_model_len, args.num_gpu_blocks * BLOCK_SIZE))
    try:
        asyncio.run(amain(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
