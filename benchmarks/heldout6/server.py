#!/usr/bin/env python3
"""simvllm: a single-file simulator of a vLLM-V1-style OpenAI-compatible inference server.

GPU work is simulated with asyncio.sleep per engine step.  See README.md.
"""
import argparse
import asyncio
import json
import math
import random
import signal
import sys
import time
import uuid
import zlib
from collections import OrderedDict, deque

from aiohttp import web

VERSION = "0.10.1.dev7+sim"
MODEL = "simlab/sim-chat-1.3b"
# ---------------------------------------------------------------- engine constants
MAX_NUM_SEQS = 10
MAX_NUM_BATCHED_TOKENS = 768
LONG_PREFILL_TOKEN_THRESHOLD = 256
BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 512
MAX_MODEL_LEN = 6144
STEP_OVERHEAD_S = 0.004
PER_SEQ_S = 0.00025
PER_PREFILL_TOKEN_S = 0.00006
PER_CTX_TOKEN_S = 0.000001
PER_LOGPROBS_SEQ_S = 0.00015
JITTER = 0.03
WARMUP_EXTRA_S = (0.15, 0.08)
VOCAB_SIZE = 32000
BUG_NAMES = ("bug1", "bug2", "bug3", "bug4", "bug5")
BUG1_LONG_PROMPT = 1024
BUG2_HUGE_PROMPT = 2560
BUG3_MIN_MAX_TOKENS = 512

_SYL = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "vo", "pe", "da", "zu", "ri", "an", "el", "om", "ur",
        "be", "ko", "ma", "si", "te", "no", "ga", "fi", "ho", "ju", "xe", "wa", "yo", "qu", "ce", "li"]
VOCAB = [a + b + c for a in _SYL for b in _SYL for c in ("", "n", "s")][:3000]
WORD2ID = {w: i for i, w in enumerate(VOCAB)}
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0]
REQ_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0]


def tokenize_text(text):
    """One token per whitespace-separated word; known vocabulary words map to their index."""
    ids = []
    for w in text.split():
        i = WORD2ID.get(w)
        ids.append(i if i is not None else len(VOCAB) + zlib.crc32(w.encode()) % (VOCAB_SIZE - len(VOCAB)))
    return ids


def detokenize(ids):
    return " ".join(VOCAB[i] if 0 <= i < len(VOCAB) else f"<t{i}>" for i in ids)


def chat_to_ids(messages):
    ids = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError("each message must be an object with a 'role'")
        content = m.get("content") or ""
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise ValueError("message content must be a string or a list of parts")
        ids += tokenize_text(f"<|{m['role']}|>") + tokenize_text(content)
    return ids + tokenize_text("<|assistant|>")


def _h(*parts):
    return zlib.crc32(repr(parts).encode())


class Histogram:
    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.n = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, v):
        self.sum += v
        self.n += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1


class KVCache:
    """Paged KV blocks with block-level prefix caching and an LRU free queue."""

    def __init__(self, n):
        self.n = n
        self.free = OrderedDict((i, None) for i in range(n))
        self.ref = [0] * n
        self.bhash = [None] * n
        self.cache = {}

    def usage(self):
        return (self.n - len(self.free)) / self.n

    def lookup(self, seq):
        """Longest run of cached full blocks, keeping at least one token to compute."""
        toks = seq.tokens()
        out, parent = [], None
        for i in range((len(toks) - 1) // BLOCK_SIZE):
            parent = hash((parent, tuple(toks[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])))
            b = self.cache.get(parent)
            if b is None:
                break
            out.append(b)
        return out

    def touch(self, blocks):
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def take(self, k):
        out = []
        for _ in range(k):
            b, _ = self.free.popitem(last=False)
            if self.bhash[b] is not None:
                self.cache.pop(self.bhash[b], None)
                self.bhash[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks):
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def register(self, seq):
        toks = seq.tokens()
        full = min(seq.num_computed // BLOCK_SIZE, len(seq.blocks))
        while seq.n_hashed < full:
            i = seq.n_hashed
            seq.parent_hash = hash((seq.parent_hash, tuple(toks[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])))
            b = seq.blocks[i]
            if self.bhash[b] is None and seq.parent_hash not in self.cache:
                self.cache[seq.parent_hash] = b
                self.bhash[b] = seq.parent_hash
            seq.n_hashed += 1


def blocks_for(ntok):
    return (ntok + BLOCK_SIZE - 1) // BLOCK_SIZE


class Seq:
    def __init__(self, parent, idx, prompt, max_tokens, ignore_eos, logprobs, seed):
        self.parent, self.idx, self.prompt = parent, idx, prompt
        self.id = f"{parent.rid}-{idx}"
        self.max_tokens, self.ignore_eos, self.logprobs = max_tokens, ignore_eos, logprobs
        self.arrival = parent.arrival
        self.output = []
        self.num_computed = 0
        self.blocks = []
        self.n_hashed, self.parent_hash = 0, None
        self.state = "waiting"  # waiting | running | done
        self.admit_seq = 0
        self.first_sched = None
        self.first_tok = self.last_tok = None
        self.zombie = False
        self.tags = set()
        self.reserve = False
        self.prompt_counted = False
        self.gen_key = _h(seed, tuple(prompt[:64]), len(prompt), idx)
        u = ((self.gen_key % 100003) + 1) / 100004.0
        self.eos_pos = 4 + int(-math.log(u) * 110)

    def tokens(self):
        return self.prompt + self.output

    def num_tokens(self):
        return len(self.prompt) + len(self.output)

    def in_prefill(self):
        return self.num_computed < len(self.prompt)


class Parent:
    def __init__(self, rid, prompt, n):
        self.rid, self.prompt, self.n = rid, prompt, n
        self.arrival = time.monotonic()
        self.seqs = []
        self.queue = asyncio.Queue()
        self.disconnected = False
        self.finish_reasons = {}
        self.recorded = False
        self.emitted = 0


class Engine:
    def __init__(self, bugs, seed, gt_path):
        self.bugs = set(bugs)
        self.rng = random.Random(seed)
        self.seed = seed
        self.kv = KVCache(NUM_GPU_BLOCKS)
        self.waiting = deque()
        self.running = []
        self.wake = asyncio.Event()
        self.steps = 0
        self.admit_counter = 0
        self.stopping = False
        self.stall = False
        self.gt = open(gt_path, "a", buffering=1) if gt_path else None
        self.c = dict(preemptions=0, prompt_tokens=0, generation_tokens=0, pc_queries=0, pc_hits=0)
        self.success = {}
        self.h = dict(ttft=Histogram(TTFT_BUCKETS), itl=Histogram(ITL_BUCKETS),
                      e2e=Histogram(REQ_BUCKETS), queue=Histogram(REQ_BUCKETS))

    # ------------------------------------------------------------ request lifecycle
    def add(self, parent, max_tokens, ignore_eos, logprobs):
        for i in range(parent.n):
            s = Seq(parent, i, parent.prompt, max_tokens, ignore_eos, logprobs, self.seed)
            parent.seqs.append(s)
            self.waiting.append(s)
        self.wake.set()

    def record(self, parent, finish_reason, error=None):
        if parent.recorded:
            return
        parent.recorded = True
        tags = set()
        for s in parent.seqs:
            tags |= s.tags
        line = {"request_id": parent.rid, "pathologies": sorted(tags),
                "client_disconnected": parent.disconnected, "finish_reason": finish_reason,
                "e2e_s": round(time.monotonic() - parent.arrival, 4),
                "prompt_tokens": len(parent.prompt), "output_tokens": sum(len(s.output) for s in parent.seqs)}
        if error:
            line["error"] = error
        if self.gt:
            self.gt.write(json.dumps(line) + "\n")
            self.gt.flush()

    def _remove(self, s):
        if s in self.running:
            self.running.remove(s)
        elif s in self.waiting:
            self.waiting.remove(s)
        self.kv.release(s.blocks)
        s.blocks = []
        s.state = "done"

    def _finish(self, s, reason):
        self._remove(s)
        p = s.parent
        p.finish_reasons[s.idx] = reason
        self.success[reason] = self.success.get(reason, 0) + 1
        if reason in ("stop", "length"):
            self.h["e2e"].observe(time.monotonic() - s.arrival)
        if not s.zombie:
            p.queue.put_nowait(("done", s.idx, reason))
        if len(p.finish_reasons) == p.n:
            rs = set(p.finish_reasons.values())
            final = "abort" if "abort" in rs or any(x.zombie for x in p.seqs) else \
                ("length" if "length" in rs else "stop")
            self.record(p, final)

    def abort(self, parent, disconnected):
        parent.disconnected = parent.disconnected or disconnected
        for s in parent.seqs:
            if s.state != "done":
                self._finish(s, "abort")

    def client_gone(self, parent, streaming):
        """Client went away: abort its sequences and free their KV."""
        parent.disconnected = True
        if "bug4" in self.bugs and streaming and parent.emitted > 0:
            live = [s for s in parent.seqs if s.state != "done"]
            for s in live:
                s.zombie, s.ignore_eos = True, True
                s.tags.add("bug4")
            if live:
                return
        self.abort(parent, True)

    def shutdown(self):
        self.stopping = True
        parents = {s.parent for s in list(self.running) + list(self.waiting)}
        for p in parents:
            self.abort(p, False)
        self.wake.set()

    # ------------------------------------------------------------ scheduling
    def _reserved(self, ignore):
        if "bug3" not in self.bugs or "bug3" in ignore:
            return 0
        tot = 0
        for s in self.running:
            if s.reserve and not (s.zombie and "bug4" in ignore):
                tot += max(0, blocks_for(len(s.prompt) + s.max_tokens) - len(s.blocks))
        return tot

    def _stall_active(self):
        return any(s.in_prefill() and len(s.prompt) >= BUG1_LONG_PROMPT for s in self.running)

    def _admit(self, budget, dry, ignore=frozenset()):
        """FCFS admission from the waiting queue. With dry=True only simulates; returns admitted seqs."""
        admitted = []
        if "bug1" in self.bugs and "bug1" not in ignore and self.stall:
            return admitted
        zombies = [s for s in self.running if s.zombie] if "bug4" in ignore else []
        slots = MAX_NUM_SEQS - (len(self.running) - len(zombies))
        free = len(self.kv.free) + sum(len(s.blocks) for s in zombies) - self._reserved(ignore)
        for s in list(self.waiting):
            if budget <= 0 or slots <= 0:
                break
            hit = self.kv.lookup(s)
            cached = len(hit) * BLOCK_SIZE
            n = min(s.num_tokens() - cached, budget, LONG_PREFILL_TOKEN_THRESHOLD)
            revived = sum(1 for b in hit if self.kv.ref[b] == 0)
            need = blocks_for(cached + n) - len(hit) + revived
            res = "bug3" in self.bugs and "bug3" not in ignore and s.max_tokens >= BUG3_MIN_MAX_TOKENS
            if res:
                need = max(need, blocks_for(len(s.prompt) + s.max_tokens) - len(hit) + revived)
            if need > free:
                break
            free -= need
            slots -= 1
            budget -= n
            admitted.append((s, n))
            if not dry:
                self.waiting.popleft()
                self.kv.touch(hit)
                s.blocks = list(hit)
                s.num_computed = cached
                s.blocks += self.kv.take(blocks_for(cached + n) - len(s.blocks))
                s.state, s.reserve = "running", res
                self.admit_counter += 1
                s.admit_seq = self.admit_counter
                self.running.append(s)
                self.c["pc_queries"] += s.num_tokens()
                self.c["pc_hits"] += cached
                if s.first_sched is None:
                    s.first_sched = time.monotonic()
                    self.h["queue"].observe(s.first_sched - s.arrival)
        return admitted

    def _preempt(self, v, sched):
        self.running.remove(v)
        self.kv.release(v.blocks)
        v.blocks, v.num_computed, v.n_hashed, v.parent_hash = [], 0, 0, None
        v.state, v.reserve = "waiting", False
        self.waiting.appendleft(v)
        self.c["preemptions"] += 1
        return sched.pop(v, 0)

    def schedule(self):
        budget = MAX_NUM_BATCHED_TOKENS
        sched = {}
        preempted = False
        self.stall = self._stall_active()
        huge = None
        if "bug2" in self.bugs:
            huge = next((s for s in self.running if s.in_prefill() and len(s.prompt) >= BUG2_HUGE_PROMPT), None)
        order = list(self.running)
        if huge is not None:
            order.remove(huge)
            order.insert(0, huge)
        for s in order:
            if s not in self.running or budget <= 0:
                continue
            remaining = s.num_tokens() - s.num_computed
            if huge is not None and s is not huge and not s.in_prefill():
                s.tags.add("bug2")  # decode skipped while the huge prompt prefills
                continue
            n = min(remaining, budget)
            if remaining > 1 and s is not huge:
                n = min(n, LONG_PREFILL_TOKEN_THRESHOLD)
            if n <= 0:
                continue
            need = blocks_for(s.num_computed + n) - len(s.blocks)
            ok = True
            while need > len(self.kv.free):
                victim = self.running[-1]
                if "bug5" in self.bugs:
                    oldest = min(self.running, key=lambda x: (x.arrival, x.id))
                    if oldest is not victim:
                        oldest.tags.add("bug5")
                    victim = oldest
                budget += self._preempt(victim, sched)
                preempted = True
                if victim is s:
                    ok = False
                    break
            if not ok:
                continue
            s.blocks += self.kv.take(need)
            sched[s] = n
            budget -= n
        if not preempted and self.waiting:
            # counterfactual admissions without each admission-side bug, used only for ground-truth tags
            cf = {b: {id(x) for x, _ in self._admit(budget, True, frozenset([b]))}
                  for b in ("bug1", "bug3", "bug4") if b in self.bugs}
            real = self._admit(budget, dry=False)
            got = {id(x) for x, _ in real}
            for b, ids in cf.items():
                for x in self.waiting:
                    if id(x) in ids and id(x) not in got:
                        x.tags.add(b)
            for s, n in real:
                sched[s] = n
        return sched

    def step_time(self, sched):
        prefill = sum(n for s, n in sched.items() if n > 1 or s.in_prefill())
        ctx = sum(s.num_computed + n for s, n in sched.items() if n == 1 and not s.in_prefill())
        lp = sum(1 for s in sched if s.logprobs)
        t = STEP_OVERHEAD_S + PER_SEQ_S * len(sched) + PER_PREFILL_TOKEN_S * prefill + PER_CTX_TOKEN_S * ctx
        t += PER_LOGPROBS_SEQ_S * lp
        t *= self.rng.uniform(1 - JITTER, 1 + JITTER)
        if self.steps < len(WARMUP_EXTRA_S):
            t += WARMUP_EXTRA_S[self.steps]
        return t

    def _gen_token(self, s):
        pos = len(s.output)
        return (_h(s.gen_key, pos) % len(VOCAB))

    async def run(self):
        while not self.stopping:
            try:
                await self._iteration()
            except Exception:  # keep serving; a scheduler fault must not hang every client
                import traceback
                traceback.print_exc()
                await asyncio.sleep(0.01)

    async def _iteration(self):
        if not self.running and not self.waiting:
            self.wake.clear()
            await self.wake.wait()
            return
        sched = self.schedule()
        if not sched:
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), 0.02)
            except asyncio.TimeoutError:
                pass
            return
        await asyncio.sleep(self.step_time(sched))
        self.steps += 1
        now = time.monotonic()
        for s, n in sched.items():
            if s.state != "running":
                continue
            s.num_computed += n
            self.kv.register(s)
            if s.num_computed > len(s.prompt) - 1 and not s.prompt_counted:
                s.prompt_counted = True
                self.c["prompt_tokens"] += len(s.prompt)
            if s.num_computed < s.num_tokens():
                continue
            tok = self._gen_token(s)
            s.output.append(tok)
            self.c["generation_tokens"] += 1
            if s.first_tok is None:
                s.first_tok = now
                self.h["ttft"].observe(now - s.arrival)
            else:
                self.h["itl"].observe(now - s.last_tok)
            s.last_tok = now
            k = len(s.output)
            reason = "length" if k >= s.max_tokens else (
                "stop" if not s.ignore_eos and k >= s.eos_pos else None)
            if not s.zombie:
                s.parent.emitted += 1
                s.parent.queue.put_nowait(("token", s.idx, tok, reason))
            if reason:
                self._finish(s, reason)


# ================================================================= HTTP layer
def err(status, msg, etype="BadRequestError"):
    return web.json_response({"error": {"message": msg, "type": etype, "param": None, "code": status}},
                             status=status)


class BadRequest(Exception):
    pass


def parse_request(body, chat):
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' must be a non-empty list")
        try:
            prompt = chat_to_ids(msgs)
        except ValueError as e:
            raise BadRequest(str(e))
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            prompt = tokenize_text(p)
        elif isinstance(p, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            if any(x < 0 or x >= VOCAB_SIZE for x in p):
                raise BadRequest(f"token id out of vocabulary range [0, {VOCAB_SIZE})")
            prompt = list(p)
        else:
            raise BadRequest("'prompt' must be a string or a list of token ids")
    if not prompt:
        raise BadRequest("The prompt cannot be empty")
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 8:
        raise BadRequest("'n' must be an integer between 1 and 8")
    mt = body.get("max_completion_tokens") if chat and body.get("max_tokens") is None else body.get("max_tokens")
    if mt is None:
        mt = MAX_MODEL_LEN - len(prompt) if chat else 16
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise BadRequest("'max_tokens' must be a positive integer")
    if len(prompt) + mt > MAX_MODEL_LEN:
        raise BadRequest(f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
                         f"{len(prompt) + mt} tokens ({len(prompt)} in the messages, {mt} in the completion). "
                         f"Please reduce the length of the messages or completion.")
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise BadRequest("'stream_options' must be an object")
    lp = body.get("logprobs")
    lp = bool(lp) if chat else (lp is not None and lp is not False)
    return dict(prompt=prompt, n=n, max_tokens=mt, stream=bool(body.get("stream", False)),
                include_usage=bool(so.get("include_usage", False)), ignore_eos=bool(body.get("ignore_eos", False)),
                logprobs=lp)


class Server:
    def __init__(self, engine):
        self.engine = engine
        self.created = int(time.time())

    async def completions(self, request):
        return await self._generate(request, chat=False)

    async def chat(self, request):
        return await self._generate(request, chat=True)

    def _fail(self, rid, msg, ntok=0):
        p = Parent(rid, [0] * ntok, 1)
        self.engine.record(p, "error", error=msg)
        return err(400, msg)

    async def _generate(self, request, chat):
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        if self.engine.stopping:
            return err(503, "server is shutting down", "ServiceUnavailableError")
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as e:
            return self._fail(rid, f"Invalid JSON body: {e}")
        try:
            r = parse_request(body, chat)
        except BadRequest as e:
            return self._fail(rid, str(e))
        if body.get("model") not in (None, MODEL):
            msg = f"The model `{body.get('model')}` does not exist."
            self.engine.record(Parent(rid, r["prompt"], 1), "error", error=msg)
            return err(404, msg, "NotFoundError")
        parent = Parent(rid, r["prompt"], r["n"])
        self.engine.add(parent, r["max_tokens"], r["ignore_eos"], r["logprobs"])
        oid = ("chatcmpl-" if chat else "cmpl-") + rid
        hdrs = {"X-Request-Id": rid}
        done = 0
        texts = [[] for _ in range(r["n"])]
        reasons = [None] * r["n"]
        resp = None
        try:
            if r["stream"]:
                resp = web.StreamResponse(headers={**hdrs, "Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache"})
                await resp.prepare(request)
            role_sent = set()
            while done < r["n"]:
                kind, idx, *rest = await parent.queue.get()
                if kind == "done":
                    done += 1
                    reasons[idx] = rest[0]
                    if rest[0] == "abort" and r["stream"]:
                        await self._send(resp, self._chunk(oid, chat, idx, None, "abort", r, role_sent))
                    continue
                tok, reason = rest
                piece = VOCAB[tok] if chat and not texts[idx] else " " + VOCAB[tok]
                texts[idx].append(piece)
                if r["stream"]:
                    await self._send(resp, self._chunk(oid, chat, idx, piece, reason, r, role_sent))
            usage = {"prompt_tokens": len(r["prompt"]), "completion_tokens": sum(len(t) for t in texts),
                     "total_tokens": len(r["prompt"]) + sum(len(t) for t in texts)}
            if r["stream"]:
                if r["include_usage"]:
                    await self._send(resp, {"id": oid, "object": "chat.completion.chunk" if chat else
                                            "text_completion", "created": self.created, "model": MODEL,
                                            "choices": [], "usage": usage})
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            if "abort" in reasons:
                return err(503, "request aborted: server shutting down", "ServiceUnavailableError")
            choices = []
            for i in range(r["n"]):
                text = "".join(texts[i])
                if chat:
                    choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                    "logprobs": None, "finish_reason": reasons[i], "stop_reason": None})
                else:
                    choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": reasons[i],
                                    "stop_reason": None})
            return web.json_response({"id": oid, "object": "chat.completion" if chat else "text_completion",
                                      "created": self.created, "model": MODEL, "choices": choices,
                                      "usage": usage}, headers=hdrs)
        except (asyncio.CancelledError, ConnectionError) as e:
            if not parent.recorded:
                self.engine.client_gone(parent, r["stream"])
            if isinstance(e, asyncio.CancelledError):
                raise
            return resp

    async def _send(self, resp, obj):
        await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _chunk(self, oid, chat, idx, piece, reason, r, role_sent):
        lp = None
        if r["logprobs"] and piece is not None:
            lp = ({"content": [{"token": piece, "logprob": -0.42, "bytes": list(piece.encode()),
                                "top_logprobs": []}]} if chat else
                  {"tokens": [piece], "token_logprobs": [-0.42], "top_logprobs": [{piece: -0.42}],
                   "text_offset": [0]})
        if chat:
            delta = {"content": piece} if piece is not None else {}
            if idx not in role_sent:
                role_sent.add(idx)
                delta = {"role": "assistant", **delta}
            ch = {"index": idx, "delta": delta, "logprobs": lp, "finish_reason": reason, "stop_reason": None}
            obj = "chat.completion.chunk"
        else:
            ch = {"index": idx, "text": piece or "", "logprobs": lp, "finish_reason": reason, "stop_reason": None}
            obj = "text_completion"
        return {"id": oid, "object": obj, "created": self.created, "model": MODEL, "choices": [ch]}

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": self.created, "owned_by": "vllm", "root": MODEL,
             "parent": None, "max_model_len": MAX_MODEL_LEN, "permission": []}]})

    async def health(self, request):
        if self.engine.stopping:
            return web.Response(status=503)
        return web.Response(status=200)

    async def version(self, request):
        return web.json_response({"version": VERSION})

    async def _json(self, request):
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"Invalid JSON body: {e}")
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    async def tokenize(self, request):
        try:
            body = await self._json(request)
            if "messages" in body:
                toks = chat_to_ids(body["messages"])
            elif isinstance(body.get("prompt"), str):
                toks = tokenize_text(body["prompt"])
            else:
                raise BadRequest("'prompt' (string) or 'messages' is required")
        except (BadRequest, ValueError) as e:
            return err(400, str(e))
        out = {"tokens": toks, "count": len(toks), "max_model_len": MAX_MODEL_LEN}
        if body.get("return_token_strs"):
            out["token_strs"] = [detokenize([t]) for t in toks]
        return web.json_response(out)

    async def detokenize(self, request):
        try:
            body = await self._json(request)
            toks = body.get("tokens")
            if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
                raise BadRequest("'tokens' must be a list of integers")
        except BadRequest as e:
            return err(400, str(e))
        return web.json_response({"prompt": detokenize(toks)})

    async def metrics(self, request):
        e = self.engine
        lab = f'model_name="{MODEL}",engine="0"'
        out = []

        def metric(name, typ, help_, value, extra=""):
            out.append(f"# HELP {name} {help_}\n# TYPE {name} {typ}")
            out.append(f"{name}{{{lab}{extra}}} {float(value)}")

        def hist(name, help_, h):
            out.append(f"# HELP {name} {help_}\n# TYPE {name} histogram")
            for b, c in zip(h.buckets, h.counts):
                out.append(f'{name}_bucket{{{lab},le="{b}"}} {float(c)}')
            out.append(f'{name}_bucket{{{lab},le="+Inf"}} {float(h.n)}')
            out.append(f"{name}_sum{{{lab}}} {h.sum}")
            out.append(f"{name}_count{{{lab}}} {float(h.n)}")

        metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
               len(e.running))
        metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               len(e.waiting))
        metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", e.kv.usage())
        metric("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
               e.c["preemptions"])
        metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", e.c["prompt_tokens"])
        metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
               e.c["generation_tokens"])
        metric("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of "
               "queried tokens.", e.c["pc_queries"])
        metric("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached "
               "tokens.", e.c["pc_hits"])
        out.append("# HELP vllm:request_success_total Count of successfully processed requests.\n"
                   "# TYPE vllm:request_success_total counter")
        for r in ("stop", "length", "abort"):
            out.append(f'vllm:request_success_total{{{lab},finished_reason="{r}"}} {float(e.success.get(r, 0))}')
        hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", e.h["ttft"])
        hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", e.h["itl"])
        hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", e.h["e2e"])
        hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
             e.h["queue"])
        metric("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", 1,
               f',block_size="{BLOCK_SIZE}",num_gpu_blocks="{NUM_GPU_BLOCKS}",enable_prefix_caching="True",'
               f'cache_dtype="auto",gpu_memory_utilization="0.9"')
        return web.Response(text="\n".join(out) + "\n", content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})


def parse_bugs(s):
    if s == "all":
        return list(BUG_NAMES)
    if s in ("none", ""):
        return []
    bugs = [b.strip() for b in s.split(",") if b.strip()]
    for b in bugs:
        if b not in BUG_NAMES:
            raise SystemExit(f"unknown bug name {b!r}; expected one of {', '.join(BUG_NAMES)}, all, none")
    return bugs


async def amain(args):
    engine = Engine(parse_bugs(args.bugs), args.seed, args.ground_truth)
    srv = Server(engine)
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_post("/v1/completions", srv.completions)
    app.router.add_post("/v1/chat/completions", srv.chat)
    app.router.add_get("/v1/models", srv.models)
    app.router.add_get("/health", srv.health)
    app.router.add_get("/version", srv.version)
    app.router.add_post("/tokenize", srv.tokenize)
    app.router.add_post("/detokenize", srv.detokenize)
    app.router.add_get("/metrics", srv.metrics)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    print(f"INFO: simvllm {VERSION} serving {MODEL} on http://{args.host}:{args.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    task = asyncio.create_task(engine.run())
    await stop.wait()
    print("INFO: shutting down, aborting in-flight requests", flush=True)
    engine.shutdown()
    await asyncio.sleep(0.1)
    task.cancel()
    try:
        await asyncio.wait_for(runner.cleanup(), 3.0)
    except (asyncio.TimeoutError, Exception):
        pass
    if engine.gt:
        engine.gt.close()


def main():
    ap = argparse.ArgumentParser(description="Simulated vLLM-style OpenAI-compatible server")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--bugs", default="none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ground-truth", default=None)
    args = ap.parse_args()
    asyncio.run(amain(args))
    sys.exit(0)


if __name__ == "__main__":
    main()
