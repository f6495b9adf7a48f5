#!/usr/bin/env python3
"""heldout5: a stand-alone, vLLM-like LLM inference server simulator.

GPU compute is simulated with asyncio sleeps derived from a step cost model.
See README.md for usage.  Planted bugs are selected with --bugs.
"""
import argparse
import asyncio
import hashlib
import json
import math
import random
import re
import signal
import sys
import time
import uuid
import zlib
from collections import OrderedDict, deque

from aiohttp import web

MODEL = "heldout5-sim"
VERSION = "0.9.2"
MAX_MODEL_LEN = 8192
BLOCK = 16
NUM_BLOCKS = 2560            # 40960 tokens of KV cache
MAX_SEQS = 16                # max_num_seqs
MAX_BATCHED = 2048           # max_num_batched_tokens (chunked prefill budget)
MAX_N = 16
BUG_NAMES = ["bug1", "bug2", "bug3", "bug4", "bug5"]

# ---------------------------------------------------------------- tokenizer
TOK_RE = re.compile(r"\w+|[^\w\s]")
VOCAB = {}
WORDS = ("the of and to in is that it for on with as was at by be this from or "
         "have an are not but all were when we there can more if will one about "
         "time model token server cache block batch queue request stream engine "
         "value data system result layer memory step green river light stone "
         "quiet north paper signal field").split()


def tok_id(s):
    i = zlib.crc32(s.encode("utf-8")) % 100000 + 100
    VOCAB.setdefault(i, s)
    return i


def tokenize_text(text):
    return [tok_id(m) for m in TOK_RE.findall(text)]


def chat_tokens(messages):
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    ids = []
    for m in messages:
        if not isinstance(m, dict):
            raise ValueError("each message must be an object")
        content = m.get("content") or ""
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        ids += [tok_id("<|start|>"), tok_id(str(m.get("role", "user")))]
        ids += tokenize_text(str(content))
        ids.append(tok_id("<|end|>"))
    ids += [tok_id("<|start|>"), tok_id("assistant")]
    return ids


def detokenize(ids):
    return " ".join(VOCAB.get(int(i), "<%d>" % int(i)) for i in ids)


# ---------------------------------------------------------------- metrics
TTFT_B = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
          5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_B = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
         7.5, 10.0, 20.0, 40.0, 80.0]
REQ_B = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
         60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
LBL = 'model_name="%s"' % MODEL


class Hist:
    def __init__(self, name, doc, buckets):
        self.name, self.doc, self.b = name, doc, buckets
        self.c = [0] * len(buckets)
        self.sum = 0.0
        self.n = 0

    def obs(self, v):
        self.sum += v
        self.n += 1
        for i, b in enumerate(self.b):
            if v <= b:
                self.c[i] += 1

    def render(self):
        out = ["# HELP %s %s" % (self.name, self.doc), "# TYPE %s histogram" % self.name]
        for b, c in zip(self.b, self.c):
            out.append('%s_bucket{le="%s",%s} %s' % (self.name, repr(float(b)), LBL, float(c)))
        out.append('%s_bucket{le="+Inf",%s} %s' % (self.name, LBL, float(self.n)))
        out.append("%s_count{%s} %s" % (self.name, LBL, float(self.n)))
        out.append("%s_sum{%s} %r" % (self.name, LBL, self.sum))
        return out


# ---------------------------------------------------------------- request
class Req:
    def __init__(self, rid, prompt, max_tokens, n, ignore_eos, stream, seed):
        self.id = rid
        self.prompt = prompt
        self.P = len(prompt)
        self.max_tokens = max_tokens
        self.n = n
        self.ignore_eos = ignore_eos
        self.stream = stream
        self.arrival = time.monotonic()
        self.out = [[] for _ in range(n)]
        self.done = [False] * n
        self.reason = [None] * n
        ph = hashlib.sha256((",".join(map(str, prompt))).encode()).hexdigest()[:16]
        self.rngs, self.stop_at = [], []
        for k in range(n):
            rg = random.Random("%s:%s:%d" % (seed, ph, k))
            if ignore_eos or rg.random() < 0.5:
                self.stop_at.append(max_tokens)
            else:
                self.stop_at.append(rg.randint(1, max_tokens))
            self.rngs.append(rg)
        # prefix-cache hash chain over full prompt blocks
        self.hashes = []
        h = "root"
        for bi in range(self.P // BLOCK):
            h = hashlib.blake2b((h + ":" + ",".join(map(str, prompt[bi * BLOCK:(bi + 1) * BLOCK]))).encode(),
                                digest_size=12).hexdigest()
            self.hashes.append(h)
        self.num_computed = 0
        self.target = self.P          # tokens to (re)prefill before decoding
        self.shared, self.dup = [], []
        self.own = [[] for _ in range(n)]
        self.decoded = [0] * n
        self.state = "new"
        self.q = asyncio.Queue()
        self.path = set()
        self.disconnected = False
        self.zombie = False
        self.finished = False
        self.finish_reason = None
        self.first_sched = None
        self.first_tok = None
        self.last_tok = [None] * n
        self.preempted = 0
        self.prompt_counted = False
        self.duptok = 0

    def active(self):
        return [k for k in range(self.n) if not self.done[k]]

    def nblocks(self):
        return len(self.shared) + len(self.dup) + sum(len(o) for o in self.own)


# ---------------------------------------------------------------- engine
class Engine:
    def __init__(self, bugs, seed, gt_path):
        self.bugs = bugs
        self.seed = seed
        self.rng = random.Random(seed)
        self.free = OrderedDict((i, None) for i in range(NUM_BLOCKS))
        self.ref = [0] * NUM_BLOCKS
        self.bhash = [None] * NUM_BLOCKS
        self.cached = {}
        self.waiting = deque()
        self.running = []
        self.wake = asyncio.Event()
        self.warm = False
        self.leaked = 0
        self.gt = open(gt_path, "a", buffering=1)
        self.c = dict(preempt=0, pq=0, ph=0, prompt=0, gen=0)
        self.success = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.h_ttft = Hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_B)
        self.h_itl = Hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_B)
        self.h_e2e = Hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQ_B)
        self.h_queue = Hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", REQ_B)
        self.task = None

    # ---- KV block pool
    def _alloc(self):
        if not self.free:
            return None
        b, _ = self.free.popitem(last=False)
        h = self.bhash[b]
        if h is not None:
            if self.cached.get(h) == b:
                del self.cached[h]
            self.bhash[b] = None
        self.ref[b] = 1
        return b

    def _touch(self, b):
        if self.ref[b] == 0:
            del self.free[b]
        self.ref[b] += 1

    def _release(self, b):
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free[b] = None

    def _grow(self, lst, need):
        while len(lst) < need:
            b = self._alloc()
            if b is None:
                return False
            lst.append(b)
        return True

    def _free_blocks(self, r):
        blocks = r.shared + r.dup + [b for o in r.own for b in o]
        for b in reversed(blocks):
            self._release(b)
        r.shared, r.dup = [], []
        r.own = [[] for _ in range(r.n)]

    def _leak_pressure(self, exclude=None):
        return self.leaked + sum(v.nblocks() for v in self.running if v.zombie and v is not exclude)

    # ---- lifecycle
    def add(self, r):
        r.state = "waiting"
        self.waiting.append(r)
        self.wake.set()

    def abort(self, r, disconnected=True):
        if r.finished or r.zombie:
            return
        r.disconnected = r.disconnected or disconnected
        if ("bug4" in self.bugs and disconnected and r.stream and r.first_tok is None
                and r.state in ("waiting", "running")):
            # abort notification is lost: request keeps running without a client
            r.zombie = True
            r.path.add("bug4")
            return
        self.finish(r, "abort")

    def finish(self, r, reason):
        if r.finished:
            return
        r.finished = True
        r.finish_reason = reason
        now = time.monotonic()
        if r in self.running:
            self.running.remove(r)
        elif r.state == "waiting":
            try:
                self.waiting.remove(r)
            except ValueError:
                pass
        r.state = "finished"
        if (r.zombie and "bug4" in self.bugs
                and self.leaked + r.nblocks() <= NUM_BLOCKS // 2):
            self.leaked += r.nblocks()      # blocks never returned to the pool
            r.shared, r.dup, r.own = [], [], [[] for _ in range(r.n)]
        else:
            self._free_blocks(r)
        self.success[reason] = self.success.get(reason, 0) + 1
        e2e = now - r.arrival
        if reason in ("stop", "length"):
            self.h_e2e.obs(e2e)
        if "none" in self.bugs or not self.bugs:
            r.path.clear()
        rec = {"request_id": r.id, "pathologies": sorted(p for p in r.path if p in self.bugs),
               "client_disconnected": bool(r.disconnected), "finish_reason": reason,
               "e2e_s": round(e2e, 6), "prompt_tokens": r.P,
               "output_tokens": sum(len(o) for o in r.out)}
        try:
            self.gt.write(json.dumps(rec) + "\n")
            self.gt.flush()
        except Exception as e:  # never crash on ground-truth I/O
            print("ground-truth write failed: %s" % e, file=sys.stderr)
        r.q.put_nowait(("done",))

    def _preempt(self, v):
        if v in self.running:
            self.running.remove(v)
        if "bug4" in self.bugs and self._leak_pressure(exclude=v) > 0 and not v.zombie:
            v.path.add("bug4")
        self._free_blocks(v)
        v.num_computed = 0
        v.target = v.P + sum(len(o) for o in v.out)
        v.decoded = [0] * v.n
        v.state = "waiting"
        v.preempted += 1
        self.waiting.appendleft(v)
        self.c["preempt"] += 1

    def _ensure(self, r, fn):
        """Allocate via fn(); on failure preempt the most recently admitted request."""
        while not fn():
            v = self.running[-1]
            if v is r:
                if len(self.running) == 1:
                    self.finish(r, "error")     # cannot fit even alone
                else:
                    self._preempt(r)
                return False
            self._preempt(v)
        return True

    # ---- scheduler
    def schedule(self):
        budget = MAX_BATCHED
        pre, dec = [], []
        order = list(self.running)
        starve = False
        if "bug3" in self.bugs:
            partial = [r for r in order if r.num_computed < r.target and r.num_computed > 0]
            if partial and any(r.num_computed >= r.target for r in order):
                order = partial + [r for r in order if r not in partial]
                starve = True
        preempted_any = False
        for r in order:
            if r.state != "running":
                continue
            if r.num_computed < r.target:
                mult = r.n if ("bug5" in self.bugs and r.n > 1) else 1
                chunk = min(r.target - r.num_computed, budget // mult)
                if chunk <= 0:
                    continue
                end = r.num_computed + chunk
                nb = -(-end // BLOCK)
                npre = len(self.running)
                ok = self._ensure(r, lambda: self._grow(r.shared, nb) and
                                  self._grow(r.dup, (mult - 1) * nb))
                preempted_any |= len(self.running) < npre
                if not ok:
                    continue
                pre.append((r, chunk, mult))
                self._dup_mark(r, chunk, mult)
                budget -= chunk * mult
            else:
                act = r.active()
                if budget < len(act):
                    if starve:
                        r.path.add("bug3")
                    continue
                npre = len(self.running)
                ok = self._ensure(r, lambda: all(self._grow(r.own[k], -(-r.decoded[k] // BLOCK))
                                                  for k in act))
                preempted_any |= len(self.running) < npre
                if not ok:
                    continue
                dec.append((r, act))
                budget -= len(act)
        pre = [p for p in pre if p[0].state == "running"]
        dec = [d for d in dec if d[0].state == "running"]
        if not preempted_any:
            self._admit(budget, pre)
        return pre, dec

    def _dup_mark(self, r, chunk, mult):
        if mult > 1:
            r.duptok += chunk * (mult - 1)
            if r.duptok >= 128:
                r.path.add("bug5")

    def _admit(self, budget, pre):
        nseq = sum(len(r.active()) for r in self.running)
        rotated = []
        rotations = 0
        while self.waiting and budget > 0:
            r = self.waiting[0]
            need_seqs = len(r.active())
            if nseq + need_seqs > MAX_SEQS:
                if "bug4" in self.bugs and sum(len(v.active()) for v in self.running if v.zombie) > 0:
                    r.path.add("bug4")
                break
            if ("bug1" in self.bugs and 1024 < r.P <= 2048 and r.preempted == 0
                    and rotations < len(self.waiting)):
                behind = list(self.waiting)[1:65]
                if any(w.P < r.P for w in behind):
                    self.waiting.rotate(-1)      # skipped and re-queued at the tail
                    rotated.append(r)
                    rotations += 1
                    continue
            hit_blocks = []
            if not r.shared and r.num_computed == 0:
                for h in r.hashes[:(r.target - 1) // BLOCK]:
                    b = self.cached.get(h)
                    if b is None:
                        break
                    hit_blocks.append(b)
            bug2 = False
            if len(hit_blocks) >= 16 and "bug2" in self.bugs and r.P > MAX_BATCHED:
                hit_blocks = []
                bug2 = True
            computed = r.num_computed or len(hit_blocks) * BLOCK
            mult = r.n if ("bug5" in self.bugs and r.n > 1) else 1
            chunk = min(r.target - computed, budget // mult)
            if chunk <= 0:
                break
            nb = -(-(computed + chunk) // BLOCK)
            evictable_hits = sum(1 for b in hit_blocks if self.ref[b] == 0)
            need = (nb - len(hit_blocks)) + (mult - 1) * nb
            if need > len(self.free) - evictable_hits:
                if "bug4" in self.bugs and 0 < need - (len(self.free) - evictable_hits) <= self._leak_pressure():
                    r.path.add("bug4")
                break
            self.waiting.popleft()
            for b in hit_blocks:
                self._touch(b)
            r.shared = list(hit_blocks)
            r.num_computed = computed
            self._grow(r.shared, nb)
            self._grow(r.dup, (mult - 1) * nb)
            if r.first_sched is None:
                r.first_sched = time.monotonic()
                self.h_queue.obs(r.first_sched - r.arrival)
                self.c["pq"] += r.P
                self.c["ph"] += len(hit_blocks) * BLOCK
            if bug2:
                r.path.add("bug2")
            r.state = "running"
            self.running.append(r)
            pre.append((r, chunk, mult))
            self._dup_mark(r, chunk, mult)
            budget -= chunk * mult
            nseq += need_seqs
        for r in rotated:
            if r.state == "waiting":
                r.path.add("bug1")

    # ---- step execution
    def _emit(self, r, k, now):
        text = " " + r.rngs[k].choice(WORDS)
        r.out[k].append(text)
        self.c["gen"] += 1
        fr = None
        if len(r.out[k]) >= r.stop_at[k]:
            r.done[k] = True
            fr = r.reason[k] = "length" if len(r.out[k]) >= r.max_tokens else "stop"
        if r.first_tok is None:
            r.first_tok = now
            self.h_ttft.obs(now - r.arrival)
        if r.last_tok[k] is not None:
            self.h_itl.obs(now - r.last_tok[k])
        r.last_tok[k] = now
        r.q.put_nowait(("tok", k, text, fr))

    def apply(self, pre, dec):
        now = time.monotonic()
        touched = []
        for r, chunk, mult in pre:
            if r.state != "running":
                continue
            old = r.num_computed
            r.num_computed += chunk
            for bi in range(old // BLOCK, min(r.num_computed, r.P) // BLOCK):
                h = r.hashes[bi]
                b = r.shared[bi]
                if h not in self.cached and self.bhash[b] is None:
                    self.cached[h] = b
                    self.bhash[b] = h
            if r.num_computed >= r.target:
                if not r.prompt_counted:
                    r.prompt_counted = True
                    self.c["prompt"] += r.P
                for k in r.active():
                    self._emit(r, k, now)
                    r.decoded[k] = 1
                touched.append(r)
        for r, act in dec:
            if r.state != "running":
                continue
            for k in act:
                if not r.done[k]:
                    self._emit(r, k, now)
                    r.decoded[k] += 1
            touched.append(r)
        for r in touched:
            if not r.finished and all(r.done):
                reasons = [x for x in r.reason if x]
                self.finish(r, "length" if all(x == "length" for x in reasons) else "stop")

    def step_cost(self, pre, dec):
        nseq = sum(len(a) for _, a in dec) + len(pre)
        ptok = sum(c * m for _, c, m in pre)
        ctx = sum((r.target + r.decoded[k]) for r, a in dec for k in a)
        cost = 0.006 + 0.0001 * nseq + 0.00012 * ptok + 2e-7 * ctx
        cost *= 1.0 + 0.004 * nseq              # slightly slower with larger batches
        cost += self.rng.uniform(0.0, 0.002)    # jitter
        if not self.warm:
            self.warm = True
            cost += 0.3                         # one-time warm-up (graph capture etc.)
        return cost

    async def run(self):
        while True:
            try:
                if not self.running and not self.waiting:
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                pre, dec = self.schedule()
                if not pre and not dec:
                    await asyncio.sleep(0.005)
                    continue
                await asyncio.sleep(self.step_cost(pre, dec))
                self.apply(pre, dec)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep the engine alive no matter what
                print("engine error: %r" % e, file=sys.stderr)
                await asyncio.sleep(0.01)

    def shutdown(self):
        for r in list(self.running) + list(self.waiting):
            r.zombie = False
            self.finish(r, "abort")
        try:
            self.gt.close()
        except Exception:
            pass

    def metrics(self):
        L = []

        def g(name, doc, val, typ="gauge", extra=""):
            L.append("# HELP %s %s" % (name, doc))
            L.append("# TYPE %s %s" % (name, typ))
            L.append("%s%s{%s%s} %s" % (name, "_total" if typ == "counter" else "", LBL, extra, float(val)))

        g("vllm:num_requests_running", "Number of requests in model execution batches.", len(self.running))
        g("vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(self.waiting))
        g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
          (NUM_BLOCKS - len(self.free)) / NUM_BLOCKS)
        g("vllm:num_preemptions", "Cumulative number of preemption from the engine.", self.c["preempt"], "counter")
        g("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
          self.c["pq"], "counter")
        g("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", self.c["ph"], "counter")
        g("vllm:prompt_tokens", "Number of prefill tokens processed.", self.c["prompt"], "counter")
        g("vllm:generation_tokens", "Number of generation tokens processed.", self.c["gen"], "counter")
        L.append("# HELP vllm:request_success_total Count of successfully processed requests.")
        L.append("# TYPE vllm:request_success_total counter")
        for k, v in self.success.items():
            L.append('vllm:request_success_total{finished_reason="%s",%s} %s' % (k, LBL, float(v)))
        for h in (self.h_ttft, self.h_itl, self.h_e2e, self.h_queue):
            L += h.render()
        L.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig")
        L.append("# TYPE vllm:cache_config_info gauge")
        L.append('vllm:cache_config_info{block_size="%d",cache_dtype="auto",enable_prefix_caching="True",'
                 'gpu_memory_utilization="0.9",num_gpu_blocks="%d",%s} 1.0' % (BLOCK, NUM_BLOCKS, LBL))
        return "\n".join(L) + "\n"


# ---------------------------------------------------------------- HTTP layer
def jdump(o):
    return json.dumps(o, separators=(",", ":"))


def err(status, msg, headers=None, typ="BadRequestError"):
    return web.json_response({"object": "error", "message": msg, "type": typ, "param": None,
                              "code": status}, status=status, headers=headers)


class Server:
    def __init__(self, engine):
        self.engine = engine
        self.created = int(time.time())

    async def _next(self, r, request):
        while True:
            if not r.q.empty():
                return r.q.get_nowait()
            try:
                return await asyncio.wait_for(r.q.get(), 0.2)
            except asyncio.TimeoutError:
                tr = request.transport
                if tr is None or tr.is_closing():
                    return None

    def _parse(self, body, chat):
        if not isinstance(body, dict):
            raise ValueError("request body must be a JSON object")
        if chat:
            toks = chat_tokens(body.get("messages"))
        else:
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
                p = p[0]
            if isinstance(p, str):
                toks = tokenize_text(p)
            elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
                toks = list(p)
            else:
                raise ValueError("'prompt' must be a string or a list of token ids")
        if not toks:
            raise ValueError("The prompt cannot be empty")
        mt = body.get("max_tokens", body.get("max_completion_tokens"))
        if mt is None:
            mt = MAX_MODEL_LEN - len(toks)
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise ValueError("max_tokens must be at least 1, got %r." % (mt,))
        n = body.get("n", 1)
        if n is None:
            n = 1
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
            raise ValueError("n must be an integer between 1 and %d, got %r." % (MAX_N, n))
        if len(toks) + mt > MAX_MODEL_LEN:
            raise ValueError(
                "This model's maximum context length is %d tokens. However, you requested %d tokens "
                "(%d in the messages, %d in the completion). Please reduce the length of the messages "
                "or completion." % (MAX_MODEL_LEN, len(toks) + mt, len(toks), mt))
        if n * -(-(len(toks) + mt) // BLOCK) > NUM_BLOCKS // 2:
            raise ValueError("Requested n=%d sequences of %d tokens exceed the KV cache capacity."
                             % (n, len(toks) + mt))
        so = body.get("stream_options") or {}
        return (toks, mt, n, bool(body.get("ignore_eos", False)), bool(body.get("stream", False)),
                bool(isinstance(so, dict) and so.get("include_usage")))

    async def generate(self, request, chat):
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        hdrs = {"X-Request-Id": rid}
        try:
            body = json.loads(await request.read())
        except Exception:
            return err(400, "Invalid JSON in request body.", hdrs)
        try:
            toks, mt, n, ignore_eos, stream, usage = self._parse(body, chat)
        except (ValueError, TypeError, AttributeError) as e:
            return err(400, str(e), hdrs)
        r = Req(rid, toks, mt, n, ignore_eos, stream, self.engine.seed)
        oid = ("chatcmpl-" if chat else "cmpl-") + rid
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        model = body.get("model") or MODEL
        try:
            if stream:
                return await self._stream(request, r, chat, oid, obj, created, model, usage, hdrs)
            return await self._full(request, r, chat, oid, created, model, hdrs)
        finally:
            if not r.finished:
                self.engine.abort(r)

    def _usage(self, r):
        c = sum(len(o) for o in r.out)
        return {"prompt_tokens": r.P, "total_tokens": r.P + c, "completion_tokens": c}

    async def _stream(self, request, r, chat, oid, obj, created, model, usage, hdrs):
        resp = web.StreamResponse(status=200, headers=dict(hdrs, **{
            "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}))
        await resp.prepare(request)
        self.engine.add(r)
        role_sent = [False] * r.n
        head = {"id": oid, "object": obj, "created": created, "model": model}
        try:
            while True:
                ev = await self._next(r, request)
                if ev is None:
                    self.engine.abort(r)
                    return resp
                if ev[0] == "done":
                    break
                _, k, text, fr = ev
                parts = []
                if chat:
                    if not role_sent[k]:
                        role_sent[k] = True
                        parts.append(dict(head, choices=[{"index": k, "delta": {"role": "assistant", "content": ""},
                                                          "logprobs": None, "finish_reason": None}]))
                    parts.append(dict(head, choices=[{"index": k, "delta": {"content": text},
                                                      "logprobs": None, "finish_reason": fr}]))
                else:
                    parts.append(dict(head, choices=[{"index": k, "text": text, "logprobs": None,
                                                      "finish_reason": fr, "stop_reason": None}]))
                await resp.write("".join("data: %s\n\n" % jdump(p) for p in parts).encode())
            if r.finish_reason == "error":
                await resp.write(("data: %s\n\n" % jdump({"object": "error", "message": "request failed",
                                                           "type": "InternalServerError", "code": 500})).encode())
            elif usage:
                await resp.write(("data: %s\n\n" % jdump(dict(head, choices=[], usage=self._usage(r)))).encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            self.engine.abort(r)
        except asyncio.CancelledError:
            self.engine.abort(r)
            raise
        return resp

    async def _full(self, request, r, chat, oid, created, model, hdrs):
        self.engine.add(r)
        try:
            while not r.finished:
                ev = await self._next(r, request)
                if ev is None:
                    self.engine.abort(r)
                    return web.Response(status=499, headers=hdrs)
        except asyncio.CancelledError:
            self.engine.abort(r)
            raise
        if r.finish_reason == "error":
            return err(500, "request failed in the engine", hdrs, "InternalServerError")
        choices = []
        for k in range(r.n):
            text = "".join(r.out[k])
            fr = r.reason[k] or r.finish_reason
            if chat:
                choices.append({"index": k, "message": {"role": "assistant", "content": text, "tool_calls": []},
                                "logprobs": None, "finish_reason": fr, "stop_reason": None})
            else:
                choices.append({"index": k, "text": text, "logprobs": None, "finish_reason": fr,
                                "stop_reason": None, "prompt_logprobs": None})
        return web.json_response({"id": oid, "object": "chat.completion" if chat else "text_completion",
                                  "created": created, "model": model, "choices": choices,
                                  "usage": self._usage(r)}, headers=hdrs, dumps=jdump)

    async def completions(self, request):
        return await self.generate(request, False)

    async def chat(self, request):
        return await self.generate(request, True)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{
            "id": MODEL, "object": "model", "created": self.created, "owned_by": "vllm", "root": MODEL,
            "parent": None, "max_model_len": MAX_MODEL_LEN, "permission": []}]})

    async def health(self, request):
        return web.Response(status=200)

    async def version(self, request):
        return web.json_response({"version": VERSION})

    async def metrics(self, request):
        return web.Response(text=self.engine.metrics(), content_type="text/plain", charset="utf-8")

    async def tokenize(self, request):
        try:
            body = json.loads(await request.read())
            if "messages" in body:
                toks = chat_tokens(body["messages"])
            elif isinstance(body.get("prompt"), str):
                toks = tokenize_text(body["prompt"])
            else:
                raise ValueError("expected 'prompt' (string) or 'messages'")
        except Exception as e:
            return err(400, "Invalid tokenize request: %s" % e)
        return web.json_response({"count": len(toks), "max_model_len": MAX_MODEL_LEN, "tokens": toks})

    async def detokenize(self, request):
        try:
            body = json.loads(await request.read())
            toks = body["tokens"]
            if not isinstance(toks, list):
                raise ValueError("'tokens' must be a list")
            text = detokenize(toks)
        except Exception as e:
            return err(400, "Invalid detokenize request: %s" % e)
        return web.json_response({"prompt": text})


async def amain(args):
    if args.bugs in ("none", ""):
        bugs = set()
    elif args.bugs == "all":
        bugs = set(BUG_NAMES)
    else:
        bugs = {b.strip() for b in args.bugs.split(",") if b.strip()}
        bad = bugs - set(BUG_NAMES)
        if bad:
            print("unknown bug name(s): %s; known: %s" % (",".join(sorted(bad)), ",".join(BUG_NAMES)),
                  file=sys.stderr)
            sys.exit(2)
    engine = Engine(bugs, args.seed, args.ground_truth)
    srv = Server(engine)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", srv.completions)
    app.router.add_post("/v1/chat/completions", srv.chat)
    app.router.add_get("/v1/models", srv.models)
    app.router.add_get("/health", srv.health)
    app.router.add_get("/version", srv.version)
    app.router.add_get("/metrics", srv.metrics)
    app.router.add_post("/tokenize", srv.tokenize)
    app.router.add_post("/detokenize", srv.detokenize)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    engine.task = asyncio.create_task(engine.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, stop.set)
    print("heldout5 simulator listening on http://%s:%d (bugs=%s)" %
          (args.host, args.port, ",".join(sorted(bugs)) or "none"), flush=True)
    await stop.wait()
    engine.task.cancel()
    engine.shutdown()
    try:
        await asyncio.wait_for(runner.cleanup(), 3.0)
    except Exception:
        pass


def main():
    ap = argparse.ArgumentParser(description="vLLM-like inference server simulator")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--bugs", default="none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ground-truth", required=True)
    args = ap.parse_args()
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
