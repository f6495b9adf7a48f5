"""Mutation operators that build the shapes public reports describe (issue 16).

The havoc operators of :mod:`fuzzer.search.mutators` change one field at a time and keep
outputs within ``Limits.max_output_tokens``; the shapes below are what a scheduling bug
of a known class needs all at once, so that a campaign reaches classes it was not tuned on:

- ``long_outputs``: a few requests with a max_tokens far above the usual (a quarter or half
  the model length) that stop early by EOS, and requests behind them. An engine that
  reserves KV for all of max_tokens at admission stalls the queue while its KV usage
  looks low (kekzl/imp PR #1714; TGI caps the preallocation for this reason).
- ``disconnect_long``: a stream of 2048-3072 tokens whose client leaves after a few tokens,
  then a later request. A server that does not propagate the abort keeps decoding it
  (vLLM #10806, #54947) and is not idle seconds after the client's last request.
- ``long_prompt_beside_stream``: a live stream, then a prompt of several step budgets
  (vLLM PR #10235, #8121, llama.cpp #4216; SGLang #22831's sticky flag).
- ``prefix_burst``: long and short members of a new shared-prefix group arriving within
  a few milliseconds (vLLM #37308).
- ``timeout_before_first_token``: clients with a TTFT or queue timeout that leave long
  prompts before their first token, then a request that needs the KV and seats. An engine
  that arms its abort only on the first output (vLLM PR #29987; KV leaked on abort in vLLM
  #46283, #50425) runs them on to max_tokens with nobody reading.
- ``client_timeout``: one request of the trace gets a client that leaves after a time
  (before its first token when it waits or prefills that long), with a long output.
- ``disconnect_fanout``: an n > 1 stream left after a few tokens, then a later request: an
  abort that reaches only the first of its sequences (vLLM PR #14326) leaves the others running.
- ``kv_burst``: a burst that asks for 1.2 to 2 times the server's KV cache
  (where it reports its size), sometimes behind a shared long prefix, then short requests.
  Preemption and queueing follow by design; what is not by design is a preempted request
  re-queued behind the queue (vLLM #41951), or admission refusing a request whose prefix
  blocks are already resident (sglang #22831, vLLM #37308's class).
- ``prefix_under_pressure``: long requests holding most of the KV cache, one of them the owner
  of a long shared prefix, then requests with that prefix and short tails of their own: they
  need a few blocks, and an admission check that counts the resident prefix blocks as new
  (sglang #22831, vLLM #37308's class) refuses them, and the queue behind, until KV frees.
- ``cached_prefix_burst``: a request that computes a long shared prefix, then, once it is done, a
  burst of requests with that prefix and short tails of their own. Each needs only its tail computed,
  and FCFS admits the whole burst in a step or two; a scheduler that charges the cached tokens to the
  step's token budget admits a couple a step, and the burst's first tokens staircase (vLLM PR #7753's
  review: the budget counted tokens that were prefix-cached; TensorRT-LLM PR #19366: chunks sized by
  the raw prompt, not the uncached suffix).
- ``abandoned_queue``: four to six prompts of two or four step budgets sent together, whose clients
  all leave within a few hundred ms (most while queued in the engine), then a short request. An engine that leaves an
  aborted request in its queue computes each prompt in its turn before dropping it (SGLang PR #6855,
  PR #6931, PR #28236), and the short request waits for all of them.
- ``reservation_under_load``: requests whose prompts fill most of the reported KV cache and decode,
  then one asking for nearly the model's length of output (a chat request without max_tokens asks
  for that) whose client reads a few tokens, then short requests. An admission check that wants the head's whole output free now
  (SGLang PR #25126) holds it and everyone behind it until the running requests finish, although
  their prompts fit.
- ``sampling_batch``: many decoding streams and one request with a sampling seed, or logprobs (and
  n > 1 where the server takes it), among them; an engine whose seeded generator path, or whose
  logprobs computation, is taken for every row of the batch (vLLM #37343's class: one request's
  sampling parameters make the whole batch pay; PR #37594) slows every stream, where the carrier
  alone costs little.
- ``logprob_streams``: two to six streams asking for logprobs, each hundreds of tokens long, then a plain
  stream while they decode. A frontend that re-detokenizes every earlier logprob of a stream at each step
  (SGLang PR #10805; vLLM #1099, PR #24174) spends CPU time that grows with the output so far, until output
  delivery for every stream falls behind the engine.
- ``cold_among_warm``: a request computes a long shared prefix, then its members, with tails of their own of a
  quarter or half a step budget, arrive a few ms apart, faster than a step admits them, and one or two short
  cache-cold prompts are sent among the first. FCFS serves the cold ones in their turn; a scheduler that sorts
  its waiting queue by cached prefix (SGLang's ``lpm``, #31954: "a cold request is re-displaced by every
  cache-hot arrival", a 20-60 s TTFT tail) serves them after every warm request sent after them.

Each takes (trace, rng, limits) like every operator and returns a valid trace or None.
"""

from __future__ import annotations

import random
from dataclasses import replace

from fuzzer.trace import Request, Trace

#: How many tokens a disconnecting client reads before it leaves.
CANCEL_AFTER = (1, 2, 4, 8, 16)
#: Long enough that a leaked request outlasts the executor's 5 s idle-after check at
#: 3.5 ms or more per decode step (7-11 s there), short enough that the next execution's
#: idle barrier (30 s) outwaits it on a server three times slower: every leaked request
#: costs a leaking server that long, and a campaign makes many.
LEAK_OUTPUTS = (2048, 3072)
#: When a client with a timeout leaves, in ms after sending: the first three are before the first
#: token of a prompt of a step budget or two on most servers; the others leave a queue or a stream.
TIMEOUT_MS = (10, 30, 80, 300, 1000)
#: When the clients of ``abandoned_queue`` leave, in ms after sending: once most of the prompts have reached the
#: engine's queue, each behind the frontend's tokenization of those before it (heldout3: 15 ms per 16k-token prompt,
#: one at a time; clients that left at 10 ms dropped most of them in the frontend, which the bug never sees), and
#: while the first is still being computed.
ABANDON_MS = (80, 300)
#: A long prompt is this many step budgets long.
BUDGET_MULTIPLES = (2, 4, 8)
#: Below this model length the shapes do not apply (their requests would not fit).
MIN_MODEL_LEN = 512


def fresh_id(trace: Trace, base: str) -> str:
    """A request id not yet in ``trace``, made from ``base``."""
    return fresh_name({r.id for r in trace.requests}, base)


def fresh_name(taken: set[str], base: str) -> str:
    base = base[:56]
    if base not in taken:
        return base
    i = 2
    while f"{base}{i}" in taken:
        i += 1
    return f"{base}{i}"


def _room(trace: Trace, limits) -> int:
    """How many requests may be added (none on a server whose model length is too short for the shapes)."""
    if limits.max_model_len < MIN_MODEL_LEN:
        return 0
    return limits.max_requests - len(trace.requests)


def long_outputs(trace: Trace, rng: random.Random, limits) -> Trace | None:
    """Two to six requests asking for a large max_tokens that stop early by EOS, then short requests behind them.

    Together they ask for one to three model lengths of output: more than the KV cache of
    a server sized for a few long requests holds, although they write little of it.
    """
    count = rng.randint(2, 6)
    victims = rng.randint(1, 2)
    if _room(trace, limits) < count + victims:
        return None
    at = float(round(rng.uniform(0, max(1.0, trace.duration_ms()))))
    current = trace
    for i in range(count + victims):
        if i < count:
            prompt = min(rng.choice([256, 1024, 2048]), limits.max_model_len // 4)
            out = min(limits.max_model_len // rng.choice([2, 4]), limits.max_model_len - prompt)
            req = Request(id=fresh_id(current, f"long{i}"), at_ms=at + i, prompt_tokens=prompt, max_tokens=out,
                          ignore_eos=False)
        else:
            req = Request(id=fresh_id(current, f"behind{i}"), at_ms=at + count + rng.choice([5.0, 20.0, 100.0]),
                          prompt_tokens=min(rng.choice([256, 1024, 4096]), limits.max_model_len - 64),
                          max_tokens=rng.choice([16, 64]))
        current = current.with_requests([*current.requests, req])
    return current


def disconnect_long(trace: Trace, rng: random.Random, limits) -> Trace | None:
    """A client leaves a long stream after a few tokens; a later request follows (when there is room)."""
    candidates = [r for r in trace.requests if r.n == 1]
    if not candidates or limits.max_model_len < MIN_MODEL_LEN:
        return None
    req = rng.choice(candidates)
    out = min(rng.choice(LEAK_OUTPUTS), limits.max_model_len - req.prompt_tokens)
    cancel = rng.choice(CANCEL_AFTER)
    if out <= cancel:
        return None
    left = replace(req, stream=True, max_tokens=out, ignore_eos=True, cancel_after_tokens=cancel)
    requests = [left if r is req else r for r in trace.requests]
    if _room(trace, limits) > 0:
        later = Request(id=fresh_id(trace, f"{req.id}_after"), at_ms=req.at_ms + rng.choice([100.0, 500.0, 2000.0]),
                        prompt_tokens=min(req.prompt_tokens, limits.max_model_len - 64), max_tokens=64)
        requests.append(later)
    return trace.with_requests(requests)


def long_prompt_beside_stream(trace: Trace, rng: random.Random, limits) -> Trace | None:
    """A stream with a long output, then a prompt of several step budgets while it streams."""
    if _room(trace, limits) < 2:
        return None
    at = rng.uniform(0, max(1.0, trace.duration_ms()))
    wanted = rng.choice([256, 512, 1024])
    prompt = rng.choice([64, 256])
    out = max(1, min(wanted, limits.max_output_tokens, limits.max_model_len - prompt))
    stream = Request(id=fresh_id(trace, "live"), at_ms=float(round(at)), prompt_tokens=prompt, max_tokens=out)
    long_prompt = min(limits.token_budget * rng.choice(BUDGET_MULTIPLES), limits.max_model_len - 32)
    big = Request(id=fresh_id(trace, "big"), at_ms=float(round(at + rng.choice([20.0, 100.0, 300.0]))),
                  prompt_tokens=long_prompt, max_tokens=rng.choice([4, 32]))
    return trace.with_requests([*trace.requests, stream, big])


def prefix_burst(trace: Trace, rng: random.Random, limits) -> Trace | None:
    """Long and short members of a new shared-prefix group, the short ones arriving among the long ones."""
    longs, shorts = rng.randint(2, 4), rng.randint(1, 3)
    if _room(trace, limits) < longs + shorts:
        return None
    prefix = rng.choice([32, 256, 1024])
    long_prompt = min(rng.choice([2048, 4096]), limits.max_model_len - 32)
    if long_prompt <= prefix:
        return None
    name = fresh_name(set(trace.prefixes), "burst")
    at = float(round(rng.uniform(0, max(1.0, trace.duration_ms()))))
    current = Trace(requests=trace.requests, prefixes={**trace.prefixes, name: prefix}, name=trace.name)
    for i in range(longs + shorts):
        short = 0 < i <= shorts  # the first arrival is long: the short ones wait during its prefill
        prompt = prefix + rng.choice([16, 64, 128]) if short else long_prompt
        req = Request(id=fresh_id(current, f"{'s' if short else 'l'}{name}_{i}"), at_ms=at + 5.0 * i,
                      prompt_tokens=prompt, prefix=name, max_tokens=rng.choice([16, 32]))
        current = replace(current, requests=(*current.requests, req))
    return current.with_requests(current.requests)


def timeout_before_first_token(trace: Trace, rng: random.Random, limits) -> Trace | None:
    """One to three long prompts whose clients leave within tens of ms (before their first token),
    each asking for a long output, then a long prompt that needs the KV and a seat."""
    count = rng.randint(1, 3)
    if _room(trace, limits) < count + 1:
        return None
    at = float(round(rng.uniform(0, max(1.0, trace.duration_ms()))))
    prompt = min(limits.token_budget * rng.choice((1, 2)) - rng.choice((0, 148)), limits.max_model_len // 2)
    out = min(rng.choice(LEAK_OUTPUTS), limits.max_model_len - prompt)
    if prompt < 1 or out < 1:
        return None
    current = trace
    for i in range(count):
        req = Request(id=fresh_id(current, f"gone{i}"), at_ms=at + i, prompt_tokens=prompt, max_tokens=out,
                      stream=rng.random() < 0.7, disconnect_after_ms=float(rng.choice(TIMEOUT_MS[:3])))
        current = current.with_requests([*current.requests, req])
    victim = Request(id=fresh_id(current, "next"), at_ms=at + rng.choice([100.0, 300.0, 1000.0]),
                     prompt_tokens=min(limits.token_budget, limits.max_model_len - 64), max_tokens=rng.choice([16, 64]))
    return current.with_requests([*current.requests, victim])


def client_timeout(trace: Trace, rng: random.Random, limits) -> Trace | None:
    """A request's client leaves after a time (set, or cleared half the time it is set); one that
    leaves within tens of ms asks for a long output (a lost abort then outlasts the idle check)."""
    if limits.max_model_len < MIN_MODEL_LEN:
        return None
    req = rng.choice(trace.requests)
    if req.disconnect_after_ms is not None and rng.random() < 0.5:
        return trace.with_requests([replace(req, disconnect_after_ms=None) if r is req else r for r in trace.requests])
    after = float(rng.choice(TIMEOUT_MS))
    if after > TIMEOUT_MS[2]:  # a late timeout: a long output could end before it, a long request, not a leak
        return trace.with_requests([replace(req, disconnect_after_ms=after) if r is req else r for r in trace.requests])
    out = max(req.max_tokens, min(rng.choice(LEAK_OUTPUTS), limits.max_model_len - req.prompt_tokens))
    left = replace(req, max_tokens=out, ignore_eos=True, disconnect_after_ms=after)
    return trace.with_requests([left if r is req else r for r in trace.requests])


def disconnect_fanout(trace: Trace, rng: random.Random, limits) -> Trace | None:
    """A stream of n choices left after a few tokens with a long output, then a later request."""
    allowed = limits.n_values()
    if not allowed or _room(trace, limits) < 2:
        return None
    at = float(round(rng.uniform(0, max(1.0, trace.duration_ms()))))
    prompt = rng.choice([64, 400, 1024])
    out = min(rng.choice(LEAK_OUTPUTS), limits.max_model_len - prompt)
    cancel = rng.choice(CANCEL_AFTER[2:])
    if out <= cancel:
        return None
    left = Request(id=fresh_id(trace, "fan"), at_ms=at, prompt_tokens=prompt, max_tokens=out, n=rng.choice(allowed),
                   temperature=1.0, cancel_after_tokens=cancel)
    later = Request(id=fresh_id(trace, "fan_after"), at_ms=at + rng.choice([200.0, 500.0, 2000.0]),
                    prompt_tokens=min(limits.token_budget, limits.max_model_len - 64), max_tokens=64)
    return trace.with_requests([*trace.requests, left, later])


def kv_burst(trace: Trace, rng: random.Random, limits) -> Trace | None:
    """Requests asking for 1.2-2x the reported KV cache within 120 ms (half the time sharing a long
    prefix), then one or two short requests (more would only make the trace longer to run)."""
    kv = getattr(limits, "kv_tokens", None)
    room = _room(trace, limits)
    if not kv or room < 6:
        return None
    count = min(room - 2, rng.choice([8, 16, 24]))
    per = -(-int(kv * rng.choice([1.2, 1.5, 2.0])) // count)
    per = min(per, limits.max_model_len)
    # Prompts carry the bulk: outputs of thousands of tokens each (a quarter of a 64k-token KV
    # over 8 requests) made one trace 35-48 s of decode steps on the held-out server; a few
    # hundred tokens per request still overflow a KV the prompts nearly fill.
    out = max(16, min(rng.choice([128, 256, 512]), per // 2, limits.max_model_len // 2))
    prompt = max(1, min(per - out, limits.max_model_len - out))
    at = float(round(rng.uniform(0, max(1.0, trace.duration_ms()))))
    prefix = None
    current = trace
    if rng.random() < 0.5 and prompt >= 2 * limits.block_size:
        prefix = fresh_name(set(trace.prefixes), "kvp")
        shared = max(limits.block_size, (prompt // 2) // limits.block_size * limits.block_size)
        current = Trace(requests=trace.requests, prefixes={**trace.prefixes, prefix: shared}, name=trace.name)
    gap = rng.choice([0.0, 1.0, 5.0])
    for i in range(count):
        req = Request(id=fresh_id(current, f"kv{i}"), at_ms=at + gap * i, prompt_tokens=prompt,
                      max_tokens=out, prefix=prefix)
        current = replace(current, requests=(*current.requests, req))
    for i in range(rng.randint(1, 2)):
        req = Request(id=fresh_id(current, f"kvlate{i}"), at_ms=at + rng.choice([50.0, 200.0, 1000.0]) + i,
                      prompt_tokens=min(rng.choice([64, 512]) + (current.prefixes[prefix] if prefix else 0),
                                        limits.max_model_len - 32), max_tokens=32, prefix=prefix)
        current = replace(current, requests=(*current.requests, req))
    return current.with_requests(current.requests)


def prefix_under_pressure(trace: Trace, rng: random.Random, limits) -> Trace | None:
    """Long requests holding most of the reported KV cache, a request that owns a long shared prefix
    among them, then two or three requests with that prefix and a short tail of their own.

    Once the owner's prefix is computed, a latecomer needs only its tail's blocks, and FCFS admits it
    while free KV is short of its whole prompt; an admission check that counts the resident prefix
    blocks as new ones refuses it, and every request behind it, until the others finish.
    """
    kv = getattr(limits, "kv_tokens", None)
    room = _room(trace, limits)
    block = limits.block_size
    if not kv or room < 4:
        return None
    # The owner is its prefix, a 32-token tail and an output of at most prefix // 24 tokens (below), a
    # sharer its prefix, a tail of at most 64 and 32 tokens out: all within the model length (capped at
    # the length alone, the owner of an 8192-token model was refused and no prefix was ever resident).
    fits = min(limits.max_model_len - 96, (limits.max_model_len - 32) * 24 // 25)
    prefix = min(kv // rng.choice([4, 8]), fits) // block * block
    if prefix < 4 * block:
        return None
    # Free KV after the owner's prefill is half its prefix plus what the decodes and the latecomers
    # will take: a latecomer's whole prompt does not fit, its tail does, and nobody is preempted.
    # The parent's requests sent from a second before the shape on may hold KV too (all of theirs at
    # once: an upper bound): they take the room the latecomers' whole prompts do not need, and a
    # parent that holds more makes no such shape. Without the decodes in the sum, a seed trace's
    # requests beside the shape ran the held-out server's cache out by design: the latecomer was
    # preempted on paper, its bound took the wait, and bug6 hid in it.
    out = max(16, min(rng.choice([256, 512]), prefix // 24))
    if prefix + 32 + out > limits.max_model_len:
        return None
    victims = rng.randint(2, 3)
    per = limits.max_model_len - out - 16
    count = min(room - 1 - victims, max(0, -(-(kv - prefix - prefix // 2) // per)))
    growth = (count + 1) * out + victims * (64 + 32)
    slack = prefix // 2 - growth - block

    def near(at: float) -> int:
        return sum(r.prompt_tokens + r.n * r.max_tokens for r in trace.requests if r.at_ms >= at - 1000.0)

    at = float(round(rng.uniform(0, max(1.0, trace.duration_ms()))))
    if near(at) > slack:
        at = trace.duration_ms() + 1000.0  # after the parent, then
    if count < 1 or near(at) > slack:
        return None
    fill = kv - (prefix + 32) - prefix // 2 - growth - near(at)
    name = fresh_name(set(trace.prefixes), "held")
    current = Trace(requests=trace.requests, prefixes={**trace.prefixes, name: prefix}, name=trace.name)
    added = [Request(id=fresh_id(current, f"fill{i}"), at_ms=at + i, prompt_tokens=max(1, min(per, fill // count)),
                     max_tokens=out) for i in range(count)] if count else []
    current = replace(current, requests=(*current.requests, *added))
    owner = Request(id=fresh_id(current, "owner"), at_ms=at + count + 1, prompt_tokens=prefix + 32, max_tokens=out,
                    prefix=name)
    current = replace(current, requests=(*current.requests, owner))
    # The latecomers come while the long prompts are still computed (in the queue behind them, by
    # design) or once they decode (admitted at once, where the resident prefix is counted once): how
    # long either lasts depends on the server's speed, so they come a factor of four apart.
    delay = rng.choice([100.0, 250.0, 500.0])
    for i in range(victims):
        tail = rng.choice([16, 32, 64])
        late = Request(id=fresh_id(current, f"sharer{i}"), at_ms=owner.at_ms + delay * 4 ** i,
                       prompt_tokens=prefix + tail, max_tokens=32, prefix=name)
        current = replace(current, requests=(*current.requests, late))
    return current.with_requests(current.requests)


#: How long after the owner of a cached prefix is sent its burst comes, in ms: after its prefill on
#: most servers (the paper schedule gives the burst its hit only once the owner has computed it).
WARM_AFTER_MS = (300.0, 1000.0)


def _prefix_owner(trace: Trace, rng: random.Random, prefix: int, base: str) -> tuple[Trace, str, float]:
    """``trace`` with a new shared prefix of ``prefix`` tokens (named from ``base``) and a request that computes it
    at a random time: (the trace, the prefix's name, when its owner is sent)."""
    name = fresh_name(set(trace.prefixes), base)
    at = float(round(rng.uniform(0, max(1.0, trace.duration_ms()))))
    current = Trace(requests=trace.requests, prefixes={**trace.prefixes, name: prefix}, name=trace.name)
    owner = Request(id=fresh_id(current, "owner"), at_ms=at, prompt_tokens=prefix + 16, max_tokens=4, prefix=name)
    return replace(current, requests=(*current.requests, owner)), name, at


def cached_prefix_burst(trace: Trace, rng: random.Random, limits) -> Trace | None:
    """A request computes a long shared prefix; once it is done, sixteen to thirty-two requests (where the
    trace has room) with that prefix and short tails of their own arrive together."""
    # Sixteen or more: two admissions a step (a typical overcharge) are then seven steps late at the end,
    # beyond the oracle's absolute margin where a step is a few ms of overhead.
    count = min(rng.choice([16, 24, 32]), _room(trace, limits) - 1)
    prefix = min(rng.choice([1024, 2048]), limits.max_model_len - 64) // limits.block_size * limits.block_size
    if count < 8 or prefix < 4 * limits.block_size:
        return None
    current, name, at = _prefix_owner(trace, rng, prefix, "warm")
    start = at + rng.choice(WARM_AFTER_MS)
    for i in range(count):
        req = Request(id=fresh_id(current, f"warm{i}"), at_ms=start + i, prompt_tokens=prefix + rng.choice([8, 16, 32]),
                      max_tokens=rng.choice([8, 16]), prefix=name)
        current = replace(current, requests=(*current.requests, req))
    return current.with_requests(current.requests)


def sampling_batch(trace: Trace, rng: random.Random, limits) -> Trace | None:
    """Eight to thirty-two short streams decoding together (half the time of several choices each,
    :func:`_row_choices`), and one request among them with a sampling seed, or logprobs and several choices
    (one row's sampling work that an engine may make the whole batch pay for)."""
    count = rng.choice([8, 16, 32])
    count = min(count, _room(trace, limits) - 1)
    if count < 4:
        return None
    at = float(round(rng.uniform(0, max(1.0, trace.duration_ms()))))
    out = min(rng.choice([64, 128, 256]), limits.max_output_tokens, limits.max_model_len - 128)
    current, rows = trace, []
    for i in range(count):
        req = Request(id=fresh_id(current, f"row{i}"), at_ms=at + i, prompt_tokens=rng.choice([32, 64, 128]),
                      max_tokens=out)
        rows.append(req)
        current = current.with_requests([*current.requests, req])
    carrier = Request(id=fresh_id(current, "seeded"), at_ms=at + count + rng.choice([10.0, 50.0]), prompt_tokens=64,
                      max_tokens=out, temperature=1.0, seed=rng.randrange(1 << 31))
    if (values := limits.logprob_values()) and rng.random() < 0.5:
        # With several choices where the server takes them (vLLM #37343: n=8, logprobs=20).
        choices = limits.n_values()
        carrier = replace(carrier, id=fresh_id(current, "logprobs"), seed=None, temperature=1.0 if choices else 0.0,
                          logprobs=rng.choice(values), n=rng.choice(choices) if choices else 1)
    n = _row_choices(count, out, limits, rng)
    return trace.with_requests([*trace.requests, *(replace(r, n=n) for r in rows), carrier])


#: The most choices a sampling batch's rows get (:func:`_row_choices`), and the share of its KV cache they may ask for.
ROW_CHOICES = 4
ROW_KV_SHARE = 0.5


def _row_choices(count: int, out: int, limits, rng: random.Random) -> int:
    """How many choices each of a sampling batch's ``count`` rows asks for: half the time the most the server
    takes up to ROW_CHOICES, when they fit in ROW_KV_SHARE of its reported KV cache; else one. A sampler's
    per-row cost grows with the sequences it samples, and a trace holds at most ``limits.max_requests``
    requests: heldout3's seeded per-row sampler slowed the others' token gaps 1.36x beside 21 rows of one
    choice and 2.1x beside 21 of four (its clean configuration: 1.0x either way); a campaign's test of two
    seeded carriers beside 21 rows of one choice measured 1.29x, under its bar."""
    choices = [v for v in limits.n_values() if v <= ROW_CHOICES]
    if not choices or rng.random() < 0.5:
        return 1
    n = max(choices)
    fits = limits.kv_tokens is None or count * n * (128 + out) <= ROW_KV_SHARE * limits.kv_tokens
    return n if fits else 1


def abandoned_queue(trace: Trace, rng: random.Random, limits) -> Trace | None:
    """Four to six long prompts sent together whose clients leave while most are queued, then a short request."""
    count = rng.randint(4, 6)
    if _room(trace, limits) < count + 1:
        return None
    # Long enough that the abandoned prompts' prefill dwarfs the 50 ms an engine may take to apply an abort:
    # prompts of two step budgets held the request behind only 1.0-1.2x its bound on heldout3 with the bug.
    prompt = min(limits.token_budget * rng.choice((4, 8)), limits.max_model_len // 2)
    at = float(round(rng.uniform(0, max(1.0, trace.duration_ms()))))
    current = trace
    for i in range(count):
        req = Request(id=fresh_id(current, f"left{i}"), at_ms=at + i, prompt_tokens=prompt, max_tokens=rng.choice((16, 64)),
                      stream=rng.random() < 0.5, disconnect_after_ms=float(rng.choice(ABANDON_MS)))
        current = current.with_requests([*current.requests, req])
    behind = Request(id=fresh_id(current, "behind_left"), at_ms=at + count + rng.choice((20.0, 50.0, 150.0)),
                     prompt_tokens=rng.choice((32, 128)), max_tokens=16)
    return current.with_requests([*current.requests, behind])


#: The share of the KV cache the running requests of ``reservation_under_load`` fill, at least.
RESERVE_FILL = (0.6, 0.75, 0.9)


def reservation_under_load(trace: Trace, rng: random.Random, limits) -> Trace | None:
    """Requests whose prompts fill most of the reported KV cache and decode, then a request asking for
    nearly the model's length of output, then one or two short requests right behind it."""
    kv = getattr(limits, "kv_tokens", None)
    if not kv:
        return None
    out = rng.choice((128, 256, 512))
    per_most = limits.max_model_len - out - 1
    # Free KV short of a whole model length: the head's output cannot fit while they run.
    fill = min(0.95, max(rng.choice(RESERVE_FILL), 1.0 - 0.7 * limits.max_model_len / kv))
    count = max(2, -(-int(kv * fill) // max(1, per_most)))
    if per_most < 64 or _room(trace, limits) < count + 3:
        return None
    prompt = min(per_most, int(kv * fill) // count)
    at = float(round(rng.uniform(0, max(1.0, trace.duration_ms()))))
    current = trace
    for i in range(count):
        req = Request(id=fresh_id(current, f"fill{i}"), at_ms=at + i, prompt_tokens=prompt, max_tokens=out)
        current = current.with_requests([*current.requests, req])
    head_at = at + count + rng.choice((300.0, 1000.0, 2000.0))
    head_prompt = rng.choice((64, 256))
    # Its client reads a few tokens and leaves: the admission check sees max_tokens, while the execution (and its
    # FCFS bound, which a campaign's time budget reads) costs only those few (the whole output kept every such
    # mutant over its share of a 30-minute campaign on a 32k-token model: heldout3 ran none).
    head = Request(id=fresh_id(current, "whole"), at_ms=head_at, prompt_tokens=head_prompt,
                   max_tokens=limits.max_model_len - head_prompt, ignore_eos=False, stream=True,
                   cancel_after_tokens=rng.choice((1, 4)))
    current = current.with_requests([*current.requests, head])
    for i in range(rng.randint(1, 2)):
        req = Request(id=fresh_id(current, f"after_whole{i}"), at_ms=head_at + rng.choice((5.0, 20.0)) + i,
                      prompt_tokens=rng.choice((64, 256)), max_tokens=16)
        current = current.with_requests([*current.requests, req])
    return current


#: Output lengths of ``logprob_streams``' streams: hundreds of tokens to a thousand, where a per-step cost that grows
#: with the output so far outgrows an engine step (heldout3's bug: four streams of 350 tokens with 20 logprobs beside
#: one plain stream). Beside a busy batch a step is longer: in a 30-minute heldout3 campaign the shape made two to
#: four streams of 256-512 tokens in traces of 19-47 requests, and the bug delayed no request; one of those traces
#: with its three streams at 1024 tokens, 21 requests (a quadratic cost: twice the tokens, four times the work).
LOGPROB_STREAM_OUTPUTS = (256, 512, 1024)


def logprob_streams(trace: Trace, rng: random.Random, limits) -> Trace | None:
    """Two to six streams asking for the most logprobs the server takes, each hundreds of tokens long, then one
    or two plain streams while they decode."""
    values = limits.logprob_values()
    count = min(rng.randint(2, 6), _room(trace, limits) - 2)
    if not values or count < 2:
        return None
    out = min(rng.choice(LOGPROB_STREAM_OUTPUTS), limits.max_model_len - 256)
    top = max(values)
    at = float(round(rng.uniform(0, max(1.0, trace.duration_ms()))))
    current = trace
    for i in range(count):
        req = Request(id=fresh_id(current, f"lp{i}"), at_ms=at + i, prompt_tokens=rng.choice((64, 256)),
                      max_tokens=out, stream=True, logprobs=top if rng.random() < 0.75 else rng.choice(values))
        current = current.with_requests([*current.requests, req])
    # While they decode: a second or more in, where the cost of the output so far has grown.
    later = at + count + rng.choice((500.0, 1500.0, 3000.0))
    for i in range(rng.randint(1, 2)):
        req = Request(id=fresh_id(current, "plain"), at_ms=later + 20.0 * i, prompt_tokens=64,
                      max_tokens=rng.choice((64, 128)), stream=True)
        current = current.with_requests([*current.requests, req])
    return current


#: Tails of ``cold_among_warm``'s warm requests, in step budgets: two to four fill a step.
WARM_TAIL_BUDGETS = (0.25, 0.5)
#: ms between ``cold_among_warm``'s warm arrivals: faster than a step that computes a budget of prompt tokens.
WARM_GAP_MS = (5.0, 10.0, 20.0)


def cold_among_warm(trace: Trace, rng: random.Random, limits) -> Trace | None:
    """A request computes a long shared prefix; once it is done, twelve to twenty-four requests with that prefix
    and tails of their own arrive a few ms apart, and one or two short cold prompts are sent after the first few."""
    block = limits.block_size
    prefix = min(rng.choice((1024, 2048)), limits.max_model_len // 2) // block * block
    tail = max(block, int(limits.token_budget * rng.choice(WARM_TAIL_BUDGETS)))
    colds = rng.randint(1, 2)
    count = min(rng.choice((12, 16, 24)), _room(trace, limits) - 1 - colds)
    if limits.kv_tokens:  # the warm tails within half the reported cache: no preemption, which excuses an order
        count = min(count, (limits.kv_tokens // 2 - prefix) // (tail + block))
    start, gap, after = rng.choice(WARM_AFTER_MS), rng.choice(WARM_GAP_MS), rng.randint(2, 4)
    # Four or more members come the order check's 20 ms reach (fuzzer.oracle.order) after the cold ones.
    if count < max(8, after + 4 + int(20 // gap)) or prefix < 4 * block or prefix + tail + 16 > limits.max_model_len:
        return None
    current, name, at = _prefix_owner(trace, rng, prefix, "hot")
    start += at
    for i in range(count):
        req = Request(id=fresh_id(current, f"hot{i}"), at_ms=start + i * gap, prompt_tokens=prefix + tail,
                      max_tokens=rng.choice((8, 16)), prefix=name)
        current = replace(current, requests=(*current.requests, req))
        if i + 1 == after:
            for j in range(colds):
                cold = Request(id=fresh_id(current, "cold"), at_ms=start + i * gap + 1 + j,
                               prompt_tokens=rng.choice((32, 128, 512)), max_tokens=16)
                current = replace(current, requests=(*current.requests, cold))
    return current.with_requests(current.requests)


SHAPE_OPERATORS = (long_outputs, disconnect_long, long_prompt_beside_stream, prefix_burst, timeout_before_first_token,
                   client_timeout, disconnect_fanout, kv_burst, prefix_under_pressure, sampling_batch,
                   cached_prefix_burst, abandoned_queue, reservation_under_load, logprob_streams, cold_among_warm)
