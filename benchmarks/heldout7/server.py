#!/usr/bin/env python3
"""Simulated vLLM-style OpenAI-compatible inference server.

The GPU forward pass is replaced by asyncio.sleep() of a modelled step time;
everything else (continuous batching, paged KV cache with prefix caching,
chunked prefill, recompute preemption, streaming, metrics) is simulated.
Standard library + aiohttp only.  See README.md.
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
import zlib
from collections import OrderedDict, namedtuple

from aiohttp import web

VERSION = "0.10.1+sim"
ALL_BUGS = ("bug1", "bug2", "bug3", "bug4", "bug5")
COST_BUGS = ("bug4", "bug5")   # bugs that can also act through the step time
COST_TAG_RATIO = 1.15          # step >=15% slower than its counterfactual

# ---------------------------------------------------------------- tokenizer
SPECIALS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|endoftext|>"]
_WORDS = """the of and to in is that it for on with as was at by an be this from or are have not had but what all were when
we there can your which their said if do will each about how up out them then she many some so these would other
into has more her two like him see time could no make than first been its who now people my made over did down
only way find use may water long little very after words called just where most know get through back much
before go good new write our used me man too any day same right look think also around another came come work
three word must because does part even place well such here take why things help put years different away again
off went old number great tell men say small every found still between name should home big give air line set
own under read last never us left end along while might next sound below saw something thought both few those
always looked show large often together asked house world going want school important until form food keep
children feet land side without boy once animals life enough took sometimes four head above kind began almost
live page got earth need far hand high year mother light parts country father let night following picture being
study second eyes soon times story boys since white days ever paper hard near sentence better best across during
today others however sure means knew try told young miles sun ways thing whole hear example heard several change
answer room sea against top turned learn point city play toward five using himself usually money seen car
morning river system model token cache batch stream queue engine server latency block prefix decode kernel
memory""".split()
_seen = set()
VOCAB = SPECIALS + [w for w in _WORDS if not (w in _seen or _seen.add(w))]
WORD_ID = {w: i for i, w in enumerate(VOCAB)}
GEN_BASE = len(SPECIALS)
GEN_N = len(VOCAB) - GEN_BASE
UNK_BASE = 1000
VOCAB_SIZE = 100000
ROLE_TOKEN = {"system": 0, "developer": 0, "user": 1, "assistant": 2, "tool": 3}


class Tokenizer:
    """One token per whitespace-separated word.  Known words have fixed ids,
    unknown words hash (crc32) into [1000, 100000) and are remembered so that
    /detokenize round-trips; ids without a word print as <|id|>."""

    def __init__(self):
        self.unk = {}

    def encode(self, text):
        out = []
        for w in text.split():
            i = WORD_ID.get(w)
            if i is None:
                if w.startswith("<|") and w.endswith("|>") and w[2:-2].isdigit() \
                        and int(w[2:-2]) < VOCAB_SIZE:
                    i = int(w[2:-2])
                else:
                    i = UNK_BASE + zlib.crc32(w.encode()) % (VOCAB_SIZE - UNK_BASE)
                    self.unk.setdefault(i, w)
            out.append(i)
        return out

    def word(self, i):
        if i < len(VOCAB):
            return VOCAB[i]
        w = self.unk.get(i)
        return w if w is not None else "<|%d|>" % i

    def decode(self, ids):
        return " ".join(self.word(i) for i in ids)

    def chat(self, messages, add_generation_prompt=True):
        if not isinstance(messages, list) or not messages:
            raise ApiError("'messages' must be a non-empty list")
        ids = []
        for m in messages:
            if not isinstance(m, dict):
                raise ApiError("each message must be an object")
            content = m.get("content") or ""
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content
                                   if isinstance(p, dict))
            if not isinstance(content, str):
                raise ApiError("message content must be a string or a list of parts")
            ids.append(ROLE_TOKEN.get(m.get("role"), 1))
            ids.extend(self.encode(content))
        if add_generation_prompt:
            ids.append(ROLE_TOKEN["assistant"])
        return ids


class ApiError(Exception):
    def __init__(self, msg, status=400, typ="BadRequestError", param=None):
        super().__init__(msg)
        self.msg, self.status, self.typ, self.param = msg, status, typ, param


# ---------------------------------------------------------------- metrics
class Hist:
    def __init__(self, name, doc, buckets):
        self.name, self.doc, self.b = name, doc, list(buckets)
        self.counts = [0] * (len(self.b) + 1)
        self.sum = 0.0
        self.n = 0

    def observe(self, v):
        self.counts[bisect.bisect_left(self.b, v)] += 1
        self.sum += v
        self.n += 1

    def render(self, lab, out):
        out.append("# HELP %s %s\n# TYPE %s histogram\n" % (self.name, self.doc, self.name))
        acc = 0
        for le, c in zip(self.b, self.counts):
            acc += c
            out.append('%s_bucket{%s,le="%s"} %d\n' % (self.name, lab, float(le), acc))
        out.append('%s_bucket{%s,le="+Inf"} %d\n' % (self.name, lab, self.n))
        out.append("%s_count{%s} %d\n%s_sum{%s} %.6f\n" % (self.name, lab, self.n,
                                                         self.name, lab, self.sum))


TTFT_B = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
          5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_B = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
         7.5, 10.0, 20.0, 40.0, 80.0]
REQ_B = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
         60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOK_B = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
SIZE_B = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]


class Metrics:
    def __init__(self):
        self.c = {"prompt_tokens": 0, "generation_tokens": 0, "num_preemptions": 0,
                  "prefix_cache_queries": 0, "prefix_cache_hits": 0}
        self.success = {"stop": 0, "length": 0, "abort": 0}
        H = Hist
        self.h = {
            "ttft": H("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_B),
            "itl": H("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_B),
            "tpot": H("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds (deprecated alias of inter_token_latency).", ITL_B),
            "e2e": H("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQ_B),
            "queue": H("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", REQ_B),
            "prefill": H("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", REQ_B),
            "decode": H("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", REQ_B),
            "iter": H("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", TOK_B),
            "rpt": H("vllm:request_prompt_tokens", "Number of prefill tokens processed.", SIZE_B),
            "rgt": H("vllm:request_generation_tokens", "Number of generation tokens processed.", SIZE_B),
        }


# ---------------------------------------------------------------- KV cache
class Block:
    __slots__ = ("h", "ref")

    def __init__(self, h):
        self.h, self.ref = h, 1


class KVCache:
    """Paged KV cache.  A sequence holds `blocks` (hashed, cacheable full prompt
    blocks, in prefix order) plus `anon` anonymous blocks.  Freed hashed blocks
    stay cached in an LRU free list and are evicted lazily on allocation."""

    def __init__(self, num_blocks, block_size, prefix_caching):
        self.n, self.bs, self.enabled = num_blocks, block_size, prefix_caching
        self.free_anon = num_blocks
        self.cache = {}
        self.lru = OrderedDict()

    def num_free(self):
        return self.free_anon + len(self.lru)

    def usage(self):
        return 1.0 - self.num_free() / self.n

    def lookup(self, s):
        """(hit blocks, hits that sit in the free list). Read-only."""
        if not self.enabled:
            return 0, 0
        h = f = 0
        for hh in s.hashes[:(s.num_tokens - 1) // self.bs]:
            b = self.cache.get(hh)
            if b is None:
                break
            h += 1
            f += b.ref == 0
        return h, f

    def releasable(self, s):
        return s.anon + sum(1 for b in s.blocks if b.ref == 1)

    def take(self, k):
        while self.free_anon < k and self.lru:
            h, _ = self.lru.popitem(last=False)
            del self.cache[h]
            self.free_anon += 1
        if self.free_anon < k:
            return False
        self.free_anon -= k
        return True

    def acquire_hits(self, s, h):
        for hh in s.hashes[:h]:
            b = self.cache[hh]
            if b.ref == 0:
                del self.lru[hh]
            b.ref += 1
            s.blocks.append(b)

    def release(self, s):
        for b in reversed(s.blocks):
            b.ref -= 1
            if b.ref == 0:
                self.lru[b.h] = b
        self.free_anon += s.anon
        s.blocks, s.anon, s.reg_stop = [], 0, False

    def register(self, s):
        if not self.enabled or s.reg_stop:
            return
        full = min(s.num_computed, s.P) // self.bs
        while len(s.blocks) < full and s.anon > 0:
            hh = s.hashes[len(s.blocks)]
            if hh in self.cache:
                s.reg_stop = True
                return
            self.cache[hh] = b = Block(hh)
            s.blocks.append(b)
            s.anon -= 1


# ---------------------------------------------------------------- requests
WAIT, RUN, DONE = 0, 1, 2


class Job:
    """One API request (n choices -> n engine sequences)."""

    def __init__(self, rid, kind, prompt, max_tokens, n, ignore_eos, min_tokens,
                 lp, stream, include_usage, seed):
        self.rid, self.kind, self.prompt, self.max_tokens = rid, kind, prompt, max_tokens
        self.n, self.lp, self.stream, self.include_usage = n, lp, stream, include_usage
        self.arrival, self.created = time.monotonic(), int(time.time())
        self.queue, self.done_evt = asyncio.Queue(), asyncio.Event()
        self.done = self.client_gone = self.zombie = self.server_abort = False
        self.first_sched = self.first_tok = self.finish = None
        self.pathologies = set()
        lp_k = 0 if lp is None else lp + 1
        base = zlib.crc32(json.dumps([seed, prompt[:64], len(prompt)]).encode())
        self.seqs = []
        for i in range(n):
            rng = random.Random(base * 31 + i)
            # seeded natural answer length, log-uniform in [8, 768)
            nat = max(1, min_tokens, int(math.exp(rng.uniform(math.log(8), math.log(768)))))
            eos = nat if not ignore_eos and nat < max_tokens else max_tokens
            self.seqs.append(Seq(self, i, prompt, max_tokens, lp_k, eos, rng.getrandbits(63)))
        self.remaining = n


class Seq:
    __slots__ = ("job", "index", "P", "hashes", "max_tokens", "lp_k", "eos_at",
                 "num_computed", "out", "blocks", "anon", "reg_stop", "arrival_seq",
                 "admit_seq", "state", "x", "tokens", "last_ts", "finish")

    def __init__(self, job, index, prompt, max_tokens, lp_k, eos_at, x):
        self.job, self.index, self.P = job, index, len(prompt)
        self.max_tokens, self.lp_k, self.eos_at, self.x = max_tokens, lp_k, eos_at, x
        self.num_computed = self.out = self.anon = self.admit_seq = self.arrival_seq = 0
        self.hashes, self.blocks, self.reg_stop, self.state = [], [], False, WAIT
        self.tokens, self.last_ts, self.finish = [], None, None

    @property
    def num_tokens(self):
        return self.P + self.out

    def held(self):
        return len(self.blocks) + self.anon

    def next_token(self):
        self.x = (self.x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        return GEN_BASE + (self.x >> 33) % GEN_N


Plan = namedtuple("Plan", "tokens preempted touched cost")


def cdiv(a, b):
    return -(-a // b)


# ---------------------------------------------------------------- engine
class Engine:
    def __init__(self, cfg, bugs, seed, gt_path):
        self.cfg, self.bugs, self.seed = cfg, frozenset(bugs), seed
        self.kv = KVCache(cfg.num_kv_blocks, cfg.block_size, not cfg.no_prefix_caching)
        self.waiting, self.running, self.jobs = [], [], {}   # waiting sorted by arrival
        self.m, self.rng, self.wake = Metrics(), random.Random(seed), asyncio.Event()
        self.counter = self.step_no = self.zombies = 0
        self.stopping = False
        self.gt = open(gt_path, "a", buffering=1) if gt_path else None

    # ----- admission / abort
    def add(self, job):
        bs = self.cfg.block_size
        hashes, h = [], 0
        for i in range(len(job.prompt) // bs):
            h = hash((h, tuple(job.prompt[i * bs:(i + 1) * bs])))
            hashes.append(h)
        for s in job.seqs:
            s.hashes = hashes
            self.counter += 1
            s.arrival_seq = self.counter
            self.waiting.append(s)
        self.jobs[id(job)] = job
        self.wake.set()

    def abort(self, job, client):
        if job.done:
            return
        if client:
            job.client_gone = True
            if "bug5" in self.bugs and job.first_tok is None:
                if not job.zombie:
                    job.zombie = True
                    job.pathologies.add("bug5")
                    self.zombies += 1
                return
        for s in job.seqs:
            if s.state == RUN:
                self.kv.release(s)
                self.running.remove(s)
            elif s.state == WAIT:
                self.waiting.remove(s)
            s.state = DONE
        self._finish_job(job, "abort")

    def shutdown(self):
        self.stopping = True
        for job in list(self.jobs.values()):
            job.server_abort = True
            self.abort(job, client=False)
        self.wake.set()
        if self.gt:
            self.gt.flush()

    def gt_line(self, rid, finish, client, e2e, ptoks, otoks, paths):
        if self.gt:
            self.gt.write(json.dumps({
                "request_id": rid, "finish_reason": finish, "client_disconnected": client,
                "e2e_s": round(e2e, 6), "prompt_tokens": ptoks, "output_tokens": otoks,
                "pathologies": sorted(paths)}) + "\n")
            self.gt.flush()

    def _finish_job(self, job, reason):
        if job.done:
            return
        job.done = True
        if job.zombie:
            self.zombies -= 1
        now = time.monotonic()
        if reason != "abort":
            reason = job.seqs[0].finish or reason
        job.finish = reason
        m = self.m
        m.success[reason] = m.success.get(reason, 0) + 1
        e2e = now - job.arrival
        m.h["e2e"].observe(e2e)
        if job.first_sched is not None:
            m.h["queue"].observe(job.first_sched - job.arrival)
            if job.first_tok is not None:
                m.h["prefill"].observe(job.first_tok - job.first_sched)
                m.h["decode"].observe(now - job.first_tok)
        out = sum(s.out for s in job.seqs)
        m.h["rpt"].observe(len(job.prompt))
        m.h["rgt"].observe(out)
        self.gt_line(job.rid, reason, job.client_gone, e2e, len(job.prompt), out, job.pathologies)
        self.jobs.pop(id(job), None)
        job.queue.put_nowait(None)
        job.done_evt.set()

    # ----- scheduling
    def plan(self, bugs):
        c, bs = self.cfg, self.cfg.block_size
        kv = self.kv
        touched = set()
        free = kv.num_free()
        if self.zombies and "bug5" not in bugs:
            run, wait = [], [s for s in self.waiting if not s.job.zombie]
            for s in self.running:
                if s.job.zombie:
                    free += kv.releasable(s)
                else:
                    run.append(s)
        else:
            run, wait = list(self.running), self.waiting
            if self.zombies:
                touched.add("bug5")
        budget = c.max_num_batched_tokens
        tokens, preempted = {}, []
        first = None
        if "bug3" in bugs:
            for s in run:
                if s.num_tokens > 2 * budget and s.num_tokens - s.num_computed > 1:
                    first = s
                    touched.add("bug3")
                    run.remove(s)
                    run.insert(0, s)
                    break
        # 1) running requests first (decodes and partial prefills, admission order)
        i = 0
        while i < len(run) and budget > 0:
            s = run[i]
            rem = s.num_tokens - s.num_computed
            n = min(rem, budget) if s is first else min(rem, c.long_prefill_token_threshold, budget)
            need = cdiv(s.num_computed + n, bs) - s.held()
            lost = False
            while need > free:
                victim = max(run[i:], key=lambda x: x.admit_seq)   # newest admitted
                run.remove(victim)
                preempted.append(victim)
                free += kv.releasable(victim)
                if victim is s:
                    lost = True
                    break
            if lost:
                break
            tokens[s] = n
            budget -= n
            free -= max(need, 0)
            i += 1
        # 2) waiting requests, FCFS, only when nothing was preempted this step
        if not preempted:
            seats = c.max_num_seqs - len(run)
            order, hits = wait, {}
            if "bug2" in bugs and len(wait) >= 2:
                for s in wait:
                    hits[s] = kv.lookup(s)
                order = sorted(wait, key=lambda s: (hits[s][0] < 2, s.arrival_seq))
                if any(a is not b for a, b in zip(order, wait)):
                    touched.add("bug2")
            reserved = 0
            if "bug1" in bugs:
                for s in run:
                    reserved += max(0, cdiv(s.P + s.max_tokens, bs) - s.held())
            for s in order:
                if seats <= 0 or budget <= 0:
                    break
                h, f = hits.get(s) or kv.lookup(s)
                start = h * bs
                n = min(s.num_tokens - start, c.long_prefill_token_threshold, budget)
                consume = cdiv(start + n, bs) - h + f
                if consume > free:
                    break                      # head-of-line: FCFS never skips
                if "bug1" in bugs:
                    full = cdiv(s.P + s.max_tokens, bs) - (h - f)
                    if full > free - reserved:
                        touched.add("bug1")
                        break
                    reserved += full - consume
                tokens[s] = n
                budget -= n
                free -= consume
                seats -= 1
        return Plan(tokens, preempted, touched, self.cost(tokens, bugs, touched))

    def cost(self, tokens, bugs, touched):
        c = self.cfg
        pre = ctx = ksum = kmax = 0
        for s, n in tokens.items():
            if s.out == 0 or s.num_tokens - s.num_computed > 1:
                pre += n
            ctx += s.num_computed + n
            ksum += s.lp_k
            if s.lp_k > kmax:
                kmax = s.lp_k
        lp = ksum
        if "bug4" in bugs and kmax and kmax * len(tokens) != ksum:
            touched.add("bug4")
            lp = kmax * len(tokens)
        return (c.step_overhead_ms + c.prefill_us_per_token * pre / 1000
                + c.seq_us * len(tokens) / 1000 + c.ctx_us_per_token * ctx / 1000
                + c.logprob_us * lp / 1000) / 1000.0

    def attribute(self, p):
        """Counterfactual per step: re-plan this same step without one bug; requests
        that lose tokens, get preempted, (cost bugs) run a >=15% slower step with an
        identical schedule, or (ordering bug) wait while a later arrival is admitted
        only because of the bug, are tagged with that bug."""
        for b in sorted(p.touched):
            cf = self.plan(self.bugs - {b})
            hurt = set()
            for s, tc in cf.tokens.items():
                if p.tokens.get(s, 0) < tc:
                    hurt.add(s)
            cfp = set(cf.preempted)
            hurt.update(s for s in p.preempted if s not in cfp)
            if b in COST_BUGS and p.cost >= COST_TAG_RATIO * cf.cost:
                hurt.update(s for s, n in p.tokens.items() if cf.tokens.get(s) == n)
            if b == "bug2":   # admitted only because of the bug => inversion for earlier arrivals
                jumped = [s.arrival_seq for s in p.tokens if s.state == WAIT and s not in cf.tokens]
                if jumped:
                    hurt.update(w for w in self.waiting
                                if w not in p.tokens and w.arrival_seq < max(jumped))
            for s in hurt:
                if not s.job.zombie:
                    s.job.pathologies.add(b)

    def _admit(self, s, n, now):
        h, f = self.kv.lookup(s)
        start = h * self.cfg.block_size
        n = min(n, s.num_tokens - start)
        need = cdiv(start + n, self.cfg.block_size) - h
        if need + f > self.kv.num_free():
            return 0
        self.kv.acquire_hits(s, h)
        self.kv.take(need)
        s.anon, s.num_computed = need, start
        self.waiting.remove(s)
        s.state = RUN
        self.counter += 1
        s.admit_seq = self.counter
        self.running.append(s)
        self.m.c["prefix_cache_queries"] += s.num_tokens
        self.m.c["prefix_cache_hits"] += start
        if s.job.first_sched is None:
            s.job.first_sched = now
        return n

    def _preempt(self, s):
        self.kv.release(s)
        self.running.remove(s)
        s.num_computed, s.state = 0, WAIT
        bisect.insort(self.waiting, s, key=lambda x: x.arrival_seq)
        self.m.c["num_preemptions"] += 1

    async def run(self):
        cold = list(self.cfg.cold_start_ms)
        while not self.stopping:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
                continue
            p = self.plan(self.bugs)
            if p.touched:
                self.attribute(p)
            now = time.monotonic()
            for v in p.preempted:
                self._preempt(v)
            sched = []
            for s, n in p.tokens.items():
                if s.state == WAIT:
                    n = self._admit(s, n, now)
                    if not n:
                        continue
                else:
                    need = cdiv(s.num_computed + n, self.cfg.block_size) - s.held()
                    if need > 0:
                        if not self.kv.take(need):
                            continue
                        s.anon += need
                sched.append((s, n))
            dt = p.cost * math.exp(self.rng.gauss(0.0, self.cfg.jitter))
            if self.step_no < len(cold):
                dt += cold[self.step_no] / 1000.0
            self.step_no += 1
            if sched:
                self.m.h["iter"].observe(sum(n for _, n in sched))
            await asyncio.sleep(dt)
            self.commit(sched, time.monotonic())

    def commit(self, sched, now):
        m = self.m
        for s, n in sched:
            if s.state != RUN:
                continue
            s.num_computed += n
            self.kv.register(s)
            if s.num_computed < s.num_tokens:
                continue
            job = s.job
            if s.out == 0:
                m.c["prompt_tokens"] += s.P
            tid = s.next_token()
            s.out += 1
            m.c["generation_tokens"] += 1
            fin = None
            if s.out >= s.max_tokens:
                fin = "length"
            elif s.out >= s.eos_at:
                fin = "stop"
            if job.first_tok is None:
                job.first_tok = now
                m.h["ttft"].observe(now - job.arrival)
            if s.last_ts is not None:
                m.h["itl"].observe(now - s.last_ts)
                m.h["tpot"].observe(now - s.last_ts)
            s.last_ts = now
            if not job.client_gone:
                if job.stream:
                    job.queue.put_nowait((s.index, tid, fin))
                else:
                    s.tokens.append(tid)
            if fin:
                s.finish = fin
                self.kv.release(s)
                self.running.remove(s)
                s.state = DONE
                job.remaining -= 1
                if job.remaining == 0:
                    self._finish_job(job, fin)

    # ----- metrics text
    def render_metrics(self, model):
        lab = 'model_name="%s",engine="0"' % model
        m, out = self.m, []

        def g(name, typ, doc, val, extra=""):
            out.append("# HELP %s %s\n# TYPE %s %s\n%s{%s%s} %s\n"
                       % (name, doc, name, typ, name, lab, extra, val))
        g("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", len(self.running))
        g("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", len(self.waiting))
        g("vllm:num_requests_waiting_by_reason", "gauge", "Number of waiting requests by reason.", len(self.waiting), ',reason="capacity"')
        g("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", "%.6f" % self.kv.usage())
        c = self.cfg
        g("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig.", 1,
          ',block_size="%d",num_gpu_blocks="%d",enable_prefix_caching="%s"'
          % (c.block_size, c.num_kv_blocks, not c.no_prefix_caching))
        for key, doc in (("num_preemptions", "Cumulative number of preemption from the engine."),
                         ("prompt_tokens", "Number of prefill tokens processed."),
                         ("generation_tokens", "Number of generation tokens processed."),
                         ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
                         ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")):
            g("vllm:%s_total" % key, "counter", doc, m.c[key])
        name = "vllm:request_success_total"
        out.append("# HELP %s Count of successfully processed requests.\n# TYPE %s counter\n" % (name, name))
        for r, v in sorted(m.success.items()):
            out.append('%s{%s,finished_reason="%s"} %d\n' % (name, lab, r, v))
        for h in m.h.values():
            h.render(lab, out)
        return "".join(out)


# ---------------------------------------------------------------- HTTP layer
def _int(body, key, default, lo, hi):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError("'%s' must be an integer" % key, param=key)
    if not lo <= v <= hi:
        raise ApiError("'%s' must be between %d and %d, got %d" % (key, lo, hi, v), param=key)
    return v


def _fake_lp(tid):
    return -0.01 - ((tid * 2654435761) % 1000) / 400.0


class Api:
    def __init__(self, engine, cfg):
        self.e, self.cfg, self.tok = engine, cfg, Tokenizer()
        self.model = cfg.model

    def err(self, e, rid=None):
        h = {"X-Request-Id": rid} if rid else None
        return web.json_response({"error": {"message": e.msg, "type": e.typ, "param": e.param,
                                            "code": e.status}}, status=e.status, headers=h)

    def prompt_ids(self, p):
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            ids = self.tok.encode(p)
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if any(not 0 <= t < VOCAB_SIZE for t in p):
                raise ApiError("token id out of vocabulary range", param="prompt")
            ids = list(p)
        else:
            raise ApiError("'prompt' must be a string, a list of token ids, or a list with "
                           "exactly one of those", param="prompt")
        if not ids:
            raise ApiError("The prompt cannot be empty", param="prompt")
        return ids

    async def body(self, request):
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise ApiError("request body is not valid JSON")
        if not isinstance(body, dict):
            raise ApiError("request body must be a JSON object")
        return body

    def build(self, body, kind, rid):
        model = body.get("model")
        if model is not None and model != self.model:
            raise ApiError("The model `%s` does not exist." % model, 404, "NotFoundError", "model")
        L = self.cfg.max_model_len
        if kind == "chat":
            ids = self.tok.chat(body.get("messages"), body.get("add_generation_prompt", True))
            mt = body.get("max_completion_tokens")
            key = "max_completion_tokens" if mt is not None else "max_tokens"
            mt = _int(body, key, max(1, L - len(ids)), 1, 10 ** 9)
            lp = None
            if body.get("logprobs"):
                lp = _int(body, "top_logprobs", 0, 0, 20)
        else:
            if "prompt" not in body:
                raise ApiError("'prompt' is required", param="prompt")
            ids = self.prompt_ids(body["prompt"])
            mt = _int(body, "max_tokens", 16, 1, 10 ** 9)
            lp = _int(body, "logprobs", None, 0, 20)
        if len(ids) + mt > L:
            raise ApiError("This model's maximum context length is %d tokens. However, you requested "
                           "%d tokens (%d in the messages, %d in the completion). Please reduce the "
                           "length of the messages or completion." % (L, len(ids) + mt, len(ids), mt),
                           param="max_tokens" if len(ids) < L else "prompt")
        n = _int(body, "n", 1, 1, 16)
        so = body.get("stream_options") or {}
        return Job(rid, kind, ids, mt, n, bool(body.get("ignore_eos", False)),
                   _int(body, "min_tokens", 0, 0, 10 ** 9), lp, bool(body.get("stream", False)),
                   bool(isinstance(so, dict) and so.get("include_usage")), self.e.seed)

    async def completions(self, request):
        return await self._generate(request, "completion")

    async def chat(self, request):
        return await self._generate(request, "chat")

    async def _generate(self, request, kind):
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        t0 = time.monotonic()
        try:
            job = self.build(await self.body(request), kind, rid)
        except ApiError as e:
            self.e.gt_line(rid, "error", False, time.monotonic() - t0, 0, 0, ())
            return self.err(e, rid)
        if self.e.stopping:
            return self.err(ApiError("server is shutting down", 503, "ServiceUnavailableError"), rid)
        self.e.add(job)
        try:
            if job.stream:
                return await self._stream(request, job)
            await job.done_evt.wait()
            if job.server_abort:
                return self.err(ApiError("request aborted: server shutting down", 503,
                                         "ServiceUnavailableError"), rid)
            return web.json_response(self._full(job), headers={"X-Request-Id": rid})
        except asyncio.CancelledError:
            self.e.abort(job, client=True)
            raise

    def _lp_obj(self, job, tid, text):
        lp = _fake_lp(tid)
        alts = [(self.tok.word(GEN_BASE + (tid + 7 * j) % GEN_N), lp - 0.4 * j - 0.3)
                for j in range(1, job.lp + 1)]
        if job.kind == "chat":
            return {"token": text, "logprob": lp, "bytes": list(text.encode()),
                    "top_logprobs": [{"token": text, "logprob": lp, "bytes": list(text.encode())}]
                    + [{"token": w, "logprob": v, "bytes": list(w.encode())} for w, v in alts]}
        top = {text: lp}
        top.update({" " + w: v for w, v in alts if " " + w not in top})
        return {"tokens": [text], "token_logprobs": [lp], "top_logprobs": [top], "text_offset": [0]}

    def _text(self, job, pos, tid):
        w = self.tok.word(tid)
        return w if (job.kind == "chat" and pos == 0) else " " + w

    def _usage(self, job):
        out = sum(s.out for s in job.seqs)
        return {"prompt_tokens": len(job.prompt), "total_tokens": len(job.prompt) + out,
                "completion_tokens": out}

    def _full(self, job):
        choices = []
        for s in job.seqs:
            texts = [self._text(job, i, t) for i, t in enumerate(s.tokens)]
            lp = None
            if job.lp is not None:
                objs = [self._lp_obj(job, t, x) for t, x in zip(s.tokens, texts)]
                if job.kind == "chat":
                    lp = {"content": objs}
                else:
                    lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                    off = 0
                    for o in objs:
                        for k in ("tokens", "token_logprobs", "top_logprobs"):
                            lp[k] += o[k]
                        lp["text_offset"].append(off)
                        off += len(o["tokens"][0])
            if job.kind == "chat":
                choices.append({"index": s.index, "message": {"role": "assistant", "content": "".join(texts),
                                "tool_calls": []}, "logprobs": lp, "finish_reason": s.finish,
                                "stop_reason": None})
            else:
                choices.append({"index": s.index, "text": "".join(texts), "logprobs": lp,
                                "finish_reason": s.finish, "stop_reason": None, "prompt_logprobs": None})
        chat = job.kind == "chat"
        return {"id": ("chatcmpl-" if chat else "cmpl-") + job.rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": job.created, "model": self.model, "choices": choices,
                "usage": dict(self._usage(job), prompt_tokens_details=None)}

    async def _stream(self, request, job):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache", "X-Request-Id": job.rid})
        await resp.prepare(request)
        chat = job.kind == "chat"
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + job.rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": job.created, "model": self.model}
        pos = [0] * job.n
        finished = False
        while not finished:
            evs = [await job.queue.get()]
            while not job.queue.empty():
                evs.append(job.queue.get_nowait())
            buf = []
            for ev in evs:
                if ev is None:
                    finished = True
                    break
                idx, tid, fin = ev
                text = self._text(job, pos[idx], tid)
                lp = self._lp_obj(job, tid, text) if job.lp is not None else None
                if chat:
                    if pos[idx] == 0:
                        buf.append(dict(head, choices=[{"index": idx, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}]))
                    ch = {"index": idx, "delta": {"content": text},
                          "logprobs": {"content": [lp]} if lp else None, "finish_reason": fin}
                else:
                    ch = {"index": idx, "text": text, "logprobs": lp, "finish_reason": fin}
                if fin:
                    ch["stop_reason"] = None
                buf.append(dict(head, choices=[ch]))
                pos[idx] += 1
            if finished and not job.server_abort and job.include_usage:
                buf.append(dict(head, choices=[], usage=self._usage(job)))
            data = "".join("data: %s\n\n" % json.dumps(b, separators=(",", ":")) for b in buf)
            if finished:
                data += "data: [DONE]\n\n"
            if data:
                try:
                    await resp.write(data.encode())
                except ConnectionError:
                    self.e.abort(job, client=True)
                    return resp
        await resp.write_eof()
        return resp

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": self.model, "parent": None, "max_model_len": self.cfg.max_model_len,
            "permission": []}]})

    async def health(self, request):
        return web.Response(status=200)

    async def version(self, request):
        return web.json_response({"version": VERSION})

    async def tokenize(self, request):
        try:
            body = await self.body(request)
            if "messages" in body:
                ids = self.tok.chat(body["messages"], body.get("add_generation_prompt", True))
            elif isinstance(body.get("prompt"), str):
                ids = self.tok.encode(body["prompt"])
            else:
                raise ApiError("either 'prompt' (string) or 'messages' is required")
        except ApiError as e:
            return self.err(e)
        res = {"count": len(ids), "max_model_len": self.cfg.max_model_len, "tokens": ids}
        if body.get("return_token_strs"):
            res["token_strs"] = [self.tok.word(i) for i in ids]
        return web.json_response(res)

    async def detokenize(self, request):
        try:
            toks = (await self.body(request)).get("tokens")
            if not isinstance(toks, list) or not all(isinstance(t, int) and 0 <= t < VOCAB_SIZE for t in toks):
                raise ApiError("'tokens' must be a list of token ids", param="tokens")
        except ApiError as e:
            return self.err(e)
        return web.json_response({"prompt": self.tok.decode(toks)})

    async def metrics(self, request):
        return web.Response(text=self.e.render_metrics(self.model),
                            content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})


# ---------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Simulated vLLM-style OpenAI-compatible server")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bugs", default="none")
    ap.add_argument("--ground-truth", default=None, metavar="PATH")
    ap.add_argument("--model", default="simlab/tiny-chat-1.2b")
    ap.add_argument("--max-model-len", type=int, default=6144)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--num-kv-blocks", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1280)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--long-prefill-token-threshold", type=int, default=512)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--step-overhead-ms", type=float, default=4.0)
    ap.add_argument("--prefill-us-per-token", type=float, default=8.0)
    ap.add_argument("--seq-us", type=float, default=60.0)
    ap.add_argument("--ctx-us-per-token", type=float, default=0.1)
    ap.add_argument("--logprob-us", type=float, default=35.0)
    ap.add_argument("--jitter", type=float, default=0.03)
    ap.add_argument("--cold-start-ms", default="300,120,50,20")
    a = ap.parse_args(argv)
    a.cold_start_ms = [float(x) for x in a.cold_start_ms.split(",") if x.strip()]
    if a.bugs in ("none", ""):
        a.bug_set = set()
    elif a.bugs == "all":
        a.bug_set = set(ALL_BUGS)
    else:
        a.bug_set = {b.strip() for b in a.bugs.split(",") if b.strip()}
        bad = a.bug_set - set(ALL_BUGS)
        if bad:
            ap.error("unknown bug(s): %s (choose from %s, none, all)" % (",".join(sorted(bad)), ",".join(ALL_BUGS)))
    if a.num_kv_blocks * a.block_size < a.max_model_len:
        ap.error("KV cache (%d tokens) is smaller than --max-model-len" % (a.num_kv_blocks * a.block_size))
    return a


async def amain(a):
    engine = Engine(a, a.bug_set, a.seed, a.ground_truth)
    api = Api(engine, a)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.add_routes([
        web.post("/v1/completions", api.completions),
        web.post("/v1/chat/completions", api.chat),
        web.get("/v1/models", api.models),
        web.get("/health", api.health),
        web.get("/version", api.version),
        web.post("/tokenize", api.tokenize),
        web.post("/detokenize", api.detokenize),
        web.get("/metrics", api.metrics),
    ])
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.3, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, a.host, a.port, shutdown_timeout=0.3)
    await site.start()
    loop = asyncio.get_running_loop()
    task = loop.create_task(engine.run())
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("serving %s on http://%s:%d (bugs: %s)" % (a.model, a.host, a.port,
          ",".join(sorted(a.bug_set)) or "none"), flush=True)
    await stop.wait()
    engine.shutdown()
    task.cancel()
    try:
        await asyncio.wait_for(runner.cleanup(), 0.8)
    except (asyncio.TimeoutError, Exception):
        pass
    if engine.gt:
        engine.gt.close()


def main():
    a = parse_args()
    try:
        asyncio.run(amain(a))
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
