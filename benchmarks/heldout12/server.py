#!/usr/bin/env python3
"""GPU-free, real-time simulator of a vLLM (V1 engine) OpenAI-compatible server.

Standard library + aiohttp only.  See README.md for the interface, the engine
configuration, the cost model and the ground-truth format.

    server.py --port P [--host 127.0.0.1] [--seed S] [--bugs none|all|bug1,...]
              [--ground-truth FILE]
"""
import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import re
import signal
import sys
import time
import uuid
import zlib
from array import array
from collections import OrderedDict, deque

from aiohttp import web

# --------------------------------------------------------------------------
# Configuration (what `vllm serve` would have been launched with)
# --------------------------------------------------------------------------
MODEL = "simllama-8b-instruct"
VERSION = "0.11.0+sim"
MAX_MODEL_LEN = 8192
MAX_NUM_BATCHED_TOKENS = 8192
MAX_NUM_SEQS = 128
BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 2400
MAX_N = 16
MAX_LOGPROBS = 20

# cost model (seconds)
STEP_BASE = 7e-3
PER_PREFILL_TOKEN = 55e-6
PER_DECODE_SEQ = 90e-6
PER_CTX_TOKEN_DECODE = 2e-9
JITTER = 0.03

ALL_BUGS = ["bug1", "bug2", "bug3", "bug4", "bug5"]

# --------------------------------------------------------------------------
# Tokenizer: one token per match of TOKEN_RE
# --------------------------------------------------------------------------
TOKEN_RE = re.compile(r"<\|[A-Za-z0-9_]+\|>|\w+|[^\w\s]")
EOS_STR = "<|endoftext|>"
_VOCAB = {}          # id -> string, for /detokenize
_VOCAB_CAP = 2_000_000


def tok_id(s):
    i = zlib.crc32(s.encode("utf-8")) & 0x7FFFFFFF
    if len(_VOCAB) < _VOCAB_CAP:
        _VOCAB.setdefault(i, s)
    return i


def tokenize_text(text):
    strs = TOKEN_RE.findall(text)
    return [tok_id(s) for s in strs], strs


def detokenize(ids):
    return " ".join(_VOCAB.get(int(i), "<unk>") for i in ids)


def render_chat(messages, add_generation_prompt=True):
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            raise BadRequest("each message must be an object")
        role = m.get("role")
        if not isinstance(role, str):
            raise BadRequest("message role must be a string")
        content = m.get("content", "")
        if content is None:
            content = ""
        if isinstance(content, list):
            texts = []
            for p in content:
                if isinstance(p, dict) and p.get("type") == "text":
                    texts.append(str(p.get("text", "")))
                elif isinstance(p, str):
                    texts.append(p)
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise BadRequest("message content must be a string or a list of parts")
        parts.append("<|im_start|>" + role + "\n" + content + "<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


EOS_ID = tok_id(EOS_STR)
WORDS = ("the of and to in is that for it as was with be by on not he this are or "
         "his from at which but have an they you were her she there one all we "
         "their can has more when will would what if so no out up said about into "
         "time than them some could other only new these two may first then do any "
         "like my now over such our man me even most made after also did many before "
         "must through back years where much your way well down should because each "
         "just those people how too little state good very make world still own see "
         "men work long get here between both life being under never day same another "
         "know while last might us great old year off come since against go came right "
         "used take three").split()
WORD_IDS = [tok_id(w) for w in WORDS]


class BadRequest(Exception):
    def __init__(self, msg, status=400, etype="BadRequestError"):
        super().__init__(msg)
        self.msg = msg
        self.status = status
        self.etype = etype


def error_body(msg, status=400, etype="BadRequestError"):
    return {"error": {"message": msg, "type": etype, "param": None, "code": status}}


# --------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------
class Histogram:
    def __init__(self, name, doc, buckets):
        self.name, self.doc, self.buckets = name, doc, list(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v):
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
                break

    def render(self, labels):
        out = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{self.name}_bucket{{{labels},le="{float(b)}"}} {acc}')
        out.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{self.name}_count{{{labels}}} {self.count}")
        out.append(f"{self.name}_sum{{{labels}}} {self.sum}")
        return out


TTFT_B = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
          2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_B = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
         5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
LAT_B = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
         50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITER_B = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


class Metrics:
    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.pc_queries = 0
        self.pc_hits = 0
        self.success = {"stop": 0, "length": 0, "abort": 0}
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_B)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_B)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (deprecated alias "
                              "of inter_token_latency).", ITL_B)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", LAT_B)
        self.queue = Histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", LAT_B)
        self.iter_tokens = Histogram("vllm:iteration_tokens_total",
                                     "Histogram of number of tokens per engine_step.", ITER_B)


# --------------------------------------------------------------------------
# KV block pool with prefix caching (V1 style)
# --------------------------------------------------------------------------
class BlockPool:
    def __init__(self, n, bugs):
        self.n = n
        self.ref = [0] * n
        self.bhash = [None] * n
        self.free = OrderedDict((i, None) for i in range(n))   # LRU order: head = evict first
        self.cached = {}       # block hash -> block id
        self.bugs = bugs
        self.bug3_evicted = set()

    @property
    def num_free(self):
        return len(self.free)

    def usage(self):
        return 1.0 - len(self.free) / self.n

    def lookup(self, hashes, max_blocks):
        hit = []
        for h in hashes[:max_blocks]:
            b = self.cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def touch(self, blocks):
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def alloc(self, k):
        out = []
        for _ in range(k):
            if "bug3" in self.bugs:
                b, _ = self.free.popitem(last=True)
                if self.bhash[b] is not None and len(self.free) > 0:
                    self.bug3_evicted.add(self.bhash[b])
            else:
                b, _ = self.free.popitem(last=False)
            h = self.bhash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.bhash[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks):
        # V1 frees in reverse order so that tail blocks are evicted first.
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def cache(self, b, h):
        if h not in self.cached and self.bhash[b] is None:
            self.cached[h] = b
            self.bhash[b] = h
            self.bug3_evicted.discard(h)


# --------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------
class Parent:
    """One API request (a completion / chat completion), fanned out into n Seqs."""

    def __init__(self, rid, gt_id, chat, prompt_ids, n, max_tokens, min_tokens,
                 ignore_eos, logprobs_k, want_logprobs, stream, include_usage, seed,
                 arrival, order):
        self.rid, self.gt_id, self.chat = rid, gt_id, chat
        self.prompt_ids = prompt_ids
        self.n = n
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.ignore_eos = ignore_eos
        self.logprobs_k = logprobs_k          # int or None
        self.want_logprobs = want_logprobs
        self.stream = stream
        self.include_usage = include_usage
        self.seed = seed
        self.arrival = arrival
        self.order = order
        self.created = int(time.time())
        self.queue = asyncio.Queue()
        self.children = []
        self.patho = set()
        self.done = False
        self.aborted = False
        self.client_disconnected = False
        self.finish_time = None
        self.last_finish_reason = None
        self.recorded = False
        self.error = None
        self._chunk_prefix = None


class Seq:
    __slots__ = ("parent", "index", "tokens", "num_prompt", "num_computed", "blocks",
                 "hashes", "status", "natural_len", "rng", "first_token_t", "last_token_t",
                 "first_sched_t", "finish_reason", "order", "preempt_t", "tail_requeued",
                 "num_new", "jump1", "jump2")

    def __init__(self, parent, index, natural_len, rng, order):
        self.parent = parent
        self.index = index
        self.tokens = list(parent.prompt_ids)
        self.num_prompt = len(parent.prompt_ids)
        self.num_computed = 0
        self.blocks = []
        self.hashes = []
        self.status = "WAITING"
        self.natural_len = natural_len
        self.rng = rng
        self.first_token_t = None
        self.last_token_t = None
        self.first_sched_t = None
        self.finish_reason = None
        self.order = order
        self.preempt_t = None
        self.tail_requeued = False
        self.num_new = 0
        self.jump1 = 0
        self.jump2 = 0

    @property
    def num_output(self):
        return len(self.tokens) - self.num_prompt

    def update_hashes(self):
        full = len(self.tokens) // BLOCK_SIZE
        h = self.hashes
        while len(h) < full:
            i = len(h)
            prev = h[-1] if h else 0
            h.append(hash((prev, tuple(self.tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]))))

    def clean_key(self):
        # position in a correct FCFS V1 waiting queue: preempted requests are
        # prepended (most recently preempted first), then arrival order.
        if self.preempt_t is not None:
            return (0, -self.preempt_t, self.order)
        return (1, self.order)


# --------------------------------------------------------------------------
# Engine (scheduler + simulated model runner)
# --------------------------------------------------------------------------
class Engine:
    def __init__(self, seed, bugs, metrics):
        self.seed = seed
        self.bugs = bugs
        self.metrics = metrics
        self.rng = random.Random(seed)
        self.pool = BlockPool(NUM_GPU_BLOCKS, bugs)
        self.waiting = deque()
        self.running = []
        self.wake = asyncio.Event()
        self.order = 0
        self.parents = set()
        self.stopping = False
        self.task = None

    # -- admission of new API requests -------------------------------------
    def natural_length(self, parent, index):
        d = hashlib.blake2b(digest_size=16)
        d.update(array("I", parent.prompt_ids).tobytes())
        d.update(repr((self.seed, index, parent.seed)).encode())
        r = random.Random(int.from_bytes(d.digest(), "big"))
        L = int(math.exp(r.random() * math.log(1024.0)))
        return max(1, min(1024, L)), r

    def add(self, parent):
        for i in range(parent.n):
            L, r = self.natural_length(parent, i)
            self.order += 1
            s = Seq(parent, i, L, r, self.order)
            s.update_hashes()
            parent.children.append(s)
            self.waiting.append(s)
        self.parents.add(parent)
        self.wake.set()

    def _finish_parent_if_done(self, parent, now):
        if parent.done:
            return
        if all(c.finish_reason is not None for c in parent.children):
            parent.done = True
            parent.finish_time = now
            self.parents.discard(parent)

    def abort(self, parent, disconnected):
        if parent.done:
            return
        now = time.monotonic()
        parent.aborted = True
        parent.client_disconnected = parent.client_disconnected or disconnected
        for s in parent.children:
            if s.finish_reason is not None:
                continue
            if s.status == "RUNNING":
                try:
                    self.running.remove(s)
                except ValueError:
                    pass
            elif s.status == "WAITING":
                try:
                    self.waiting.remove(s)
                except ValueError:
                    pass
            if s.blocks:
                self.pool.release(s.blocks)
                s.blocks = []
            s.status = "FINISHED"
            s.finish_reason = "abort"
            self.metrics.success["abort"] += 1
            self.metrics.e2e.observe(now - parent.arrival)
            parent.last_finish_reason = "abort"
        self._finish_parent_if_done(parent, now)
        parent.queue.put_nowait(("abort",))

    def abort_all(self):
        for p in list(self.parents):
            self.abort(p, disconnected=False)

    # -- scheduling ----------------------------------------------------------
    def _preempt(self, victim, now):
        self.pool.release(victim.blocks)
        victim.blocks = []
        victim.num_computed = 0
        victim.status = "WAITING"
        victim.preempt_t = now
        self.metrics.preemptions += 1
        if "bug2" in self.bugs:
            self.waiting.append(victim)
            victim.tail_requeued = True
        else:
            self.waiting.appendleft(victim)

    def schedule(self, now):
        budget = MAX_NUM_BATCHED_TOKENS
        sched = []
        pool = self.pool
        # 1) running requests first (decodes)
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            num_new = len(r.tokens) - r.num_computed
            need = -(-(r.num_computed + num_new) // BLOCK_SIZE) - len(r.blocks)
            ok = True
            while need > pool.num_free:
                victim = self.running.pop()
                self._preempt(victim, now)
                if victim is r:
                    ok = False
                    break
            if not ok:
                break
            if need > 0:
                r.blocks.extend(pool.alloc(need))
            r.num_new = num_new
            budget -= num_new
            sched.append(r)
            i += 1

        # 2) waiting requests (whole prompt must fit: chunked prefill disabled)
        clean_set = None
        if self.waiting and (("bug1" in self.bugs) or ("bug2" in self.bugs)):
            clean_set = self._dry_run_clean(budget)
        favored = None
        if "bug1" in self.bugs and len(self.waiting) > 1:
            favored = set()
            front, back = [], []
            for w in self.waiting:
                w.update_hashes()
                maxb = (len(w.tokens) - 1) // BLOCK_SIZE
                nh = len(pool.lookup(w.hashes, maxb)) * BLOCK_SIZE
                if nh >= 16 and nh * 2 >= len(w.tokens):
                    front.append(w)
                    favored.add(id(w))
                else:
                    back.append(w)
            self.waiting = deque(front + back)
        admitted = []
        while self.waiting and budget > 0 and len(self.running) < MAX_NUM_SEQS:
            w = self.waiting[0]
            w.update_hashes()
            maxb = (len(w.tokens) - 1) // BLOCK_SIZE
            hit = pool.lookup(w.hashes, maxb)
            num_cached = len(hit) * BLOCK_SIZE
            num_new = len(w.tokens) - num_cached
            if num_new > budget:
                break
            need_new = -(-len(w.tokens) // BLOCK_SIZE) - len(hit)
            evictable = sum(1 for b in hit if pool.ref[b] == 0)
            if need_new + evictable > pool.num_free:
                break
            # bug3 ground truth: the lookup stopped at a block the buggy
            # eviction order threw away out of LRU order.
            if "bug3" in self.bugs and len(hit) < maxb and w.hashes[len(hit)] in pool.bug3_evicted:
                lost = 0
                for h in w.hashes[len(hit):maxb]:
                    if h in pool.bug3_evicted or h in pool.cached:
                        lost += 1
                    else:
                        break
                if lost * BLOCK_SIZE >= 128:
                    w.parent.patho.add("bug3")
            pool.touch(hit)
            w.blocks = hit + pool.alloc(need_new)
            self.metrics.pc_queries += len(w.tokens)
            self.metrics.pc_hits += num_cached
            self.waiting.popleft()
            w.status = "RUNNING"
            w.num_computed = num_cached
            w.num_new = num_new
            if w.first_sched_t is None:
                w.first_sched_t = now
            if w.jump1 or w.jump2:
                self._tag_jumped(w, now)
            self.running.append(w)
            budget -= num_new
            sched.append(w)
            admitted.append(w)

        # ground truth for ordering bugs: requests that a correct FCFS V1
        # scheduler would have admitted in this step but that were not.
        if clean_set:
            adm_ids = set(id(x) for x in admitted)
            jumped = favored is not None and any(
                id(x) in favored and id(x) not in clean_set for x in admitted)
            for y in self.waiting:
                if id(y) not in clean_set:
                    continue
                tagged = False
                if y.tail_requeued:
                    y.parent.patho.add("bug2")
                    tagged = True
                if jumped and id(y) not in favored:
                    y.parent.patho.add("bug1")
                    tagged = True
                if not tagged:
                    y.parent.patho.add("bug1" if favored is not None else "bug2")
        # bookkeeping for requests that were overtaken and are still waiting
        if admitted and self.waiting and (favored is not None or "bug2" in self.bugs):
            for y in self.waiting:
                yk = y.clean_key()
                for x in admitted:
                    if x.clean_key() > yk:
                        if favored is not None and id(x) in favored and id(y) not in favored:
                            y.jump1 += x.num_new
                        if y.tail_requeued:
                            y.jump2 += x.num_new
        for w in admitted:
            w.tail_requeued = False
            w.preempt_t = None
        # cache full blocks that will be computed in this step
        for s in sched:
            upto = (s.num_computed + s.num_new) // BLOCK_SIZE
            s.update_hashes()
            for bi in range(max(0, s.num_computed // BLOCK_SIZE), min(upto, len(s.hashes))):
                pool.cache(s.blocks[bi], s.hashes[bi])
        return sched

    def _tag_jumped(self, w, now):
        # Requests that jumped ahead of w (against FCFS order) did their
        # prefill work before w; tag w when that work is a material part of
        # its wait (>= 20 ms and >= 25 % of the wait).
        start = w.preempt_t if w.preempt_t is not None else w.parent.arrival
        waited = now - start
        for name, toks in (("bug1", w.jump1), ("bug2", w.jump2)):
            est = toks * PER_PREFILL_TOKEN
            if toks and est >= 0.02 and est >= 0.25 * waited:
                w.parent.patho.add(name)
        w.jump1 = w.jump2 = 0

    def _dry_run_clean(self, budget):
        """Which waiting requests would the correct FCFS scheduler admit now?"""
        pool = self.pool
        free = pool.num_free
        nrun = len(self.running)
        vcached = set()
        out = set()
        for w in sorted(self.waiting, key=Seq.clean_key):
            if budget <= 0 or nrun >= MAX_NUM_SEQS:
                break
            w.update_hashes()
            maxb = (len(w.tokens) - 1) // BLOCK_SIZE
            nh = 0
            evictable = 0
            for h in w.hashes[:maxb]:
                b = pool.cached.get(h)
                if b is not None:
                    if pool.ref[b] == 0 and h not in vcached:
                        evictable += 1
                elif h not in vcached:
                    break
                nh += 1
            num_new = len(w.tokens) - nh * BLOCK_SIZE
            if num_new > budget:
                break
            need_new = -(-len(w.tokens) // BLOCK_SIZE) - nh
            if need_new + evictable > free:
                break
            free -= need_new + evictable
            budget -= num_new
            nrun += 1
            vcached.update(w.hashes[:(len(w.tokens)) // BLOCK_SIZE])
            out.add(id(w))
        return out

    def step_time(self, sched):
        prefill = 0
        ndec = 0
        ctx = 0
        for s in sched:
            if s.num_new == 1 and s.num_computed > 0:
                ndec += 1
                ctx += s.num_computed
            else:
                prefill += s.num_new
        dt = STEP_BASE + PER_PREFILL_TOKEN * prefill + PER_DECODE_SEQ * ndec + PER_CTX_TOKEN_DECODE * ctx
        extra = 0.0
        if "bug5" in self.bugs:
            ks = [s.parent.logprobs_k for s in sched if s.parent.want_logprobs]
            if ks:
                extra = 0.4e-3 * len(sched) * (max(ks) + 1)
                if extra >= dt:
                    for s in sched:
                        s.parent.patho.add("bug5")
        j = 1.0 + self.rng.uniform(-JITTER, JITTER)
        return (dt + extra) * j, prefill + ndec

    def apply(self, sched, now):
        m = self.metrics
        for s in sched:
            if s.status != "RUNNING" or s.finish_reason is not None:
                continue
            p = s.parent
            s.num_computed += s.num_new
            k = s.num_output + 1          # index (1-based) of the token being produced
            eos_pos = s.natural_len
            if p.min_tokens and eos_pos < p.min_tokens:
                eos_pos = p.min_tokens
            finish = None
            if not p.ignore_eos and k >= eos_pos:
                tid = EOS_ID
                finish = "stop"
            else:
                tid = WORD_IDS[s.rng.randrange(len(WORD_IDS))]
            if finish is None and k >= p.max_tokens:
                finish = "length"
            s.tokens.append(tid)
            m.generation_tokens += 1
            if s.first_token_t is None:
                s.first_token_t = now
                m.ttft.observe(now - p.arrival)
                m.prompt_tokens += s.num_prompt
                if s.first_sched_t is not None:
                    m.queue.observe(s.first_sched_t - p.arrival)
            else:
                d = now - s.last_token_t
                m.itl.observe(d)
                m.tpot.observe(d)
            s.last_token_t = now
            lp = None
            if p.want_logprobs:
                lp = s.rng.uniform(-3.0, -0.01)
            if finish is not None:
                s.finish_reason = finish
                s.status = "FINISHED"
                try:
                    self.running.remove(s)
                except ValueError:
                    pass
                self.pool.release(s.blocks)
                s.blocks = []
                m.success[finish] += 1
                m.e2e.observe(now - p.arrival)
                p.last_finish_reason = finish
            p.queue.put_nowait(("tok", s.index, tid, finish, lp, now))
            self._finish_parent_if_done(p, now)

    async def run(self):
        loop = asyncio.get_running_loop()
        while not self.stopping:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
                continue
            t0 = loop.time()
            now = time.monotonic()
            sched = self.schedule(now)
            if not sched:
                # nothing schedulable (should not happen in a healthy engine)
                await asyncio.sleep(0.005)
                continue
            dt, ntok = self.step_time(sched)
            self.metrics.iter_tokens.observe(ntok)
            delay = t0 + dt - loop.time()
            await asyncio.sleep(max(0.0, delay))
            self.apply(sched, time.monotonic())


# --------------------------------------------------------------------------
# HTTP front end
# --------------------------------------------------------------------------
def _int(v, name, lo=None, hi=None, allow_none=True):
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{name}' must be an integer")
    if lo is not None and v < lo:
        raise BadRequest(f"'{name}' must be at least {lo}, got {v}.")
    if hi is not None and v > hi:
        raise BadRequest(f"'{name}' must be at most {hi}, got {v}.")
    return v


class Server:
    def __init__(self, args, bugs):
        self.args = args
        self.bugs = bugs
        self.metrics = Metrics()
        self.engine = None
        self.gt = open(args.ground_truth, "a", buffering=1) if args.ground_truth else None
        self.shutting_down = False
        self.active = set()
        self.inflight = set()
        self.req_counter = 0

    # -- ground truth ----------------------------------------------------------
    def record(self, parent=None, gt_id=None, arrival=None, prompt_tokens=0, reason="error"):
        if parent is not None:
            if parent.recorded:
                return
            parent.recorded = True
            self.inflight.discard(parent)
            end = parent.finish_time if parent.finish_time is not None else time.monotonic()
            rec = {
                "request_id": parent.gt_id,
                "pathologies": sorted(parent.patho),
                "client_disconnected": bool(parent.client_disconnected),
                "finish_reason": "abort" if parent.aborted else (parent.last_finish_reason or "error"),
                "e2e_s": round(end - parent.arrival, 6),
                "prompt_tokens": len(parent.prompt_ids),
                "output_tokens": sum(c.num_output for c in parent.children),
            }
        else:
            rec = {"request_id": gt_id, "pathologies": [], "client_disconnected": False,
                   "finish_reason": reason, "e2e_s": round(time.monotonic() - arrival, 6),
                   "prompt_tokens": prompt_tokens, "output_tokens": 0}
        if self.gt:
            try:
                self.gt.write(json.dumps(rec) + "\n")
                self.gt.flush()
            except Exception:
                pass

    # -- simple endpoints ------------------------------------------------------
    async def health(self, request):
        return web.Response(status=200)

    async def version(self, request):
        return web.json_response({"version": VERSION})

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{
            "id": MODEL, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": MODEL, "parent": None, "max_model_len": MAX_MODEL_LEN,
            "permission": []}]})

    async def tokenize(self, request):
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("request body must be a JSON object")
            self._check_model(body)
            if "messages" in body:
                if not isinstance(body["messages"], list):
                    raise BadRequest("'messages' must be a list")
                text = render_chat(body["messages"], bool(body.get("add_generation_prompt", True)))
            elif isinstance(body.get("prompt"), str):
                text = body["prompt"]
            else:
                raise BadRequest("either 'prompt' (string) or 'messages' is required")
            ids, strs = tokenize_text(text)
            out = {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids}
            if body.get("return_token_strs"):
                out["token_strs"] = strs
            return web.json_response(out)
        except BadRequest as e:
            return web.json_response(error_body(e.msg, e.status, e.etype), status=e.status)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response(error_body("invalid JSON body"), status=400)

    async def detokenize(self, request):
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("request body must be a JSON object")
            self._check_model(body)
            toks = body.get("tokens")
            if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
                raise BadRequest("'tokens' must be a list of integers")
            return web.json_response({"prompt": detokenize(toks)})
        except BadRequest as e:
            return web.json_response(error_body(e.msg, e.status, e.etype), status=e.status)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response(error_body("invalid JSON body"), status=400)

    async def metrics_ep(self, request):
        m = self.metrics
        e = self.engine
        L = f'engine="0",model_name="{MODEL}"'
        out = []

        def g(name, typ, doc, val, labels=L):
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {typ}")
            out.append(f"{name}{{{labels}}} {val}")

        g("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", len(e.running))
        g("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", len(e.waiting))
        g("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", e.pool.usage())
        g("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage (deprecated alias).", e.pool.usage())
        g("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.", m.pc_queries)
        g("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", m.pc_hits)
        g("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", m.preemptions)
        g("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", m.prompt_tokens)
        g("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", m.generation_tokens)
        out.append("# HELP vllm:request_success_total Count of successfully processed requests.")
        out.append("# TYPE vllm:request_success_total counter")
        for k, v in m.success.items():
            out.append(f'vllm:request_success_total{{{L},finished_reason="{k}"}} {v}')
        out.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig")
        out.append("# TYPE vllm:cache_config_info gauge")
        out.append(f'vllm:cache_config_info{{{L},block_size="{BLOCK_SIZE}",enable_prefix_caching="True",'
                   f'num_gpu_blocks="{NUM_GPU_BLOCKS}"}} 1.0')
        for h in (m.ttft, m.itl, m.tpot, m.e2e, m.queue, m.iter_tokens):
            out.extend(h.render(L))
        return web.Response(text="\n".join(out) + "\n",
                            content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    def _check_model(self, body):
        mdl = body.get("model")
        if mdl is not None and mdl != MODEL:
            raise BadRequest(f"The model `{mdl}` does not exist.", 404, "NotFoundError")

    # -- generation ------------------------------------------------------------
    def _parse(self, body, chat, arrival, rid, gt_id):
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        self._check_model(body)
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise BadRequest("'messages' must be a non-empty list")
            text = render_chat(msgs, bool(body.get("add_generation_prompt", True)))
            prompt_ids, _ = tokenize_text(text)
        else:
            pr = body.get("prompt")
            if isinstance(pr, list) and len(pr) == 1 and isinstance(pr[0], (str, list)):
                pr = pr[0]
            if isinstance(pr, str):
                prompt_ids, _ = tokenize_text(pr)
            elif isinstance(pr, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in pr):
                prompt_ids = list(pr)
            elif isinstance(pr, list):
                raise BadRequest("batched prompts are not supported by this server; send one prompt per request")
            else:
                raise BadRequest("'prompt' must be a string or a list of token ids")
        plen = len(prompt_ids)
        if plen == 0:
            raise BadRequest("The prompt cannot be empty.")
        if plen >= MAX_MODEL_LEN:
            raise BadRequest(f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your "
                             f"request has {plen} input tokens. Please reduce the length of the input messages.")
        n = _int(body.get("n", 1), "n", 1, MAX_N, allow_none=True) or 1
        mt = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None else body.get("max_tokens")
        mt = _int(mt, "max_tokens", 1)
        if mt is None:
            mt = MAX_MODEL_LEN - plen
        if plen + mt > MAX_MODEL_LEN:
            raise BadRequest(f"'max_tokens' or 'max_completion_tokens' is too large: {mt}. This model's maximum "
                             f"context length is {MAX_MODEL_LEN} tokens and your request has {plen} input tokens "
                             f"({mt} > {MAX_MODEL_LEN} - {plen}).")
        min_tokens = _int(body.get("min_tokens", 0), "min_tokens", 0) or 0
        if min_tokens > mt:
            raise BadRequest(f"min_tokens must be less than or equal to max_tokens={mt}, got {min_tokens}.")
        ie = body.get("ignore_eos", False)
        if not isinstance(ie, bool):
            raise BadRequest("'ignore_eos' must be a boolean")
        temp = body.get("temperature")
        if temp is not None and (isinstance(temp, bool) or not isinstance(temp, (int, float)) or temp < 0):
            raise BadRequest("temperature must be non-negative")
        seed = body.get("seed")
        if seed is not None:
            _int(seed, "seed")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be a boolean")
        so = body.get("stream_options")
        include_usage = False
        if so is not None:
            if not stream:
                raise BadRequest("Stream options can only be defined when `stream=True`.")
            if not isinstance(so, dict):
                raise BadRequest("'stream_options' must be an object")
            include_usage = bool(so.get("include_usage", False))
        want_lp = False
        k = 0
        if chat:
            lp = body.get("logprobs", False)
            if lp is not None and not isinstance(lp, bool):
                raise BadRequest("'logprobs' must be a boolean for chat completions")
            tl = _int(body.get("top_logprobs"), "top_logprobs", 0, MAX_LOGPROBS)
            if tl is not None and tl > 0 and not lp:
                raise BadRequest("when using `top_logprobs`, `logprobs` must be set to true.")
            want_lp = bool(lp)
            k = tl or 0
        else:
            lp = _int(body.get("logprobs"), "logprobs", 0, MAX_LOGPROBS)
            if lp is not None:
                want_lp = True
                k = lp
        return Parent(rid, gt_id, chat, prompt_ids, n, mt, min_tokens, ie, k, want_lp, stream,
                      include_usage, seed, arrival, 0)

    def _lp_obj(self, parent, tid, lp, text_offset):
        tok = "" if tid == EOS_ID else " " + _VOCAB.get(tid, "")
        k = parent.logprobs_k
        alts = []
        r = random.Random(tid ^ int(lp * 1e6))
        for j in range(max(0, k - 1)):
            w = WORDS[r.randrange(len(WORDS))]
            alts.append((" " + w, lp - 0.5 - j * 0.7))
        if parent.chat:
            top = []
            if k > 0:
                top = [{"token": tok, "logprob": lp, "bytes": list(tok.encode())}] + \
                      [{"token": a, "logprob": v, "bytes": list(a.encode())} for a, v in alts]
            return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": top}]}
        top = {}
        if k > 0:
            top[tok] = lp
            for a, v in alts:
                top.setdefault(a, v)
        return {"tokens": [tok], "token_logprobs": [lp], "top_logprobs": [top] if k > 0 else None,
                "text_offset": [text_offset]}

    @staticmethod
    def _merge_lp(acc, obj, chat):
        if obj is None:
            return acc
        if acc is None:
            return json.loads(json.dumps(obj))
        if chat:
            acc["content"].extend(obj["content"])
        else:
            acc["tokens"].extend(obj["tokens"])
            acc["token_logprobs"].extend(obj["token_logprobs"])
            if acc["top_logprobs"] is not None and obj["top_logprobs"] is not None:
                acc["top_logprobs"].extend(obj["top_logprobs"])
            acc["text_offset"].extend(obj["text_offset"])
        return acc

    def _usage(self, parent):
        ct = sum(c.num_output for c in parent.children)
        pt = len(parent.prompt_ids)
        return {"prompt_tokens": pt, "total_tokens": pt + ct, "completion_tokens": ct,
                "prompt_tokens_details": None}

    async def completions(self, request):
        return await self._generate(request, chat=False)

    async def chat_completions(self, request):
        return await self._generate(request, chat=True)

    async def _generate(self, request, chat):
        arrival = time.monotonic()
        hdr = request.headers.get("X-Request-Id")
        self.req_counter += 1
        base = hdr if hdr else uuid.uuid4().hex
        rid = ("chatcmpl-" if chat else "cmpl-") + base
        gt_id = hdr if hdr else rid
        headers = {"X-Request-Id": hdr if hdr else rid}
        parent = None
        task = asyncio.current_task()
        self.active.add(task)
        try:
            if self.shutting_down:
                raise BadRequest("server is shutting down", 503, "ServiceUnavailableError")
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
                raise BadRequest("invalid JSON body")
            parent = self._parse(body, chat, arrival, rid, gt_id)
            self.engine.add(parent)
            self.inflight.add(parent)
            if parent.stream:
                return await self._stream(request, parent, headers)
            return await self._nonstream(request, parent, headers)
        except BadRequest as e:
            plen = len(parent.prompt_ids) if parent else 0
            if parent is None:
                self.record(None, gt_id, arrival, plen, "error")
            return web.json_response(error_body(e.msg, e.status, e.etype), status=e.status, headers=headers)
        except (asyncio.CancelledError, ConnectionError):
            if parent is not None and not parent.done:
                self.engine.abort(parent, disconnected=not self.shutting_down)
            raise
        finally:
            self.active.discard(task)
            if parent is not None:
                if not parent.done:
                    self.engine.abort(parent, disconnected=not self.shutting_down)
                self.record(parent)

    async def _nonstream(self, request, parent, headers):
        n = parent.n
        texts = [[] for _ in range(n)]
        lps = [None] * n
        offsets = [0] * n
        finish = [None] * n
        while True:
            ev = await parent.queue.get()
            if ev[0] == "abort":
                break
            _, idx, tid, fin, lp, t = ev
            piece = "" if tid == EOS_ID else " " + _VOCAB.get(tid, "")
            if parent.want_logprobs:
                lps[idx] = self._merge_lp(lps[idx], self._lp_obj(parent, tid, lp, offsets[idx]), parent.chat)
            offsets[idx] += len(piece)
            texts[idx].append(piece)
            if fin:
                finish[idx] = fin
            if parent.done and parent.queue.empty():
                break
        choices = []
        for i in range(n):
            fr = finish[i] or "abort"
            txt = "".join(texts[i])
            if parent.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": txt,
                                                        "reasoning_content": None, "tool_calls": []},
                                "logprobs": lps[i], "finish_reason": fr, "stop_reason": None})
            else:
                choices.append({"index": i, "text": txt, "logprobs": lps[i], "finish_reason": fr,
                                "stop_reason": None, "prompt_logprobs": None})
        body = {"id": parent.rid, "object": "chat.completion" if parent.chat else "text_completion",
                "created": parent.created, "model": MODEL, "choices": choices,
                "usage": self._usage(parent)}
        if parent.chat:
            body["prompt_logprobs"] = None
        return web.json_response(body, headers=headers)

    def _chunk(self, parent, choices, usage=None):
        d = {"id": parent.rid, "object": "chat.completion.chunk" if parent.chat else "text_completion",
             "created": parent.created, "model": MODEL, "choices": choices}
        if usage is not None:
            d["usage"] = usage
        return b"data: " + json.dumps(d, separators=(",", ":")).encode() + b"\n\n"

    async def _stream(self, request, parent, headers):
        h = dict(headers)
        h["Content-Type"] = "text/event-stream; charset=utf-8"
        h["Cache-Control"] = "no-cache"
        resp = web.StreamResponse(status=200, headers=h)
        await resp.prepare(request)
        n = parent.n
        chat = parent.chat
        offsets = [0] * n
        done = [False] * n
        role_sent = False
        hold = "bug4" in self.bugs and n > 1
        held = []
        max_hold = 0.0
        try:
            while True:
                ev = await parent.queue.get()
                if ev[0] == "abort":
                    out = []
                    if held and time.monotonic() - held[0][1] >= 0.02:
                        parent.patho.add("bug4")
                    for (e2, tq) in held:
                        out.append(self._tok_chunk(parent, e2, offsets))
                    held = []
                    for i in range(n):
                        if not done[i]:
                            done[i] = True
                            if chat:
                                out.append(self._chunk(parent, [{"index": i, "delta": {"content": ""}, "logprobs": None,
                                                                 "finish_reason": "abort", "stop_reason": None}]))
                            else:
                                out.append(self._chunk(parent, [{"index": i, "text": "", "logprobs": None,
                                                                 "finish_reason": "abort", "stop_reason": None}]))
                    if parent.include_usage:
                        out.append(self._chunk(parent, [], self._usage(parent)))
                    out.append(b"data: [DONE]\n\n")
                    await resp.write(b"".join(out))
                    break
                _, idx, tid, fin, lp, t = ev
                out = []
                if chat and not role_sent:
                    role_sent = True
                    for i in range(n):
                        out.append(self._chunk(parent, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None}]))
                if fin:
                    done[idx] = True
                if hold and idx != 0 and not done[0]:
                    held.append((ev, time.monotonic()))
                else:
                    out.append(self._tok_chunk(parent, ev, offsets))
                    if hold and idx == 0 and fin and held:
                        tnow = time.monotonic()
                        for (e2, tq) in held:
                            max_hold = max(max_hold, tnow - tq)
                            out.append(self._tok_chunk(parent, e2, offsets))
                        held = []
                        if max_hold >= 0.02:
                            parent.patho.add("bug4")
                if parent.done and not held and parent.queue.empty():
                    if parent.include_usage:
                        out.append(self._chunk(parent, [], self._usage(parent)))
                    out.append(b"data: [DONE]\n\n")
                    if out:
                        await resp.write(b"".join(out))
                    break
                if out:
                    await resp.write(b"".join(out))
        except ConnectionError:
            if held and time.monotonic() - held[0][1] >= 0.02:
                parent.patho.add("bug4")
            if not parent.done:
                self.engine.abort(parent, disconnected=not self.shutting_down)
            return resp
        except asyncio.CancelledError:
            if held and time.monotonic() - held[0][1] >= 0.02:
                parent.patho.add("bug4")
            if not parent.done:
                self.engine.abort(parent, disconnected=not self.shutting_down)
            raise
        try:
            await resp.write_eof()
        except ConnectionError:
            pass
        return resp

    def _tok_chunk(self, parent, ev, offsets):
        _, idx, tid, fin, lp, t = ev
        piece = "" if tid == EOS_ID else " " + _VOCAB.get(tid, "")
        if not parent.want_logprobs and fin is None:
            # fast path (same bytes as the generic path below)
            pre = getattr(parent, "_chunk_prefix", None)
            if pre is None:
                pre = ('data: {"id":%s,"object":%s,"created":%d,"model":%s,"choices":[{"index":' % (
                    json.dumps(parent.rid), '"chat.completion.chunk"' if parent.chat else '"text_completion"',
                    parent.created, json.dumps(MODEL)))
                parent._chunk_prefix = pre
            offsets[idx] += len(piece)
            if parent.chat:
                body = '%d,"delta":{"content":%s},"logprobs":null,"finish_reason":null}]}\n\n' % (idx, json.dumps(piece))
            else:
                body = '%d,"text":%s,"logprobs":null,"finish_reason":null}]}\n\n' % (idx, json.dumps(piece))
            return (pre + body).encode()
        lpo = self._lp_obj(parent, tid, lp, offsets[idx]) if parent.want_logprobs else None
        offsets[idx] += len(piece)
        if parent.chat:
            c = {"index": idx, "delta": {"content": piece}, "logprobs": lpo, "finish_reason": fin}
        else:
            c = {"index": idx, "text": piece, "logprobs": lpo, "finish_reason": fin}
        if fin:
            c["stop_reason"] = None
        return self._chunk(parent, [c])


# --------------------------------------------------------------------------
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
            raise SystemExit(f"unknown bug name {b!r}; valid: {', '.join(ALL_BUGS)}, all, none")
        out.add(b)
    return out


async def amain(args):
    bugs = parse_bugs(args.bugs)
    srv = Server(args, bugs)
    srv.engine = Engine(args.seed, bugs, srv.metrics)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", srv.completions)
    app.router.add_post("/v1/chat/completions", srv.chat_completions)
    app.router.add_get("/v1/models", srv.models)
    app.router.add_get("/health", srv.health)
    app.router.add_get("/version", srv.version)
    app.router.add_post("/tokenize", srv.tokenize)
    app.router.add_post("/detokenize", srv.detokenize)
    app.router.add_get("/metrics", srv.metrics_ep)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.3)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_address=True)
    await site.start()
    port = runner.addresses[0][1]
    srv.engine.task = asyncio.create_task(srv.engine.run())
    bug_str = ",".join(sorted(bugs)) if bugs else "none"
    print(f"vllm-sim: serving model {MODEL} on http://{args.host}:{port} port={port} "
          f"seed={args.seed} bugs={bug_str}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # graceful-but-quick shutdown: abort everything in flight
    srv.shutting_down = True
    srv.engine.stopping = True
    srv.engine.wake.set()
    srv.engine.abort_all()
    deadline = loop.time() + 0.5
    while srv.active and loop.time() < deadline:
        await asyncio.sleep(0.02)
    for p in list(srv.inflight):
        srv.record(p)
    srv.engine.task.cancel()
    try:
        await asyncio.wait_for(runner.cleanup(), 0.5)
    except Exception:
        pass
    if srv.gt:
        srv.gt.flush()
        srv.gt.close()


def main():
    ap = argparse.ArgumentParser(description="vLLM V1 OpenAI-compatible server simulator")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bugs", default="none")
    ap.add_argument("--ground-truth", default=None)
    args = ap.parse_args()
    try:
        asyncio.run(amain(args))
    except KeyboardInterrupt:
        pass
    os._exit(0)


if __name__ == "__main__":
    main()
