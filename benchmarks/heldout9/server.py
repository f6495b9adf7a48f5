#!/usr/bin/env python3
"""Simulated vLLM-like (V1 engine) OpenAI-compatible inference server.

The GPU forward pass is replaced by ``asyncio.sleep`` for a modelled step time.
Everything else (continuous batching, paged KV cache with prefix caching,
chunked prefill under a token budget, recompute preemption, n>1 fan-out,
logprobs, aborts) is simulated step by step.  See README.md.

Usage:
  python server.py --port PORT [--host 127.0.0.1] [--seed N]
                   [--bugs none|all|bug1,bug3,...] [--ground-truth PATH]
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
from collections import OrderedDict, deque

from aiohttp import web

# --------------------------------------------------------------------------
# Engine configuration
# --------------------------------------------------------------------------
MODEL = "sim-qwen2.5-1.5b-instruct"
VERSION = "0.11.0+sim"
BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 1024                 # 16384 KV token slots
MAX_NUM_BATCHED_TOKENS = 3072         # per-step token budget
MAX_NUM_SEQS = 48                     # running-sequence cap ("seats")
LONG_PREFILL_TOKEN_THRESHOLD = 1024   # per-request per-step prefill cap
MAX_MODEL_LEN = 4096
ENABLE_PREFIX_CACHING = True
MAX_LOGPROBS = 20

# step-time model (seconds)
T_OVERHEAD = 6.0e-3        # fixed per busy step (launch, schedule, sample)
T_PER_SEQ = 15e-6          # CPU bookkeeping per scheduled sequence
T_PREFILL_TOK = 20e-6      # per prefill (query) token
T_PREFILL_ATTN = 1.5e-9    # per (query token x attended context token)
T_DECODE_SEQ = 120e-6      # per decode sequence
T_DECODE_CTX = 40e-9       # per context token read by a decode sequence
T_LOGPROBS_ROW = 250e-6    # per sampled row that asked for logprobs
T_TOPK = 20e-6             # per requested top logprob on such a row
T_SEEDED_ROW = 30e-6       # per sampled row with its own generator (seed)
T_MINTOK_ROW = 10e-6       # per sampled row still masking EOS (min_tokens)
JITTER_SIGMA = 0.03
COLD_STEPS = 6             # first busy steps are slower (lazy kernels)
COLD_FACTOR = 2.5

ALL_BUGS = ["bug1", "bug2", "bug3", "bug4", "bug5"]
BUG3_ROW_PENALTY = 350e-6

BOS, EOS, IM_START, IM_END = 1, 2, 3, 4
SPECIAL = {BOS: "<s>", EOS: "</s>", IM_START: "<|im_start|>", IM_END: "<|im_end|>"}

OUT_VOCAB = ("the of and to in a is that for it as was with be by on not he this are or his from at "
             "which but have an they you were her she there been one all we their has would when "
             "if so no will more out up into do any your what some can time only new could "
             "model token cache block queue batch kernel latency stream").split()


# --------------------------------------------------------------------------
# Tokenizer: one token per whitespace-separated word
# --------------------------------------------------------------------------
class Tokenizer:
    def __init__(self):
        self.id2w = dict(SPECIAL)

    def wid(self, w):
        i = 100 + zlib.crc32(w.encode("utf-8", "surrogatepass")) % 50000
        self.id2w.setdefault(i, w)
        return i

    def encode(self, text, add_special=True):
        ids = [self.wid(w) for w in text.split()]
        return ([BOS] if add_special else []) + ids

    def chat(self, messages, add_generation_prompt=True):
        ids = [BOS]
        for m in messages:
            role = str(m.get("role", "user"))
            content = m.get("content")
            if isinstance(content, list):
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            elif content is None:
                content = ""
            ids += [IM_START, self.wid(role)] + self.encode(str(content), False) + [IM_END]
        if add_generation_prompt:
            ids += [IM_START, self.wid("assistant")]
        return ids

    def piece(self, i):
        return self.id2w.get(i, "<t%d>" % i)

    def decode(self, ids, skip_special=True):
        return " ".join(self.piece(i) for i in ids if not (skip_special and i in SPECIAL))


TOK = Tokenizer()
OUT_IDS = [TOK.wid(w) for w in OUT_VOCAB]


# --------------------------------------------------------------------------
# Histograms / metrics
# --------------------------------------------------------------------------
class Histogram:
    def __init__(self, buckets):
        self.buckets = list(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v):
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def render(self, name, labels):
        out = []
        for b, c in zip(self.buckets, self.counts):
            out.append('%s_bucket{%s,le="%s"} %d' % (name, labels, repr(float(b)), c))
        out.append('%s_bucket{%s,le="+Inf"} %d' % (name, labels, self.count))
        out.append("%s_sum{%s} %r" % (name, labels, self.sum))
        out.append("%s_count{%s} %d" % (name, labels, self.count))
        return out


TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQ_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITER_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


class Metrics:
    def __init__(self):
        self.preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success = {"stop": 0, "length": 0, "abort": 0}
        self.pc_queries = 0
        self.pc_hits = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQ_BUCKETS)
        self.queue = Histogram(REQ_BUCKETS)
        self.iter_tokens = Histogram(ITER_BUCKETS)


# --------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------
class Parent:
    """One HTTP request (fans out into n engine sequences)."""

    def __init__(self, server, rid, kind, n, prompt_ids, arrival):
        self.server = server
        self.rid = rid
        self.kind = kind
        self.n = n
        self.prompt_ids = prompt_ids
        self.arrival = arrival
        self.seqs = []
        self.queue = asyncio.Queue()
        self.done = asyncio.Event()
        self.finished = 0
        self.gt_written = False
        self.last_time = arrival

    def on_token(self, seq, ev):
        self.queue.put_nowait(ev)
        if ev["finish"] is not None:
            self.finished += 1
            if self.finished == self.n:
                self.finalize(None, False)
                self.done.set()

    def finalize(self, reason, disconnected, now=None):
        if self.gt_written:
            return
        self.gt_written = True
        if reason is None:
            frs = [s.finish for s in self.seqs]
            reason = frs[-1] if len(set(frs)) == 1 else ("length" if "length" in frs else frs[-1])
            end = max(s.last_tok or self.arrival for s in self.seqs)
        else:
            end = now if now is not None else time.monotonic()
        self.server.live.pop(id(self), None)
        tags = set()
        for s in self.seqs:
            tags |= s.tags
        self.server.write_gt({
            "request_id": self.rid,
            "finish_reason": reason,
            "client_disconnected": bool(disconnected),
            "e2e_s": round(max(0.0, end - self.arrival), 6),
            "prompt_tokens": len(self.prompt_ids),
            "output_tokens": sum(len(s.out) for s in self.seqs),
            "pathologies": sorted(tags),
        })


class Seq:
    """One engine request (one choice)."""
    __slots__ = ("parent", "idx", "rid", "tokens", "prompt_len", "out", "max_tokens",
                 "min_tokens", "ignore_eos", "logprobs", "top_k", "seeded", "n_parent", "rng",
                 "eos_at", "hashes", "arrival", "first_sched", "first_tok", "last_tok",
                 "finish", "aborted", "tags", "lp_sum", "text_len", "__weakref__")

    def __init__(self, parent, idx, params, rng):
        self.parent = parent
        self.idx = idx
        self.rid = "%s#%d" % (parent.rid, idx)
        self.tokens = list(parent.prompt_ids)
        self.prompt_len = len(self.tokens)
        self.out = []
        self.max_tokens = params["max_tokens"]
        self.min_tokens = params["min_tokens"]
        self.ignore_eos = params["ignore_eos"]
        self.logprobs = params["logprobs"]      # None or number of top logprobs
        self.top_k = params["logprobs"] or 0
        self.seeded = params["seed"] is not None
        self.n_parent = parent.n
        self.rng = rng
        if self.ignore_eos:
            self.eos_at = None
        else:
            natural = 1 + int(rng.expovariate(1.0 / 48.0))
            self.eos_at = max(natural, self.min_tokens + 1)
        self.hashes = []
        self.arrival = parent.arrival
        self.first_sched = None
        self.first_tok = None
        self.last_tok = None
        self.finish = None
        self.aborted = False
        self.tags = set()
        self.text_len = 0

    def block_hash(self, i):
        hs = self.hashes
        while len(hs) <= i:
            j = len(hs)
            prev = hs[j - 1] if j else None
            hs.append(hash((prev, tuple(self.tokens[j * BLOCK_SIZE:(j + 1) * BLOCK_SIZE]))))
        return hs[i]


# --------------------------------------------------------------------------
# KV cache block pool and scheduler state
# --------------------------------------------------------------------------
class KVPool:
    def __init__(self, n):
        self.n = n
        self.ref = [0] * n
        self.h = [None] * n
        self.free = OrderedDict.fromkeys(range(n))   # LRU free queue (head = evict first)
        self.cached = {}                            # block hash -> block id
        self.leaked = []

    def clone(self):
        k = KVPool.__new__(KVPool)
        k.n = self.n
        k.ref = self.ref[:]
        k.h = self.h[:]
        k.free = self.free.copy()
        k.cached = self.cached.copy()
        k.leaked = self.leaked[:]
        return k

    def reclaim_leaked(self):
        for b in self.leaked:
            self.ref[b] = 0
            self.free[b] = None
        self.leaked = []


class State:
    def __init__(self):
        self.kv = KVPool(NUM_GPU_BLOCKS)
        self.running = []
        self.waiting = deque()
        self.shadow = deque()   # FCFS reference order of the waiting queue
        self.nc = {}            # seq -> num_computed_tokens
        self.blk = {}           # seq -> block ids
        self.ncb = {}           # seq -> number of its blocks already hashed

    def clone(self):
        s = State.__new__(State)
        s.kv = self.kv.clone()
        s.running = list(self.running)
        s.waiting = deque(self.waiting)
        s.shadow = deque(self.shadow)
        s.nc = dict(self.nc)
        s.blk = {k: list(v) for k, v in self.blk.items()}
        s.ncb = dict(self.ncb)
        return s


def kv_lookup(st, seq):
    if not ENABLE_PREFIX_CACHING:
        return []
    maxb = (len(seq.tokens) - 1) // BLOCK_SIZE     # always recompute >= 1 token
    hits = []
    cached = st.kv.cached
    for i in range(maxb):
        b = cached.get(seq.block_hash(i))
        if b is None:
            break
        hits.append(b)
    return hits


def kv_allocate(st, seq, n_new, hits=None):
    kv = st.kv
    blk = st.blk[seq]
    total = st.nc[seq] + n_new
    need = -(-total // BLOCK_SIZE)
    have = len(blk) + (len(hits) if hits else 0)
    new = max(0, need - have)
    free_hits = sum(1 for b in hits if kv.ref[b] == 0) if hits else 0
    if new > len(kv.free) - free_hits:
        return False
    if hits:
        for b in hits:
            if kv.ref[b] == 0:
                del kv.free[b]
            kv.ref[b] += 1
            blk.append(b)
    for _ in range(new):
        b, _ = kv.free.popitem(last=False)
        h = kv.h[b]
        if h is not None:
            if kv.cached.get(h) == b:
                del kv.cached[h]
            kv.h[b] = None
        kv.ref[b] = 1
        blk.append(b)
    if ENABLE_PREFIX_CACHING:
        full = min(total, len(seq.tokens)) // BLOCK_SIZE
        i = st.ncb.get(seq, 0)
        while i < full:
            b = blk[i]
            if kv.h[b] is None:
                hh = seq.block_hash(i)
                if hh not in kv.cached:
                    kv.cached[hh] = b
                    kv.h[b] = hh
            i += 1
        if full > st.ncb.get(seq, 0):
            st.ncb[seq] = full
    return True


def kv_free(st, seq):
    kv = st.kv
    for b in reversed(st.blk.get(seq, ())):
        kv.ref[b] -= 1
        if kv.ref[b] == 0:
            kv.free[b] = None
    st.blk[seq] = []
    st.nc[seq] = 0
    st.ncb[seq] = 0


def kv_free_on_abort(st, seq, bugs):
    if ("bug2" in bugs and 0 < st.nc.get(seq, 0) < seq.prompt_len):
        kv = st.kv
        for b in st.blk.get(seq, ()):
            if kv.ref[b] == 1:
                h = kv.h[b]
                if h is not None and kv.cached.get(h) == b:
                    del kv.cached[h]
                kv.h[b] = None
                kv.leaked.append(b)
            else:
                kv.ref[b] -= 1
        st.blk[seq] = []
        st.nc[seq] = 0
        st.ncb[seq] = 0
        return True
    kv_free(st, seq)
    return False


class SchedOut:
    __slots__ = ("sched", "preempted", "admitted", "lookups", "fired")

    def __init__(self):
        self.sched = {}
        self.preempted = []
        self.admitted = []
        self.lookups = []
        self.fired = set()


def schedule(st, bugs):
    """One vLLM-V1-style FCFS scheduling step.  Mutates st."""
    out = SchedOut()
    budget = MAX_NUM_BATCHED_TOKENS
    sched = out.sched
    running = st.running
    # 1) running requests first
    i = 0
    while i < len(running) and budget > 0:
        seq = running[i]
        n = len(seq.tokens) - st.nc[seq]
        if LONG_PREFILL_TOKEN_THRESHOLD and n > LONG_PREFILL_TOKEN_THRESHOLD:
            n = LONG_PREFILL_TOKEN_THRESHOLD
        n = min(n, budget)
        if n <= 0:
            i += 1
            continue
        ok = True
        while not kv_allocate(st, seq, n):
            victim = running.pop()
            kv_free(st, victim)
            if "bug4" in bugs:
                st.waiting.append(victim)
            else:
                st.waiting.appendleft(victim)
            st.shadow.appendleft(victim)
            out.preempted.append(victim)
            if victim is seq:
                ok = False
                break
        if not ok:
            break
        sched[seq] = n
        st.nc[seq] += n
        budget -= n
        i += 1
    # 2) waiting requests (only if nothing was preempted this step)
    if not out.preempted:
        while st.waiting and budget > 0:
            if "bug5" in bugs:
                seats = sum(s.n_parent for s in running)
                if seats >= MAX_NUM_SEQS:
                    if len(running) < MAX_NUM_SEQS:
                        out.fired.add("bug5")
                    break
            elif len(running) >= MAX_NUM_SEQS:
                break
            seq = st.waiting[0]
            hits = kv_lookup(st, seq)
            cached = len(hits) * BLOCK_SIZE
            n = len(seq.tokens) - cached
            if LONG_PREFILL_TOKEN_THRESHOLD and n > LONG_PREFILL_TOKEN_THRESHOLD:
                n = LONG_PREFILL_TOKEN_THRESHOLD
            n = min(n, budget)
            st.nc[seq] = cached
            if not kv_allocate(st, seq, n, hits):
                st.nc[seq] = 0
                break
            st.waiting.popleft()
            st.shadow.remove(seq)
            running.append(seq)
            out.admitted.append(seq)
            out.lookups.append((seq, len(seq.tokens), cached))
            sched[seq] = n
            st.nc[seq] += n
            charge = n
            if "bug1" in bugs and cached:
                charge = n + cached
                if st.waiting:
                    out.fired.add("bug1")
            budget = max(0, budget - charge)
    return out


def harmed_by(out_bug, out_cf):
    harmed = set()
    sb = out_bug.sched
    for s, n in out_cf.sched.items():
        if sb.get(s, 0) < n:
            harmed.add(s)
    cfp = set(out_cf.preempted)
    for s in out_bug.preempted:
        if s not in cfp:
            harmed.add(s)
    return harmed


# --------------------------------------------------------------------------
# Engine
# --------------------------------------------------------------------------
class Engine:
    def __init__(self, server, bugs, seed):
        self.server = server
        self.bugs = frozenset(bugs)
        self.rng = random.Random(seed)
        self.seed = seed
        self.st = State()
        self.wake = asyncio.Event()
        self.aborts = []
        self.m = server.metrics
        self.busy_steps = 0
        self.step_no = 0
        self.cpu_total = 0.0     # host time spent scheduling (debug)
        self.overruns = 0        # steps whose scheduling took longer than the modelled step

    def add(self, seqs):
        st = self.st
        for s in seqs:
            st.waiting.append(s)
            st.shadow.append(s)
            st.nc[s] = 0
            st.blk[s] = []
            st.ncb[s] = 0
        self.wake.set()

    def abort(self, seqs):
        for s in seqs:
            if s.finish is None and not s.aborted:
                s.aborted = True
                self.aborts.append(s)
        self.wake.set()

    def _process_aborts(self):
        st = self.st
        for s in self.aborts:
            if s in st.nc:
                if s in st.running:
                    st.running.remove(s)
                    kv_free_on_abort(st, s, self.bugs)
                else:
                    try:
                        st.waiting.remove(s)
                        st.shadow.remove(s)
                    except ValueError:
                        pass
                    kv_free(st, s)
                self._forget(s)
            if s.finish is None:
                s.finish = "abort"
                self.m.success["abort"] += 1
        self.aborts = []

    def _forget(self, s):
        st = self.st
        st.nc.pop(s, None)
        st.blk.pop(s, None)
        st.ncb.pop(s, None)

    def step_time(self, out, bugs):
        st = self.st
        pre_tok = 0
        attn = 0.0
        dec = 0
        ctx = 0
        extra = 0.0
        rows = 0
        mintok_rows = 0
        for seq, n in out.sched.items():
            end = st.nc[seq]
            start = end - n
            if n == 1 and seq.out and start == len(seq.tokens) - 1:
                dec += 1
                ctx += start
            else:
                pre_tok += n
                attn += n * (start + n / 2.0)
            if end == len(seq.tokens):       # a token is sampled for this row
                rows += 1
                if seq.logprobs is not None:
                    extra += T_LOGPROBS_ROW + T_TOPK * seq.top_k
                if seq.seeded:
                    extra += T_SEEDED_ROW
                if seq.min_tokens > len(seq.out) and not seq.ignore_eos:
                    extra += T_MINTOK_ROW
                    mintok_rows += 1
        t = (T_OVERHEAD + T_PER_SEQ * len(out.sched) + T_PREFILL_TOK * pre_tok
             + T_PREFILL_ATTN * attn + T_DECODE_SEQ * dec + T_DECODE_CTX * ctx + extra)
        bug_extra = 0.0
        if "bug3" in bugs and mintok_rows:
            bug_extra = BUG3_ROW_PENALTY * len(out.sched)
        mult = math.exp(self.rng.gauss(0.0, JITTER_SIGMA))
        if self.busy_steps < COLD_STEPS:
            mult *= 1.0 + (COLD_FACTOR - 1.0) * (COLD_STEPS - self.busy_steps) / COLD_STEPS
        return (t + bug_extra) * mult, t * mult, pre_tok + dec

    async def run(self):
        st = self.st
        loop = asyncio.get_running_loop()
        cf_bugs = self.bugs & {"bug1", "bug2", "bug4", "bug5"}
        while True:
            if self.aborts:
                self._process_aborts()
            if not st.running and st.kv.leaked:
                st.kv.reclaim_leaked()          # housekeeping when the batch drains
            if not st.running and not st.waiting:
                self.wake.clear()
                await self.wake.wait()
                continue
            t0 = loop.time()
            pre = st.clone() if cf_bugs else None
            out = schedule(st, self.bugs)
            # ---- ground-truth tagging: counterfactual of this step without each bug
            if pre is not None:
                fired = set(out.fired)
                if "bug2" in cf_bugs and pre.kv.leaked:
                    fired.add("bug2")
                if "bug4" in cf_bugs and list(pre.waiting) != list(pre.shadow):
                    fired.add("bug4")
                for b in sorted(fired & cf_bugs):
                    cf = pre.clone()
                    if b == "bug2":
                        cf.kv.reclaim_leaked()
                    elif b == "bug4":
                        cf.waiting = deque(cf.shadow)
                    out_cf = schedule(cf, self.bugs - {b})
                    for s in harmed_by(out, out_cf):
                        s.tags.add(b)
            self.m.preemptions += len(out.preempted)
            for seq, total, hit in out.lookups:
                self.m.pc_queries += total
                self.m.pc_hits += hit
            now = time.monotonic()
            for seq in out.admitted:
                if seq.first_sched is None:
                    seq.first_sched = now
                    self.m.queue.observe(now - seq.arrival)
            if not out.sched:
                await asyncio.sleep(0.001)
                continue
            dt, dt_clean, ntok = self.step_time(out, self.bugs)
            if dt - dt_clean >= 0.5e-3:
                for seq in out.sched:
                    seq.tags.add("bug3")
            self.busy_steps += 1
            self.step_no += 1
            self.m.iter_tokens.observe(ntok)
            cpu = loop.time() - t0
            self.cpu_total += cpu
            if cpu > dt:
                self.overruns += 1
            await asyncio.sleep(max(0.0, t0 + dt - loop.time()))
            self._apply_outputs(out)

    def _apply_outputs(self, out):
        st = self.st
        now = time.monotonic()
        for seq in out.sched:
            if seq.aborted or seq.finish is not None or seq not in st.nc:
                continue
            if st.nc[seq] != len(seq.tokens):
                continue          # partial prefill chunk: no output
            self._sample(seq, now)
            if seq.finish is not None:
                st.running.remove(seq)
                kv_free(st, seq)
                self._forget(seq)

    def _sample(self, seq, now):
        rng = seq.rng
        k = len(seq.out) + 1
        finish = None
        if seq.eos_at is not None and k == seq.eos_at:
            tok = EOS
            finish = "stop"
        else:
            tok = OUT_IDS[rng.randrange(len(OUT_IDS))]
            if k >= seq.max_tokens:
                finish = "length"
        if k >= seq.max_tokens and finish is None:
            finish = "length"
        lp = None
        if seq.logprobs is not None:
            lpv = -round(rng.random() * 2.5, 4)
            top = []
            if seq.top_k:
                top.append((tok, lpv))
                used = {tok}
                while len(top) < seq.top_k:
                    alt = OUT_IDS[rng.randrange(len(OUT_IDS))]
                    if alt in used:
                        continue
                    used.add(alt)
                    top.append((alt, round(lpv - 0.3 - rng.random() * 3, 4)))
            lp = (lpv, top)
        seq.out.append(tok)
        seq.tokens.append(tok)
        m = self.m
        m.generation_tokens += 1
        if seq.first_tok is None:
            seq.first_tok = now
            m.ttft.observe(now - seq.arrival)
            m.prompt_tokens += seq.prompt_len
        else:
            m.itl.observe(now - seq.last_tok)
        seq.last_tok = now
        if tok == EOS:
            text = ""
        elif seq.parent.kind == "chat" and len(seq.out) == 1:
            text = TOK.piece(tok)
        else:
            text = " " + TOK.piece(tok)
        if finish is not None:
            seq.finish = finish
            m.success[finish] = m.success.get(finish, 0) + 1
            m.e2e.observe(now - seq.arrival)
        seq.parent.on_token(seq, {"idx": seq.idx, "tok": tok, "text": text, "lp": lp,
                                  "finish": finish, "t": now})


# --------------------------------------------------------------------------
# HTTP layer
# --------------------------------------------------------------------------
class BadRequest(Exception):
    def __init__(self, msg, status=400, etype="BadRequestError", param=None):
        super().__init__(msg)
        self.status = status
        self.etype = etype
        self.param = param


def err_response(e, headers):
    body = {"error": {"message": str(e), "type": e.etype, "param": e.param, "code": e.status}}
    return web.json_response(body, status=e.status, headers=headers)


def _int(body, key, default, lo=None, hi=None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest("%s must be an integer" % key, param=key)
    if lo is not None and v < lo:
        raise BadRequest("%s must be at least %d, got %d." % (key, lo, v), param=key)
    if hi is not None and v > hi:
        raise BadRequest("%s must be at most %d, got %d." % (key, hi, v), param=key)
    return v


class Server:
    def __init__(self, args):
        self.args = args
        self.bugs = parse_bugs(args.bugs)
        self.metrics = Metrics()
        self.engine = None
        self.live = {}
        self.gt = open(args.ground_truth, "a", buffering=1) if args.ground_truth else None
        self.seed = args.seed
        self.req_counter = 0
        self.created = int(time.time())

    def write_gt(self, rec):
        if self.gt is not None:
            self.gt.write(json.dumps(rec) + "\n")
            self.gt.flush()

    # ---------------- validation helpers
    def common_params(self, body, prompt_len, chat):
        if chat:
            mt = body.get("max_completion_tokens")
            if mt is None:
                mt = body.get("max_tokens")
            if mt is None:
                mt = MAX_MODEL_LEN - prompt_len
            body = dict(body, max_tokens=mt)
            max_tokens = _int(body, "max_tokens", mt, 1)
        else:
            max_tokens = _int(body, "max_tokens", 16, 1)
        n = _int(body, "n", 1, 1, 64)
        min_tokens = _int(body, "min_tokens", 0, 0)
        if min_tokens > max_tokens:
            raise BadRequest("min_tokens must be less than or equal to max_tokens=%d, got %d."
                             % (max_tokens, min_tokens), param="min_tokens")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest("seed must be an integer", param="seed")
        ignore_eos = bool(body.get("ignore_eos", False))
        if chat:
            if body.get("logprobs"):
                logprobs = _int(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
            else:
                if body.get("top_logprobs") not in (None, 0):
                    raise BadRequest("when using `top_logprobs`, `logprobs` must be set to true.",
                                     param="top_logprobs")
                logprobs = None
        else:
            logprobs = body.get("logprobs")
            if logprobs is not None:
                logprobs = _int(body, "logprobs", 0, 0, MAX_LOGPROBS)
        if prompt_len > MAX_MODEL_LEN or prompt_len + max_tokens > MAX_MODEL_LEN:
            raise BadRequest(
                "This model's maximum context length is %d tokens. However, you requested %d "
                "tokens (%d in the messages, %d in the completion). Please reduce the length of "
                "the messages or completion." % (MAX_MODEL_LEN, prompt_len + max_tokens,
                                                 prompt_len, max_tokens), param="max_tokens")
        so = body.get("stream_options") or {}
        include_usage = bool(isinstance(so, dict) and so.get("include_usage"))
        return {"max_tokens": max_tokens, "n": n, "min_tokens": min_tokens, "seed": seed,
                "ignore_eos": ignore_eos, "logprobs": logprobs,
                "stream": bool(body.get("stream", False)), "include_usage": include_usage}

    def check_model(self, body):
        m = body.get("model")
        if m is not None and m != MODEL:
            raise BadRequest("The model `%s` does not exist." % m, status=404,
                             etype="NotFoundError", param="model")

    # ---------------- handlers
    async def h_completions(self, request):
        return await self._generate(request, "cmpl")

    async def h_chat(self, request):
        return await self._generate(request, "chat")

    async def _generate(self, request, kind):
        arrival = time.monotonic()
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        prompt_len = 0
        try:
            try:
                body = await request.json()
            except Exception:
                raise BadRequest("Invalid JSON body")
            if not isinstance(body, dict):
                raise BadRequest("Request body must be a JSON object")
            self.check_model(body)
            if kind == "chat":
                msgs = body.get("messages")
                if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
                    raise BadRequest("messages must be a non-empty list of objects", param="messages")
                ids = TOK.chat(msgs, True)
            else:
                p = body.get("prompt")
                if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
                    p = p[0]
                if isinstance(p, str):
                    ids = TOK.encode(p, True)
                elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool)
                                                      and x >= 0 for x in p):
                    ids = list(p)
                else:
                    raise BadRequest("prompt must be a string or a non-empty list of token ids "
                                     "(batched prompts are not supported)", param="prompt")
            prompt_len = len(ids)
            params = self.common_params(body, prompt_len, kind == "chat")
        except BadRequest as e:
            self.write_gt({"request_id": rid, "finish_reason": "error",
                           "client_disconnected": False,
                           "e2e_s": round(time.monotonic() - arrival, 6),
                           "prompt_tokens": prompt_len, "output_tokens": 0, "pathologies": []})
            return err_response(e, headers)

        parent = Parent(self, rid, kind, params["n"], ids, arrival)
        self.req_counter += 1
        for i in range(params["n"]):
            if params["seed"] is not None:
                rng = random.Random("%d-%d" % (params["seed"], i))
            else:
                rng = random.Random("%s-%d-%d" % (self.seed, self.req_counter, i))
            parent.seqs.append(Seq(parent, i, params, rng))
        self.live[id(parent)] = parent
        self.engine.add(parent.seqs)
        oid = ("chatcmpl-" if kind == "chat" else "cmpl-") + rid
        created = int(time.time())
        try:
            if params["stream"]:
                return await self._stream(request, parent, params, oid, created, headers)
            return await self._full(parent, params, oid, created, headers)
        except (asyncio.CancelledError, ConnectionResetError, ConnectionError):
            self._client_gone(parent)
            raise

    def _client_gone(self, parent):
        if not parent.gt_written:
            self.engine.abort(parent.seqs)
            parent.finalize("abort", True)

    def _lp_cmpl(self, ev, offset):
        lpv, top = ev["lp"]
        piece = ev["text"]
        return {"text_offset": [offset], "token_logprobs": [lpv], "tokens": [piece],
                "top_logprobs": [{(" " + TOK.piece(t)): v for t, v in top}] if top else None}

    def _lp_chat(self, ev):
        lpv, top = ev["lp"]
        piece = TOK.piece(ev["tok"]) if ev["tok"] != EOS else ""
        return {"content": [{"token": piece, "logprob": lpv, "bytes": list(piece.encode()),
                             "top_logprobs": [{"token": TOK.piece(t), "logprob": v,
                                               "bytes": list(TOK.piece(t).encode())}
                                              for t, v in top]}]}

    async def _stream(self, request, parent, params, oid, created, headers):
        resp = web.StreamResponse(status=200, headers=dict(headers, **{
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}))
        await resp.prepare(request)
        chat = parent.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        remaining = parent.n
        first = True
        offsets = [0] * parent.n

        def frame(choices, usage=None):
            d = {"id": oid, "object": obj, "created": created, "model": MODEL, "choices": choices}
            if usage is not None:
                d["usage"] = usage
            return ("data: " + json.dumps(d, separators=(",", ":")) + "\n\n").encode()

        while remaining:
            ev = await parent.queue.get()
            if ev is None:
                break
            buf = b""
            if chat and first:
                for i in range(parent.n):
                    buf += frame([{"index": i, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}])
            first = False
            i = ev["idx"]
            if chat:
                ch = {"index": i, "delta": {"content": ev["text"]},
                      "logprobs": self._lp_chat(ev) if ev["lp"] else None,
                      "finish_reason": ev["finish"]}
            else:
                ch = {"index": i, "text": ev["text"],
                      "logprobs": self._lp_cmpl(ev, offsets[i]) if ev["lp"] else None,
                      "finish_reason": ev["finish"]}
                offsets[i] += len(ev["text"])
            if ev["finish"] is not None:
                ch["stop_reason"] = None
                remaining -= 1
            buf += frame([ch])
            await resp.write(buf)
        if params["include_usage"]:
            ct = sum(len(s.out) for s in parent.seqs)
            pt = len(parent.prompt_ids)
            await resp.write(frame([], {"prompt_tokens": pt, "total_tokens": pt + ct,
                                        "completion_tokens": ct}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _full(self, parent, params, oid, created, headers):
        await parent.done.wait()
        chat = parent.kind == "chat"
        evs = {i: [] for i in range(parent.n)}
        while not parent.queue.empty():
            ev = parent.queue.get_nowait()
            if ev is not None:
                evs[ev["idx"]].append(ev)
        choices = []
        for i in range(parent.n):
            text = "".join(e["text"] for e in evs[i])
            fr = parent.seqs[i].finish
            if chat:
                lp = None
                if params["logprobs"] is not None:
                    lp = {"content": [self._lp_chat(e)["content"][0] for e in evs[i]]}
                choices.append({"index": i, "message": {"role": "assistant", "content": text,
                                                        "tool_calls": []},
                                "logprobs": lp, "finish_reason": fr, "stop_reason": None})
            else:
                lp = None
                if params["logprobs"] is not None:
                    lp = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
                    off = 0
                    for e in evs[i]:
                        one = self._lp_cmpl(e, off)
                        off += len(e["text"])
                        for k in ("text_offset", "token_logprobs", "tokens"):
                            lp[k] += one[k]
                        lp["top_logprobs"] += one["top_logprobs"] or [None]
                    if params["logprobs"] == 0:
                        lp["top_logprobs"] = None
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": fr,
                                "stop_reason": None, "prompt_logprobs": None})
        ct = sum(len(s.out) for s in parent.seqs)
        pt = len(parent.prompt_ids)
        body = {"id": oid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": MODEL, "choices": choices,
                "usage": {"prompt_tokens": pt, "total_tokens": pt + ct, "completion_tokens": ct,
                          "prompt_tokens_details": None}}
        return web.json_response(body, headers=headers)

    async def h_models(self, request):
        return web.json_response({"object": "list", "data": [{
            "id": MODEL, "object": "model", "created": self.created, "owned_by": "vllm",
            "root": MODEL, "parent": None, "max_model_len": MAX_MODEL_LEN,
            "permission": [{"id": "modelperm-sim", "object": "model_permission",
                            "created": self.created, "allow_create_engine": False,
                            "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None,
                            "is_blocking": False}]}]})

    async def h_health(self, request):
        return web.Response(status=200)

    async def h_version(self, request):
        return web.json_response({"version": VERSION})

    async def h_tokenize(self, request):
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("Request body must be a JSON object")
            self.check_model(body)
            if "messages" in body:
                ids = TOK.chat(body["messages"], bool(body.get("add_generation_prompt", True)))
            elif isinstance(body.get("prompt"), str):
                ids = TOK.encode(body["prompt"], bool(body.get("add_special_tokens", True)))
            else:
                raise BadRequest("prompt (string) or messages required", param="prompt")
        except BadRequest as e:
            return err_response(e, {})
        except Exception as e:
            return err_response(BadRequest("Invalid request: %s" % e), {})
        res = {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids}
        if body.get("return_token_strs"):
            res["token_strs"] = [TOK.piece(i) for i in ids]
        return web.json_response(res)

    async def h_detokenize(self, request):
        try:
            body = await request.json()
            toks = body.get("tokens")
            if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
                raise BadRequest("tokens must be a list of integers", param="tokens")
        except BadRequest as e:
            return err_response(e, {})
        except Exception as e:
            return err_response(BadRequest("Invalid request: %s" % e), {})
        return web.json_response({"prompt": TOK.decode(toks)})

    async def h_metrics(self, request):
        m = self.metrics
        st = self.engine.st
        lab = 'engine="0",model_name="%s"' % MODEL
        L = []

        def g(name, typ, help_, val, extra=""):
            L.append("# HELP %s %s" % (name, help_))
            L.append("# TYPE %s %s" % (name, typ))
            L.append("%s{%s%s} %s" % (name, lab, extra, val))

        g("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
          float(len(st.running)))
        g("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
          float(len(st.waiting)))
        used = 1.0 - len(st.kv.free) / float(st.kv.n)
        g("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", used)
        g("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
          float(m.preemptions))
        g("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
          float(m.prompt_tokens))
        g("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
          float(m.generation_tokens))
        L.append("# HELP vllm:request_success_total Count of successfully processed requests.")
        L.append("# TYPE vllm:request_success_total counter")
        for fr in ("stop", "length", "abort"):
            L.append('vllm:request_success_total{%s,finished_reason="%s"} %s'
                     % (lab, fr, float(m.success.get(fr, 0))))
        g("vllm:prefix_cache_queries_total", "counter",
          "Prefix cache queries, in terms of number of queried tokens.", float(m.pc_queries))
        g("vllm:prefix_cache_hits_total", "counter",
          "Prefix cache hits, in terms of number of cached tokens.", float(m.pc_hits))
        g("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", 1.0,
          ',block_size="%d",num_gpu_blocks="%d",enable_prefix_caching="%s",'
          'max_num_batched_tokens="%d",max_num_seqs="%d"'
          % (BLOCK_SIZE, NUM_GPU_BLOCKS, str(ENABLE_PREFIX_CACHING), MAX_NUM_BATCHED_TOKENS,
             MAX_NUM_SEQS))
        for name, h, help_ in (
                ("vllm:time_to_first_token_seconds", m.ttft, "Histogram of time to first token in seconds."),
                ("vllm:inter_token_latency_seconds", m.itl, "Histogram of inter-token latency in seconds."),
                ("vllm:e2e_request_latency_seconds", m.e2e, "Histogram of e2e request latency in seconds."),
                ("vllm:request_queue_time_seconds", m.queue, "Histogram of time spent in WAITING phase for request."),
                ("vllm:iteration_tokens_total", m.iter_tokens, "Histogram of number of tokens per engine_step.")):
            L.append("# HELP %s %s" % (name, help_))
            L.append("# TYPE %s histogram" % name)
            L.extend(h.render(name, lab))
        return web.Response(text="\n".join(L) + "\n",
                            content_type="text/plain", charset="utf-8")

    def shutdown(self):
        now = time.monotonic()
        for p in list(self.live.values()):
            for s in p.seqs:
                if s.finish is None:
                    s.finish = "abort"
            p.finalize("abort", False, now)
        if self.gt is not None:
            self.gt.flush()
            try:
                os.fsync(self.gt.fileno())
            except OSError:
                pass
            self.gt.close()
        if os.environ.get("SIMVLLM_DEBUG"):
            e = self.engine
            print("steps=%d sched_cpu_mean=%.3fms overruns=%d" % (
                e.step_no, 1e3 * e.cpu_total / max(1, e.step_no), e.overruns), file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def parse_bugs(spec):
    spec = (spec or "none").strip().lower()
    if spec in ("", "none"):
        return set()
    if spec == "all":
        return set(ALL_BUGS)
    out = set()
    for b in spec.split(","):
        b = b.strip()
        if not b:
            continue
        if b not in ALL_BUGS:
            raise SystemExit("unknown bug %r (choose from %s)" % (b, ",".join(ALL_BUGS)))
        out.add(b)
    return out


async def amain(args):
    srv = Server(args)
    srv.engine = Engine(srv, srv.bugs, args.seed)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", srv.h_completions)
    app.router.add_post("/v1/chat/completions", srv.h_chat)
    app.router.add_get("/v1/models", srv.h_models)
    app.router.add_get("/health", srv.h_health)
    app.router.add_get("/version", srv.h_version)
    app.router.add_post("/tokenize", srv.h_tokenize)
    app.router.add_post("/detokenize", srv.h_detokenize)
    app.router.add_get("/metrics", srv.h_metrics)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, srv.shutdown)
    task = asyncio.ensure_future(srv.engine.run())
    print("sim-vllm serving %s on http://%s:%d (bugs=%s)"
          % (MODEL, args.host, args.port, ",".join(sorted(srv.bugs)) or "none"), flush=True)
    await task


def main():
    ap = argparse.ArgumentParser(description="Simulated vLLM-like OpenAI-compatible server")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bugs", default="none")
    ap.add_argument("--ground-truth", default=None)
    args = ap.parse_args()
    parse_bugs(args.bugs)
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
