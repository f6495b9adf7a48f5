#!/usr/bin/env python3
"""Held-out vLLM-like inference server simulator (no model, no GPU).

One asyncio process: an OpenAI-compatible HTTP frontend (aiohttp) plus a
V1-style engine loop (chunked prefill, FCFS, prefix caching, recompute
preemption) whose steps sleep for a modelled GPU time.  Optional planted
scheduling bugs (--bugs) and a ground-truth log (--ground-truth).
"""
import argparse
import asyncio
import json
import random
import re
import signal
import sys
import time
import uuid
from collections import OrderedDict, deque

from aiohttp import web
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter,
                               Gauge, Histogram, disable_created_metrics, generate_latest)

disable_created_metrics()

MODEL = "heldout-7b"
BLOCK = 16
ALL_BUGS = [f"bug{i}" for i in range(1, 9)]

# ---- cost model (seconds); roughly a 7B model on one A100-class GPU ----
C0 = 0.0055        # fixed per-step overhead (launch, schedule, sample, detok)
C_PF = 30e-6       # per prefill token (linear layers)
C_ATT = 4e-10      # per prefill token x context token (attention)
C_DEC = 60e-6      # per decoding sequence
C_CTX = 12e-9      # per context token of decoding sequences (KV reads)
C_SAMP = 10e-6     # per sampled row
C_SEED = 380e-6    # per sampled row that needs its own seeded generator
C_LP = 25e-6       # per logprobs row (times 1 + k/5)
NOISE = 0.03       # lognormal sigma of step time
P_EOS = 1.0 / 200  # per-token stop probability without ignore_eos
IDLE_RELEASE_S = 4.0
REWARM_S = 0.75

# ---------------------------------------------------------------- tokenizer
_WORDS = """the of and to in is that for it as was with be by on not he this are or
his from at which but have an they you were her she there one all we their its been has
would more if will so who what when can no said up out about into them some could him time
only do other than then may these two now any like most over such very also just first my
new where after how our well me back even made many before your much must through way down
should because each those people same while state great here year work world good used
being life day last take make long little own know see still get under think place again
might home part small number between high three off come old every found never system set
information end around large world water both need since next without case form point fact
group problem hand order area program power value model request server token batch queue cache
block memory latency prompt answer question data result test simple short random text word
line value start stop early late fast slow green blue red light dark river stone cloud tree
city house road music paper story night morning window garden market""".split()
_PIECE_RE = re.compile(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]|\s")


class Tokenizer:
    """Words (with/without leading space, lower/capitalised) + letter pairs + bytes."""

    def __init__(self):
        self.pieces = [b"", b"", b""]  # 0 <unk>, 1 <s>, 2 </s>
        self.pieces += [bytes([b]) for b in range(256)]  # ids 3..258
        self.index = {}
        letters = "abcdefghijklmnopqrstuvwxyz"
        for a in letters:
            for b in letters:
                self._add(a + b)
        seen = []
        for w in _WORDS:
            if w in seen:
                continue
            seen.append(w)
            for v in (w, " " + w, w.capitalize(), " " + w.capitalize()):
                self._add(v)
        self.vocab_size = len(self.pieces)
        self.gen_ids = [self.index[" " + w] for w in seen]
        self.punct_ids = [3 + ord("."), 3 + ord(",")]

    def _add(self, s):
        if s not in self.index:
            self.index[s] = len(self.pieces)
            self.pieces.append(s.encode())

    def encode(self, text):
        ids, idx = [], self.index
        for m in _PIECE_RE.finditer(text):
            p = m.group()
            i = idx.get(p)
            if i is not None:
                ids.append(i)
                continue
            body = p
            if len(p) > 1 and p[0] == " ":
                ids.append(3 + 32)
                body = p[1:]
            if body.isascii() and body.isalpha():
                j = 0
                while j < len(body):
                    two = body[j:j + 2]
                    k = idx.get(two) if len(two) == 2 else None
                    if k is not None:
                        ids.append(k)
                        j += 2
                    else:
                        ids.append(3 + ord(body[j]))
                        j += 1
            else:
                ids.extend(3 + b for b in body.encode())
        return ids

    def decode(self, ids):
        n = len(self.pieces)
        return b"".join(self.pieces[i] if 0 <= i < n else b"" for i in ids).decode("utf-8", "replace")

    def piece(self, i):
        return self.pieces[i].decode("utf-8", "replace") if 0 <= i < len(self.pieces) else ""


TOK = Tokenizer()


def chat_prompt(messages, add_generation_prompt=True):
    parts = []
    for m in messages:
        c = m.get("content") or ""
        if isinstance(c, list):
            c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
        parts.append(f"<|{m.get('role', 'user')}|>\n{c}\n")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


# ---------------------------------------------------------------- KV cache
class KVCache:
    def __init__(self, num_blocks):
        self.n = num_blocks
        self.ref = [0] * num_blocks
        self.bhash = [None] * num_blocks
        self.free = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached = {}  # block hash -> block id

    def num_free(self):
        return len(self.free)

    def lookup(self, req):
        """Leading cached full blocks of req (hit capped below num_tokens)."""
        maxb = (len(req.tokens) - 1) // BLOCK
        req.ensure_hashes(maxb)
        hits, cached = [], self.cached
        for h in req.hashes[:maxb]:
            b = cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def need(self, req, n_new, hits=()):
        """(correct, naive) number of free blocks needed to schedule n_new tokens."""
        ncached = len(hits) * BLOCK
        total = -(-(req.num_computed + ncached + n_new) // BLOCK)
        fresh = total - len(req.blocks) - len(hits)
        revive = sum(1 for b in hits if self.ref[b] == 0)
        # naive: every block of the scheduled range counted as a fresh allocation
        return fresh + revive, total - len(req.blocks)

    def allocate(self, req, n_new, hits=()):
        need, _ = self.need(req, n_new, hits)
        if need > len(self.free):
            return False
        for b in hits:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
            req.blocks.append(b)
        total = -(-(req.num_computed + len(hits) * BLOCK + n_new) // BLOCK)
        fresh = total - len(req.blocks)
        for _ in range(fresh):
            b, _v = self.free.popitem(last=False)
            h = self.bhash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.bhash[b] = None
            self.ref[b] = 1
            req.blocks.append(b)
        return True

    def release(self, req):
        for b in reversed(req.blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
        req.blocks = []

    def register(self, req):
        full = min(req.num_computed // BLOCK, len(req.blocks))
        if full <= req.reg:
            return
        req.ensure_hashes(full)
        for i in range(req.reg, full):
            b, h = req.blocks[i], req.hashes[i]
            if self.bhash[b] is None and h not in self.cached:
                self.cached[h] = b
                self.bhash[b] = h
        req.reg = full

    def exclusive_blocks(self, reqs):
        return sum(1 for r in reqs for b in r.blocks if self.ref[b] == 1)


# ---------------------------------------------------------------- requests
class Seq:
    """One engine sequence (one choice of an HTTP request)."""

    def __init__(self, group, idx, prompt, p):
        self.group, self.idx = group, idx
        self.tokens = list(prompt)
        self.plen = len(prompt)
        self.max_tokens = p["max_tokens"]
        self.min_tokens = p["min_tokens"]
        self.ignore_eos = p["ignore_eos"]
        self.seeded = p["seed"] is not None
        self.lp = p["lp_rows"]
        if self.seeded:
            rs = p["seed"] + idx
        elif p["greedy"]:
            rs = hash(tuple(prompt)) + idx
        else:
            rs = group.engine.rng.random()
        self.rng = random.Random(rs)
        self.num_computed = 0
        self.blocks, self.reg, self.hashes = [], 0, []
        self.status = "waiting"
        self.qseq = 0
        self.back = False  # requeued at the back after preemption
        self.stalled_by = None  # bug that kept it waiting although it was admissible
        self.late_by = None     # bug that delayed its latest admission
        self.leak = None   # name of the bug that let it outlive its client
        self.first_t = self.last_t = self.finish_t = None
        self.finish_reason = None
        self.delay, self.pre, self.gcur, self.gmax = {}, {}, {}, {}

    @property
    def num_out(self):
        return len(self.tokens) - self.plen

    def ensure_hashes(self, nblocks):
        hs, t = self.hashes, self.tokens
        while len(hs) < nblocks:
            i = len(hs)
            hs.append(hash((hs[-1] if hs else None, tuple(t[i * BLOCK:(i + 1) * BLOCK]))))

    def charge(self, bug, secs):
        if secs <= 0:
            return
        self.delay[bug] = self.delay.get(bug, 0.0) + secs
        if self.first_t is None:
            self.pre[bug] = self.pre.get(bug, 0.0) + secs
        self.gcur[bug] = self.gcur.get(bug, 0.0) + secs

    def on_token(self):
        if self.first_t is not None:
            for b, v in self.gcur.items():
                if v > self.gmax.get(b, 0.0):
                    self.gmax[b] = v
        self.gcur = {}


class Group:
    """One HTTP request: n sequences sharing a prompt."""

    def __init__(self, engine, rid, prompt, p, kind):
        self.engine, self.rid, self.kind = engine, rid, kind
        self.arrival = time.monotonic()
        self.event = asyncio.Event()
        self.armed = False        # frontend has seen an output for this request
        self.disconnected = False
        self.first_t = None
        self.done = False
        self.seqs = [Seq(self, i, prompt, p) for i in range(p["n"])]


# ---------------------------------------------------------------- metrics
class Metrics:
    def __init__(self, args):
        r = self.registry = CollectorRegistry()
        L = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Running requests.", L, registry=r).labels(MODEL)
        self.waiting = Gauge("vllm:num_requests_waiting", "Waiting requests.", L, registry=r).labels(MODEL)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = 100%).", L, registry=r).labels(MODEL)
        self.preempt = Counter("vllm:num_preemptions", "Cumulative preemptions.", L, registry=r).labels(MODEL)
        self.pq = Counter("vllm:prefix_cache_queries", "Prefix cache queries (tokens).", L, registry=r).labels(MODEL)
        self.ph = Counter("vllm:prefix_cache_hits", "Prefix cache hits (tokens).", L, registry=r).labels(MODEL)
        self.prompt = Counter("vllm:prompt_tokens", "Prefill tokens processed.", L, registry=r).labels(MODEL)
        self.gen = Counter("vllm:generation_tokens", "Generation tokens.", L, registry=r).labels(MODEL)
        self.success = Counter("vllm:request_success", "Finished requests.", L + ["finished_reason"], registry=r)
        info = Gauge("vllm:cache_config_info", "Cache config.",
                     ["block_size", "num_gpu_blocks", "enable_prefix_caching"] + L, registry=r)
        info.labels(str(BLOCK), str(args.num_gpu_blocks), "True", MODEL).set(1.0)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT.", L, registry=r, buckets=[
            0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]).labels(MODEL)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "E2E latency.", L, registry=r, buckets=[
            0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
            240.0, 480.0, 960.0, 1920.0, 7680.0]).labels(MODEL)
        self.iter_tokens = Histogram("vllm:iteration_tokens_total", "Tokens per engine step.", L, registry=r,
                                     buckets=[1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
                                     ).labels(MODEL)


# ---------------------------------------------------------------- engine
class Engine:
    def __init__(self, args, bugs, gt_file, metrics):
        self.bugs = bugs
        self.max_batched = args.max_num_batched_tokens
        self.max_seqs = args.max_num_seqs
        self.max_model_len = args.max_model_len
        self.kv = KVCache(args.num_gpu_blocks)
        self.m = metrics
        self.gt = gt_file
        self.rng = random.Random(args.seed)
        self.waiting = deque()
        self.running = []
        self.pending_aborts = []
        self.wake = asyncio.Event()
        self.qcounter = 0
        self.front_counter = 0
        self.last_step_end = time.monotonic()
        self.step_extra = []  # (bug, secs, excluded leak) extra-time charges of the current step

    # -- public API
    def add(self, group):
        for s in group.seqs:
            self.qcounter += 1
            s.qseq = self.qcounter
            self.waiting.append(s)
        self.wake.set()

    def abort(self, seqs):
        for s in seqs:
            if s.status in ("waiting", "running"):
                self.pending_aborts.append(s)
        self.wake.set()

    # -- helpers
    def _process_aborts(self, now):
        while self.pending_aborts:
            s = self.pending_aborts.pop()
            if s.status in ("waiting", "running"):
                self._finish(s, "abort", now)

    def _preempt(self, s, plan):
        self.running.remove(s)
        if s in plan:  # only possible with a reordered running phase
            del plan[s]
        self.kv.release(s)
        s.num_computed, s.reg, s.status = 0, 0, "waiting"
        # admitted late because of a bug, it became the newest running request and hence
        # the preemption victim; the wait that follows is charged to that bug
        s.stalled_by = s.late_by
        self.front_counter += 1
        s.qseq = -self.front_counter
        self.m.preempt.inc()
        if "bug7" in self.bugs:
            self.waiting.append(s)
            s.back = True
        else:
            self.waiting.appendleft(s)

    def _dry_admit(self, order, budget, free, seats, skip=None):
        """Side-effect-free admission pass with the correct checks (for ground truth)."""
        out = []
        for r in order:
            if budget <= 0 or seats <= 0:
                break
            if skip is not None and skip(r):
                continue
            hits = self.kv.lookup(r)
            n = min(len(r.tokens) - len(hits) * BLOCK, budget)
            need, _ = self.kv.need(r, n, hits)
            if need > free:
                break
            free -= need
            budget -= n
            seats -= 1
            out.append(r)
        return out

    def _cost(self, items):
        pf = att = ndec = ctx = rows = seeded = lp = 0
        for r, n in items:
            pending = len(r.tokens) - r.num_computed
            if n == 1 and pending == 1 and r.num_computed >= r.plen:
                ndec += 1
                ctx += r.num_computed
            else:
                pf += n
                att += n * (r.num_computed + n / 2)
            if n == pending:
                rows += 1
                seeded += r.seeded
                if r.lp:
                    lp += 1 + r.lp / 5
        t = C0 + C_PF * pf + C_ATT * att + C_DEC * ndec + C_CTX * ctx + C_SAMP * rows + C_SEED * seeded + C_LP * lp
        return t, rows, seeded, pf + ndec

    # -- scheduling
    def schedule(self, now):
        bugs, kv = self.bugs, self.kv
        budget = self.max_batched
        plan = {}
        step_charges = []  # (seq, bug): charged the whole step duration
        # 1) RUNNING requests first.
        order = self.running
        if "bug5" in bugs:
            order = sorted(self.running, key=lambda r: len(r.tokens) - r.num_computed <= 1)
        for r in list(order):
            if budget <= 0:
                break
            if r.status != "running":
                continue
            n = min(len(r.tokens) - r.num_computed, budget)
            ok = True
            while not kv.allocate(r, n):
                victim = self.running[-1]
                if victim in plan:
                    budget += plan[victim]
                self._preempt(victim, plan)
                if victim is r:
                    ok = False
                    break
            if not ok:
                break
            plan[r] = n
            budget -= n
        if order is not self.running:
            b = self.max_batched
            for r in self.running:
                pend = len(r.tokens) - r.num_computed
                got = min(pend, b)
                b -= got
                if pend == 1 and got == 1 and r not in plan:
                    step_charges.append((r, "bug5"))
        # resources that leaked (client-less) running sequences hold right now
        leak_res = {}
        for r in self.running:
            if r.leak:
                bud, blk, seats = leak_res.get(r.leak, (0, 0, 0))
                leak_res[r.leak] = (bud + plan.get(r, 0), blk + kv.exclusive_blocks([r]), seats + 1)
        # 2) WAITING requests, FCFS, while budget / seats / KV allow.
        snap = (budget, kv.num_free(), self.max_seqs - len(self.running))
        wl = list(self.waiting)
        it = wl
        reordered = False
        if "bug1" in bugs and 2 <= len(wl) <= 128:
            it = sorted(wl, key=lambda r: (-len(kv.lookup(r)), int(r.group.arrival / 0.05)))
            reordered = any(a is not b for a, b in zip(it, wl))
        admitted = set()
        for i, r in enumerate(it):
            if budget <= 0 or len(self.running) >= self.max_seqs:
                break
            hits = kv.lookup(r)
            n = min(len(r.tokens) - len(hits) * BLOCK, budget)
            need, naive = kv.need(r, n, hits)
            free = kv.num_free()
            if need > free:
                break
            if "bug6" in bugs and naive > free:
                for v in self._dry_admit(it[i:], budget, free, self.max_seqs - len(self.running)):
                    v.stalled_by = v.stalled_by or "bug6"
                break
            kv.allocate(r, n, hits)
            self.waiting.remove(r)
            self.running.append(r)
            r.status, r.back = "running", False
            r.late_by, r.stalled_by = r.stalled_by, None
            r.num_computed, r.reg = len(hits) * BLOCK, len(hits)
            self.m.pq.inc(len(r.tokens))
            self.m.ph.inc(len(hits) * BLOCK)
            plan[r] = n
            budget -= n
            admitted.add(r)
        # ground truth: who would correct ordering have admitted this step?
        if wl and (reordered or any(r.back for r in wl)):
            for v in self._dry_admit(sorted(wl, key=lambda r: r.qseq), *snap):
                bug = "bug7" if v.back else "bug1"
                if v not in admitted and bug in bugs:
                    v.stalled_by = v.stalled_by or bug
        # ground truth for leaks: who would have been admitted without the leaked sequences?
        for r in wl:
            if r.leak:
                leak_res.setdefault(r.leak, (0, 0, 0))
        for bug, (bud, blk, seats) in leak_res.items():
            for v in self._dry_admit(wl, snap[0] + bud, snap[1] + blk, snap[2] + seats,
                                     skip=lambda r: r.leak is not None):
                if v not in admitted:
                    v.stalled_by = v.stalled_by or bug
        leaks = {}
        for r in self.running:
            if r.leak:
                leaks.setdefault(r.leak, []).append(r)
        return plan, step_charges, leaks

    def step_time(self, now, plan, step_charges, leaks):
        items = list(plan.items())
        base, rows, seeded, ntok = self._cost(items)
        noise = self.rng.lognormvariate(0.0, NOISE)
        dur = base * noise
        everyone = self.running + list(self.waiting)
        sec_charges = []
        if "bug4" in self.bugs and seeded and rows > seeded:
            extra = (C_SEED - C_SAMP) * (rows - seeded) * noise
            dur += extra
            sec_charges.append(("bug4", extra, None))
        if "bug2" in self.bugs and now - self.last_step_end >= IDLE_RELEASE_S:
            extra = REWARM_S * self.rng.lognormvariate(0.0, 0.1)
            dur += extra
            sec_charges.append(("bug2", extra, None))
        for bug, lr in leaks.items():
            if lr:
                ls = set(lr)
                without, *_ = self._cost([(r, n) for r, n in items if r not in ls])
                sec_charges.append((bug, (base - without) * noise, bug))
        for bug, secs, exclude in sec_charges:
            for s in everyone:
                if exclude is None or s.leak != exclude:
                    s.charge(bug, secs)
        self.step_extra = sec_charges
        for s, bug in step_charges:
            s.charge(bug, dur)
        # a waiting request that correct scheduling would already have admitted keeps
        # accruing delay (attributed to the bug that first held it back) until admitted
        for s in self.waiting:
            if s.stalled_by:
                s.charge(s.stalled_by, dur)
        self.m.iter_tokens.observe(ntok)
        return dur

    def _charge_arrivals(self, start, end):
        """Extra time of a step also delays sequences that arrived while it ran: they could
        not be scheduled before it ended. Charge each the part of the extra it waited."""
        extra = self.step_extra
        total = sum(secs for _b, secs, _x in extra)
        if total <= 0:
            return
        for s in self.waiting:
            a = s.group.arrival
            if a <= start or s.status != "waiting":
                continue
            waited = min(total, max(0.0, end - a))
            for bug, secs, exclude in extra:
                if exclude is None or s.leak != exclude:
                    s.charge(bug, waited * secs / total)

    def update(self, plan, now):
        touched = set()
        gen = 0
        for r, n in plan.items():
            if r.status != "running":
                continue
            r.num_computed += n
            self.kv.register(r)
            if r.num_computed < len(r.tokens):
                continue
            # sample one token
            if (not r.ignore_eos and r.num_out >= max(1, r.min_tokens) and r.rng.random() < P_EOS):
                self._finish(r, "stop", now)
                continue
            tok = (r.rng.choice(TOK.punct_ids) if r.rng.random() < 0.08 else r.rng.choice(TOK.gen_ids))
            r.tokens.append(tok)
            gen += 1
            r.on_token()
            r.last_t = now
            if r.first_t is None:
                r.first_t = now
                self.m.prompt.inc(r.plen)
                g = r.group
                if g.first_t is None:
                    g.first_t = now
                    self.m.ttft.observe(now - g.arrival)
            if r.num_out >= r.max_tokens or len(r.tokens) >= self.max_model_len:
                self._finish(r, "length", now)
            else:
                touched.add(r.group)
        if gen:
            self.m.gen.inc(gen)
        for g in touched:
            g.event.set()

    def _finish(self, s, reason, now):
        if s.status == "running":
            self.running.remove(s)
            self.kv.release(s)
        elif s.status == "waiting":
            self.waiting.remove(s)
        s.status = "finished"
        s.finish_reason, s.finish_t = reason, now
        if reason == "stop":
            s.on_token()  # the final (EOS) chunk ends the last inter-token gap
        g = s.group
        g.event.set()
        if not g.done and all(x.status == "finished" for x in g.seqs):
            g.done = True
            self._group_done(g, now)

    def _group_done(self, g, now):
        e2e = max(s.finish_t for s in g.seqs) - g.arrival
        reasons = [s.finish_reason for s in g.seqs]
        reason = "abort" if "abort" in reasons else reasons[0]
        self.m.success.labels(MODEL, reason).inc()
        self.m.e2e.observe(e2e)
        if self.gt is None:
            return
        tags, est = set(), {}
        for s in g.seqs:
            for b, v in self._tags(s).items():
                tags.add(b)
                est[b] = max(est.get(b, 0.0), v)
        rec = {"request_id": g.rid, "pathologies": sorted(tags),
               "ttft_s": None if g.first_t is None else round(g.first_t - g.arrival, 6),
               "e2e_s": round(e2e, 6), "finish_reason": reason,
               "client_disconnected": g.disconnected, "est_delay_s": {k: round(v, 4) for k, v in est.items()}}
        self.gt.write(json.dumps(rec) + "\n")
        self.gt.flush()

    @staticmethod
    def _tags(s):
        """Bugs whose estimated added delay materially inflated this sequence's latency."""
        if not s.delay:
            return {}
        arr = s.group.arrival
        e2e = s.finish_t - arr
        ttft = (s.first_t if s.first_t is not None else s.finish_t) - arr
        cf_e2e = max(1e-3, e2e - sum(s.delay.values()))
        cf_ttft = max(1e-3, ttft - sum(s.pre.values()))
        nout = len(s.tokens) - s.plen
        cf_itl = (cf_e2e - cf_ttft) / (nout - 1) if nout >= 2 and s.first_t is not None else None
        out = {}
        for b, d in s.delay.items():
            pre, gap = s.pre.get(b, 0.0), s.gmax.get(b, 0.0)
            if ((pre >= 0.025 and pre >= 0.5 * cf_ttft) or (d >= 0.025 and d >= 0.5 * cf_e2e)
                    or (cf_itl is not None and gap >= 0.05 and gap >= max(cf_itl, 1e-3))):
                out[b] = max(pre, d if d >= 0.5 * cf_e2e else 0.0, gap)
        return out

    async def run(self):
        while True:
            now = time.monotonic()
            self._process_aborts(now)
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
                continue
            plan, charges, leaks = self.schedule(now)
            if not plan:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), 0.01)
                except asyncio.TimeoutError:
                    pass
                continue
            dur = self.step_time(now, plan, charges, leaks)
            delay = now + dur - time.monotonic()
            await asyncio.sleep(max(0.0, delay))
            end = time.monotonic()
            self._charge_arrivals(now, end)
            self._process_aborts(end)
            self.update(plan, end)
            self.last_step_end = end


# ---------------------------------------------------------------- frontend
def err(status, msg, typ="BadRequestError", param=None):
    return web.json_response({"object": "error", "message": msg, "type": typ, "param": param, "code": status},
                             status=status)


class ReqError(Exception):
    def __init__(self, status, msg, typ="BadRequestError"):
        super().__init__(msg)
        self.status, self.msg, self.typ = status, msg, typ


def _int(body, key, default, lo=None, hi=None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ReqError(400, f"'{key}' must be an integer")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ReqError(400, f"'{key}' out of range")
    return v


class Frontend:
    def __init__(self, args, engine):
        self.args, self.engine = args, engine
        self.created = int(time.time())

    def _check_model(self, body):
        m = body.get("model")
        if m is not None and m != MODEL:
            raise ReqError(404, f"The model `{m}` does not exist.", "NotFoundError")

    def _prompt_ids(self, body, chat):
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
                raise ReqError(400, "'messages' must be a non-empty list of messages")
            return TOK.encode(chat_prompt(msgs, body.get("add_generation_prompt", True)))
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            return TOK.encode(p)
        if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if any(t < 0 or t >= TOK.vocab_size for t in p):
                raise ReqError(400, "token id out of vocabulary range")
            return list(p)
        raise ReqError(400, "'prompt' must be a string or a list of token ids (batched prompts unsupported)")

    def _params(self, body, chat, plen):
        a = self.args
        mt = body.get("max_completion_tokens") if chat else None
        if mt is None:
            mt = body.get("max_tokens")
        if mt is None:
            mt = a.max_model_len - plen if chat else 16
        elif isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise ReqError(400, "'max_tokens' must be a positive integer")
        if plen < 1:
            raise ReqError(400, "The prompt cannot be empty.")
        if plen + mt > a.max_model_len:
            raise ReqError(400, f"This model's maximum context length is {a.max_model_len} tokens. However, you "
                                f"requested {plen + mt} tokens ({plen} in the messages, {mt} in the completion). "
                                f"Please reduce the length of the messages or completion.")
        if -(-(plen + mt) // BLOCK) > a.num_gpu_blocks:
            raise ReqError(400, "Request needs more KV-cache blocks than the server has.")
        n = _int(body, "n", 1, 1, 64)
        if chat:
            lp_rows = _int(body, "top_logprobs", 0, 0, 20) if body.get("logprobs") else 0
            lp_kind = "chat" if body.get("logprobs") else None
        else:
            lpv = _int(body, "logprobs", None, 0, 20)
            lp_rows, lp_kind = (lpv or 0), ("cmpl" if lpv is not None else None)
        temp = body.get("temperature", 1.0)
        if temp is not None and (not isinstance(temp, (int, float)) or temp < 0):
            raise ReqError(400, "'temperature' must be non-negative")
        seed = _int(body, "seed", None)
        so = body.get("stream_options") or {}
        return {"max_tokens": mt, "min_tokens": _int(body, "min_tokens", 0, 0), "n": n,
                "ignore_eos": bool(body.get("ignore_eos", False)), "seed": seed, "greedy": temp == 0,
                "lp_rows": lp_rows + (1 if lp_kind else 0), "lp_k": lp_rows, "lp_kind": lp_kind,
                "stream": bool(body.get("stream", False)),
                "include_usage": bool(isinstance(so, dict) and so.get("include_usage"))}

    # ---- logprobs formatting (fake values)
    @staticmethod
    def _lp(rng, tok, k, kind, offset):
        text = TOK.piece(tok)
        lp = -round(rng.random() * 2.0, 4)
        alts = [TOK.piece(rng.choice(TOK.gen_ids)) for _ in range(k)]
        if kind == "chat":
            return {"token": text, "logprob": lp, "bytes": list(text.encode()),
                    "top_logprobs": [{"token": t, "logprob": round(lp - 0.5 * (j + 1), 4),
                                      "bytes": list(t.encode())} for j, t in enumerate(alts)]}
        top = {text: lp}
        for j, t in enumerate(alts):
            top.setdefault(t, round(lp - 0.5 * (j + 1), 4))
        return {"tokens": [text], "token_logprobs": [lp], "top_logprobs": [top], "text_offset": [offset]}

    def _lp_block(self, g, s, toks, p, offset):
        if not p["lp_kind"]:
            return None
        rng = random.Random(hash((g.rid, s.idx, offset)))
        items, off = [], offset
        for t in toks:
            items.append(self._lp(rng, t, p["lp_k"], p["lp_kind"], off))
            off += len(TOK.piece(t))
        if p["lp_kind"] == "chat":
            return {"content": items}
        return {"tokens": [x for it in items for x in it["tokens"]],
                "token_logprobs": [x for it in items for x in it["token_logprobs"]],
                "top_logprobs": [x for it in items for x in it["top_logprobs"]],
                "text_offset": [x for it in items for x in it["text_offset"]]}

    # ---- handlers
    async def completions(self, request):
        return await self._generate(request, chat=False)

    async def chat(self, request):
        return await self._generate(request, chat=True)

    async def _generate(self, request, chat):
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        hdrs = {"X-Request-Id": rid}
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ReqError(400, "request body must be a JSON object")
            self._check_model(body)
            prompt = self._prompt_ids(body, chat)
            p = self._params(body, chat, len(prompt))
        except ReqError as e:
            resp = err(e.status, e.msg, e.typ)
            resp.headers.update(hdrs)
            return resp
        except (ValueError, json.JSONDecodeError):
            resp = err(400, "invalid JSON body")
            resp.headers.update(hdrs)
            return resp
        g = Group(self.engine, rid, prompt, p, "chat" if chat else "cmpl")
        self.engine.add(g)
        oid = ("chatcmpl-" if chat else "cmpl-") + rid
        base = {"id": oid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": MODEL}
        try:
            if p["stream"]:
                return await self._stream(request, g, p, chat, base, hdrs)
            return await self._full(g, p, chat, base, hdrs)
        except (asyncio.CancelledError, ConnectionError):
            self._client_gone(g)
            raise

    def _client_gone(self, g):
        if g.done:
            return
        live = [s for s in g.seqs if s.status in ("waiting", "running")]
        g.disconnected = True
        if "bug3" in self.engine.bugs and not g.armed:
            for s in live:
                s.leak = "bug3"
            return
        if "bug8" in self.engine.bugs and len(g.seqs) > 1:
            self.engine.abort([s for s in live if s.idx == 0])
            for s in live:
                if s.idx != 0:
                    s.leak = "bug8"
            return
        self.engine.abort(live)

    async def _wait_output(self, g):
        await g.event.wait()
        g.event.clear()
        g.armed = True

    async def _stream(self, request, g, p, chat, base, hdrs):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **hdrs})
        await resp.prepare(request)
        sent = [0] * len(g.seqs)
        offs = [0] * len(g.seqs)
        finished_sent = [False] * len(g.seqs)
        first = True
        while not all(finished_sent):
            await self._wait_output(g)
            out = []
            if first and chat:
                for s in g.seqs:
                    out.append({**base, "choices": [{"index": s.idx, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]})
            first = False
            for s in g.seqs:
                if finished_sent[s.idx]:
                    continue
                toks = s.tokens[s.plen + sent[s.idx]:]
                fin = s.status == "finished"
                if not toks and not fin:
                    continue
                sent[s.idx] += len(toks)
                text = "".join(TOK.piece(t) for t in toks)
                lp = self._lp_block(g, s, toks, p, offs[s.idx]) if toks else None
                offs[s.idx] += len(text)
                fr = s.finish_reason if fin else None
                if chat:
                    ch = {"index": s.idx, "delta": {"content": text}, "logprobs": lp, "finish_reason": fr}
                else:
                    ch = {"index": s.idx, "text": text, "logprobs": lp, "finish_reason": fr}
                if fin:
                    ch["stop_reason"] = None
                    finished_sent[s.idx] = True
                out.append({**base, "choices": [ch]})
            if out:
                await resp.write("".join(f"data: {json.dumps(c)}\n\n" for c in out).encode())
        if p["include_usage"]:
            ct = sum(s.num_out for s in g.seqs)
            pt = g.seqs[0].plen
            await resp.write(f"data: {json.dumps({**base, 'choices': [], 'usage': {'prompt_tokens': pt, 'total_tokens': pt + ct, 'completion_tokens': ct}})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _full(self, g, p, chat, base, hdrs):
        while not g.done:
            await self._wait_output(g)
        choices = []
        for s in g.seqs:
            toks = s.tokens[s.plen:]
            text = TOK.decode(toks)
            lp = self._lp_block(g, s, toks, p, 0)
            if chat:
                choices.append({"index": s.idx, "message": {"role": "assistant", "content": text, "tool_calls": []},
                                "logprobs": lp, "finish_reason": s.finish_reason, "stop_reason": None})
            else:
                choices.append({"index": s.idx, "text": text, "logprobs": lp, "finish_reason": s.finish_reason,
                                "stop_reason": None, "prompt_logprobs": None})
        ct = sum(s.num_out for s in g.seqs)
        pt = g.seqs[0].plen
        body = {**base, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                "usage": {"prompt_tokens": pt, "total_tokens": pt + ct, "completion_tokens": ct}}
        return web.json_response(body, headers=hdrs)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{
            "id": MODEL, "object": "model", "created": self.created, "owned_by": "vllm", "root": MODEL,
            "parent": None, "max_model_len": self.args.max_model_len, "permission": []}]})

    async def health(self, request):
        return web.Response(status=200)

    async def version(self, request):
        return web.json_response({"version": "0.0.0+heldout"})

    async def tokenize(self, request):
        try:
            body = await request.json()
            self._check_model(body)
            if "messages" in body:
                ids = self._prompt_ids(body, chat=True)
            else:
                if not isinstance(body.get("prompt"), str):
                    raise ReqError(400, "'prompt' must be a string")
                ids = TOK.encode(body["prompt"])
        except ReqError as e:
            return err(e.status, e.msg, e.typ)
        except (ValueError, AttributeError):
            return err(400, "invalid JSON body")
        out = {"count": len(ids), "max_model_len": self.args.max_model_len, "tokens": ids}
        if body.get("return_token_strs"):
            out["token_strs"] = [TOK.piece(i) for i in ids]
        return web.json_response(out)

    async def detokenize(self, request):
        try:
            body = await request.json()
            self._check_model(body)
            toks = body.get("tokens")
            if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
                raise ReqError(400, "'tokens' must be a list of integers")
        except ReqError as e:
            return err(e.status, e.msg, e.typ)
        except (ValueError, AttributeError):
            return err(400, "invalid JSON body")
        return web.json_response({"prompt": TOK.decode(toks)})

    async def metrics(self, request):
        e, m = self.engine, self.engine.m
        m.running.set(len(e.running))
        m.waiting.set(len(e.waiting))
        m.kv_usage.set(1.0 - e.kv.num_free() / e.kv.n)
        return web.Response(body=generate_latest(m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


# ---------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="vLLM-like inference server simulator")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--bugs", default="none", help="none | all | comma-separated names (%s)" % ",".join(ALL_BUGS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ground-truth", default=None)
    ap.add_argument("--num-gpu-blocks", type=int, default=4000)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=8192)
    a = ap.parse_args(argv)
    if a.bugs in ("", "none"):
        a.bug_set = frozenset()
    elif a.bugs == "all":
        a.bug_set = frozenset(ALL_BUGS)
    else:
        names = [x.strip() for x in a.bugs.split(",") if x.strip()]
        bad = [x for x in names if x not in ALL_BUGS]
        if bad:
            ap.error(f"unknown bug name(s): {', '.join(bad)}")
        a.bug_set = frozenset(names)
    return a


async def amain(args):
    random.seed(args.seed)
    gt = open(args.ground_truth, "a", buffering=1) if args.ground_truth else None
    metrics = Metrics(args)
    engine = Engine(args, args.bug_set, gt, metrics)
    fe = Frontend(args, engine)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", fe.completions)
    app.router.add_post("/v1/chat/completions", fe.chat)
    app.router.add_get("/v1/models", fe.models)
    app.router.add_get("/health", fe.health)
    app.router.add_get("/version", fe.version)
    app.router.add_post("/tokenize", fe.tokenize)
    app.router.add_post("/detokenize", fe.detokenize)
    app.router.add_get("/metrics", fe.metrics)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True,
                           shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    engine_task = asyncio.create_task(engine.run())
    print(f"INFO: serving {MODEL} on http://{args.host}:{args.port}", flush=True)
    await stop.wait()
    engine_task.cancel()
    try:
        await engine_task
    except asyncio.CancelledError:
        pass
    await runner.cleanup()
    if gt:
        gt.close()


def main():
    args = parse_args()
    try:
        asyncio.run(amain(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
