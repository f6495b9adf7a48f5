#!/usr/bin/env python3
"""heldout8: a simulated vLLM-like OpenAI-compatible inference server.

The GPU forward pass is replaced by ``asyncio.sleep`` of a modelled step time;
everything else (continuous batching, paged KV cache with prefix caching,
chunked prefill, recompute preemption, OpenAI/vLLM HTTP surface, Prometheus
metrics) is simulated for real.  See README.md for the engine configuration.
Standard library + aiohttp only.
"""
import argparse, asyncio, bisect, collections, hashlib, json, os, random, signal, sys, time, uuid  # noqa: E401

from aiohttp import web

VERSION = "0.11.2+sim.heldout8"
DEFAULT_MODEL = "sim/Granite-3B-Instruct"
ALL_BUGS = ("bug1", "bug2", "bug3", "bug4", "bug5")

# ----------------------------------------------------------------------------
# step-time model (seconds)
T_STEP = 4.0e-3          # per-step floor: launch + weight read + scheduler CPU
T_PREFILL_TOK = 9.0e-6   # per prompt (prefill) token in the batch
T_SEQ = 30.0e-6          # per sequence in the batch (sampling, bookkeeping)
T_DEC_CTX = 3.0e-8       # decode attention per context token (x (1 + ctx/16384))
T_PRE_ATTN = 2.5e-10     # prefill attention per chunk_token * (ctx + chunk/2)
T_LOGPROB = 15.0e-6      # per sampled sequence per requested top-logprob
COLD_START = (0.25, 0.12, 0.06)  # extra seconds on the first three busy steps
JITTER_SIGMA = 0.03
# internal constants
B_LP_MIN, B_LP_CAP, B_LP_COST = 5, 8, 25.0e-6
B_LONG_OUT = 1024
TIME_HARM_FRAC, TIME_HARM_MIN = 0.10, 0.002

# ----------------------------------------------------------------------------
# tokenizer: one token per whitespace-separated word
SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>",
           "<|tool|>", "<|developer|>"]
EOS_ID = 2
ROLE_IDS = {"system": 3, "user": 4, "assistant": 5, "tool": 6, "developer": 7}
WORD_BASE, HASH_BASE, VOCAB = 16, 2048, 32000
_WORDS = """the of and to a in is it you that he was for on are with as his they be
at one have this from or had by hot word but what some we can out other were all there
when up use your how said an each she which do their time if will way about many then
them write would like so these her long make thing see him two has look more day could
go come did number sound no most people my over know water than call first who may down
side been now find any new work part take get place made live where after back little
only round man year came show every good me give our under name very through just form
sentence great think say help low line differ turn cause much mean before move right boy""".split()


class Tokenizer:
    def __init__(self):
        self.stoi, self.itos, self.words = {}, {}, []
        for i, w in enumerate(SPECIAL):
            self.stoi[w], self.itos[i] = i, w
        for w in _WORDS:
            if w not in self.stoi:
                i = WORD_BASE + len(self.words)
                self.words.append(w)
                self.stoi[w], self.itos[i] = i, w
        self.hashed = {}

    def word_id(self, w):
        i = self.stoi.get(w)
        if i is not None:
            return i
        i = self.hashed.get(w)
        if i is None:
            h = int.from_bytes(hashlib.blake2b(w.encode("utf-8", "replace"),
                                               digest_size=8).digest(), "little")
            i = HASH_BASE + h % (VOCAB - HASH_BASE)
            if len(self.hashed) < 400000:
                self.hashed[w] = i
                self.itos.setdefault(i, w)
        return i

    def encode(self, text):
        return [self.word_id(w) for w in text.split()]

    def decode(self, ids):
        return " ".join(self.itos.get(i, "<tok%d>" % i) for i in ids)

    def piece(self, i):
        return "" if i < WORD_BASE else " " + self.itos.get(i, "<tok%d>" % i)

    def chat(self, messages, add_generation_prompt=True):
        ids = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError("each message needs a string 'role'")
            content = m.get("content") or ""
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                raise ApiError("message content must be a string or a list of parts")
            ids.append(ROLE_IDS.get(m["role"], 4))
            ids.extend(self.encode(content))
        if add_generation_prompt:
            ids.append(ROLE_IDS["assistant"])
        return ids


class ApiError(Exception):
    def __init__(self, msg, code=400, prompt_tokens=0):
        super().__init__(msg)
        self.msg, self.code, self.prompt_tokens = msg, code, prompt_tokens


# ----------------------------------------------------------------------------
# metrics
class Hist:
    def __init__(self, buckets):
        self.b = list(buckets)
        self.c = [0] * len(self.b)
        self.sum, self.n = 0.0, 0

    def observe(self, v):
        self.sum += v
        self.n += 1
        i = bisect.bisect_left(self.b, v)
        if i < len(self.b):
            self.c[i] += 1

    def render(self, name, lab, out):
        acc = 0
        for le, c in zip(self.b, self.c):
            acc += c
            out.append('%s_bucket{%s,le="%s"} %d' % (name, lab, float(le), acc))
        out.append('%s_bucket{%s,le="+Inf"} %d' % (name, lab, self.n))
        out.append("%s_sum{%s} %r" % (name, lab, self.sum))
        out.append("%s_count{%s} %d" % (name, lab, self.n))


TTFT_B = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
          5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_B = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
         7.5, 10.0, 20.0, 40.0, 80.0]
REQ_B = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
         60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITER_B = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


# ----------------------------------------------------------------------------
# engine data structures
WAITING, RUNNING, PREEMPTED, DONE = "waiting", "running", "preempted", "done"


class Req:
    def __init__(self, rid, kind, prompt, n, max_tokens, ignore_eos, min_tokens, lp,
                 seed, stream, include_usage, arrival):
        self.rid, self.kind, self.prompt, self.n = rid, kind, prompt, n
        self.max_tokens, self.ignore_eos, self.min_tokens = max_tokens, ignore_eos, min_tokens
        self.lp, self.seed, self.stream, self.include_usage = lp, seed, stream, include_usage
        self.arrival, self.seqs, self.live = arrival, [], n
        self.queue = asyncio.Queue() if stream else None
        self.done = asyncio.get_running_loop().create_future()
        self.finished = self.aborted = self.client_disconnected = False
        self.finish_reason = self.first_sched = self.first_token = self.end = None
        self.tags, self.bug_delay = set(), {}   # ground truth: bugs that changed this request


class Seq:
    __slots__ = ("sid", "req", "idx", "prompt", "hashes", "out", "blocks", "computed",
                 "status", "aborted", "orphan", "finish", "rng", "eos_at", "last_t")

    def __init__(self, sid, req, idx, hashes, rng, eos_at):
        self.sid, self.req, self.idx = sid, req, idx
        self.prompt, self.hashes = req.prompt, hashes
        self.out, self.blocks, self.computed = [], [], 0
        self.status, self.aborted, self.orphan = WAITING, False, False
        self.finish, self.rng, self.eos_at, self.last_t = None, rng, eos_at, None

    @property
    def num_tokens(self):
        return len(self.prompt) + len(self.out)


class KVCache:
    """Paged KV cache: LRU free queue of blocks, hash -> block prefix cache."""

    def __init__(self, nblocks, caching):
        self.n, self.caching, self.cache = nblocks, caching, {}
        self.free = collections.OrderedDict((i, None) for i in range(nblocks))  # LRU order
        self.ref, self.bhash = [0] * nblocks, [None] * nblocks

    def nfree(self):
        return len(self.free)

    def lookup(self, hashes, max_blocks):
        hit = []
        if self.caching:
            for h in hashes[:max_blocks]:
                b = self.cache.get(h)
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
            b, _ = self.free.popitem(last=False)
            h = self.bhash[b]
            if h is not None:
                if self.cache.get(h) == b:
                    del self.cache[h]
                self.bhash[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks):
        for b in reversed(blocks):      # tail blocks end up evicted first
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def register(self, b, h):
        if self.caching and h not in self.cache and self.bhash[b] is None:
            self.cache[h] = b
            self.bhash[b] = h


class Plan:
    __slots__ = ("sched", "preempted", "reaped", "admitted", "fired", "budget", "wait",
                 "cost", "pcq", "pch")

    def __init__(self, budget):
        self.sched, self.fired, self.budget, self.wait, self.cost = {}, set(), budget, (), 0.0
        self.preempted, self.reaped, self.admitted = [], [], []
        self.pcq = self.pch = 0


class Engine:
    def __init__(self, a, bugs, gt_path):
        self.a, self.bs, self.bugs = a, a.block_size, frozenset(bugs)
        self.kv = KVCache(a.num_gpu_blocks, not a.no_enable_prefix_caching)
        self.running, self.waiting = [], collections.deque()
        self.rng = random.Random(a.seed)
        self.sid = self.nreq = self.steps = self.n_orphans = self.n_long = 0
        self.wake, self.stopping, self.dead, self.live = asyncio.Event(), False, False, {}
        self.gt = open(gt_path, "a", encoding="utf-8") if gt_path else None
        self.c, self.success = collections.Counter(), collections.Counter()
        self.h_ttft, self.h_itl = Hist(TTFT_B), Hist(ITL_B)
        self.h_e2e, self.h_queue, self.h_iter = Hist(REQ_B), Hist(REQ_B), Hist(ITER_B)

    # ------------------------------------------------------------------ intake
    def add(self, req):
        bs, p, hashes, h = self.bs, req.prompt, [], 0
        for i in range(len(p) // bs):     # chained hashes of the full prompt blocks
            h = hash((h, tuple(p[i * bs:(i + 1) * bs])))
            hashes.append(h)
        self.nreq += 1
        base = req.seed if req.seed is not None else "%d:%d" % (self.a.seed, self.nreq)
        for i in range(req.n):
            rng = random.Random("%s:%d" % (base, i))
            eos_at = None
            if not req.ignore_eos and rng.random() < 0.5:
                lo = max(req.min_tokens + 1, (req.max_tokens + 3) // 4)
                if lo <= req.max_tokens:
                    eos_at = rng.randint(lo, req.max_tokens)
            self.sid += 1
            s = Seq(self.sid, req, i, hashes, rng, eos_at)
            req.seqs.append(s)
            self.waiting.append(s)
            if req.max_tokens >= B_LONG_OUT:
                self.n_long += 1
        self.live[id(req)] = req
        self.wake.set()

    def abort(self, req, disconnected):
        if req.finished:
            return
        req.aborted = True
        req.client_disconnected = req.client_disconnected or disconnected
        fanout_lost = "bug1" in self.bugs and disconnected and req.n >= 2
        for s in req.seqs:
            if s.status == DONE:
                continue
            if fanout_lost and s.idx > 0:
                s.orphan = True          # parent aborted, child left behind
                self.n_orphans += 1
            else:
                s.aborted = True
        self.wake.set()

    # --------------------------------------------------------------- scheduler
    def blocks_for(self, ntok):
        return -(-ntok // self.bs)

    def schedule(self, bugs):
        """One vLLM-V1-style scheduling pass.  Mutates the engine state; the
        caller snapshots/restores around counterfactual passes."""
        a, kv, bs = self.a, self.kv, self.bs
        P = Plan(a.max_num_batched_tokens)
        cap = a.long_prefill_token_threshold or (1 << 30)
        # 0. reap aborted sequences (clean: the whole fan-out)
        for lst_name in ("running", "waiting"):
            lst = getattr(self, lst_name)
            if any(s.aborted or s.orphan for s in lst):
                keep = []
                for s in lst:
                    if s.aborted or (s.orphan and "bug1" not in bugs):
                        if s.blocks:
                            kv.release(s.blocks)
                            s.blocks = []
                        s.status = DONE
                        P.reaped.append(s)
                    else:
                        if s.orphan:
                            P.fired.add("bug1")
                        keep.append(s)
                setattr(self, lst_name, keep if lst_name == "running" else collections.deque(keep))
        running, waiting = self.running, self.waiting
        sched = P.sched

        def preempt(victim):
            if victim in sched:           # scheduled earlier in this step: undo
                n = sched.pop(victim)
                P.budget += n
                for i in range(victim.computed // bs, min(victim.computed + n, len(victim.prompt)) // bs):
                    b = victim.blocks[i]
                    h = kv.bhash[b]
                    if h is not None and kv.ref[b] == 1:
                        if kv.cache.get(h) == b:
                            del kv.cache[h]
                        kv.bhash[b] = None
            kv.release(victim.blocks)
            victim.blocks = []
            victim.computed = 0
            victim.status = PREEMPTED
            P.preempted.append(victim)
            waiting.appendleft(victim)

        def is_decode(s):
            return s.out and s.computed == s.num_tokens - 1

        # 1. running sequences: decodes first, then partial prefills
        big = []
        if "bug4" in bugs:
            big = [s for s in running if not is_decode(s)
                   and s.num_tokens > 2 * a.max_num_batched_tokens]
            if big:
                P.fired.add("bug4")
        order = big + [s for s in running if is_decode(s)] + \
            [s for s in running if not is_decode(s) and s not in big]
        for s in order:
            if P.budget <= 0:
                break
            if s.status != RUNNING:
                continue
            n = s.num_tokens - s.computed
            n = min(n, P.budget) if s in big else min(n, cap, P.budget)
            if n <= 0:
                continue
            while True:
                need = self.blocks_for(s.computed + n) - len(s.blocks)
                if need <= kv.nfree():
                    break
                victim = running.pop()
                preempt(victim)
                if victim is s:
                    break
            if s.status != RUNNING:
                continue
            if need > 0:
                s.blocks = s.blocks + kv.alloc(need)
            self._register(s, n)
            sched[s] = n
            P.budget -= n
        # 2. waiting queue in order; stop at the first that does not fit
        if not P.preempted:
            resv = None
            if "bug5" in bugs and self.n_long:
                resv = sum(max(0, self.blocks_for(len(r.prompt) + r.req.max_tokens) - len(r.blocks))
                           for r in running if r.req.max_tokens >= B_LONG_OUT)
            while waiting and P.budget > 0 and len(running) < a.max_num_seqs:
                s = waiting[0]
                if "bug2" in bugs and s.status == PREEMPTED:
                    for x in waiting:
                        if x.status == WAITING:
                            s = x
                            P.fired.add("bug2")
                            break
                hit = kv.lookup(s.hashes, (s.num_tokens - 1) // bs)
                hit_tok = len(hit) * bs
                n = min(s.num_tokens - hit_tok, cap, P.budget)
                new = self.blocks_for(hit_tok + n) - len(hit)
                need = new + sum(1 for b in hit if kv.ref[b] == 0)
                if need > kv.nfree():
                    break
                own = 0
                if resv is not None:
                    if s.req.max_tokens >= B_LONG_OUT:
                        own = max(0, self.blocks_for(len(s.prompt) + s.req.max_tokens)
                                  - len(hit) - new)
                    if need + resv + own > kv.nfree():
                        P.fired.add("bug5")
                        break
                    resv += own
                if s is waiting[0]:
                    waiting.popleft()
                else:
                    waiting.remove(s)
                kv.touch(hit)
                s.blocks = hit + kv.alloc(new)
                s.computed = hit_tok
                s.status = RUNNING
                running.append(s)
                self._register(s, n)
                sched[s] = n
                P.budget -= n
                P.admitted.append(s)
                P.pcq += s.num_tokens
                P.pch += hit_tok
        P.wait = tuple(waiting)
        P.cost = self.step_cost(P, bugs)
        return P

    def _register(self, s, n):
        bs = self.bs
        lo = s.computed // bs
        hi = min(s.computed + n, len(s.prompt)) // bs
        for i in range(lo, min(hi, len(s.hashes))):
            self.kv.register(s.blocks[i], s.hashes[i])

    def step_cost(self, P, bugs):
        t = T_STEP
        kmax, plain = 0, 0
        for s, n in P.sched.items():
            t += T_SEQ
            ctx = s.computed
            if n == 1 and s.out and ctx == s.num_tokens - 1:
                t += T_DEC_CTX * (ctx + 1) * (1.0 + (ctx + 1) / 16384.0)
            else:
                t += T_PREFILL_TOK * n + T_PRE_ATTN * n * (ctx + n / 2.0)
            if ctx + n >= s.num_tokens:          # this sequence samples a token
                lp = s.req.lp
                if lp is None:
                    plain += 1
                else:
                    t += T_LOGPROB * max(1, lp)
                    kmax = max(kmax, lp)
        if "bug3" in bugs and kmax >= B_LP_MIN and plain:
            t += B_LP_COST * min(kmax, B_LP_CAP) * plain
        return t

    # ------------------------------------------------- counterfactual support
    def armed(self):
        b = self.bugs
        if "bug1" in b and self.n_orphans:
            return True
        if "bug5" in b and self.n_long:
            return True
        if "bug4" in b or "bug2" in b:
            lim = 2 * self.a.max_num_batched_tokens
            need = 0
            for s in self.running:
                if "bug4" in b and s.num_tokens > lim and s.computed < s.num_tokens - 1:
                    return True
                need += self.blocks_for(s.num_tokens) - len(s.blocks)
            if "bug2" in b and (need > self.kv.nfree() or (
                    self.waiting and self.waiting[0].status == PREEMPTED)):
                return True
        return False

    def snapshot(self):
        kv = self.kv
        seqs = [(s, list(s.blocks), s.computed, s.status)
                for lst in (self.running, self.waiting) for s in lst]
        return (collections.OrderedDict(kv.free), list(kv.ref), list(kv.bhash),
                dict(kv.cache), list(self.running), list(self.waiting), seqs)

    def restore(self, snap):
        free, ref, bhash, cache, running, waiting, seqs = snap
        kv = self.kv
        kv.free, kv.ref, kv.bhash, kv.cache = (collections.OrderedDict(free), list(ref),
                                               list(bhash), dict(cache))
        self.running, self.waiting = list(running), collections.deque(waiting)
        for s, blocks, computed, status in seqs:
            s.blocks, s.computed, s.status = list(blocks), computed, status

    def judge(self, real, cf, bug):
        """Tag the requests whose schedule in this step is worse than in the
        counterfactual step without `bug`."""
        harmed = set()
        cf_reaped = set(cf.reaped) - set(real.reaped)
        for s in cf_reaped:
            s.req.tags.add(bug)
        rs = real.sched
        for s, n in cf.sched.items():
            if rs.get(s, 0) < n and s not in cf_reaped:
                harmed.add(s)
        cfp = set(cf.preempted)
        for s in real.preempted:
            if s not in cfp:
                harmed.add(s)
        if real.wait != cf.wait:
            rank = {s: i for i, s in enumerate(cf.wait)}
            hi = -1
            for s in real.wait:          # queue position got worse
                r = rank.get(s)
                if r is None:
                    continue
                if hi > r:
                    harmed.add(s)
                hi = max(hi, r)
            cfa = set(cf.admitted)       # overtaken by a later request
            passed = [rank[t] for t in real.admitted if t not in cfa and t in rank]
            if passed:
                top = max(passed)
                for s in real.wait:
                    if rank.get(s, top) < top:
                        harmed.add(s)
        for s in harmed:
            s.req.tags.add(bug)
        extra = real.cost - cf.cost
        if extra > 0:
            cs = cf.sched
            for s, n in rs.items():
                if s not in harmed and n <= cs.get(s, 0):
                    d = s.req.bug_delay
                    d[bug] = d.get(bug, 0.0) + extra

    def plan_step(self):
        bugs = self.bugs
        if not bugs:
            return self.schedule(bugs)
        snap = self.snapshot() if self.armed() else None
        real = self.schedule(bugs)
        redo = [b for b in sorted(real.fired) if b != "bug3"]
        if redo and snap is not None:
            post = self.snapshot()
            for b in redo:
                self.restore(snap)
                cf = self.schedule(bugs - {b})
                self.judge(real, cf, b)
            self.restore(post)
        if "bug3" in bugs and real.sched:
            base = self.step_cost(real, bugs - {"bug3"})
            if real.cost > base:
                cf = Plan(0)
                cf.sched, cf.preempted, cf.reaped = real.sched, real.preempted, real.reaped
                cf.wait, cf.cost = real.wait, base
                self.judge(real, cf, "bug3")
        return real

    # --------------------------------------------------------------- main loop
    async def run(self):
        loop = asyncio.get_running_loop()
        while not self.stopping:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
                continue
            t0 = loop.time()
            P = self.plan_step()
            self.c["preemptions"] += len(P.preempted)
            self.c["pc_queries"] += P.pcq
            self.c["pc_hits"] += P.pch
            for s in P.reaped:
                self.seq_done(s, "abort", t0, remove=False)
            if not P.sched:
                if self.running or self.waiting:
                    await asyncio.sleep(T_STEP)
                continue
            for s in P.sched:
                if s.req.first_sched is None:
                    s.req.first_sched = t0
                    self.h_queue.observe(t0 - s.req.arrival)
            cost = P.cost * self.rng.lognormvariate(0.0, JITTER_SIGMA)
            if self.steps < len(COLD_START) and not self.a.no_cold_start:
                cost += COLD_START[self.steps]
            self.steps += 1
            self.h_iter.observe(sum(P.sched.values()))
            await asyncio.sleep(max(0.0, t0 + cost - loop.time()))
            if self.stopping:
                return
            self.finish_step(P, loop.time())

    def finish_step(self, P, now):
        tok = self.tok
        for s, n in P.sched.items():
            if s.status != RUNNING:
                continue
            s.computed += n
            if s.computed < s.num_tokens:
                continue
            req = s.req
            k = len(s.out) + 1
            if s.eos_at is not None and k >= s.eos_at:
                t, fin = EOS_ID, "stop"
            else:
                t = WORD_BASE + s.rng.randrange(len(tok.words))
                fin = "length" if k >= req.max_tokens else None
            s.out.append(t)
            self.c["gen_tokens"] += 1
            if req.first_token is None:
                req.first_token = now
                self.h_ttft.observe(now - req.arrival)
                self.c["prompt_tokens"] += len(req.prompt)
            if s.last_t is not None:
                self.h_itl.observe(now - s.last_t)
            s.last_t = now
            if req.queue is not None and not req.aborted:
                req.queue.put_nowait((s.idx, t, fin))
            if fin:
                self.seq_done(s, fin, now, remove=True)

    def seq_done(self, s, reason, now, remove):
        if s.status == DONE and not remove and s.finish is not None:
            return
        if remove:
            self.kv.release(s.blocks)
            s.blocks = []
            if s in self.running:
                self.running.remove(s)
        s.status, s.finish, req = DONE, reason, s.req
        self.n_orphans -= s.orphan
        self.n_long -= req.max_tokens >= B_LONG_OUT
        req.live -= 1
        if req.live == 0:
            self.finish_req(req, now)

    def finish_req(self, req, now, reason=None):
        if req.finished:
            return
        req.finished, req.end = True, now
        if reason is None:
            reason = "abort" if req.aborted else (req.seqs[0].finish or "abort")
        req.finish_reason = reason
        self.success[reason] += 1
        e2e = now - req.arrival
        if reason != "abort":
            self.h_e2e.observe(e2e)
        for b, d in req.bug_delay.items():
            if d >= TIME_HARM_MIN and d >= TIME_HARM_FRAC * e2e:
                req.tags.add(b)
        self.live.pop(id(req), None)
        self.write_gt(req.rid, reason, req.client_disconnected, e2e, len(req.prompt),
                      sum(len(s.out) for s in req.seqs), sorted(req.tags))
        if not req.done.done():
            req.done.set_result(reason)
        if req.queue is not None:
            req.queue.put_nowait(None)

    def write_gt(self, rid, reason, disc, e2e, ptok, otok, tags):
        if self.gt is None:
            return
        self.gt.write(json.dumps({"request_id": rid, "finish_reason": reason,
                                  "client_disconnected": bool(disc), "e2e_s": round(e2e, 6),
                                  "prompt_tokens": ptok, "output_tokens": otok,
                                  "pathologies": tags}) + "\n")
        self.gt.flush()

    def shutdown(self):
        self.stopping = True
        now = asyncio.get_running_loop().time()
        for req in list(self.live.values()):
            req.aborted = True
            for s in req.seqs:
                if s.status != DONE:
                    s.status, s.finish = DONE, "abort"
            self.finish_req(req, now, "abort")
        self.running, self.waiting = [], collections.deque()
        if self.gt:
            self.gt.flush()
        self.wake.set()

    # ----------------------------------------------------------------- metrics
    def metrics(self, model):
        lab = 'engine="0",model_name="%s"' % model
        out = []

        def fam(name, typ, help_, lines):
            out.append("# HELP %s %s" % (name, help_))
            out.append("# TYPE %s %s" % (name, typ))
            out.extend(lines)

        def one(name, typ, help_, v, extra=""):
            fam(name, typ, help_, ["%s{%s%s} %s" % (name, lab, extra, float(v))])

        kv, c = self.kv, self.c
        for name, typ, v, help_ in (
                ("num_requests_running", "gauge", len(self.running), "Number of requests in model execution batches."),
                ("num_requests_waiting", "gauge", len(self.waiting), "Number of requests waiting to be processed."),
                ("kv_cache_usage_perc", "gauge", (kv.n - kv.nfree()) / kv.n, "KV-cache usage. 1 means 100 percent usage."),
                ("num_preemptions_total", "counter", c["preemptions"], "Cumulative number of preemption from the engine."),
                ("prompt_tokens_total", "counter", c["prompt_tokens"], "Number of prefill tokens processed."),
                ("generation_tokens_total", "counter", c["gen_tokens"], "Number of generation tokens processed."),
                ("prefix_cache_queries_total", "counter", c["pc_queries"], "Prefix cache queries, in tokens."),
                ("prefix_cache_hits_total", "counter", c["pc_hits"], "Prefix cache hits, in tokens.")):
            one("vllm:" + name, typ, help_, v)
        fam("vllm:request_success_total", "counter", "Count of successfully processed requests.",
            ['vllm:request_success_total{%s,finished_reason="%s"} %s' % (lab, r, float(self.success[r]))
             for r in ("stop", "length", "abort")])
        a = self.a
        one("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", 1,
            ',block_size="%d",cache_dtype="auto",enable_prefix_caching="%s",num_gpu_blocks="%d",'
            'max_num_batched_tokens="%d",max_num_seqs="%d"'
            % (self.bs, self.kv.caching, kv.n, a.max_num_batched_tokens, a.max_num_seqs))
        for name, h, help_ in (
                ("vllm:iteration_tokens_total", self.h_iter, "Histogram of number of tokens per engine_step."),
                ("vllm:time_to_first_token_seconds", self.h_ttft, "Histogram of time to first token in seconds."),
                ("vllm:inter_token_latency_seconds", self.h_itl, "Histogram of inter-token latency in seconds."),
                ("vllm:e2e_request_latency_seconds", self.h_e2e, "Histogram of e2e request latency in seconds."),
                ("vllm:request_queue_time_seconds", self.h_queue,
                 "Histogram of time spent in WAITING phase for request.")):
            lines = []
            h.render(name, lab, lines)
            fam(name, "histogram", help_, lines)
        return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------
# HTTP layer
def err_json(msg, code=400, headers=None):
    typ = {400: "BadRequestError", 404: "NotFoundError"}.get(code, "InternalServerError")
    return web.json_response({"error": {"message": msg, "type": typ, "param": None, "code": code}},
                             status=code, headers=headers)


def _int(body, key, default, lo, hi):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError("'%s' must be an integer" % key)
    if v < lo or (hi is not None and v > hi):
        raise ApiError("'%s' must be >= %d%s, got %d" % (key, lo, "" if hi is None else
                                                          " and <= %d" % hi, v))
    return v


class Server:
    def __init__(self, a, bugs):
        self.a, self.model, self.tok, self.created = a, a.model, Tokenizer(), int(time.time())
        self.engine = Engine(a, bugs, a.ground_truth)
        self.engine.tok = self.tok

    def app(self):
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/v1/completions", lambda q: self.completion(q, chat=False))
        r.add_post("/v1/chat/completions", lambda q: self.completion(q, chat=True))
        for path, h in (("/v1/models", self.models), ("/health", self.health), ("/version", self.version),
                        ("/metrics", self.metrics)):
            r.add_get(path, h)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        return app

    async def health(self, q):
        return web.Response(status=500 if self.engine.dead else 503 if self.engine.stopping else 200)

    async def version(self, q):
        return web.json_response({"version": VERSION})

    async def models(self, q):
        return web.json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.created, "owned_by": "vllm",
            "root": self.model, "parent": None, "max_model_len": self.a.max_model_len,
            "permission": [{"id": "modelperm-heldout8", "object": "model_permission",
                            "allow_sampling": True, "allow_logprobs": True}]}]})

    async def metrics(self, q):
        return web.Response(text=self.engine.metrics(self.model),
                            content_type="text/plain", charset="utf-8")

    async def _body(self, q):
        try:
            body = await q.json()
        except Exception:
            raise ApiError("request body is not valid JSON")
        if not isinstance(body, dict):
            raise ApiError("request body must be a JSON object")
        return body

    async def tokenize(self, q):
        try:
            body = await self._body(q)
            if "messages" in body:
                if not isinstance(body["messages"], list):
                    raise ApiError("'messages' must be a list")
                ids = self.tok.chat(body["messages"], bool(body.get("add_generation_prompt", True)))
            elif isinstance(body.get("prompt"), str):
                ids = self.tok.encode(body["prompt"])
            else:
                raise ApiError("either 'prompt' (string) or 'messages' is required")
        except ApiError as e:
            return err_json(e.msg, e.code)
        out = {"count": len(ids), "max_model_len": self.a.max_model_len, "tokens": ids}
        if body.get("return_token_strs"):
            out["token_strs"] = [self.tok.itos.get(i, "<tok%d>" % i) for i in ids]
        return web.json_response(out)

    async def detokenize(self, q):
        try:
            body = await self._body(q)
            ids = body.get("tokens")
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                    for i in ids):
                raise ApiError("'tokens' must be a list of integers")
        except ApiError as e:
            return err_json(e.msg, e.code)
        return web.json_response({"prompt": self.tok.decode(ids)})

    def parse(self, body, chat):
        a, isint = self.a, lambda v: isinstance(v, int) and not isinstance(v, bool)
        m = body.get("model")
        if m is not None and m != self.model:
            raise ApiError("The model `%s` does not exist." % m, 404)
        if chat:
            if not isinstance(body.get("messages"), list) or not body["messages"]:
                raise ApiError("'messages' must be a non-empty list")
            prompt = self.tok.chat(body["messages"], bool(body.get("add_generation_prompt", True)))
        else:
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
                p = p[0]
            if isinstance(p, str):
                prompt = self.tok.encode(p)
            elif isinstance(p, list) and p and all(isint(i) for i in p):
                if any(i < 0 or i >= VOCAB for i in p):
                    raise ApiError("token id out of range [0, %d)" % VOCAB)
                prompt = list(p)
            else:
                raise ApiError("'prompt' must be a string or a list of token ids (batches unsupported)")
        if not prompt:
            raise ApiError("The prompt cannot be empty.")
        pt = len(prompt)
        mt = body.get("max_completion_tokens") if chat else None
        mt = body.get("max_tokens") if mt is None else mt
        spec = dict(prompt=prompt, ignore_eos=bool(body.get("ignore_eos")), seed=body.get("seed"),
                    stream=bool(body.get("stream", False)), lp=None)
        try:
            spec["max_tokens"] = _int({"max_tokens": mt}, "max_tokens",
                                      max(1, min(256, a.max_model_len - pt)) if chat else 16, 1, None)
            spec["n"] = _int(body, "n", 1, 1, 16)
            spec["min_tokens"] = _int(body, "min_tokens", 0, 0, spec["max_tokens"])
            if spec["seed"] is not None and not isint(spec["seed"]):
                raise ApiError("'seed' must be an integer")
            if not chat:
                spec["lp"] = _int(body, "logprobs", None, 0, 20)
            elif body.get("logprobs"):
                spec["lp"] = _int(body, "top_logprobs", 0, 0, 20)
            so = body.get("stream_options") or {}
            if not isinstance(so, dict) or (so and not spec["stream"]):
                raise ApiError("Stream options can only be defined when `stream=True`.")
            spec["include_usage"] = bool(so.get("include_usage", False))
        except ApiError as e:
            e.prompt_tokens = pt
            raise
        if pt + spec["max_tokens"] > a.max_model_len:
            raise ApiError("This model's maximum context length is %d tokens. However, you requested "
                           "%d tokens (%d in the messages, %d in the completion). Please reduce the "
                           "length of the messages or completion." %
                           (a.max_model_len, pt + spec["max_tokens"], pt, spec["max_tokens"]), 400, pt)
        return spec

    async def completion(self, q, chat):
        loop = asyncio.get_running_loop()
        t_arr = loop.time()
        rid = q.headers.get("X-Request-Id") or uuid.uuid4().hex
        hdrs = {"X-Request-Id": rid}
        eng = self.engine
        if eng.stopping:
            return err_json("server is shutting down", 503, hdrs)
        try:
            spec = self.parse(await self._body(q), chat)
        except ApiError as e:
            eng.write_gt(rid, "error", False, loop.time() - t_arr, e.prompt_tokens, 0, [])
            return err_json(e.msg, e.code, hdrs)
        req = Req(rid, "chat" if chat else "cmpl", spec["prompt"], spec["n"], spec["max_tokens"],
                  spec["ignore_eos"], spec["min_tokens"], spec["lp"], spec["seed"], spec["stream"],
                  spec["include_usage"], t_arr)
        eng.add(req)
        cid = ("chatcmpl-" if chat else "cmpl-") + rid
        try:
            if req.stream:
                return await self.stream(q, req, cid, chat, hdrs)
            await req.done
            return web.json_response(self.full_body(req, cid, chat), headers=hdrs)
        except (asyncio.CancelledError, ConnectionResetError, ConnectionError):
            eng.abort(req, disconnected=True)
            raise
        except Exception:
            eng.abort(req, disconnected=False)
            raise

    def usage(self, req):
        c = sum(len(s.out) for s in req.seqs)
        return {"prompt_tokens": len(req.prompt), "total_tokens": len(req.prompt) + c,
                "completion_tokens": c, "prompt_tokens_details": None}

    def lp_entry(self, t, k, chat):
        tok = self.tok
        piece = tok.piece(t)
        lp = -(0.05 + (t % 97) / 40.0)
        alts = [WORD_BASE + (t * 7 + j * 13) % len(tok.words) for j in range(k)]
        if chat:
            return {"token": piece, "logprob": lp, "bytes": list(piece.encode()),
                    "top_logprobs": [{"token": tok.piece(x), "logprob": lp - 0.5 * (j + 1),
                                      "bytes": list(tok.piece(x).encode())}
                                     for j, x in enumerate(alts)]}
        return piece, lp, {tok.piece(x): lp - 0.5 * (j + 1) for j, x in enumerate(alts)}

    def cmpl_logprobs(self, toks, k):
        ents, offs, off = [self.lp_entry(t, k, False) for t in toks], [], 0
        for piece, _, _ in ents:
            offs.append(off)
            off += len(piece)
        return {"text_offset": offs, "token_logprobs": [e[1] for e in ents],
                "tokens": [e[0] for e in ents], "top_logprobs": [e[2] for e in ents]}

    def full_body(self, req, cid, chat):
        tok = self.tok
        choices = []
        for s in req.seqs:
            text = "".join(tok.piece(t) for t in s.out)
            fin = s.finish if s.finish in ("stop", "length") else "abort"
            if chat:
                lps = None
                if req.lp is not None:
                    lps = {"content": [self.lp_entry(t, req.lp, True) for t in s.out]}
                choices.append({"index": s.idx, "message": {"role": "assistant", "content": text,
                                                            "tool_calls": []},
                                "logprobs": lps, "finish_reason": fin, "stop_reason": None})
            else:
                choices.append({"index": s.idx, "text": text, "logprobs":
                                self.cmpl_logprobs(s.out, req.lp) if req.lp is not None else None,
                                "finish_reason": fin, "stop_reason": None, "prompt_logprobs": None})
        return {"id": cid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model, "choices": choices,
                "usage": self.usage(req)}

    async def stream(self, q, req, cid, chat, hdrs):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache", **hdrs})
        await resp.prepare(q)
        tok, started = self.tok, set()
        head = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model}

        def sse(**kw):
            return "data: " + json.dumps({**head, **kw}) + "\n\n"
        while True:
            evs = [await req.queue.get()]
            while not req.queue.empty():
                evs.append(req.queue.get_nowait())
            buf, end = [], False
            for ev in evs:
                if ev is None:
                    end = True
                    break
                idx, t, fin = ev
                piece = tok.piece(t)
                if chat:
                    if idx not in started:     # role chunk comes with the first output
                        started.add(idx)
                        buf.append(sse(choices=[{"index": idx, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]))
                    ch = {"index": idx, "delta": {"content": piece},
                          "logprobs": {"content": [self.lp_entry(t, req.lp, True)]}
                          if req.lp is not None else None, "finish_reason": fin}
                else:
                    ch = {"index": idx, "text": piece,
                          "logprobs": self.cmpl_logprobs([t], req.lp) if req.lp is not None else None,
                          "finish_reason": fin}
                if fin:
                    ch["stop_reason"] = None
                buf.append(sse(choices=[ch]))
            if end:
                if req.include_usage:
                    buf.append(sse(choices=[], usage=self.usage(req)))
                buf.append("data: [DONE]\n\n")
            if buf:
                await resp.write("".join(buf).encode())
            if end:
                break
        await resp.write_eof()
        return resp


# ----------------------------------------------------------------------------
def parse_bugs(spec):
    spec = (spec or "none").strip().lower()
    if spec in ("", "none", "all"):
        return set(ALL_BUGS) if spec == "all" else set()
    out = {b.strip() for b in spec.split(",")}
    if out - set(ALL_BUGS):
        raise SystemExit("unknown bug(s) %s (choose none, all or %s)" % (sorted(out - set(ALL_BUGS)),
                                                                      ",".join(ALL_BUGS)))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="heldout8 simulated vLLM-like server")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bugs", default="none")
    p.add_argument("--ground-truth", default=None)
    p.add_argument("--model", "--served-model-name", dest="model", default=DEFAULT_MODEL)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--num-gpu-blocks", type=int, default=768)
    p.add_argument("--max-num-batched-tokens", type=int, default=3072)
    p.add_argument("--max-num-seqs", type=int, default=40)
    p.add_argument("--long-prefill-token-threshold", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--no-enable-prefix-caching", action="store_true")
    p.add_argument("--no-cold-start", action="store_true")
    a = p.parse_args(argv)
    if a.max_model_len > a.num_gpu_blocks * a.block_size:
        p.error("max_model_len exceeds KV capacity (num_gpu_blocks * block_size)")
    return a


async def amain(a, bugs):
    srv = Server(a, bugs)
    eng = srv.engine
    runner = web.AppRunner(srv.app(), handler_cancellation=True, shutdown_timeout=0.2,
                           access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, a.host, a.port, shutdown_timeout=0.2)
    await site.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal():
        if not stop.is_set():
            eng.shutdown()
            stop.set()
            loop.call_later(0.9, os._exit, 0)     # hard deadline

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    task = asyncio.create_task(eng.run())
    task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or (
        setattr(eng, "dead", True), print("engine died: %r" % t.exception(), file=sys.stderr, flush=True)))
    print("heldout8 server on http://%s:%d model=%s bugs=%s" %
          (a.host, a.port, a.model, ",".join(sorted(bugs)) or "none"), flush=True)
    await stop.wait()
    task.cancel()
    try:
        await asyncio.wait_for(runner.cleanup(), 0.6)
    except (asyncio.TimeoutError, Exception):
        pass
    if eng.gt:
        eng.gt.close()


def main():
    a = parse_args()
    asyncio.run(amain(a, parse_bugs(a.bugs)))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
