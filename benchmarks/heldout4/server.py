#!/usr/bin/env python3
"""Simulated vLLM V1 OpenAI-compatible server (single file, real-time).

Deployment modelled: meta-llama/Llama-3.1-8B-Instruct-FP8 (W8A8) on a single
NVIDIA L4 24 GB, KV cache in BF16, gpu_memory_utilization 0.62.  See README.md
for the derivation of the KV block count and per-step costs.

Only the standard library and aiohttp are used.
"""
import argparse
import asyncio
import collections
import json
import math
import random
import sys
import time
import uuid
import zlib

from aiohttp import web

VLLM_VERSION = "0.11.0"
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct-FP8"
BLOCK_SIZE = 16
VOCAB_SIZE = 128256
EOS_ID = 128009
ALL_FAULTS = ["bug%d" % i for i in range(1, 9)]

# ---------------------------------------------------------------------------
# Cost model constants (seconds).  Derivation in README.md.
# ---------------------------------------------------------------------------
T_STEP_OVERHEAD = 2.6e-3          # scheduler, input prep, graph launch, output processing
T_WEIGHT_STREAM = 31.5e-3         # 8.03 GB of weights read per forward at ~255 GB/s
T_LINEAR_PER_TOKEN = 0.102e-3     # 16.06 GFLOP/token at ~157 effective FP8 TFLOPS
T_KV_READ_PER_TOKEN = 0.514e-6    # 128 KiB of KV per context token at ~255 GB/s
T_ATTN_PER_PAIR = 3.34e-9         # causal attention FLOPs per (query, key) pair
T_SAMPLE_ROW = 15e-6              # per sampled row
T_LOGPROBS_ROW = 0.35e-3          # log_softmax over 128k vocab + top-k + D2H for one row
T_LOGPROBS_PER_K = 0.01e-3
T_SEEDED_ROW = 0.12e-3            # per-request torch.Generator path
T_NONGRAPH_FIXED = 30e-3
T_NONGRAPH_ROW = 0.3e-3
LONG_PROMPT_TOKENS = 3072
HOLD_MAX_S = 0.75
DEFERRED_FREE_S = 4.0

GEN_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his "
    "from at which but have an they you were her she there been one all we their "
    "has would when if so no will more other its some what time only into them can "
    "two may then these about first any new like our could over such also after "
    "model token server request latency batch cache block queue memory stream value "
    "system result number point data level order world state market light river "
    "north south green quiet simple rapid gentle bright silver golden ancient modern "
    "careful honest yellow purple window garden forest mountain ocean island valley "
    "engine signal circuit planet rocket bridge castle harbor meadow canyon desert").split()


def cdiv(a, b):
    return -(-a // b)


# ---------------------------------------------------------------------------
# Fake tokenizer: whitespace-separated words are tokens.
# ---------------------------------------------------------------------------
class Tokenizer:
    def __init__(self):
        self.id2word = {}

    def word_id(self, w):
        i = 1000 + zlib.crc32(w.encode("utf-8", "surrogatepass")) % 126000
        if i not in self.id2word:
            self.id2word[i] = w
        return i

    def encode(self, text):
        return [self.word_id(w) for w in text.split()]

    def token_str(self, i):
        if i == EOS_ID:
            return "<|eot_id|>"
        return self.id2word.get(i, "<t%d>" % i)

    def decode(self, ids):
        return " ".join(self.token_str(i) for i in ids)


TOK = Tokenizer()
GEN_IDS = [TOK.word_id(w) for w in GEN_WORDS]


def chat_template(messages, add_generation_prompt=True):
    parts = ["<|begin_of_text|>"]
    for m in messages:
        if not isinstance(m, dict):
            raise ValueError("each message must be an object")
        role = str(m.get("role", "user"))
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
            content = " ".join(texts)
        parts.append("<|start_header_id|> %s <|end_header_id|> %s <|eot_id|>" % (role, content))
    if add_generation_prompt:
        parts.append("<|start_header_id|> assistant <|end_header_id|>")
    return " ".join(parts)


# ---------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------
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
        out = ["# HELP %s %s" % (self.name, self.doc), "# TYPE %s histogram" % self.name]
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append('%s_bucket{%s,le="%s"} %d' % (self.name, labels, repr(float(b)), acc))
        out.append('%s_bucket{%s,le="+Inf"} %d' % (self.name, labels, self.count))
        out.append("%s_count{%s} %d" % (self.name, labels, self.count))
        out.append("%s_sum{%s} %r" % (self.name, labels, self.sum))
        return out


TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0]
REQ_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]
ITER_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


class Metrics:
    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.success = collections.Counter()
        self.h = {
            "ttft": Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS),
            "itl": Histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
            "tpot": Histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", ITL_BUCKETS),
            "e2e": Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQ_BUCKETS),
            "queue": Histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQ_BUCKETS),
            "prefill": Histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQ_BUCKETS),
            "decode": Histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQ_BUCKETS),
            "inference": Histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQ_BUCKETS),
            "req_prompt": Histogram("vllm:request_prompt_tokens",
                                    "Number of prefill tokens processed.", TOKEN_BUCKETS),
            "req_gen": Histogram("vllm:request_generation_tokens",
                                 "Number of generation tokens processed.", TOKEN_BUCKETS),
            "iter": Histogram("vllm:iteration_tokens_total",
                              "Histogram of number of tokens per engine_step.", ITER_BUCKETS),
        }


# ---------------------------------------------------------------------------
# KV cache: paged blocks with a hash-based prefix cache and an LRU free queue.
# ---------------------------------------------------------------------------
class Block:
    __slots__ = ("id", "ref", "h")

    def __init__(self, i):
        self.id, self.ref, self.h = i, 0, None


class KVCacheManager:
    def __init__(self, num_blocks, caching):
        self.caching = caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block 0 is the null block, never handed out
        self.free = collections.OrderedDict((i, None) for i in range(1, num_blocks))
        self.usable = num_blocks - 1
        self.cached = {}
        self.held = []  # (time, [blocks])

    def num_free(self):
        return len(self.free)

    def usage(self):
        return 1.0 - len(self.free) / self.usable

    def held_exclusive(self):
        return sum(1 for _, bl in self.held for b in bl if b.ref == 1)

    @staticmethod
    def block_hashes(seq, n):
        hs = seq.hashes
        while len(hs) < n:
            i = len(hs)
            a, b = i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE
            p = seq.prompt
            toks = p[a:b] if b <= len(p) else (p + seq.out)[a:b]
            hs.append(hash((hs[-1] if hs else 0, tuple(toks))))
        return hs

    def lookup(self, seq):
        if not self.caching:
            return [], 0
        nb = (seq.num_tokens - 1) // BLOCK_SIZE
        hits = []
        for h in self.block_hashes(seq, nb)[:nb]:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * BLOCK_SIZE

    def blocks_needed(self, seq, num_new, hits=()):
        total = seq.ncomp + len(hits) * BLOCK_SIZE + num_new
        need = cdiv(total, BLOCK_SIZE) - len(seq.blocks) - len(hits)
        evictable = sum(1 for b in hits if b.ref == 0)
        return need, evictable

    def can_allocate(self, seq, num_new, hits=()):
        need, evictable = self.blocks_needed(seq, num_new, hits)
        return need <= len(self.free) - evictable

    def allocate(self, seq, num_new, hits=()):
        need, evictable = self.blocks_needed(seq, num_new, hits)
        if need > len(self.free) - evictable:
            return False
        for b in hits:
            if b.ref == 0:
                del self.free[b.id]
            b.ref += 1
        seq.blocks.extend(hits)
        for _ in range(max(0, need)):
            bid, _ = self.free.popitem(last=False)
            b = self.blocks[bid]
            if b.h is not None:
                if self.cached.get(b.h) is b:
                    del self.cached[b.h]
                b.h = None
            b.ref = 1
            seq.blocks.append(b)
        if self.caching:
            total = seq.ncomp + len(hits) * BLOCK_SIZE + num_new
            nfull = min(total, seq.num_tokens) // BLOCK_SIZE
            if nfull > seq.ncached:
                hs = self.block_hashes(seq, nfull)
                for i in range(seq.ncached, nfull):
                    b = seq.blocks[i]
                    if b.h is None:
                        b.h = hs[i]
                        self.cached.setdefault(b.h, b)
                seq.ncached = nfull
        return True

    def _release(self, blocks):
        for b in reversed(blocks):
            b.ref -= 1
            if b.ref == 0:
                self.free[b.id] = None

    def free_seq(self, seq):
        self._release(seq.blocks)
        seq.blocks = []
        seq.ncached = 0

    def detach_seq(self, seq, now):
        if seq.blocks:
            self.held.append((now, seq.blocks))
        seq.blocks = []
        seq.ncached = 0

    def sweep(self, now):
        if not self.held:
            return
        keep = []
        for t, bl in self.held:
            if now - t >= DEFERRED_FREE_S:
                self._release(bl)
            else:
                keep.append((t, bl))
        self.held = keep


# ---------------------------------------------------------------------------
# Engine requests
# ---------------------------------------------------------------------------
WAITING, RUNNING, FINISHED = "WAITING", "RUNNING", "FINISHED"


class Seq:
    _counter = 0

    def __init__(self, client, index, prompt, params, rng):
        Seq._counter += 1
        self.no = Seq._counter
        self.client = client
        self.index = index
        self.rid = "%s-%d" % (client.rid, index)
        self.prompt = prompt
        self.out = []
        self.max_tokens = params["max_tokens"]
        self.ignore_eos = params["ignore_eos"]
        self.nlp = params["logprobs"]
        self.seeded = params["seed"] is not None
        self.rng = rng
        self.eos_at = self._eos_position()
        self.status = WAITING
        self.ncomp = 0
        self.ncached = 0
        self.blocks = []
        self.hashes = []
        self.arrival = time.monotonic()
        self.first_sched = None
        self.first_tok = None
        self.last_tok = None
        self.num_preemptions = 0
        self.finish_reason = None

    def _eos_position(self):
        if self.ignore_eos:
            return None
        if self.rng.random() < 0.25:
            return self.rng.randint(16, 512)
        return None

    @property
    def num_tokens(self):
        return len(self.prompt) + len(self.out)

    def tag(self, name):
        self.client.tags.add(name)


class ClientRequest:
    def __init__(self, rid, kind, n, stream, prompt, params):
        self.rid = rid
        self.kind = kind
        self.n = n
        self.stream = stream
        self.prompt = prompt
        self.params = params
        self.arrival = time.monotonic()
        self.queue = asyncio.Queue()
        self.tags = set()
        self.disconnected = False
        self.children = []
        self.pending = []   # children not yet submitted to the engine
        self.finished = 0
        self.reasons = {}
        self.completion_tokens = 0
        self.recorded = False


# ---------------------------------------------------------------------------
# Engine core: vLLM V1-style scheduler + simulated model runner
# ---------------------------------------------------------------------------
class Engine:
    def __init__(self, args, faults):
        self.args = args
        self.faults = set(faults)
        self.max_num_seqs = args.max_num_seqs
        self.max_batched = args.max_num_batched_tokens
        self.max_model_len = args.max_model_len
        self.threshold = args.long_prefill_token_threshold or 0
        self.kv = KVCacheManager(args.num_gpu_blocks, not args.no_enable_prefix_caching)
        self.waiting = collections.deque()
        self.running = []
        self.metrics = Metrics()
        self.jitter = random.Random(args.seed)
        self.sampler_seed = random.Random(args.seed * 7919 + 17)
        self.wake = asyncio.Event()
        self.gt_path = args.ground_truth
        self.gt_file = open(self.gt_path, "a", buffering=1) if self.gt_path else None
        self.steps = 0
        self.stopping = False

    # ----- request lifecycle -------------------------------------------------
    def make_rng(self, client, index):
        p = client.params
        if p["seed"] is not None:
            return random.Random(hash((int(p["seed"]), index)))
        if p["temperature"] == 0:
            return random.Random(hash((tuple(client.prompt[:64]), len(client.prompt))))
        return random.Random(self.sampler_seed.getrandbits(64))

    def submit(self, client):
        client.children = [Seq(client, i, client.prompt, client.params, self.make_rng(client, i))
                           for i in range(client.n)]
        first = self._spawn_children(client)
        for s in first:
            self._enqueue(s)

    def _spawn_children(self, client):
        if "bug6" in self.faults and client.n > 1 and client.stream:
            client.pending = list(client.children[1:])
            return client.children[:1]
        return list(client.children)

    def _enqueue(self, s):
        s.arrival = time.monotonic()
        self.waiting.append(s)
        self.wake.set()

    def abort_client(self, client):
        for s in list(client.pending):
            client.pending.remove(s)
            self._finish(s, "abort", freed=True)
        for s in client.children:
            if s.status != FINISHED:
                self.abort(s)

    def abort(self, s):
        if s.status == FINISHED:
            return
        if s in self.waiting:
            self.waiting.remove(s)
        if s in self.running:
            self.running.remove(s)
        if self._release_on_abort(s):
            self.kv.detach_seq(s, time.monotonic())
        else:
            self.kv.free_seq(s)
        self._finish(s, "abort", freed=True)

    def _release_on_abort(self, s):
        return ("bug7" in self.faults and s.status == RUNNING and s.ncomp < len(s.prompt)
                and bool(s.blocks))

    def _finish(self, s, reason, freed=False):
        if s.status == FINISHED:
            return
        if not freed:
            self.kv.free_seq(s)
        s.status = FINISHED
        s.finish_reason = reason
        now = time.monotonic()
        c = s.client
        m = self.metrics
        m.success[reason] += 1
        if reason != "abort":
            m.h["e2e"].observe(now - s.arrival)
            m.h["req_prompt"].observe(len(s.prompt))
            m.h["req_gen"].observe(len(s.out))
            if s.first_sched is not None:
                m.h["queue"].observe(s.first_sched - s.arrival)
                m.h["inference"].observe(now - s.first_sched)
                if s.first_tok is not None:
                    m.h["prefill"].observe(s.first_tok - s.first_sched)
                    m.h["decode"].observe(now - s.first_tok)
            if s.first_tok is not None and len(s.out) > 1:
                m.h["tpot"].observe((now - s.first_tok) / (len(s.out) - 1))
        c.finished += 1
        c.reasons[s.index] = reason
        c.completion_tokens += len(s.out)
        c.queue.put_nowait(("fin", s.index, reason))
        if reason != "abort" and c.pending:
            nxt = c.pending.pop(0)
            c.tags.add("bug6")
            self._enqueue(nxt)
        if c.finished >= c.n:
            self.record(c)

    def record(self, c):
        if c.recorded:
            return
        c.recorded = True
        rs = set(c.reasons.values())
        fr = "abort" if "abort" in rs else ("length" if "length" in rs else "stop")
        if self.gt_file:
            line = {"request_id": c.rid, "pathologies": sorted(c.tags),
                    "client_disconnected": c.disconnected, "finish_reason": fr,
                    "e2e_s": round(time.monotonic() - c.arrival, 6)}
            self.gt_file.write(json.dumps(line) + "\n")
            self.gt_file.flush()

    # ----- scheduling ---------------------------------------------------------
    def _victim_index(self, running):
        if "bug4" in self.faults and len(running) > 1:
            return 0
        return len(running) - 1

    def _preempt(self, v):
        self.kv.free_seq(v)
        v.status = WAITING
        v.ncomp = 0
        v.num_preemptions += 1
        self.metrics.preemptions += 1
        self.waiting.appendleft(v)

    def _short_on_blocks(self, s, n, hits=()):
        held = self.kv.held_exclusive()
        if not held:
            return False
        need, ev = self.kv.blocks_needed(s, n, hits)
        return need <= len(self.kv.free) - ev + held

    def _prefill_span(self, s, nhit, budget):
        n = s.num_tokens - nhit
        if ("bug3" in self.faults and not s.out and nhit == 0 and s.num_preemptions == 0
                and len(s.prompt) > LONG_PROMPT_TOKENS):
            return n, True
        if self.threshold and n > self.threshold:
            n = self.threshold
        return min(n, budget), False

    def _admission_hold(self, now):
        if "bug8" not in self.faults or len(self.waiting) < 4 or len(self.waiting) >= 16:
            return False
        if not any(s.ncomp >= len(s.prompt) for s in self.running):
            return False
        head = self.waiting[0]
        return not head.num_preemptions and now - head.arrival < HOLD_MAX_S

    def _admission_order(self):
        if "bug5" not in self.faults or len(self.waiting) < 4:
            return None
        hits = {}
        warm = 0
        for s in self.waiting:
            if s.num_preemptions:
                return None
            _, nh = self.kv.lookup(s)
            hits[s] = nh
            if nh >= BLOCK_SIZE:
                warm += 1
        if warm < 3:
            return None
        pos = {s: i for i, s in enumerate(self.waiting)}
        self.waiting = collections.deque(sorted(self.waiting, key=lambda s: (-hits[s], pos[s])))
        return pos

    def schedule(self):
        now = time.monotonic()
        budget = self.max_batched
        sched = {}
        running = self.running
        preempted = False
        oversized = None
        i = 0
        while i < len(running) and budget > 0:
            s = running[i]
            n = s.num_tokens - s.ncomp
            if self.threshold and n > self.threshold:
                n = self.threshold
            n = min(n, budget)
            if n <= 0:
                i += 1
                continue
            ok = True
            while not self.kv.allocate(s, n):
                short = self._short_on_blocks(s, n)
                vi = self._victim_index(running)
                v = running.pop(vi)
                if vi < i:
                    i -= 1
                if v in sched:
                    budget += sched.pop(v)
                if vi != len(running):
                    v.tag("bug4")
                if short:
                    v.tag("bug7")
                self._preempt(v)
                preempted = True
                if v is s:
                    ok = False
                    break
            if not ok:
                break
            sched[s] = n
            budget -= n
            i += 1

        if not preempted and self.waiting and budget > 0 and len(running) < self.max_num_seqs:
            if self._admission_hold(now):
                k = min(len(self.waiting), self.max_num_seqs - len(running))
                for s in list(self.waiting)[:k]:
                    s.tag("bug8")
            else:
                pos = self._admission_order()
                admitted = []
                while self.waiting and budget > 0:
                    if len(running) >= self.max_num_seqs:
                        break
                    s = self.waiting[0]
                    hits, nhit = self.kv.lookup(s)
                    n, big = self._prefill_span(s, nhit, budget)
                    if not self.kv.allocate(s, n, hits):
                        if self._short_on_blocks(s, n, hits):
                            s.tag("bug7")
                        break
                    self.waiting.popleft()
                    running.append(s)
                    s.status = RUNNING
                    s.ncomp = nhit
                    if s.first_sched is None:
                        s.first_sched = now
                    self.metrics.prefix_queries += s.num_tokens
                    self.metrics.prefix_hits += nhit
                    sched[s] = n
                    budget -= n
                    admitted.append(s)
                    if big and budget < 0:
                        oversized = s
                if pos is not None:
                    rest = sorted(self.waiting, key=lambda s: pos[s])
                    self.waiting = collections.deque(rest)
                    if admitted and rest:
                        last = max(pos[a] for a in admitted)
                        for w in rest:
                            if pos[w] < last:
                                w.tag("bug5")
        if oversized is not None:
            for s in sched:
                if s is not oversized:
                    s.tag("bug3")
        return sched

    # ----- cost model ---------------------------------------------------------
    def step_time(self, sched):
        tokens = 0
        kv_read = 0
        pairs = 0
        rows = 0
        extra = 0.0
        for s, n in sched.items():
            tokens += n
            c = s.ncomp
            if n == 1:
                kv_read += c
            else:
                pairs += n * c + n * (n + 1) // 2
                kv_read += c
            if c + n >= s.num_tokens:
                rows += 1
                if s.nlp is not None:
                    extra += T_LOGPROBS_ROW + T_LOGPROBS_PER_K * s.nlp
                if s.seeded:
                    extra += T_SEEDED_ROW
        lin = tokens * T_LINEAR_PER_TOKEN
        mm = max(T_WEIGHT_STREAM, lin) + 0.15 * min(T_WEIGHT_STREAM, lin)
        t = (T_STEP_OVERHEAD + mm + kv_read * T_KV_READ_PER_TOKEN + pairs * T_ATTN_PER_PAIR
             + rows * T_SAMPLE_ROW + extra)
        t += self._sampler_mode_cost(sched)
        self.metrics.h["iter"].observe(tokens)
        return t * min(1.06, max(0.96, 1.0 + self.jitter.gauss(0.0, 0.015)))

    def _sampler_mode_cost(self, sched):
        if "bug2" not in self.faults:
            return 0.0
        if not any(s.nlp is not None and s.nlp >= 5 for s in sched):
            return 0.0
        for s in sched:
            s.tag("bug2")
        return T_NONGRAPH_FIXED + T_NONGRAPH_ROW * len(sched)

    # ----- model output processing ---------------------------------------------
    def update(self, sched):
        now = time.monotonic()
        m = self.metrics
        for s, n in sched.items():
            if s.status != RUNNING:
                continue
            s.ncomp += n
            if s.ncomp < s.num_tokens:
                continue
            tok, lp = self.sample(s)
            s.out.append(tok)
            m.generation_tokens += 1
            if s.first_tok is None:
                m.prompt_tokens += len(s.prompt)
                s.first_tok = now
                m.h["ttft"].observe(now - s.arrival)
            else:
                m.h["itl"].observe(now - s.last_tok)
            s.last_tok = now
            reason = None
            if tok == EOS_ID:
                reason = "stop"
            elif len(s.out) >= s.max_tokens or s.num_tokens >= self.max_model_len:
                reason = "length"
            s.client.queue.put_nowait(("tok", s.index, tok, lp, reason))
            if reason:
                self.running.remove(s)
                self._finish(s, reason)

    def sample(self, s):
        if s.eos_at is not None and len(s.out) + 1 >= s.eos_at:
            tok = EOS_ID
        else:
            tok = GEN_IDS[s.rng.randrange(len(GEN_IDS))]
        lp = None
        if s.nlp is not None:
            chosen = -round(s.rng.random() * 2.0, 4)
            top = {}
            for _ in range(max(0, s.nlp)):
                alt = GEN_IDS[s.rng.randrange(len(GEN_IDS))]
                top[alt] = -round(s.rng.random() * 6.0 + 0.1, 4)
            if s.nlp:
                top[tok] = chosen
            lp = (chosen, top)
        return tok, lp

    # ----- main loop ------------------------------------------------------------
    async def run(self):
        while not self.stopping:
            self.kv.sweep(time.monotonic())
            if not self.running and not self.waiting:
                self.wake.clear()
                if self.kv.held:
                    try:
                        await asyncio.wait_for(self.wake.wait(), 0.5)
                    except asyncio.TimeoutError:
                        pass
                else:
                    await self.wake.wait()
                continue
            t0 = time.monotonic()
            sched = self.schedule()
            self.steps += 1
            if not sched:
                await asyncio.sleep(0.005)
                continue
            dur = self.step_time(sched)
            delay = t0 + dur - time.monotonic()
            await asyncio.sleep(max(0.0, delay))
            self.update(sched)


# ---------------------------------------------------------------------------
# HTTP layer (OpenAI-compatible)
# ---------------------------------------------------------------------------
class BadRequest(Exception):
    def __init__(self, msg, status=400, etype="BadRequestError"):
        super().__init__(msg)
        self.status = status
        self.etype = etype


def error_response(msg, status=400, etype="BadRequestError"):
    return web.json_response({"object": "error", "message": msg, "type": etype,
                              "param": None, "code": status}, status=status)


class Server:
    def __init__(self, args):
        self.args = args
        faults = parse_faults(args.bugs)
        self.engine = Engine(args, faults)
        self.model = args.served_model_name
        self.start_time = int(time.time())

    # ----- helpers ------------------------------------------------------------
    def _rid(self, request):
        return request.headers.get("X-Request-Id") or uuid.uuid4().hex

    def _check_model(self, body):
        m = body.get("model")
        if m is not None and m != self.model:
            raise BadRequest("The model `%s` does not exist." % m, 404, "NotFoundError")

    @staticmethod
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

    def _common_params(self, body, prompt_len, default_max, max_key_value):
        temperature = body.get("temperature", 1.0)
        if temperature is None:
            temperature = 1.0
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise BadRequest("temperature must be non-negative")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest("seed must be an integer")
        n = self._int(body, "n", 1, 1, 16)
        mml = self.args.max_model_len
        if prompt_len == 0:
            raise BadRequest("The prompt cannot be empty.")
        if prompt_len >= mml:
            raise BadRequest(
                "This model's maximum context length is %d tokens. However, your request has %d "
                "input tokens. Please reduce the length of the input messages." % (mml, prompt_len))
        if max_key_value is None:
            max_tokens = default_max if default_max is not None else mml - prompt_len
        else:
            max_tokens = max_key_value
            if max_tokens < 1:
                raise BadRequest("max_tokens must be at least 1, got %d." % max_tokens)
        if prompt_len + max_tokens > mml:
            raise BadRequest(
                "'max_tokens' or 'max_completion_tokens' is too large: %d. This model's maximum "
                "context length is %d tokens and your request has %d input tokens (%d > %d - %d)."
                % (max_tokens, mml, prompt_len, max_tokens, mml, prompt_len))
        return {"temperature": float(temperature), "seed": seed, "n": n,
                "max_tokens": max_tokens, "ignore_eos": bool(body.get("ignore_eos", False))}

    @staticmethod
    def _disconnected(request):
        t = request.transport
        return t is None or t.is_closing()

    async def _watch(self, request, client, done):
        try:
            while not done.is_set():
                await asyncio.sleep(0.1)
                if done.is_set():
                    return
                if self._disconnected(request):
                    client.queue.put_nowait(("gone",))
                    return
        except asyncio.CancelledError:
            pass

    def _on_client_gone(self, client):
        if client.disconnected:
            return
        client.disconnected = True
        if client.finished >= client.n:
            return
        if "bug1" in self.engine.faults and not client.stream:
            client.tags.add("bug1")
            return
        self.engine.abort_client(client)

    # ----- parsing ---------------------------------------------------------------
    async def _json(self, request):
        try:
            body = await request.json()
        except Exception:
            raise BadRequest("Invalid JSON body")
        if not isinstance(body, dict):
            raise BadRequest("Request body must be a JSON object")
        return body

    def _completion_prompt(self, body):
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            return TOK.encode(p)
        if isinstance(p, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            for x in p:
                if x < 0 or x >= VOCAB_SIZE:
                    raise BadRequest("Token id %d is out of vocabulary" % x)
            return list(p)
        if p is None:
            raise BadRequest("prompt is required")
        raise BadRequest("prompt must be a string or a list of token ids (batched prompts are "
                         "not supported by this server)")

    # ----- endpoints ---------------------------------------------------------------
    async def completions(self, request):
        rid = self._rid(request)
        try:
            body = await self._json(request)
            self._check_model(body)
            prompt = self._completion_prompt(body)
            lp = body.get("logprobs")
            if lp is not None:
                lp = self._int(body, "logprobs", None, 0, 20)
            params = self._common_params(body, len(prompt), 16,
                                         self._int(body, "max_tokens", None))
            params["logprobs"] = lp
            stream = bool(body.get("stream", False))
            so = body.get("stream_options") or {}
            params["include_usage"] = bool(isinstance(so, dict) and so.get("include_usage"))
            params["echo"] = False
        except BadRequest as e:
            return self._err(e, rid)
        client = ClientRequest(rid, "completion", params["n"], stream, prompt, params)
        return await self._serve(request, client, "cmpl-" + rid)

    async def chat(self, request):
        rid = self._rid(request)
        try:
            body = await self._json(request)
            self._check_model(body)
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise BadRequest("messages must be a non-empty list")
            try:
                text = chat_template(msgs, body.get("add_generation_prompt", True))
            except ValueError as e:
                raise BadRequest(str(e))
            prompt = TOK.encode(text)
            mt = self._int(body, "max_completion_tokens", None)
            if mt is None:
                mt = self._int(body, "max_tokens", None)
            params = self._common_params(body, len(prompt), None, mt)
            lp = None
            if body.get("logprobs"):
                lp = self._int(body, "top_logprobs", 0, 0, 20)
            elif body.get("top_logprobs") is not None:
                raise BadRequest("when using `top_logprobs`, `logprobs` must be set to true.")
            params["logprobs"] = lp
            stream = bool(body.get("stream", False))
            so = body.get("stream_options") or {}
            params["include_usage"] = bool(isinstance(so, dict) and so.get("include_usage"))
        except BadRequest as e:
            return self._err(e, rid)
        client = ClientRequest(rid, "chat", params["n"], stream, prompt, params)
        return await self._serve(request, client, "chatcmpl-" + rid)

    def _err(self, e, rid):
        r = error_response(str(e), e.status, e.etype)
        r.headers["X-Request-Id"] = rid
        return r

    def _usage(self, client):
        pt = len(client.prompt)
        ct = client.completion_tokens
        return {"prompt_tokens": pt, "total_tokens": pt + ct, "completion_tokens": ct,
                "prompt_tokens_details": None}

    def _lp_completion(self, toks, lps, offset0):
        out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        off = offset0
        for t, lp in zip(toks, lps):
            s = " " + TOK.token_str(t) if t != EOS_ID else ""
            out["text_offset"].append(off)
            out["tokens"].append(TOK.token_str(t))
            out["token_logprobs"].append(lp[0] if lp else None)
            out["top_logprobs"].append({TOK.token_str(k): v for k, v in lp[1].items()} if lp else None)
            off += len(s)
        return out

    @staticmethod
    def _lp_chat(toks, lps):
        content = []
        for t, lp in zip(toks, lps):
            ts = TOK.token_str(t)
            ent = {"token": ts, "logprob": lp[0] if lp else 0.0,
                   "bytes": list(ts.encode("utf-8")), "top_logprobs": []}
            if lp:
                for k, v in lp[1].items():
                    ks = TOK.token_str(k)
                    ent["top_logprobs"].append({"token": ks, "logprob": v,
                                                "bytes": list(ks.encode("utf-8"))})
            content.append(ent)
        return {"content": content}

    async def _serve(self, request, client, resp_id):
        eng = self.engine
        eng.submit(client)
        done = asyncio.Event()
        watcher = asyncio.ensure_future(self._watch(request, client, done))
        try:
            if client.stream:
                return await self._stream(request, client, resp_id)
            return await self._full(request, client, resp_id)
        finally:
            done.set()
            watcher.cancel()

    async def _full(self, request, client, resp_id):
        n = client.n
        toks = [[] for _ in range(n)]
        lps = [[] for _ in range(n)]
        reasons = [None] * n
        remaining = n
        while remaining > 0:
            ev = await client.queue.get()
            if ev[0] == "gone":
                self._on_client_gone(client)
                return web.Response(status=499)
            if ev[0] == "tok":
                _, idx, tok, lp, _r = ev
                toks[idx].append(tok)
                lps[idx].append(lp)
            elif ev[0] == "fin":
                reasons[ev[1]] = ev[2]
                remaining -= 1
        created = int(time.time())
        choices = []
        for i in range(n):
            text_toks = [t for t in toks[i] if t != EOS_ID]
            text = "".join(" " + TOK.token_str(t) for t in text_toks)
            if client.kind == "completion":
                ch = {"index": i, "text": text,
                      "logprobs": (self._lp_completion(toks[i], lps[i], 0)
                                   if client.params["logprobs"] is not None else None),
                      "finish_reason": reasons[i], "stop_reason": None,
                      "prompt_logprobs": None}
            else:
                ch = {"index": i,
                      "message": {"role": "assistant", "content": text, "refusal": None,
                                  "annotations": None, "audio": None, "function_call": None,
                                  "tool_calls": [], "reasoning_content": None},
                      "logprobs": (self._lp_chat(toks[i], lps[i])
                                   if client.params["logprobs"] is not None else None),
                      "finish_reason": reasons[i], "stop_reason": None}
            choices.append(ch)
        if client.kind == "completion":
            body = {"id": resp_id, "object": "text_completion", "created": created,
                    "model": self.model, "choices": choices, "service_tier": None,
                    "system_fingerprint": None, "usage": self._usage(client),
                    "kv_transfer_params": None}
        else:
            body = {"id": resp_id, "object": "chat.completion", "created": created,
                    "model": self.model, "choices": choices, "service_tier": None,
                    "system_fingerprint": None, "usage": self._usage(client),
                    "prompt_logprobs": None, "kv_transfer_params": None}
        return web.json_response(body, headers={"X-Request-Id": client.rid})

    async def _stream(self, request, client, resp_id):
        resp = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache", "X-Request-Id": client.rid})
        created = int(time.time())
        n = client.n
        chat = client.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        want_lp = client.params["logprobs"] is not None
        offsets = [0] * n
        try:
            await resp.prepare(request)
            if chat:
                for i in range(n):
                    first = {"id": resp_id, "object": obj, "created": created, "model": self.model,
                             "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
                    await resp.write(b"data: " + json.dumps(first).encode() + b"\n\n")
            remaining = n
            while remaining > 0:
                ev = await client.queue.get()
                if ev[0] == "gone":
                    self._on_client_gone(client)
                    return resp
                if ev[0] == "fin":
                    remaining -= 1
                    if ev[2] == "abort":
                        continue
                    continue
                _, idx, tok, lp, reason = ev
                piece = "" if tok == EOS_ID else " " + TOK.token_str(tok)
                if chat:
                    delta = {"content": piece} if piece or not reason else {}
                    choice = {"index": idx, "delta": delta,
                              "logprobs": self._lp_chat([tok], [lp]) if want_lp else None,
                              "finish_reason": reason}
                    if reason:
                        choice["stop_reason"] = None
                else:
                    choice = {"index": idx, "text": piece,
                              "logprobs": (self._lp_completion([tok], [lp], offsets[idx])
                                           if want_lp else None),
                              "finish_reason": reason, "stop_reason": None}
                    offsets[idx] += len(piece)
                chunk = {"id": resp_id, "object": obj, "created": created, "model": self.model,
                         "choices": [choice]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if client.params.get("include_usage"):
                chunk = {"id": resp_id, "object": obj, "created": created, "model": self.model,
                         "choices": [], "usage": self._usage(client)}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError, RuntimeError):
            self._on_client_gone(client)
        return resp

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.start_time, "owned_by": "vllm",
            "root": self.model, "parent": None, "max_model_len": self.args.max_model_len,
            "permission": [{"id": "modelperm-" + uuid.uuid4().hex, "object": "model_permission",
                            "created": self.start_time, "allow_create_engine": False,
                            "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None,
                            "is_blocking": False}]}]})

    async def health(self, request):
        return web.Response(status=200)

    async def version(self, request):
        return web.json_response({"version": VLLM_VERSION})

    async def tokenize(self, request):
        try:
            body = await self._json(request)
            self._check_model(body)
            if "messages" in body:
                msgs = body.get("messages")
                if not isinstance(msgs, list):
                    raise BadRequest("messages must be a list")
                try:
                    text = chat_template(msgs, body.get("add_generation_prompt", True))
                except ValueError as e:
                    raise BadRequest(str(e))
            else:
                text = body.get("prompt")
                if not isinstance(text, str):
                    raise BadRequest("prompt must be a string")
            ids = TOK.encode(text)
        except BadRequest as e:
            return error_response(str(e), e.status, e.etype)
        out = {"count": len(ids), "max_model_len": self.args.max_model_len, "tokens": ids,
               "token_strs": None}
        if body.get("return_token_strs"):
            out["token_strs"] = [TOK.token_str(i) for i in ids]
        return web.json_response(out)

    async def detokenize(self, request):
        try:
            body = await self._json(request)
            self._check_model(body)
            ids = body.get("tokens")
            if not isinstance(ids, list) or not all(isinstance(x, int) for x in ids):
                raise BadRequest("tokens must be a list of integers")
        except BadRequest as e:
            return error_response(str(e), e.status, e.etype)
        return web.json_response({"prompt": TOK.decode(ids)})

    async def metrics(self, request):
        e = self.engine
        m = e.metrics
        lab = 'engine="0",model_name="%s"' % self.model
        L = []

        def gauge(name, doc, v, labels=lab):
            L.extend(["# HELP %s %s" % (name, doc), "# TYPE %s gauge" % name,
                      "%s{%s} %r" % (name, labels, float(v))])

        def counter(name, doc, v, labels=lab):
            L.extend(["# HELP %s %s" % (name, doc), "# TYPE %s counter" % name,
                      "%s{%s} %r" % (name, labels, float(v))])

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              len(e.running))
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              len(e.waiting))
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
              e.kv.usage())
        gauge("vllm:gpu_cache_usage_perc",
              "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use "
              "vllm:kv_cache_usage_perc instead.", e.kv.usage())
        counter("vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.", m.prefix_queries)
        counter("vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.", m.prefix_hits)
        counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
                m.preemptions)
        counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.",
                m.prompt_tokens)
        counter("vllm:generation_tokens_total", "Number of generation tokens processed.",
                m.generation_tokens)
        L.extend(["# HELP vllm:request_success_total Count of successfully processed requests.",
                  "# TYPE vllm:request_success_total counter"])
        for r in ("stop", "length", "abort"):
            L.append('vllm:request_success_total{%s,finished_reason="%s"} %r'
                     % (lab, r, float(m.success[r])))
        for h in m.h.values():
            L.extend(h.render(lab))
        cfg = ('block_size="%d",cache_dtype="auto",calculate_kv_scales="False",'
               'cpu_offload_gb="0",enable_prefix_caching="%s",gpu_memory_utilization="0.62",'
               'is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="%d",'
               'num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",'
               'sliding_window="None",swap_space="4",swap_space_bytes="4294967296"'
               % (BLOCK_SIZE, str(not self.args.no_enable_prefix_caching),
                  self.args.num_gpu_blocks))
        L.extend(["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                  "# TYPE vllm:cache_config_info gauge",
                  "vllm:cache_config_info{%s,engine=\"0\"} 1.0" % cfg])
        return web.Response(text="\n".join(L) + "\n",
                            content_type="text/plain", charset="utf-8")

    # ----- app -------------------------------------------------------------------
    def app(self):
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/metrics", self.metrics)

        async def start(app_):
            app_["engine_task"] = asyncio.ensure_future(self.engine.run())

        async def stop(app_):
            self.engine.stopping = True
            self.engine.wake.set()
            t = app_["engine_task"]
            t.cancel()
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
            if self.engine.gt_file:
                self.engine.gt_file.close()

        app.on_startup.append(start)
        app.on_cleanup.append(stop)
        return app


def parse_faults(spec):
    spec = (spec or "none").strip()
    if spec == "none" or spec == "":
        return []
    if spec == "all":
        return list(ALL_FAULTS)
    out = []
    for p in spec.split(","):
        p = p.strip()
        if not p:
            continue
        if p not in ALL_FAULTS:
            raise SystemExit("unknown --bugs entry %r (valid: none, all, %s)"
                             % (p, ",".join(ALL_FAULTS)))
        out.append(p)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description="Simulated vLLM V1 OpenAI-compatible server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--bugs", default="none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ground-truth", default=None)
    ap.add_argument("--served-model-name", default=DEFAULT_MODEL)
    ap.add_argument("--num-gpu-blocks", type=int, default=2150)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--long-prefill-token-threshold", type=int, default=0)
    ap.add_argument("--no-enable-prefix-caching", action="store_true")
    args = ap.parse_args(argv)
    parse_faults(args.bugs)
    if args.num_gpu_blocks < 2:
        raise SystemExit("--num-gpu-blocks must be >= 2")
    if args.max_model_len > (args.num_gpu_blocks - 1) * BLOCK_SIZE:
        raise SystemExit("max_model_len %d does not fit in the KV cache (%d tokens); lower "
                         "--max-model-len or raise --num-gpu-blocks"
                         % (args.max_model_len, (args.num_gpu_blocks - 1) * BLOCK_SIZE))
    srv = Server(args)
    print("INFO simulated vLLM %s serving %s on http://%s:%d (num_gpu_blocks=%d, "
          "max_num_seqs=%d, max_num_batched_tokens=%d, max_model_len=%d)"
          % (VLLM_VERSION, srv.model, args.host, args.port, args.num_gpu_blocks,
             args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len), flush=True)
    web.run_app(srv.app(), host=args.host, port=args.port, access_log=None,
                shutdown_timeout=1.0, print=None, handle_signals=True)


if __name__ == "__main__":
    main()
