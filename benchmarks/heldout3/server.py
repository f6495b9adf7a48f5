#!/usr/bin/env python3
"""Real-time simulator of a vLLM (V1 engine) OpenAI-compatible server.

Simulated deployment: Qwen/Qwen3-30B-A3B-Instruct-2507 (MoE, 30.5B total /
3.3B active parameters, 48 layers, 128 experts top-8, GQA 32q/4kv heads,
head_dim 128), bf16 weights, one H100-SXM-80GB, TP=1, vLLM 0.11-style V1
engine: chunked prefill, prefix caching, async scheduling, CUDA graphs.

No model runs: tokens are fake words.  The engine loop sleeps for each step's
modelled GPU time.  See README.md for the behaviour and the cost model.

Only the standard library and aiohttp are used.
"""
import argparse
import asyncio
import bisect
import json
import math
import random
import signal
import sys
import time
import uuid
from collections import OrderedDict, deque

from aiohttp import web

MODEL_NAME = "Qwen/Qwen3-30B-A3B-Instruct-2507"
VLLM_VERSION = "0.11.0"
BLOCK = 16
VOCAB = 151936
ENDOFTEXT_ID = 151643
IM_START_ID = 151644
IM_END_ID = 151645  # EOS of the chat model
NL_ID = 198
MAX_LOGPROBS = 20
ALL_BUGS = ["bug1", "bug2", "bug3", "bug4", "bug5", "bug6", "bug7"]

# ----------------------------------------------------------------------------
# Tokenizer (deterministic, whitespace-word level, 1 word == 1 token)
# ----------------------------------------------------------------------------
_SYL = [c + v for c in "bdfghjklmnprstvz" for v in "aeiu"]  # 64 syllables
_SYL_IDX = {s: i for i, s in enumerate(_SYL)}
_SPECIAL = {ENDOFTEXT_ID: "<|endoftext|>", IM_START_ID: "<|im_start|>",
            IM_END_ID: "<|im_end|>"}
_SPECIAL_REV = {v: k for k, v in _SPECIAL.items()}
_WORD_CACHE = {}


def id_to_word(i):
    w = _WORD_CACHE.get(i)
    if w is None:
        w = _SPECIAL.get(i)
        if w is None:
            w = _SYL[i & 63] + _SYL[(i >> 6) & 63] + _SYL[(i >> 12) & 63]
        _WORD_CACHE[i] = w
    return w


def word_to_id(w):
    sp = _SPECIAL_REV.get(w)
    if sp is not None:
        return sp
    if len(w) == 6:
        a = _SYL_IDX.get(w[0:2])
        b = _SYL_IDX.get(w[2:4])
        c = _SYL_IDX.get(w[4:6])
        if a is not None and b is not None and c is not None:
            v = a | (b << 6) | (c << 12)
            if v < ENDOFTEXT_ID:
                return v
    h = 2166136261
    for ch in w.encode("utf-8", "surrogatepass"):
        h = ((h ^ ch) * 16777619) & 0xFFFFFFFF
    return h % ENDOFTEXT_ID


def tokenize_text(text):
    return [word_to_id(w) for w in text.split()]


def _content_text(content):
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


def tokenize_chat(messages, add_generation_prompt=True):
    """ChatML template: per message <|im_start|> role \\n content <|im_end|> \\n
    (5 + words(content) tokens); generation prompt <|im_start|> assistant \\n."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise ValueError("each message must be an object")
        role = m.get("role")
        if not isinstance(role, str):
            raise ValueError("message role missing")
        out.append(IM_START_ID)
        out.append(word_to_id(role))
        out.append(NL_ID)
        out.extend(tokenize_text(_content_text(m.get("content"))))
        out.append(IM_END_ID)
        out.append(NL_ID)
    if add_generation_prompt:
        out.append(IM_START_ID)
        out.append(word_to_id("assistant"))
        out.append(NL_ID)
    return out


def fake_logprob(tok):
    return -((tok * 2654435761) % 4000) / 1000.0 - 0.001


# ----------------------------------------------------------------------------
# Prometheus histograms
# ----------------------------------------------------------------------------
class Hist:
    __slots__ = ("name", "buckets", "counts", "sum", "count", "help")

    def __init__(self, name, buckets, help_=""):
        self.name = name
        self.buckets = list(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0
        self.help = help_

    def observe(self, v):
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def render(self, lbl, out):
        out.append("# HELP %s %s" % (self.name, self.help))
        out.append("# TYPE %s histogram" % self.name)
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append('%s_bucket{%s,le="%s"} %d' % (self.name, lbl, repr(float(b)), acc))
        acc += self.counts[-1]
        out.append('%s_bucket{%s,le="+Inf"} %d' % (self.name, lbl, acc))
        out.append("%s_sum{%s} %r" % (self.name, lbl, self.sum))
        out.append("%s_count{%s} %d" % (self.name, lbl, self.count))


def _125(maxv):
    out, m = [], 1
    while True:
        for f in (1, 2, 5):
            v = f * m
            if v > maxv:
                return out
            out.append(v)
        m *= 10


# ----------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------
WAITING, RUNNING, FINISHED = 0, 1, 2


class ClientReq:
    """One HTTP request (parent of n engine requests)."""

    def __init__(self, rid, kind, stream, n):
        self.rid = rid
        self.kind = kind  # "cmpl" | "chat"
        self.stream = stream
        self.n = n
        self.children = []
        self.arrival = 0.0
        self.created = int(time.time())
        self.prompt_len = 0
        self.logprobs = None  # int k or None
        self.include_usage = False
        self.buffer = []
        self.event = asyncio.Event()
        self.n_done = 0
        self.all_done = False
        self.disconnected = False
        self.disc_t = None
        self.first_tok_t = None
        self.finish_t = None
        self.gt_written = False
        self.self_tags = set()


class EngReq:
    __slots__ = (
        "eid", "parent", "idx", "all_tokens", "num_prompt", "max_tokens",
        "min_tokens", "ignore_eos", "eos_at", "logprobs", "seed", "temperature",
        "status", "num_computed", "blocks", "hashes", "ncached_blocks", "rng",
        "finish_reason", "n_out", "enq_t", "first_sched_t", "sched_once",
        "num_preemptions", "zombie", "abort_pending", "abort_t", "back_queued",
        "bd", "bdt", "delivered", "last_deliv_t", "first_tok_t", "seeded_rand",
        "cached_tokens", "prefill_done_t",
    )

    def __init__(self):
        self.bd = {}
        self.bdt = {}
        self.blocks = []
        self.hashes = []
        self.ncached_blocks = 0
        self.num_computed = 0
        self.n_out = 0
        self.status = WAITING
        self.finish_reason = None
        self.first_sched_t = None
        self.sched_once = False
        self.num_preemptions = 0
        self.zombie = None
        self.abort_pending = False
        self.abort_t = None
        self.back_queued = False
        self.delivered = 0
        self.last_deliv_t = None
        self.first_tok_t = None
        self.cached_tokens = 0
        self.prefill_done_t = None

    @property
    def num_tokens(self):
        return len(self.all_tokens)


def acc(r, bug, d):
    if d <= 0:
        return
    r.bd[bug] = r.bd.get(bug, 0.0) + d
    if r.n_out == 0:
        r.bdt[bug] = r.bdt.get(bug, 0.0) + d


def acc_max(r, bug, d):
    if d <= 0:
        return
    if d > r.bd.get(bug, 0.0):
        r.bd[bug] = d
    if r.n_out <= 1 and d > r.bdt.get(bug, 0.0):
        r.bdt[bug] = d


# ----------------------------------------------------------------------------
# KV cache: block pool with prefix caching (vLLM V1 semantics)
# ----------------------------------------------------------------------------
class KVPool:
    def __init__(self, num_blocks, bug_free_order):
        self.n = num_blocks
        self.ref = [0] * num_blocks
        self.bhash = [None] * num_blocks
        # block 0 is the null block (never handed out), as in vLLM.
        self.free_q = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached = {}
        self.bug_free_order = bug_free_order
        self.queries = 0
        self.hits = 0

    def num_free(self):
        return len(self.free_q)

    def usage(self):
        return 1.0 - len(self.free_q) / float(self.n - 1)

    def lookup(self, r):
        """Longest cached prefix (full blocks), capped at num_tokens - 1."""
        hashes = r.hashes
        nb = min(len(hashes), (len(r.all_tokens) - 1) // BLOCK)
        cached = self.cached
        out = []
        for i in range(nb):
            b = cached.get(hashes[i])
            if b is None:
                break
            out.append(b)
        return out

    def present_after_miss(self, r, hit_blocks):
        hashes = r.hashes
        nb = min(len(hashes), (len(r.all_tokens) - 1) // BLOCK)
        cached = self.cached
        c = 0
        for i in range(hit_blocks + 1, nb):
            if hashes[i] in cached:
                c += 1
        return c

    def blocks_needed(self, r, n_new, comp):
        total = r.num_computed + len(comp) * BLOCK + n_new
        need = -(-total // BLOCK) - len(r.blocks) - len(comp)
        if need < 0:
            need = 0
        ref = self.ref
        touch = 0
        for b in comp:
            if ref[b] == 0:
                touch += 1
        return need + touch, need

    def allocate(self, r, n_new, comp=()):
        tot, need = self.blocks_needed(r, n_new, comp)
        fq = self.free_q
        if tot > len(fq):
            return False
        ref = self.ref
        if comp:
            for b in comp:
                if ref[b] == 0:
                    del fq[b]
                ref[b] += 1
            r.blocks.extend(comp)
            if r.ncached_blocks < len(r.blocks):
                r.ncached_blocks = len(r.blocks)
        if need:
            bh = self.bhash
            cached = self.cached
            blocks = r.blocks
            for _ in range(need):
                b = fq.popitem(last=False)[0]
                h = bh[b]
                if h is not None:
                    if cached.get(h) == b:
                        del cached[h]
                    bh[b] = None
                ref[b] = 1
                blocks.append(b)
        # Cache the full blocks that this step will have computed.
        ncache = min(r.num_computed + len(comp) * BLOCK + n_new, len(r.all_tokens)) // BLOCK
        if ncache > r.ncached_blocks:
            hashes = r.hashes
            blocks = r.blocks
            bh = self.bhash
            cached = self.cached
            top = min(ncache, len(hashes), len(blocks))
            for i in range(r.ncached_blocks, top):
                b = blocks[i]
                if bh[b] is None:
                    h = hashes[i]
                    if h not in cached:
                        cached[h] = b
                        bh[b] = h
            r.ncached_blocks = top
        return True

    def free(self, r):
        ref = self.ref
        fq = self.free_q
        # vLLM frees tail blocks first so that eviction (from the queue head)
        # takes the deepest block of a chain first.
        seq = r.blocks if self.bug_free_order else reversed(r.blocks)
        for b in seq:
            ref[b] -= 1
            if ref[b] == 0:
                fq[b] = None
        r.blocks = []
        r.ncached_blocks = 0

    def exclusive_blocks(self, r):
        ref = self.ref
        return sum(1 for b in r.blocks if ref[b] == 1)


# ----------------------------------------------------------------------------
# Step cost model (Qwen3-30B-A3B bf16 on 1x H100 SXM, vLLM V1)
# ----------------------------------------------------------------------------
CG_SIZES = [1, 2, 4] + list(range(8, 513, 8))
W_BASE = 2.45e9          # bytes read per step outside experts (attn + lm_head)
EXPERT_BYTES = 48 * 9.44e6  # one expert across 48 layers (3 x 2048 x 768 bf16)
BW_W = 3.0e12            # effective HBM bandwidth for weight streaming
TAU = 11e-6              # s per token of linear/MoE compute (compute bound)
PAIR = 1.6e-9            # s per (query, key) pair of prefill attention (FA3)
KV_BYTES = 98304         # KV bytes per token (48 layers x 4 kv heads x 128 x 2 x bf16)
BW_KV = 2.4e12
FIXED = 3.5e-3           # launch + 48 MoE layers fixed latency per step
MIXED = 1.6e-3           # piecewise CUDA graph overhead when a prefill is in the batch


def pad_graph(b):
    if b > 512:
        return b
    return CG_SIZES[bisect.bisect_left(CG_SIZES, b)]


def model_time(B, n_tok, dec_ctx, pre_ctx, pre_pairs, mixed, any_lp, n_seeded):
    if B == 0:
        return 0.0
    n_eff = n_tok if mixed else pad_graph(B)
    e = 128.0 * (1.0 - 0.9375 ** n_tok)
    t_mem = (W_BASE + EXPERT_BYTES * e) / BW_W
    t_cmp = n_eff * TAU
    if t_mem > t_cmp:
        t_lin = t_mem + 0.15 * t_cmp
    else:
        t_lin = t_cmp + 0.15 * t_mem
    t = FIXED + t_lin + (dec_ctx + pre_ctx) * KV_BYTES / BW_KV + pre_pairs * PAIR
    if mixed:
        t += MIXED
    t += 1.2e-4 + 1.2e-6 * B           # sampler (top-p/top-k from generation config)
    if any_lp:
        t += 3.0e-4 + 2.2e-6 * B       # full-vocab log_softmax + topk for the batch
    t += 1.8e-5 * n_seeded             # per-request torch.Generator rows
    return t


# ----------------------------------------------------------------------------
# Engine
# ----------------------------------------------------------------------------
class Engine:
    def __init__(self, args, bugs, gt_path):
        self.bugs = bugs
        self.max_num_seqs = args.max_num_seqs
        self.max_batched = args.max_num_batched_tokens
        self.num_blocks = args.num_gpu_blocks
        self.max_model_len = args.max_model_len
        self.long_prefill_thr = args.long_prefill_token_threshold
        self.kv = KVPool(self.num_blocks, "bug4" in bugs)
        self.waiting = deque()
        self.running = []
        self.requests = {}
        self.pending_aborts = []
        self.wake = asyncio.Event()
        self.rng = random.Random(args.seed)
        self.jit = random.Random(args.seed * 7919 + 17)
        self.prev_end = 0.0
        self.fe_free = 0.0      # API-server event loop (output processing)
        self.fe_cf_free = 0.0   # counterfactual clock (ground-truth estimation only)
        self.tok_free = 0.0     # tokenizer worker thread
        self.stopping = False
        self.gt = open(gt_path, "a") if gt_path else None
        self.backq = set()
        self.zombies = set()
        # metrics
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.gen_tokens_total = 0
        self.success = {"stop": 0, "length": 0, "abort": 0}
        mml = self.max_model_len
        self.h_ttft = Hist("vllm:time_to_first_token_seconds",
                           [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                            0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
                            640.0, 2560.0], "Histogram of time to first token in seconds.")
        self.h_itl = Hist("vllm:inter_token_latency_seconds",
                          [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                           1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
                          "Histogram of inter-token latency in seconds.")
        lat_b = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
        self.h_e2e = Hist("vllm:e2e_request_latency_seconds", lat_b,
                          "Histogram of e2e request latency in seconds.")
        self.h_queue = Hist("vllm:request_queue_time_seconds", lat_b,
                            "Histogram of time spent in WAITING phase for request.")
        self.h_prefill = Hist("vllm:request_prefill_time_seconds", lat_b,
                              "Histogram of time spent in PREFILL phase for request.")
        self.h_decode = Hist("vllm:request_decode_time_seconds", lat_b,
                             "Histogram of time spent in DECODE phase for request.")
        self.h_iter = Hist("vllm:iteration_tokens_total",
                           [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
                           "Histogram of number of tokens per engine_step.")
        self.h_ptok = Hist("vllm:request_prompt_tokens", _125(mml),
                           "Number of prefill tokens processed.")
        self.h_gtok = Hist("vllm:request_generation_tokens", _125(mml),
                           "Number of generation tokens processed.")
        self.h_n = Hist("vllm:request_params_n", [1, 2, 5, 10, 20],
                        "Histogram of the n request parameter.")
        self.h_maxtok = Hist("vllm:request_params_max_tokens", _125(mml),
                             "Histogram of the max_tokens request parameter.")

    # ------------------------------------------------------------------ intake
    def new_child(self, parent, idx, prompt, max_tokens, min_tokens, ignore_eos,
                  logprobs, seed, temperature, internal_id):
        r = EngReq()
        r.eid = internal_id
        r.parent = parent
        r.idx = idx
        r.all_tokens = list(prompt)
        r.num_prompt = len(prompt)
        r.max_tokens = max_tokens
        r.min_tokens = min_tokens
        r.ignore_eos = ignore_eos
        r.logprobs = logprobs
        r.seed = seed
        r.temperature = temperature
        r.seeded_rand = seed is not None and temperature > 0
        if seed is not None:
            key = hash((seed, len(prompt), tuple(prompt[-32:])))
        elif temperature <= 0:
            key = hash((len(prompt), tuple(prompt[-32:])))  # greedy: same for all n
        else:
            key = self.rng.getrandbits(62)
        rr = random.Random(key)
        r.rng = rr.getrandbits(63) | 1
        if ignore_eos:
            r.eos_at = None
        else:
            mu = math.log(160.0 if parent.kind == "chat" else 110.0)
            natural = int(rr.lognormvariate(mu, 0.85)) + 1
            natural = max(4, min(natural, 6000))
            r.eos_at = max(natural, min_tokens + 1)
        toks = r.all_tokens
        hs = []
        h = None
        for i in range(len(toks) // BLOCK):
            h = hash((h, tuple(toks[i * BLOCK:(i + 1) * BLOCK])))
            hs.append(h)
        r.hashes = hs
        return r

    def add(self, children, now):
        for r in children:
            r.enq_t = now
            r.status = WAITING
            self.requests[r.eid] = r
            self.waiting.append(r)
        self.wake.set()

    def client_abort(self, parent, now):
        """Frontend detected that the client went away."""
        if parent.disconnected:
            return
        parent.disconnected = True
        parent.disc_t = now
        live = [c for c in parent.children if c.status != FINISHED]
        if not live:
            return
        if "bug1" in self.bugs and parent.n > 1:
            targets = [c for c in live if c.idx == 0]
            for c in live:
                if c.idx != 0:
                    c.zombie = "bug1"
                    c.abort_t = now
                    self.zombies.add(c)
        else:
            targets = live
        for c in targets:
            c.abort_t = now
            self.pending_aborts.append(c)
        self.wake.set()

    def _process_aborts(self, now):
        if not self.pending_aborts:
            return
        pend = self.pending_aborts
        self.pending_aborts = []
        for c in pend:
            if c.status == FINISHED:
                continue
            if c.status == WAITING:
                if "bug6" in self.bugs:
                    # abort of a queued request only takes effect once it has
                    # gone through the model (see BUGS.md)
                    c.abort_pending = True
                    c.zombie = "bug6"
                    self.zombies.add(c)
                    continue
                try:
                    self.waiting.remove(c)
                except ValueError:
                    pass
                self.backq.discard(c)
            else:
                try:
                    self.running.remove(c)
                except ValueError:
                    pass
                self.kv.free(c)
            self._finish_engine(c, "abort", now)
            self._child_done(c, now)

    # --------------------------------------------------------------- schedule
    def _preempt(self, r, now):
        self.kv.free(r)
        r.status = WAITING
        r.num_computed = 0
        r.num_preemptions += 1
        self.num_preemptions += 1
        r.enq_t = now
        if "bug2" in self.bugs:
            self.waiting.append(r)
            r.back_queued = True
            self.backq.add(r)
        else:
            self.waiting.appendleft(r)

    def schedule(self, now):
        kv = self.kv
        bugs = self.bugs
        budget = self.max_batched
        thr = self.long_prefill_thr
        mml = self.max_model_len
        sched = []
        flags = {}
        preempted = False
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = len(r.all_tokens) - r.num_computed
            if 0 < thr < n:
                n = thr
            if n > budget:
                n = budget
            lim = mml - 1 - r.num_computed
            if n > lim:
                n = lim
            if n <= 0:
                i += 1
                continue
            ok = True
            while not kv.allocate(r, n):
                victim = running.pop()
                self._preempt(victim, now)
                preempted = True
                if victim is r:
                    ok = False
                    break
            if not ok:
                break
            sched.append((r, n, r.num_computed))
            r.num_computed += n
            budget -= n
            i += 1

        admitted = 0
        if not preempted:
            waiting = self.waiting
            if self.backq and waiting:
                # ground truth only: a re-queued request that would have been
                # admitted this step had it been at the head of the queue
                hold = []
                head = waiting[0]
                for p in self.backq:
                    if p.status != WAITING or p is head:
                        continue
                    comp = kv.lookup(p)
                    n = min(len(p.all_tokens) - len(comp) * BLOCK, budget)
                    if n > 0 and kv.blocks_needed(p, n, comp)[0] <= kv.num_free():
                        hold.append(p)
                if hold:
                    flags["bug2"] = hold
            while waiting and budget > 0:
                if len(running) >= self.max_num_seqs:
                    break
                r = waiting[0]
                comp = kv.lookup(r)
                ncached = len(comp) * BLOCK
                n = len(r.all_tokens) - ncached
                if 0 < thr < n:
                    n = thr
                if n > budget:
                    n = budget
                if "bug7" in bugs and r.n_out == 0:
                    reserve = len(r.all_tokens) + r.max_tokens
                    need_r = -(-reserve // BLOCK) - len(comp)
                    need_r = min(need_r, self.num_blocks - 1 - len(comp))
                    touch = sum(1 for b in comp if kv.ref[b] == 0)
                    if need_r + touch > kv.num_free():
                        if kv.blocks_needed(r, n, comp)[0] <= kv.num_free():
                            flags["bug7"] = True
                        break
                lost = 0
                if "bug4" in bugs:
                    lost = kv.present_after_miss(r, len(comp))
                if not kv.allocate(r, n, comp):
                    if self.zombies and "bug1" in bugs:
                        zb = sum(kv.exclusive_blocks(z) for z in self.zombies
                                 if z.zombie == "bug1" and z.status == RUNNING)
                        if zb and kv.blocks_needed(r, n, comp)[0] <= kv.num_free() + zb:
                            flags["bug1kv"] = True
                    break
                waiting.popleft()
                if r.back_queued:
                    r.back_queued = False
                    self.backq.discard(r)
                running.append(r)
                r.status = RUNNING
                r.num_computed = ncached
                kv.queries += len(r.all_tokens)
                kv.hits += ncached
                if not r.sched_once:
                    r.sched_once = True
                    r.first_sched_t = now
                    r.cached_tokens = ncached
                    self.h_queue.observe(now - r.parent.arrival)
                if lost:
                    lt = lost * BLOCK
                    acc(r, "bug4", lt * (TAU + PAIR * (ncached + lt / 2.0)))
                sched.append((r, n, ncached))
                r.num_computed += n
                budget -= n
                admitted += 1
        if admitted and self.backq:
            held = flags.get("bug2") or []
            flags["bug2"] = list(set(held) | set(p for p in self.backq if p.status == WAITING))
        return sched, flags

    # ------------------------------------------------------------------- cost
    def cost(self, sched):
        B = len(sched)
        n_tok = dec_ctx = pre_ctx = 0
        pre_pairs = 0.0
        mixed = False
        any_lp = False
        n_seeded = 0
        any_seed_rand = False
        z_tok = z_dec = z_ctx = z_pre = 0
        z_pairs = 0.0
        z_B = 0
        z_mixed_only = True
        for r, n, p in sched:
            n_tok += n
            if n == 1:
                dec_ctx += p
            else:
                mixed = True
                pre_ctx += p
                pre_pairs += n * (p + n * 0.5)
            if r.logprobs is not None:
                any_lp = True
            if r.seed is not None:
                n_seeded += 1
                if r.seeded_rand:
                    any_seed_rand = True
            if r.zombie is not None:
                z_B += 1
                z_tok += n
                if n == 1:
                    z_dec += p
                else:
                    z_pre += p
                    z_pairs += n * (p + n * 0.5)
        base = model_time(B, n_tok, dec_ctx, pre_ctx, pre_pairs, mixed, any_lp, n_seeded)
        extras = {}
        if "bug3" in self.bugs and any_seed_rand:
            # seeded request drags the whole batch through per-row sampling
            x = 3.2e-4 * B
            extras["bug3"] = x
            base += x
        if z_B:
            # marginal cost of work that should have been aborted
            rest_mixed = any(n > 1 for r, n, p in sched if r.zombie is None)
            wo = model_time(B - z_B, n_tok - z_tok, dec_ctx - z_dec, pre_ctx - z_pre,
                            pre_pairs - z_pairs, rest_mixed, any_lp, n_seeded)
            extras["zombie"] = (max(0.0, base - wo), z_tok / float(max(1, n_tok)))
        jit = math.exp(self.jit.gauss(0.0, 0.02))
        return base * jit, extras, n_tok

    # ------------------------------------------------------------------- loop
    async def run(self):
        loop = asyncio.get_running_loop()
        while not self.stopping:
            now = loop.time()
            self._process_aborts(now)
            if not self.waiting and not self.running:
                self.wake.clear()
                await self.wake.wait()
                continue
            sched, flags = self.schedule(now)
            if not sched:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), 0.005)
                except asyncio.TimeoutError:
                    pass
                continue
            dur, extras, n_tok = self.cost(sched)
            start = self.prev_end if 0.0 <= now - self.prev_end < 0.004 else now
            end = start + dur
            delay = end - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)
            self.prev_end = end
            self.h_iter.observe(n_tok)
            if flags or extras:
                self._accrue(start, dur, flags, extras, sched)
            self._update(sched, end)

    def _live(self, t0):
        for r in self.running:
            if r.enq_t <= t0:
                yield r
        for r in self.waiting:
            if r.enq_t <= t0:
                yield r

    def _accrue(self, t0, dur, flags, extras, sched):
        x = extras.get("bug3")
        if x:
            for r in self._live(t0):
                acc(r, "bug3", x)
        z = extras.get("zombie")
        if z:
            marg, frac = z
            kinds = set(r.zombie for r, n, p in sched if r.zombie is not None)
            for bug in kinds:
                for r in self.running:
                    if r.zombie is None and r.enq_t <= t0:
                        acc(r, bug, marg)
                for r in self.waiting:
                    if r.zombie is None and r.enq_t <= t0:
                        acc(r, bug, max(marg, dur * frac))
        if flags.get("bug1kv"):
            for r in self.waiting:
                if r.zombie is None and r.enq_t <= t0:
                    acc(r, "bug1", dur)
        if flags.get("bug7"):
            for r in self.waiting:
                if r.enq_t <= t0:
                    acc(r, "bug7", dur)
        bq = flags.get("bug2")
        if bq:
            for r in bq:
                acc(r, "bug2", dur)

    # ----------------------------------------------------------------- update
    def _finish_engine(self, r, reason, now):
        r.status = FINISHED
        r.finish_reason = reason
        self.requests.pop(r.eid, None)
        self.zombies.discard(r)
        self.backq.discard(r)
        self.success[reason] = self.success.get(reason, 0) + 1

    def _update(self, sched, now):
        outs = []
        finished = False
        mml = self.max_model_len
        for r, n, p in sched:
            if r.status != RUNNING:
                continue
            toks = r.all_tokens
            if r.num_computed < len(toks):
                continue  # partial prefill chunk, nothing sampled
            if r.prefill_done_t is None:
                r.prefill_done_t = now
                self.prompt_tokens_total += r.num_prompt
            if r.abort_pending:
                # deferred abort of a queued request (bug6): drop it now
                self.kv.free(r)
                self._finish_engine(r, "abort", now)
                self._child_done(r, now)
                finished = True
                continue
            k = r.n_out + 1
            if r.eos_at is not None and k == r.eos_at:
                tok = IM_END_ID
            else:
                s = (r.rng * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
                r.rng = s
                tok = 1000 + (s >> 33) % 59000
            toks.append(tok)
            r.n_out = k
            self.gen_tokens_total += 1
            if len(toks) % BLOCK == 0:
                hs = r.hashes
                hs.append(hash((hs[-1] if hs else None, tuple(toks[-BLOCK:]))))
            reason = None
            if tok == IM_END_ID and r.eos_at is not None:
                reason = "stop"
            elif k >= r.max_tokens or len(toks) >= mml:
                reason = "length"
            if reason is not None:
                self.kv.free(r)
                self._finish_engine(r, reason, now)
                finished = True
            outs.append((r, k, reason))
        if finished:
            self.running = [r for r in self.running if r.status == RUNNING]
        if outs:
            self._frontend_outputs(outs, now)

    # ---------------------------------------------------------------- frontend
    def frontend_tokenize_done(self, now, cost):
        """Tokenizer runs on a single worker thread: serial queue."""
        start = self.tok_free if self.tok_free > now else now
        self.tok_free = start + cost
        return self.tok_free

    def _frontend_outputs(self, outs, now):
        cost = 0.0
        extra = 0.0
        bug5 = "bug5" in self.bugs
        for r, k, reason in outs:
            p = r.parent
            c = 1.0e-5 + (2.2e-5 if p.stream else 2.0e-6)
            if r.logprobs is not None:
                c += 1.1e-6 * (r.logprobs + 1)
                if bug5 and p.stream:
                    extra += 1.1e-6 * (r.logprobs + 1) * k
            if reason is not None:
                c += 2.5e-5 + (0.0 if p.stream else 4e-7 * k)
            cost += c
        start = self.fe_free if self.fe_free > now else now
        done = start + cost + extra
        self.fe_free = done
        if bug5:
            cs = self.fe_cf_free if self.fe_cf_free > now else now
            cf = cs + cost
            self.fe_cf_free = cf
            lag = done - cf
            if lag > 0:
                for r, k, reason in outs:
                    acc_max(r, "bug5", lag)
        loop = asyncio.get_running_loop()
        if done - loop.time() > 0.0005:
            loop.call_at(done, self._deliver, outs)
        else:
            self._deliver(outs)

    def _deliver(self, outs):
        t = asyncio.get_running_loop().time()
        itl = self.h_itl
        for r, k, reason in outs:
            p = r.parent
            if r.first_tok_t is None:
                r.first_tok_t = t
                if p.first_tok_t is None:
                    p.first_tok_t = t
                    self.h_ttft.observe(t - p.arrival)
            else:
                itl.observe(t - r.last_deliv_t)
            r.last_deliv_t = t
            if not p.disconnected:
                p.buffer.append((r, k, reason))
                p.event.set()
            if reason is not None:
                self.h_e2e.observe(t - p.arrival)
                if r.first_sched_t is not None and r.prefill_done_t is not None:
                    self.h_prefill.observe(max(0.0, r.prefill_done_t - r.first_sched_t))
                    self.h_decode.observe(max(0.0, t - r.first_tok_t))
                self.h_ptok.observe(r.num_prompt)
                self.h_gtok.observe(r.n_out)
                self._child_done(r, t)

    def _child_done(self, r, t):
        p = r.parent
        p.n_done += 1
        if p.n_done >= p.n:
            p.all_done = True
            p.finish_t = t
            p.event.set()
            self.write_gt(p)

    # ------------------------------------------------------------ ground truth
    def write_gt(self, p, reason_override=None):
        if p.gt_written:
            return
        p.gt_written = True
        if self.gt is None:
            return
        e2e = (p.finish_t if p.finish_t is not None else p.arrival) - p.arrival
        if reason_override:
            reason = reason_override
        else:
            reasons = [c.finish_reason for c in p.children]
            non_abort = [c for c in p.children if c.finish_reason != "abort"]
            if not non_abort:
                reason = "abort"
            else:
                reason = max(non_abort, key=lambda c: (c.last_deliv_t or 0.0)).finish_reason
            if reason is None:
                reason = reasons[-1] or "abort"
        tags = set(p.self_tags)
        ttft = (p.first_tok_t - p.arrival) if p.first_tok_t is not None else None
        for c in p.children:
            if c.zombie == "bug1" and p.disconnected and p.disc_t is not None:
                if (c.last_deliv_t or p.disc_t) - p.disc_t >= 0.05 or c.finish_reason != "abort":
                    tags.add("bug1")
            if c.zombie == "bug6" and c.abort_t is not None:
                if (p.finish_t or c.abort_t) - c.abort_t >= 0.05:
                    tags.add("bug6")
        bugs = set()
        for c in p.children:
            bugs.update(c.bd.keys())
        for bug in bugs:
            d = max(c.bd.get(bug, 0.0) for c in p.children)
            dt = max(c.bdt.get(bug, 0.0) for c in p.children)
            if d >= 0.05 and d >= 0.2 * e2e:
                tags.add(bug)
            elif dt >= 0.05:
                ref = ttft if ttft is not None else e2e
                if dt >= 0.3 * ref:
                    tags.add(bug)
        rec = {"request_id": p.rid, "pathologies": sorted(tags),
               "client_disconnected": bool(p.disconnected), "finish_reason": reason,
               "e2e_s": round(e2e, 6)}
        self.gt.write(json.dumps(rec) + "\n")
        self.gt.flush()

    # ----------------------------------------------------------------- metrics
    def render_metrics(self):
        lbl = 'engine="0",model_name="%s"' % MODEL_NAME
        out = []

        def g(name, typ, val, help_, extra=""):
            out.append("# HELP %s %s" % (name, help_))
            out.append("# TYPE %s %s" % (name, typ))
            out.append("%s{%s%s} %s" % (name, lbl, extra, val))

        g("vllm:num_requests_running", "gauge", len(self.running),
          "Number of requests in model execution batches.")
        g("vllm:num_requests_waiting", "gauge", len(self.waiting),
          "Number of requests waiting to be processed.")
        g("vllm:kv_cache_usage_perc", "gauge", repr(self.kv.usage()),
          "KV-cache usage. 1 means 100 percent usage.")
        g("vllm:num_preemptions_total", "counter", self.num_preemptions,
          "Cumulative number of preemption from the engine.")
        g("vllm:prefix_cache_queries_total", "counter", self.kv.queries,
          "Prefix cache queries, in terms of number of queried tokens.")
        g("vllm:prefix_cache_hits_total", "counter", self.kv.hits,
          "Prefix cache hits, in terms of number of cached tokens.")
        g("vllm:prompt_tokens_total", "counter", self.prompt_tokens_total,
          "Number of prefill tokens processed.")
        g("vllm:generation_tokens_total", "counter", self.gen_tokens_total,
          "Number of generation tokens processed.")
        out.append("# HELP vllm:request_success_total Count of successfully processed requests.")
        out.append("# TYPE vllm:request_success_total counter")
        for reason in ("stop", "length", "abort"):
            out.append('vllm:request_success_total{%s,finished_reason="%s"} %d'
                       % (lbl, reason, self.success.get(reason, 0)))
        out.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig")
        out.append("# TYPE vllm:cache_config_info gauge")
        out.append('vllm:cache_config_info{block_size="%d",cache_dtype="auto",'
                   'enable_prefix_caching="True",gpu_memory_utilization="0.9",'
                   'num_cpu_blocks="None",num_gpu_blocks="%d",'
                   'num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",'
                   'engine="0",model_name="%s"} 1.0' % (BLOCK, self.num_blocks, MODEL_NAME))
        for h in (self.h_ttft, self.h_itl, self.h_e2e, self.h_queue, self.h_prefill,
                  self.h_decode, self.h_iter, self.h_ptok, self.h_gtok, self.h_n,
                  self.h_maxtok):
            h.render(lbl, out)
        return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------
# HTTP layer (OpenAI-compatible, vLLM-shaped)
# ----------------------------------------------------------------------------
class BadRequest(Exception):
    def __init__(self, msg, code=400, typ="BadRequestError"):
        super().__init__(msg)
        self.msg = msg
        self.code = code
        self.typ = typ


def err_response(msg, code=400, typ="BadRequestError"):
    return web.json_response({"error": {"message": msg, "type": typ, "param": None,
                                        "code": code}}, status=code)


def _int(body, key, default, lo=None, hi=None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and v != int(v)):
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
        self.engine = Engine(args, bugs, args.ground_truth)
        self.live_ids = set()
        self.start_time = int(time.time())

    # ----------------------------------------------------------- simple routes
    async def health(self, request):
        return web.Response(status=200)

    async def version(self, request):
        return web.json_response({"version": VLLM_VERSION})

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{
            "id": MODEL_NAME, "object": "model", "created": self.start_time,
            "owned_by": "vllm", "root": MODEL_NAME, "parent": None,
            "max_model_len": self.engine.max_model_len,
            "permission": [{"id": "modelperm-0", "object": "model_permission",
                            "created": self.start_time, "allow_create_engine": False,
                            "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*",
                            "group": None, "is_blocking": False}]}]})

    async def metrics(self, request):
        return web.Response(text=self.engine.render_metrics(),
                            content_type="text/plain", charset="utf-8")

    async def _json(self, request):
        try:
            body = await request.json()
        except Exception:
            raise BadRequest("Invalid JSON body")
        if not isinstance(body, dict):
            raise BadRequest("Request body must be a JSON object")
        return body

    async def tokenize(self, request):
        try:
            body = await self._json(request)
            if "messages" in body:
                msgs = body["messages"]
                if not isinstance(msgs, list):
                    raise BadRequest("messages must be a list")
                try:
                    toks = tokenize_chat(msgs, bool(body.get("add_generation_prompt", True)))
                except ValueError as e:
                    raise BadRequest(str(e))
            elif isinstance(body.get("prompt"), str):
                toks = tokenize_text(body["prompt"])
            else:
                raise BadRequest("Either 'prompt' (string) or 'messages' is required")
        except BadRequest as e:
            return err_response(e.msg, e.code, e.typ)
        res = {"count": len(toks), "max_model_len": self.engine.max_model_len, "tokens": toks}
        if body.get("return_token_strs"):
            res["token_strs"] = [id_to_word(t) for t in toks]
        return web.json_response(res)

    async def detokenize(self, request):
        try:
            body = await self._json(request)
            toks = body.get("tokens")
            if not isinstance(toks, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < VOCAB for t in toks):
                raise BadRequest("tokens must be a list of valid token ids")
        except BadRequest as e:
            return err_response(e.msg, e.code, e.typ)
        return web.json_response({"prompt": " ".join(id_to_word(t) for t in toks)})

    # --------------------------------------------------------------- generation
    def _request_id(self, request):
        rid = request.headers.get("X-Request-Id")
        if not rid:
            rid = uuid.uuid4().hex
        return rid

    def _parse_common(self, body, kind):
        model = body.get("model")
        if model is not None and model != MODEL_NAME:
            raise BadRequest("The model `%s` does not exist." % model, 404, "NotFoundError")
        n = _int(body, "n", 1, 1, 128)
        stream = bool(body.get("stream", False))
        so = body.get("stream_options") or {}
        if so and not isinstance(so, dict):
            raise BadRequest("stream_options must be an object")
        if so and not stream:
            raise BadRequest("Stream options can only be defined when `stream=True`.")
        include_usage = bool(so.get("include_usage", False)) if so else False
        temperature = _float(body, "temperature", 0.7)
        if temperature < 0:
            raise BadRequest("temperature must be non-negative, got %s." % temperature)
        seed = body.get("seed")
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise BadRequest("seed must be an integer")
        ignore_eos = bool(body.get("ignore_eos", False))
        min_tokens = _int(body, "min_tokens", 0, 0)
        if kind == "cmpl":
            lp = body.get("logprobs")
            if lp is None or lp is False:
                logprobs = None
            else:
                if isinstance(lp, bool) or not isinstance(lp, int):
                    raise BadRequest("logprobs must be an integer")
                logprobs = lp
        else:
            if body.get("logprobs"):
                logprobs = _int(body, "top_logprobs", 0, 0)
            else:
                if body.get("top_logprobs") not in (None, 0):
                    raise BadRequest("when using `top_logprobs`, `logprobs` must be set to true.")
                logprobs = None
        if logprobs is not None and (logprobs < 0 or logprobs > MAX_LOGPROBS):
            raise BadRequest("Requested sample logprobs of %d, which is greater than max "
                             "allowed: %d" % (logprobs, MAX_LOGPROBS))
        return dict(n=n, stream=stream, include_usage=include_usage, temperature=temperature,
                    seed=seed, ignore_eos=ignore_eos, min_tokens=min_tokens, logprobs=logprobs)

    async def completions(self, request):
        return await self._generate(request, "cmpl")

    async def chat(self, request):
        return await self._generate(request, "chat")

    async def _generate(self, request, kind):
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        eng = self.engine
        rid = self._request_id(request)
        try:
            body = await self._json(request)
            opts = self._parse_common(body, kind)
            if kind == "cmpl":
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                    prompt = prompt[0]
                if isinstance(prompt, str):
                    toks = tokenize_text(prompt)
                    tcost = 6e-5 + 9e-7 * len(toks)
                elif isinstance(prompt, list) and prompt and all(
                        isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                    if any(t < 0 or t >= VOCAB for t in prompt):
                        raise BadRequest("Token id out of vocabulary range [0, %d)" % VOCAB)
                    toks = list(prompt)
                    tcost = 2e-5 + 2e-8 * len(toks)
                elif isinstance(prompt, list) and len(prompt) > 1:
                    raise BadRequest("Only a single prompt per request is supported by this server.")
                else:
                    raise BadRequest("prompt must be a string or a list of token ids")
                max_tokens = _int(body, "max_tokens", 16, 1)
            else:
                msgs = body.get("messages")
                if not isinstance(msgs, list) or not msgs:
                    raise BadRequest("messages must be a non-empty list")
                try:
                    toks = tokenize_chat(msgs, bool(body.get("add_generation_prompt", True)))
                except ValueError as e:
                    raise BadRequest(str(e))
                tcost = 2.5e-4 + 9e-7 * len(toks)
                mt = body.get("max_completion_tokens")
                if mt is None:
                    mt = body.get("max_tokens")
                max_tokens = None if mt is None else _int({"max_tokens": mt}, "max_tokens", 0, 1)
            if not toks:
                raise BadRequest("The prompt cannot be empty.")
        except BadRequest as e:
            return err_response(e.msg, e.code, e.typ)

        # tokenization on the API server's single tokenizer worker
        done = eng.frontend_tokenize_done(loop.time(), tcost)
        p = ClientReq(rid, kind, opts["stream"], opts["n"])
        p.arrival = arrival
        p.prompt_len = len(toks)
        p.logprobs = opts["logprobs"]
        p.include_usage = opts["include_usage"]
        try:
            d = done - loop.time()
            if d > 0:
                await asyncio.sleep(d)
        except asyncio.CancelledError:
            p.disconnected = True
            p.finish_t = loop.time()
            eng.write_gt(p, "abort")
            raise

        mml = eng.max_model_len
        plen = len(toks)
        if max_tokens is None:
            max_tokens = mml - plen
        if plen >= mml or plen + max_tokens > mml:
            if plen >= mml:
                msg = ("This model's maximum context length is %d tokens. However, your "
                       "request has %d input tokens. Please reduce the length of the "
                       "input messages." % (mml, plen))
            else:
                msg = ("This model's maximum context length is %d tokens. However, you "
                       "requested %d tokens (%d in the messages, %d in the completion). "
                       "Please reduce the length of the messages or completion."
                       % (mml, plen + max_tokens, plen, max_tokens))
            return err_response(msg)
        if opts["min_tokens"] > max_tokens:
            return err_response("min_tokens must be less than or equal to max_tokens=%d, got %d."
                                % (max_tokens, opts["min_tokens"]))

        base_id = rid
        k = 1
        while base_id in self.live_ids:
            base_id = "%s~%d" % (rid, k)
            k += 1
        self.live_ids.add(base_id)
        n = opts["n"]
        for i in range(n):
            seed = opts["seed"]
            if seed is not None and n > 1:
                seed = seed + i
            iid = base_id if n == 1 else "%d_%s" % (i, base_id)
            c = eng.new_child(p, i, toks, max_tokens, opts["min_tokens"], opts["ignore_eos"],
                              opts["logprobs"], seed, opts["temperature"], iid)
            p.children.append(c)
        eng.h_n.observe(n)
        eng.h_maxtok.observe(max_tokens)
        eng.add(p.children, loop.time())
        try:
            if p.stream:
                return await self._stream(request, p)
            return await self._full(request, p)
        except (asyncio.CancelledError, ConnectionResetError, ConnectionError):
            eng.client_abort(p, loop.time())
            raise
        finally:
            self.live_ids.discard(base_id)

    # ------------------------------------------------------------- formatting
    def _lp_cmpl(self, toks, k, offset0):
        lps = [fake_logprob(t) for t in toks]
        words = [" " + id_to_word(t) if t != IM_END_ID else "" for t in toks]
        offs = []
        o = offset0
        for w in words:
            offs.append(o)
            o += len(w)
        tops = []
        for t, lp in zip(toks, lps):
            d = {(" " + id_to_word(t) if t != IM_END_ID else ""): lp}
            for j in range(1, k + 1):
                alt = (t + 7919 * j) % 60000 + 1000
                d[" " + id_to_word(alt)] = lp - 0.35 * j - 0.2
            tops.append(d)
        return {"text_offset": offs, "token_logprobs": lps, "tokens": words,
                "top_logprobs": tops if k > 0 else None}

    def _lp_chat(self, toks, k):
        content = []
        for t in toks:
            lp = fake_logprob(t)
            w = " " + id_to_word(t) if t != IM_END_ID else ""
            tl = []
            if k > 0:
                tl.append({"token": w, "logprob": lp, "bytes": list(w.encode())})
                for j in range(1, k):
                    aw = " " + id_to_word((t + 7919 * j) % 60000 + 1000)
                    tl.append({"token": aw, "logprob": lp - 0.35 * j - 0.2,
                               "bytes": list(aw.encode())})
            content.append({"token": w, "logprob": lp, "bytes": list(w.encode()),
                            "top_logprobs": tl})
        return {"content": content}

    def _usage(self, p):
        ct = sum(c.n_out for c in p.children)
        return {"prompt_tokens": p.prompt_len, "total_tokens": p.prompt_len + ct,
                "completion_tokens": ct, "prompt_tokens_details": None}

    async def _stream(self, request, p):
        resp = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache", "X-Request-Id": p.rid})
        await resp.prepare(request)
        if p.kind == "cmpl":
            head = ('data: {"id":"cmpl-%s","object":"text_completion","created":%d,'
                    '"model":"%s","choices":[' % (p.rid, p.created, MODEL_NAME))
        else:
            head = ('data: {"id":"chatcmpl-%s","object":"chat.completion.chunk","created":%d,'
                    '"model":"%s","choices":[' % (p.rid, p.created, MODEL_NAME))
        first = True
        sent_upto = [0] * p.n
        text_off = [0] * p.n
        while True:
            if not p.buffer and not p.all_done:
                p.event.clear()
                await p.event.wait()
            items = p.buffer
            p.buffer = []
            parts = []
            if items and first and p.kind == "chat":
                for i in range(p.n):
                    parts.append(head + '{"index":%d,"delta":{"role":"assistant","content":""},'
                                 '"logprobs":null,"finish_reason":null}]}\n\n' % i)
            if items:
                first = False
            # merge per child (like vLLM's RequestOutputCollector when behind)
            merged = {}
            order = []
            for c, k, reason in items:
                if c.idx not in merged:
                    order.append(c.idx)
                merged[c.idx] = (c, k, reason)
            for idx in order:
                c, k, reason = merged[idx]
                lo = sent_upto[idx]
                toks = c.all_tokens[c.num_prompt + lo: c.num_prompt + k]
                sent_upto[idx] = k
                text = "".join(" " + id_to_word(t) for t in toks if t != IM_END_ID)
                if p.logprobs is not None and toks:
                    if p.kind == "cmpl":
                        lpj = json.dumps(self._lp_cmpl(toks, p.logprobs, text_off[idx]))
                    else:
                        lpj = json.dumps(self._lp_chat(toks, p.logprobs))
                else:
                    lpj = "null"
                text_off[idx] += len(text)
                fr = "null" if reason is None else '"%s"' % reason
                if p.kind == "cmpl":
                    parts.append(head + '{"index":%d,"text":%s,"logprobs":%s,"finish_reason":%s,'
                                 '"stop_reason":null}]}\n\n' % (idx, json.dumps(text), lpj, fr))
                else:
                    sr = ',"stop_reason":null' if reason is not None else ""
                    parts.append(head + '{"index":%d,"delta":{"content":%s},"logprobs":%s,'
                                 '"finish_reason":%s%s}]}\n\n' % (idx, json.dumps(text), lpj, fr, sr))
            if p.all_done and not p.buffer:
                if p.include_usage:
                    parts.append(head + '],"usage":%s}\n\n' % json.dumps(self._usage(p)))
                parts.append("data: [DONE]\n\n")
                await resp.write("".join(parts).encode())
                break
            if parts:
                await resp.write("".join(parts).encode())
        await resp.write_eof()
        return resp

    async def _full(self, request, p):
        while not p.all_done:
            p.event.clear()
            await p.event.wait()
        p.buffer = []
        choices = []
        for c in p.children:
            toks = c.all_tokens[c.num_prompt:]
            text = "".join(" " + id_to_word(t) for t in toks if t != IM_END_ID)
            if p.kind == "cmpl":
                lp = self._lp_cmpl(toks, p.logprobs, 0) if p.logprobs is not None else None
                choices.append({"index": c.idx, "text": text, "logprobs": lp,
                                "finish_reason": c.finish_reason, "stop_reason": None,
                                "prompt_logprobs": None})
            else:
                lp = self._lp_chat(toks, p.logprobs) if p.logprobs is not None else None
                choices.append({"index": c.idx, "message": {"role": "assistant", "content": text,
                                                            "tool_calls": []},
                                "logprobs": lp, "finish_reason": c.finish_reason,
                                "stop_reason": None})
        if p.kind == "cmpl":
            obj = {"id": "cmpl-" + p.rid, "object": "text_completion", "created": p.created,
                   "model": MODEL_NAME, "choices": choices, "usage": self._usage(p)}
        else:
            obj = {"id": "chatcmpl-" + p.rid, "object": "chat.completion", "created": p.created,
                   "model": MODEL_NAME, "choices": choices, "usage": self._usage(p),
                   "prompt_logprobs": None}
        return web.Response(text=json.dumps(obj), content_type="application/json",
                            headers={"X-Request-Id": p.rid})


# ----------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="vLLM-like inference server simulator")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--bugs", default="none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ground-truth", default=None)
    ap.add_argument("--num-gpu-blocks", type=int, default=6417)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--long-prefill-token-threshold", type=int, default=0)
    return ap.parse_args(argv)


def parse_bugs(s):
    s = (s or "none").strip()
    if s in ("", "none"):
        return frozenset()
    if s == "all":
        return frozenset(ALL_BUGS)
    out = set()
    for b in s.split(","):
        b = b.strip()
        if not b:
            continue
        if b not in ALL_BUGS:
            raise SystemExit("unknown bug %r (known: %s)" % (b, ", ".join(ALL_BUGS)))
        out.add(b)
    return frozenset(out)


async def amain(args):
    bugs = parse_bugs(args.bugs)
    if args.num_gpu_blocks < 2:
        raise SystemExit("--num-gpu-blocks must be >= 2")
    cap = (args.num_gpu_blocks - 1) * BLOCK
    if args.max_model_len > cap:
        print("WARNING: max_model_len %d exceeds KV cache capacity (%d tokens); "
              "lowering max_model_len to %d" % (args.max_model_len, cap, cap),
              file=sys.stderr, flush=True)
        args.max_model_len = cap
    if args.max_num_batched_tokens < 1 or args.max_num_seqs < 1:
        raise SystemExit("invalid scheduler limits")
    srv = Server(args, bugs)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", srv.health)
    app.router.add_get("/version", srv.version)
    app.router.add_get("/v1/models", srv.models)
    app.router.add_get("/metrics", srv.metrics)
    app.router.add_post("/tokenize", srv.tokenize)
    app.router.add_post("/detokenize", srv.detokenize)
    app.router.add_post("/v1/completions", srv.completions)
    app.router.add_post("/v1/chat/completions", srv.chat)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=1024)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    eng_task = asyncio.create_task(srv.engine.run())
    print("simulated vLLM %s serving %s on http://%s:%d (bugs: %s)"
          % (VLLM_VERSION, MODEL_NAME, args.host, args.port,
             ",".join(sorted(bugs)) or "none"), flush=True)
    await stop.wait()
    srv.engine.stopping = True
    srv.engine.wake.set()
    eng_task.cancel()
    try:
        await eng_task
    except (asyncio.CancelledError, Exception):
        pass
    try:
        await asyncio.wait_for(runner.cleanup(), 3.0)
    except Exception:
        pass
    if srv.engine.gt:
        srv.engine.gt.close()


def main():
    args = parse_args()
    try:
        asyncio.run(amain(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
