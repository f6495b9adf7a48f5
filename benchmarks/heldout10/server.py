#!/usr/bin/env python3
"""simvllm -- a GPU-free, simulated vLLM-style OpenAI-compatible inference server.

The engine is simulated one step at a time: each step the scheduler decides
which sequences get how many tokens (continuous batching, paged KV cache,
prefix caching, chunked prefill, recompute preemption), a step time is
computed from a cost model, and the engine sleeps for that long before
emitting the sampled tokens.  See README.md for the full description.

Only the Python standard library and aiohttp are used.
"""

import argparse
import asyncio
import json
import math
import os
import random
import signal
import sys
import time
import uuid
import zlib
from collections import OrderedDict

from aiohttp import web

# ---------------------------------------------------------------------------
# Served model and engine configuration (documented in README.md)
# ---------------------------------------------------------------------------
MODEL_NAME = "simlab/quokka-7b-instruct"
SERVER_VERSION = "0.9.2+sim"

BLOCK_SIZE = 32                 # tokens per KV block
NUM_GPU_BLOCKS = 480            # 15,360 token slots
MAX_NUM_BATCHED_TOKENS = 1536   # per-step token budget
MAX_NUM_SEQS = 48               # cap on running sequences
MAX_MODEL_LEN = 6144            # prompt + output limit
LONG_PREFILL_TOKEN_THRESHOLD = 768  # per-request per-step prefill cap
ENABLE_PREFIX_CACHING = True
MAX_N = 16
MAX_LOGPROBS = 20

# Step-time model (seconds).  See README.md "Step-time model".
T_OVERHEAD = 3.8e-3         # fixed per-step overhead (launch, sync, bookkeeping)
T_PREFILL_TOKEN = 10.5e-6   # per scheduled prefill token (GEMMs)
T_ATTN_PAIR = 4.0e-10       # per (query token x key token) pair in prefill attention
T_DECODE_SEQ = 55e-6        # per decoding sequence
T_CTX_TOKEN = 0.06e-6       # per context token read by a decoding sequence
T_SAMPLE_SEQ = 8e-6         # per sampled sequence (batched sampler)
T_LOGPROBS_SEQ = 90e-6      # per sequence that returns logprobs
T_LOGPROBS_TOPK = 12e-6     # per requested top-logprob alternative
T_SEED_SEQ = 35e-6          # per sequence with a per-request seed (own generator)
T_SEED_FALLBACK_ROW = 0.40e-3   # per-row generator sampling cost (see BUGS.md)
JITTER_SIGMA = 0.03         # lognormal step-time jitter
COLD_START = (0.030, 0.015, 0.007)  # extra time of the first engine steps

# Ground-truth attribution thresholds for accrued delays.
DELAY_ABS_S = 0.010
DELAY_REL = 0.05

DEBUG_GT = os.environ.get("SIMVLLM_DEBUG_GT") == "1"

ALL_BUGS = ("bug1", "bug2", "bug3", "bug4", "bug5")

# ---------------------------------------------------------------------------
# Tokenizer: one token per whitespace separated word
# ---------------------------------------------------------------------------
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|tool|>", "<|end|>"]
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
VOCAB_SIZE = 32000
BASE_OFFSET = 16
NUM_BASE_WORDS = 2048
CHAT_ROLES = ("system", "user", "assistant", "tool")


class Tokenizer:
    def __init__(self):
        rng = random.Random(20240611)
        cons = "bdfghklmnprstvz"
        vows = "aeiou"
        syl = [c + v for c in cons for v in vows]
        words, seen = [], set()
        while len(words) < NUM_BASE_WORDS:
            w = "".join(rng.choice(syl) for _ in range(rng.choice((1, 2, 2, 3))))
            if rng.random() < 0.3:
                w += rng.choice("nrst")
            if w not in seen:
                seen.add(w)
                words.append(w)
        self.id_to_word = {}
        self.word_to_id = {}
        for i, w in enumerate(SPECIAL_TOKENS):
            self.id_to_word[i] = w
            self.word_to_id[w] = i
        for i, w in enumerate(words):
            self.id_to_word[BASE_OFFSET + i] = w
            self.word_to_id[w] = BASE_OFFSET + i
        self.hash_lo = BASE_OFFSET + NUM_BASE_WORDS
        self.learned = {}

    def word_id(self, w):
        tid = self.word_to_id.get(w)
        if tid is not None:
            return tid
        tid = self.hash_lo + zlib.crc32(w.encode("utf-8", "surrogatepass")) % (
            VOCAB_SIZE - self.hash_lo)
        if tid not in self.learned and len(self.learned) < 500000:
            self.learned[tid] = w
        return tid

    def encode(self, text, add_bos):
        ids = [self.word_id(w) for w in text.split()]
        if add_bos:
            ids.insert(0, BOS_ID)
        return ids

    def token_str(self, tid):
        w = self.id_to_word.get(tid)
        if w is None:
            w = self.learned.get(tid, "t%d" % tid)
        return w

    def decode(self, ids):
        return " ".join(self.token_str(t) for t in ids)

    @staticmethod
    def render_chat(messages, add_generation_prompt):
        parts = ["<s>"]
        for m in messages:
            parts.append("<|%s|>" % m["role"])
            if m["content"]:
                parts.append(m["content"])
            parts.append("<|end|>")
        if add_generation_prompt:
            parts.append("<|assistant|>")
        return " ".join(parts)


TOKENIZER = Tokenizer()


# ---------------------------------------------------------------------------
# Metrics (Prometheus text format)
# ---------------------------------------------------------------------------
def _fmt(v):
    if isinstance(v, float) and math.isinf(v):
        return "+Inf"
    return repr(float(v))


class Histogram:
    def __init__(self, name, doc, buckets):
        self.name, self.doc = name, doc
        self.buckets = list(buckets)
        self.counts = [0] * len(self.buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, v):
        self.count += 1
        self.sum += v
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
                break

    def render(self, labels):
        out = ["# HELP %s %s" % (self.name, self.doc),
               "# TYPE %s histogram" % self.name]
        cum = 0
        for b, c in zip(self.buckets, self.counts):
            cum += c
            out.append('%s_bucket{%s,le="%s"} %s' % (self.name, labels, _fmt(b), _fmt(cum)))
        out.append('%s_bucket{%s,le="+Inf"} %s' % (self.name, labels, _fmt(self.count)))
        out.append("%s_count{%s} %s" % (self.name, labels, _fmt(self.count)))
        out.append("%s_sum{%s} %s" % (self.name, labels, _fmt(self.sum)))
        return out


class Metrics:
    def __init__(self):
        self.preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success = {"stop": 0, "length": 0, "abort": 0}
        self.pc_queries = 0
        self.pc_hits = 0
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
             2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0])
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
             2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0])
        lat = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", lat)
        self.queue = Histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", lat)
        self.iter_tokens = Histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384])

    def render(self, engine):
        lab = 'model_name="%s",engine="0"' % MODEL_NAME
        out = []

        def gauge(name, doc, v, extra=""):
            out.append("# HELP %s %s" % (name, doc))
            out.append("# TYPE %s gauge" % name)
            out.append("%s{%s%s} %s" % (name, lab, extra, _fmt(v)))

        def counter(name, doc, v):
            out.append("# HELP %s %s" % (name, doc))
            out.append("# TYPE %s counter" % name)
            out.append("%s_total{%s} %s" % (name, lab, _fmt(v)))

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              len(engine.running))
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              len(engine.waiting))
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
              engine.kv_usage())
        counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                self.preemptions)
        counter("vllm:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens)
        counter("vllm:generation_tokens", "Number of generation tokens processed.",
                self.generation_tokens)
        out.append("# HELP vllm:request_success Count of successfully processed requests.")
        out.append("# TYPE vllm:request_success counter")
        for reason in ("stop", "length", "abort"):
            out.append('vllm:request_success_total{%s,finished_reason="%s"} %s'
                       % (lab, reason, _fmt(self.success[reason])))
        counter("vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.", self.pc_queries)
        counter("vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.", self.pc_hits)
        gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", 1,
              ',block_size="%d",num_gpu_blocks="%d",enable_prefix_caching="%s",'
              'max_num_batched_tokens="%d",max_num_seqs="%d"'
              % (BLOCK_SIZE, NUM_GPU_BLOCKS, "True" if ENABLE_PREFIX_CACHING else "False",
                 MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS))
        for h in (self.ttft, self.itl, self.e2e, self.queue, self.iter_tokens):
            out.extend(h.render(lab))
        return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------
# Requests and sequences
# ---------------------------------------------------------------------------
WAITING, RUNNING, FINISHED = 0, 1, 2


class HttpReq:
    """One HTTP completion/chat request; owns n engine sequences."""

    def __init__(self, rid, kind):
        self.rid = rid
        self.kind = kind
        self.arrival = time.perf_counter()
        self.created = int(time.time())
        self.seqs = []
        self.prompt_tokens = 0
        self.remaining = 0
        self.queue = asyncio.Queue()
        self.aborted = False
        self.gt_done = False
        self.direct_tags = set()
        self.delay = {}
        self.reasons = []

    def output_tokens(self):
        return sum(len(s.output) for s in self.seqs)


class Seq:
    __slots__ = ("id", "http", "index", "tokens", "num_prompt", "output", "max_tokens",
                 "stop_len", "logprobs_k", "seeded", "rng", "arrival", "status",
                 "num_computed", "blocks", "ncached", "hashes", "in_prefill",
                 "preempt_no", "first_sched", "last_token", "first_token_seen",
                 "finish_reason", "pending")

    def __init__(self, http, index, prompt, max_tokens, stop_len, logprobs_k, seeded, rng):
        self.id = "%d_%s" % (index, http.rid)
        self.http = http
        self.index = index
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.output = []
        self.max_tokens = max_tokens
        self.stop_len = stop_len
        self.logprobs_k = logprobs_k
        self.seeded = seeded
        self.rng = rng
        self.arrival = http.arrival
        self.status = WAITING
        self.num_computed = 0
        self.blocks = []
        self.ncached = 0
        self.hashes = []
        self.in_prefill = True
        self.preempt_no = 0
        self.first_sched = None
        self.last_token = None
        self.first_token_seen = False
        self.finish_reason = None
        self.pending = None

    @property
    def num_tokens(self):
        return len(self.tokens)

    def ensure_hashes(self, nblocks):
        hs = self.hashes
        toks = self.tokens
        while len(hs) < nblocks:
            i = len(hs)
            prev = hs[-1] if hs else 0
            hs.append(hash((prev, tuple(toks[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]))))
        return hs


# ---------------------------------------------------------------------------
# Paged KV block pool with prefix caching (LRU eviction of free cached blocks)
# ---------------------------------------------------------------------------
class BlockPool:
    def __init__(self, n):
        self.n = n
        self.ref = [0] * n
        self.hash_of = [None] * n
        self.free = OrderedDict((i, None) for i in range(n))
        self.cached = {}

    def clone(self):
        p = BlockPool.__new__(BlockPool)
        p.n = self.n
        p.ref = self.ref[:]
        p.hash_of = self.hash_of[:]
        p.free = OrderedDict(self.free)
        p.cached = dict(self.cached)
        return p

    def num_free(self):
        return len(self.free)

    def lookup(self, seq):
        if not ENABLE_PREFIX_CACHING:
            return []
        nb = (seq.num_tokens - 1) // BLOCK_SIZE
        hs = seq.ensure_hashes(nb)
        hits = []
        cached = self.cached
        for j in range(nb):
            b = cached.get(hs[j])
            if b is None:
                break
            hits.append(b)
        return hits

    def touch(self, blocks):
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def allocate(self, m):
        out = []
        for _ in range(m):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.hash_of[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks):
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def cache_blocks(self, seq, blocks, ncached, upto_tokens):
        """Register hashes of full blocks; returns the new cached-block count."""
        if not ENABLE_PREFIX_CACHING:
            return ncached
        nfull = upto_tokens // BLOCK_SIZE
        if nfull <= ncached:
            return ncached
        hs = seq.ensure_hashes(nfull)
        for j in range(ncached, nfull):
            b = blocks[j]
            if self.hash_of[b] is None:
                h = hs[j]
                if h not in self.cached:
                    self.cached[h] = b
                    self.hash_of[b] = h
        return nfull


def cdiv(a, b):
    return -(-a // b)


class Plan:
    __slots__ = ("sched", "comp", "blocks", "ncb", "running", "waiting", "preempted",
                 "admitted", "hit_tokens", "overcharged")

    def __init__(self, running, waiting):
        self.sched = {}
        self.comp = {}
        self.blocks = {}
        self.ncb = {}
        self.running = list(running)
        self.waiting = list(waiting)
        self.preempted = []
        self.admitted = []
        self.hit_tokens = {}
        self.overcharged = False


# ---------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------
class Engine:
    def __init__(self, seed, bugs):
        self.bugs = frozenset(bugs)
        self.rng = random.Random(seed)
        self.step_rng = random.Random((seed * 7919 + 17) & 0xFFFFFFFF)
        self.pool = BlockPool(NUM_GPU_BLOCKS)
        self.running = []
        self.waiting = []
        self.abort_q = []
        self.leaked = []
        self.pending = set()
        self.preempt_counter = 0
        self.step_no = 0
        self.metrics = Metrics()
        self.wake = asyncio.Event()
        self.live = {}
        self.gt_file = None
        self.overshoot = 0.0
        self.stopped = False

    # -- public API used by the HTTP layer --------------------------------
    def add(self, http):
        self.live[id(http)] = http
        for s in http.seqs:
            self.waiting.append(s)
        self.wake.set()

    def abort(self, http):
        if http.aborted:
            return
        http.aborted = True
        self.abort_q.append(http)
        self.wake.set()

    def kv_usage(self):
        return 1.0 - self.pool.num_free() / NUM_GPU_BLOCKS

    def new_rng(self, seed, index):
        if seed is not None:
            return random.Random((seed * 1000003 + index * 7 + 1) & 0xFFFFFFFFFFFF)
        return random.Random(self.rng.getrandbits(64))

    # -- ground truth -------------------------------------------------------
    def write_gt(self, http, finish_reason, disconnected):
        if http.gt_done:
            return
        http.gt_done = True
        self.live.pop(id(http), None)
        if self.gt_file is None:
            return
        e2e = time.perf_counter() - http.arrival
        tags = set(http.direct_tags)
        thr = max(DELAY_ABS_S, DELAY_REL * e2e)
        for k, d in http.delay.items():
            if d >= thr:
                tags.add(k)
        rec = {"request_id": http.rid, "finish_reason": finish_reason,
               "client_disconnected": bool(disconnected), "e2e_s": round(e2e, 6),
               "prompt_tokens": http.prompt_tokens, "output_tokens": http.output_tokens(),
               "pathologies": sorted(t for t in tags if t in self.bugs)}
        if DEBUG_GT:
            rec["_delays"] = {k: round(v, 4) for k, v in http.delay.items()}
            rec["_direct"] = sorted(http.direct_tags)
        try:
            self.gt_file.write(json.dumps(rec) + "\n")
            self.gt_file.flush()
        except (OSError, ValueError):
            pass

    # -- aborts -------------------------------------------------------------
    def process_aborts(self):
        if not self.abort_q:
            return
        q, self.abort_q = self.abort_q, []
        for http in q:
            for s in http.seqs:
                if s.status == RUNNING:
                    self.running.remove(s)
                    if ("bug1" in self.bugs and s.in_prefill and s.num_computed > 0
                            and s.num_computed < s.num_tokens):
                        # Partial-prefill abort path: blocks parked, not returned.
                        self.leaked.extend(s.blocks)
                    else:
                        self.pool.release(s.blocks)
                    s.blocks = []
                elif s.status == WAITING:
                    try:
                        self.waiting.remove(s)
                    except ValueError:
                        pass
                    if s.blocks:
                        self.pool.release(s.blocks)
                        s.blocks = []
                else:
                    continue
                s.status = FINISHED
                s.finish_reason = "abort"
                self.metrics.success["abort"] += 1

    def reclaim_leaked(self):
        if self.leaked:
            self.pool.release(self.leaked)
            self.leaked = []

    # -- scheduler -------------------------------------------------------------
    def clean_order(self, waiting):
        pend = [s for s in waiting if s.preempt_no]
        if not pend:
            return waiting
        pend.sort(key=lambda s: -s.preempt_no)
        rest = [s for s in waiting if not s.preempt_no]
        return pend + rest

    def plan(self, pool, running, waiting, bugs):
        """One scheduling decision (vLLM V1 style).  Mutates only `pool`."""
        P = Plan(running, waiting)
        comp, blk, ncb, sched = P.comp, P.blocks, P.ncb, P.sched
        budget = MAX_NUM_BATCHED_TOKENS
        cap = LONG_PREFILL_TOKEN_THRESHOLD
        R = P.running

        def gcomp(s):
            return comp[s] if s in comp else s.num_computed

        def gblk(s):
            b = blk.get(s)
            return s.blocks if b is None else b

        def preempt(v):
            nonlocal budget
            pool.release(gblk(v))
            blk[v] = []
            comp[v] = 0
            ncb[v] = 0
            P.preempted.append(v)
            if v in sched:
                budget += sched.pop(v)
            if "bug2" in bugs:
                P.waiting.append(v)
            else:
                P.waiting.insert(0, v)

        # 1) running requests, in admission order
        i = 0
        while i < len(R) and budget > 0:
            s = R[i]
            c = gcomp(s)
            n = s.num_tokens - c
            if 0 < cap < n:
                n = cap
            n = min(n, budget)
            if n <= 0:
                i += 1
                continue
            ok = True
            while True:
                blocks = gblk(s)
                need = cdiv(c + n, BLOCK_SIZE) - len(blocks)
                if need <= pool.num_free():
                    break
                if "bug5" in bugs:
                    v = max(R, key=lambda r: len(gblk(r)))
                else:
                    v = R[-1]
                vi = R.index(v)
                R.pop(vi)
                preempt(v)
                if v is s:
                    ok = False
                    break
                if vi < i:
                    i -= 1
            if not ok:
                break
            if need > 0:
                blocks = blocks + pool.allocate(need)
                blk[s] = blocks
            ncb[s] = pool.cache_blocks(s, blocks, ncb.get(s, s.ncached), c + n)
            sched[s] = n
            budget -= n
            i += 1

        # 2) waiting requests, FCFS; admission stops at the first misfit
        if not P.preempted:
            W = P.waiting
            while W and budget > 0:
                if len(R) >= MAX_NUM_SEQS:
                    break
                s = W[0]
                hits = pool.lookup(s)
                hit_tok = len(hits) * BLOCK_SIZE
                if "bug4" in bugs:
                    # chunk sized before the prefix-cache lookup
                    charge = min(s.num_tokens, cap, budget) if cap > 0 else min(s.num_tokens, budget)
                    n = min(charge, s.num_tokens - hit_tok)
                else:
                    n = s.num_tokens - hit_tok
                    if 0 < cap < n:
                        n = cap
                    n = min(n, budget)
                    charge = n
                need = cdiv(hit_tok + n, BLOCK_SIZE) - len(hits)
                evictable = 0
                for b in hits:
                    if pool.ref[b] == 0:
                        evictable += 1
                if need > pool.num_free() - evictable:
                    break
                pool.touch(hits)
                blocks = hits + pool.allocate(need)
                blk[s] = blocks
                comp[s] = hit_tok
                ncb[s] = pool.cache_blocks(s, blocks, len(hits), hit_tok + n)
                W.pop(0)
                R.append(s)
                sched[s] = n
                budget -= charge
                if charge > n:
                    P.overcharged = True
                P.admitted.append(s)
                P.hit_tokens[s] = hit_tok
        return P

    def commit(self, P, now):
        for s, c in P.comp.items():
            s.num_computed = c
        for s, b in P.blocks.items():
            s.blocks = b
        for s, k in P.ncb.items():
            s.ncached = k
        self.running = P.running
        self.waiting = P.waiting
        m = self.metrics
        for s in P.preempted:
            s.status = WAITING
            s.in_prefill = True
            self.preempt_counter += 1
            s.preempt_no = self.preempt_counter
            m.preemptions += 1
        for s in P.admitted:
            s.status = RUNNING
            s.preempt_no = 0
            if s.pending is not None:
                s.pending = None
                self.pending.discard(s)
            m.pc_queries += s.num_tokens
            m.pc_hits += P.hit_tokens.get(s, 0)
            if s.first_sched is None:
                s.first_sched = now
                m.queue.observe(now - s.arrival)

    # -- step-time model ------------------------------------------------------
    def plan_cost(self, P):
        """Modelled cost of a plan before jitter: (cost, cost without bug3)."""
        pre_tok = 0
        attn = 0.0
        ndec = 0
        ctx = 0
        samp = 0.0
        samp_fallback = 0.0
        any_seed = False
        comp = P.comp
        for s, n in P.sched.items():
            c = comp[s] if s in comp else s.num_computed
            if s.in_prefill:
                pre_tok += n
                attn += n * (c + n * 0.5)
            else:
                ndec += 1
                ctx += c
            if c + n >= s.num_tokens:
                extra = 0.0
                if s.logprobs_k is not None:
                    extra = T_LOGPROBS_SEQ + T_LOGPROBS_TOPK * s.logprobs_k
                samp += T_SAMPLE_SEQ + extra + (T_SEED_SEQ if s.seeded else 0.0)
                samp_fallback += T_SEED_FALLBACK_ROW + extra
                if s.seeded:
                    any_seed = True
        base = (T_OVERHEAD + pre_tok * T_PREFILL_TOKEN + attn * T_ATTN_PAIR
                + ndec * T_DECODE_SEQ + ctx * T_CTX_TOKEN)
        clean = base + samp
        if "bug3" in self.bugs and any_seed:
            # seeded rows force the per-row generator path for the whole batch
            return base + samp_fallback, clean
        return clean, clean

    def step_time(self, P):
        cost, cost_clean = self.plan_cost(P)
        jit = math.exp(self.step_rng.gauss(0.0, JITTER_SIGMA))
        cold = COLD_START[self.step_no] if self.step_no < len(COLD_START) else 0.0
        return cost * jit + cold, cost_clean * jit + cold, cost, jit

    # -- counterfactual attribution ----------------------------------------------
    def _hurt(self, real, cf, bug, hurt):
        """Compare the real plan with the counterfactual plan of the same step.

        * preempted in reality but not in the counterfactual -> tagged directly;
        * a waiting request the counterfactual admits but reality does not ->
          its delay accrues every step until it is actually admitted;
        * a running request that gets fewer tokens -> one step of delay.
        """
        cfp = set(cf.preempted)
        for s in real.preempted:
            if s not in cfp:
                s.http.direct_tags.add(bug)
        for s, n in cf.sched.items():
            if real.sched.get(s, 0) < n:
                if s.status == WAITING and s not in real.sched:
                    if s.pending is None:
                        s.pending = set()
                    s.pending.add(bug)
                    self.pending.add(s)
                else:
                    hurt.add(s.http)

    def attribute(self, snap, running, waiting, real):
        """Per-step counterfactuals: the same step re-planned without each bug."""
        hurt = {}
        cfs = {}
        bugs = self.bugs
        if "bug1" in bugs and self.leaked:
            p = snap.clone()
            p.release(self.leaked)
            cf = cfs["bug1"] = self.plan(p, running, waiting, bugs - {"bug1"})
            self._hurt(real, cf, "bug1", hurt.setdefault("bug1", set()))
        if "bug2" in bugs:
            order = self.clean_order(waiting)
            if order is not waiting and order != waiting:
                cf = cfs["bug2"] = self.plan(snap.clone(), running, order, bugs - {"bug2"})
                h = hurt.setdefault("bug2", set())
                self._hurt(real, cf, "bug2", h)
                # overtaking: a request admitted ahead of a pending preempted one
                pend = [s for s in real.waiting if s.preempt_no]
                if pend and real.admitted:
                    for c in pend:
                        for x in real.admitted:
                            if (not x.preempt_no) or x.preempt_no < c.preempt_no:
                                h.add(c.http)
                                break
        if "bug4" in bugs and real.overcharged:
            cf = cfs["bug4"] = self.plan(snap.clone(), running, waiting, bugs - {"bug4"})
            self._hurt(real, cf, "bug4", hurt.setdefault("bug4", set()))
        if "bug5" in bugs and real.preempted:
            cf = cfs["bug5"] = self.plan(snap.clone(), running, waiting, bugs - {"bug5"})
            self._hurt(real, cf, "bug5", hurt.setdefault("bug5", set()))
        return hurt, cfs

    # -- token generation ---------------------------------------------------------
    def sample(self, s):
        r = s.rng
        tok = BASE_OFFSET + r.randrange(NUM_BASE_WORDS)
        out_len = len(s.output) + 1
        reason = None
        if s.stop_len is not None and out_len >= s.stop_len:
            tok = EOS_ID
            reason = "stop"
        elif out_len >= s.max_tokens:
            reason = "length"
        lp = None
        if s.logprobs_k is not None:
            base = -r.expovariate(3.0)
            top = [(tok, base)] if s.logprobs_k > 0 else []
            cur = base
            for _ in range(max(0, s.logprobs_k - 1)):
                cur -= r.expovariate(1.5) + 0.01
                top.append((BASE_OFFSET + r.randrange(NUM_BASE_WORDS), cur))
            lp = (base, top)
        return tok, reason, lp

    def postprocess(self, P, now):
        m = self.metrics
        finished = []
        for s, n in P.sched.items():
            if s.status != RUNNING:
                continue
            s.num_computed += n
            if s.num_computed < s.num_tokens:
                continue
            tok, reason, lp = self.sample(s)
            s.output.append(tok)
            s.tokens.append(tok)
            s.in_prefill = False
            m.generation_tokens += 1
            if not s.first_token_seen:
                s.first_token_seen = True
                m.prompt_tokens += s.num_prompt
                m.ttft.observe(now - s.arrival)
            else:
                m.itl.observe(now - s.last_token)
            s.last_token = now
            http = s.http
            if not http.aborted:
                text = "" if tok == EOS_ID else " " + TOKENIZER.token_str(tok)
                http.queue.put_nowait((s.index, tok, text, lp, reason))
            if reason is not None:
                s.finish_reason = reason
                finished.append(s)
        for s in finished:
            s.status = FINISHED
            self.running.remove(s)
            self.pool.release(s.blocks)
            s.blocks = []
            m.success[s.finish_reason] += 1
            m.e2e.observe(now - s.arrival)

    # -- main loop ---------------------------------------------------------------
    async def run(self):
        while not self.stopped:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep serving whatever happens
                print("engine step error: %r" % (e,), file=sys.stderr)
                await asyncio.sleep(0.005)

    async def _step(self):
        if not self.running and not self.waiting and not self.abort_q:
            self.reclaim_leaked()
            self.wake.clear()
            await self.wake.wait()
            self.overshoot = 0.0
        t0 = time.perf_counter()
        self.process_aborts()
        if self.leaked and not self.running:
            self.reclaim_leaked()
        if not self.running and not self.waiting:
            return
        running, waiting = self.running, self.waiting
        snap = self.pool.clone() if self.bugs else None
        P = self.plan(self.pool, running, waiting, self.bugs)
        hurt, cfs = self.attribute(snap, running, waiting, P) if self.bugs else (None, None)
        self.commit(P, t0)
        dt, dt_clean, cost, jit = self.step_time(P)
        self.step_no += 1
        self.metrics.iter_tokens.observe(sum(P.sched.values()))
        if hurt:
            for bug, hs in hurt.items():
                for h in hs:
                    h.delay[bug] = h.delay.get(bug, 0.0) + dt
        if cfs:
            # a bug that makes this step do more work than its counterfactual
            # (e.g. prefill that will be thrown away) slows everyone in the engine
            everyone = None
            for bug, cf in cfs.items():
                extra = (cost - self.plan_cost(cf)[0]) * jit
                if extra <= 1e-5:
                    continue
                if everyone is None:
                    everyone = {s.http for s in running}
                    everyone.update(s.http for s in waiting)
                gain = {s.http for s, n in P.sched.items() if n > cf.sched.get(s, 0)}
                for h in everyone:
                    if h not in gain:
                        h.delay[bug] = h.delay.get(bug, 0.0) + extra
        if self.pending:
            for s in list(self.pending):
                if s.status != WAITING or not s.pending:
                    s.pending = None
                    self.pending.discard(s)
                    continue
                d = s.http.delay
                for bug in s.pending:
                    d[bug] = d.get(bug, 0.0) + dt
        if dt > dt_clean:
            extra = dt - dt_clean
            seen = set()
            for s in running:
                seen.add(s.http)
            for s in waiting:
                seen.add(s.http)
            for h in seen:
                h.delay["bug3"] = h.delay.get("bug3", 0.0) + extra
        # host scheduling time is part of the modelled step: sleep the remainder
        target = t0 + dt - self.overshoot
        wait = target - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        else:
            await asyncio.sleep(0)
        now = time.perf_counter()
        self.overshoot = min(max(now - target, 0.0), 0.004)
        self.postprocess(P, now)


# ---------------------------------------------------------------------------
# HTTP layer
# ---------------------------------------------------------------------------
class ApiError(Exception):
    def __init__(self, status, message, etype=None, param=None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.etype = etype or {400: "BadRequestError", 404: "NotFoundError"}.get(
            status, "InternalServerError")
        self.param = param


def error_response(e, headers=None):
    body = {"error": {"message": e.message, "type": e.etype, "param": e.param,
                      "code": e.status}}
    return web.json_response(body, status=e.status, headers=headers)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _get_int(body, key, default, lo=None, hi=None):
    v = body.get(key, default)
    if v is None:
        return default
    if not _is_int(v):
        raise ApiError(400, "`%s` must be an integer" % key, param=key)
    if lo is not None and v < lo:
        raise ApiError(400, "`%s` must be at least %d, got %d" % (key, lo, v), param=key)
    if hi is not None and v > hi:
        raise ApiError(400, "`%s` must be at most %d, got %d" % (key, hi, v), param=key)
    return v


def _get_bool(body, key, default=False):
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, "`%s` must be a boolean" % key, param=key)
    return v


def _check_ids(ids):
    for t in ids:
        if not _is_int(t) or t < 0 or t >= VOCAB_SIZE:
            raise ApiError(400, "Token id %r is out of vocabulary (size %d)"
                           % (t, VOCAB_SIZE), param="prompt")
    return list(ids)


def _message_text(m, i):
    if not isinstance(m, dict):
        raise ApiError(400, "messages[%d] must be an object" % i, param="messages")
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise ApiError(400, "messages[%d].role must be one of %s" % (i, ", ".join(CHAT_ROLES)),
                       param="messages")
    content = m.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            elif isinstance(p, str):
                parts.append(p)
            else:
                raise ApiError(400, "messages[%d].content: only text parts are supported" % i,
                               param="messages")
        text = " ".join(parts)
    else:
        raise ApiError(400, "messages[%d].content must be a string or a list" % i,
                       param="messages")
    return {"role": role, "content": text}


def tokenize_messages(messages, add_generation_prompt, add_special_tokens):
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` must be a non-empty list", param="messages")
    msgs = [_message_text(m, i) for i, m in enumerate(messages)]
    text = Tokenizer.render_chat(msgs, add_generation_prompt)
    return TOKENIZER.encode(text, add_special_tokens)


def tokenize_prompt(prompt, add_special_tokens=True):
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ApiError(400, "The prompt cannot be empty", param="prompt")
        return TOKENIZER.encode(prompt, add_special_tokens)
    if isinstance(prompt, list):
        if not prompt:
            raise ApiError(400, "The prompt cannot be empty", param="prompt")
        if all(_is_int(t) for t in prompt):
            return _check_ids(prompt)
        if len(prompt) != 1:
            raise ApiError(400, "Batched prompts are not supported; send one prompt per request",
                           param="prompt")
        return tokenize_prompt(prompt[0], add_special_tokens)
    raise ApiError(400, "`prompt` must be a string, a list of token ids or a one-element list",
                   param="prompt")


class Server:
    def __init__(self, engine):
        self.engine = engine
        self.start_time = int(time.time())

    # -- simple endpoints ----------------------------------------------------------
    async def health(self, request):
        return web.Response(status=200)

    async def version(self, request):
        return web.json_response({"version": SERVER_VERSION})

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{
            "id": MODEL_NAME, "object": "model", "created": self.start_time,
            "owned_by": "vllm", "root": MODEL_NAME, "parent": None,
            "max_model_len": MAX_MODEL_LEN,
            "permission": [{"id": "modelperm-sim", "object": "model_permission",
                            "created": self.start_time, "allow_create_engine": False,
                            "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*",
                            "group": None, "is_blocking": False}]}]})

    async def metrics(self, request):
        return web.Response(text=self.engine.metrics.render(self.engine),
                            content_type="text/plain", charset="utf-8")

    async def tokenize(self, request):
        try:
            body = await self._json(request)
            model = body.get("model")
            if model is not None and model != MODEL_NAME:
                raise ApiError(404, "The model `%s` does not exist." % model, param="model")
            if "messages" in body:
                ids = tokenize_messages(body["messages"],
                                        _get_bool(body, "add_generation_prompt", True),
                                        _get_bool(body, "add_special_tokens", False))
            elif "prompt" in body:
                p = body["prompt"]
                add = _get_bool(body, "add_special_tokens", True)
                if isinstance(p, str):
                    ids = TOKENIZER.encode(p, add)
                else:
                    ids = tokenize_prompt(p, add)
            else:
                raise ApiError(400, "Either `prompt` or `messages` is required")
        except ApiError as e:
            return error_response(e)
        return web.json_response({"count": len(ids), "max_model_len": MAX_MODEL_LEN,
                                  "tokens": ids, "token_strs": None})

    async def detokenize(self, request):
        try:
            body = await self._json(request)
            toks = body.get("tokens")
            if not isinstance(toks, list):
                raise ApiError(400, "`tokens` must be a list of token ids", param="tokens")
            _check_ids(toks)
        except ApiError as e:
            return error_response(e)
        return web.json_response({"prompt": TOKENIZER.decode(toks)})

    @staticmethod
    async def _json(request):
        try:
            body = await request.json()
        except Exception:
            raise ApiError(400, "Request body is not valid JSON")
        if not isinstance(body, dict):
            raise ApiError(400, "Request body must be a JSON object")
        return body

    # -- validation ------------------------------------------------------------------
    def _validate(self, body, kind, http):
        model = body.get("model")
        if model is not None and model != MODEL_NAME:
            raise ApiError(404, "The model `%s` does not exist." % model, param="model")
        p = {}
        if kind == "cmpl":
            if "prompt" not in body:
                raise ApiError(400, "`prompt` is required", param="prompt")
            ids = tokenize_prompt(body["prompt"], True)
            http.prompt_tokens = len(ids)
            max_tokens = _get_int(body, "max_tokens", 16, lo=1)
            lp = body.get("logprobs")
            if lp is None or lp is False:
                lpk = None
            elif lp is True:
                lpk = 0
            elif _is_int(lp):
                if lp < 0 or lp > MAX_LOGPROBS:
                    raise ApiError(400, "`logprobs` must be between 0 and %d" % MAX_LOGPROBS,
                                   param="logprobs")
                lpk = lp
            else:
                raise ApiError(400, "`logprobs` must be an integer", param="logprobs")
        else:
            if "messages" not in body:
                raise ApiError(400, "`messages` is required", param="messages")
            ids = tokenize_messages(body["messages"], True, False)
            http.prompt_tokens = len(ids)
            mct = body.get("max_completion_tokens")
            if mct is not None:
                max_tokens = _get_int(body, "max_completion_tokens", None, lo=1)
            else:
                max_tokens = _get_int(body, "max_tokens", None, lo=1)
            if max_tokens is None:
                max_tokens = MAX_MODEL_LEN - len(ids)
                if max_tokens < 1:
                    raise ApiError(400, "This model's maximum context length is %d tokens. "
                                   "However, your messages resulted in %d tokens."
                                   % (MAX_MODEL_LEN, len(ids)), param="messages")
            want = _get_bool(body, "logprobs", False)
            top = _get_int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
            if top is not None and top > 0 and not want:
                raise ApiError(400, "when using `top_logprobs`, `logprobs` must be set to true.",
                               param="top_logprobs")
            lpk = (top or 0) if want else None
        total = len(ids) + max_tokens
        if total > MAX_MODEL_LEN:
            raise ApiError(400, "This model's maximum context length is %d tokens. However, you "
                           "requested %d tokens (%d in the %s, %d in the completion). Please "
                           "reduce the length of the %s or completion."
                           % (MAX_MODEL_LEN, total, len(ids),
                              "prompt" if kind == "cmpl" else "messages", max_tokens,
                              "prompt" if kind == "cmpl" else "messages"),
                           param="max_tokens")
        n = _get_int(body, "n", 1, lo=1, hi=MAX_N)
        stream = _get_bool(body, "stream", False)
        so = body.get("stream_options")
        include_usage = False
        if so is not None:
            if not stream:
                raise ApiError(400, "Stream options can only be defined when `stream=True`.",
                               param="stream_options")
            if not isinstance(so, dict):
                raise ApiError(400, "`stream_options` must be an object", param="stream_options")
            include_usage = bool(so.get("include_usage", False))
        ignore_eos = _get_bool(body, "ignore_eos", False)
        min_tokens = _get_int(body, "min_tokens", 0, lo=0)
        if min_tokens > max_tokens:
            raise ApiError(400, "min_tokens must be less than or equal to max_tokens=%d, got %d."
                           % (max_tokens, min_tokens), param="min_tokens")
        seed = body.get("seed")
        if seed is not None and not _is_int(seed):
            raise ApiError(400, "`seed` must be an integer", param="seed")
        p.update(ids=ids, max_tokens=max_tokens, n=n, stream=stream,
                 include_usage=include_usage, ignore_eos=ignore_eos, min_tokens=min_tokens,
                 seed=seed, logprobs=lpk)
        return p

    def _make_seqs(self, http, p):
        eng = self.engine
        for i in range(p["n"]):
            rng = eng.new_rng(p["seed"], i)
            natural = max(1, int(round(math.exp(rng.gauss(math.log(40.0), 0.9)))))
            if p["min_tokens"] and natural <= p["min_tokens"]:
                natural = p["min_tokens"] + 1
            stop_len = None if p["ignore_eos"] else natural
            http.seqs.append(Seq(http, i, p["ids"], p["max_tokens"], stop_len, p["logprobs"],
                                 p["seed"] is not None, rng))
            http.reasons.append(None)
        http.remaining = p["n"]

    # -- completion handlers ------------------------------------------------------------
    async def completions(self, request):
        return await self._handle(request, "cmpl")

    async def chat(self, request):
        return await self._handle(request, "chat")

    async def _handle(self, request, kind):
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        hdrs = {"X-Request-Id": rid}
        http = HttpReq(rid, kind)
        eng = self.engine
        try:
            body = await self._json(request)
            p = self._validate(body, kind, http)
        except ApiError as e:
            eng.write_gt(http, "error", False)
            return error_response(e, hdrs)
        self._make_seqs(http, p)
        eng.add(http)
        try:
            if p["stream"]:
                return await self._stream(request, http, p, hdrs)
            return await self._full(http, p, hdrs)
        except (asyncio.CancelledError, ConnectionError):
            eng.abort(http)
            eng.write_gt(http, "abort", True)
            raise

    def _final_reason(self, http):
        return "length" if "length" in http.reasons else "stop"

    def _usage(self, http):
        c = http.output_tokens()
        return {"prompt_tokens": http.prompt_tokens, "total_tokens": http.prompt_tokens + c,
                "completion_tokens": c, "prompt_tokens_details": None}

    @staticmethod
    def _lp_completion(tok, lp, offset):
        base, top = lp
        tops = {TOKENIZER.token_str(tok): base}
        for t, v in top:
            tops.setdefault(TOKENIZER.token_str(t), v)
        return {"tokens": [TOKENIZER.token_str(tok)], "token_logprobs": [base],
                "top_logprobs": [tops],
                "text_offset": [offset]}

    @staticmethod
    def _lp_chat(tok, lp):
        base, top = lp
        ts = TOKENIZER.token_str(tok)
        return {"token": ts, "logprob": base, "bytes": list(ts.encode()),
                "top_logprobs": [{"token": TOKENIZER.token_str(t), "logprob": v,
                                  "bytes": list(TOKENIZER.token_str(t).encode())}
                                 for t, v in top]}

    async def _full(self, http, p, hdrs):
        n = p["n"]
        texts = [[] for _ in range(n)]
        lps = [[] for _ in range(n)]
        offsets = [0] * n
        while http.remaining > 0:
            idx, tok, text, lp, reason = await http.queue.get()
            texts[idx].append(text)
            if lp is not None:
                lps[idx].append((tok, lp, offsets[idx]))
            offsets[idx] += len(text)
            if reason is not None:
                http.reasons[idx] = reason
                http.remaining -= 1
        choices = []
        for i in range(n):
            text = "".join(texts[i])
            if http.kind == "cmpl":
                lpo = None
                if p["logprobs"] is not None:
                    lpo = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
                    for tok, lp, off in lps[i]:
                        one = self._lp_completion(tok, lp, off)
                        for k in lpo:
                            lpo[k].extend(one[k])
                choices.append({"index": i, "text": text, "logprobs": lpo,
                                "finish_reason": http.reasons[i], "stop_reason": None,
                                "prompt_logprobs": None})
            else:
                lpo = None
                if p["logprobs"] is not None:
                    lpo = {"content": [self._lp_chat(tok, lp) for tok, lp, _ in lps[i]]}
                choices.append({"index": i, "message": {"role": "assistant", "content": text,
                                                        "tool_calls": [],
                                                        "reasoning_content": None},
                                "logprobs": lpo, "finish_reason": http.reasons[i],
                                "stop_reason": None})
        if http.kind == "cmpl":
            body = {"id": "cmpl-%s" % http.rid, "object": "text_completion",
                    "created": http.created, "model": MODEL_NAME, "choices": choices,
                    "usage": self._usage(http)}
        else:
            body = {"id": "chatcmpl-%s" % http.rid, "object": "chat.completion",
                    "created": http.created, "model": MODEL_NAME, "choices": choices,
                    "usage": self._usage(http), "prompt_logprobs": None}
        resp = web.json_response(body, headers=hdrs)
        self.engine.write_gt(http, self._final_reason(http), False)
        return resp

    async def _stream(self, request, http, p, hdrs):
        resp = web.StreamResponse(status=200, headers=dict(hdrs, **{
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}))
        await resp.prepare(request)
        chat = http.kind == "chat"
        cid = ("chatcmpl-%s" if chat else "cmpl-%s") % http.rid
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = '{"id":%s,"object":"%s","created":%d,"model":%s,"choices":' % (
            json.dumps(cid), obj, http.created, json.dumps(MODEL_NAME))
        offsets = [0] * p["n"]
        first = True
        eng = self.engine
        try:
            while http.remaining > 0:
                ev = await http.queue.get()
                evs = [ev]
                while not http.queue.empty():
                    evs.append(http.queue.get_nowait())
                buf = []
                if first and chat:
                    for i in range(p["n"]):
                        ch = {"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}
                        buf.append("data: " + head + json.dumps([ch], separators=(",", ":")) + "}\n\n")
                first = False
                for idx, tok, text, lp, reason in evs:
                    if chat:
                        ch = {"index": idx, "delta": {"content": text},
                              "logprobs": ({"content": [self._lp_chat(tok, lp)]}
                                           if lp is not None else None),
                              "finish_reason": reason}
                        if reason is not None:
                            ch["stop_reason"] = None
                    else:
                        ch = {"index": idx, "text": text,
                              "logprobs": (self._lp_completion(tok, lp, offsets[idx])
                                           if lp is not None else None),
                              "finish_reason": reason, "stop_reason": None}
                    offsets[idx] += len(text)
                    buf.append("data: " + head + json.dumps([ch], separators=(",", ":")) + "}\n\n")
                    if reason is not None:
                        http.reasons[idx] = reason
                        http.remaining -= 1
                if http.remaining == 0:
                    if p["include_usage"]:
                        buf.append("data: " + head + '[],"usage":' + json.dumps(self._usage(http), separators=(",", ":"))
                                   + "}\n\n")
                    buf.append("data: [DONE]\n\n")
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError("client went away")
                await resp.write("".join(buf).encode())
            await resp.write_eof()
        except ConnectionError:
            eng.abort(http)
            eng.write_gt(http, "abort", True)
            return resp
        eng.write_gt(http, self._final_reason(http), False)
        return resp


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------
def parse_bugs(s):
    s = (s or "none").strip().lower()
    if s in ("", "none"):
        return set()
    if s == "all":
        return set(ALL_BUGS)
    out = set()
    for b in s.split(","):
        b = b.strip()
        if not b:
            continue
        if b not in ALL_BUGS:
            raise SystemExit("unknown bug %r (known: %s)" % (b, ", ".join(ALL_BUGS)))
        out.add(b)
    return out


async def amain(args):
    bugs = parse_bugs(args.bugs)
    engine = Engine(args.seed, bugs)
    if args.ground_truth:
        engine.gt_file = open(args.ground_truth, "a", buffering=1, encoding="utf-8")
    srv = Server(engine)
    app = web.Application(client_max_size=32 * 1024 * 1024)
    app.router.add_post("/v1/completions", srv.completions)
    app.router.add_post("/v1/chat/completions", srv.chat)
    app.router.add_get("/v1/models", srv.models)
    app.router.add_get("/health", srv.health)
    app.router.add_get("/version", srv.version)
    app.router.add_post("/tokenize", srv.tokenize)
    app.router.add_post("/detokenize", srv.detokenize)
    app.router.add_get("/metrics", srv.metrics)
    try:
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    except TypeError:  # very old aiohttp
        runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_address=True)
    await site.start()
    engine_task = asyncio.create_task(engine.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("simvllm: serving %s on http://%s:%d (bugs: %s)" % (
        MODEL_NAME, args.host, args.port, ",".join(sorted(bugs)) or "none"),
        file=sys.stderr, flush=True)
    await stop.wait()
    # Shutdown: abort everything in flight and record it.
    engine.stopped = True
    for http in list(engine.live.values()):
        engine.abort(http)
        engine.write_gt(http, "abort", False)
    engine.process_aborts()
    engine_task.cancel()
    if engine.gt_file is not None:
        try:
            engine.gt_file.flush()
            engine.gt_file.close()
        except OSError:
            pass
    sys.stderr.flush()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description="Simulated vLLM-style OpenAI-compatible server")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bugs", default="none")
    ap.add_argument("--ground-truth", default=None)
    args = ap.parse_args()
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
