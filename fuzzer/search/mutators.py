"""Structure-aware mutation of traces (ARCHITECTURE.md, "Search").

Every operator takes a trace, an injected ``random.Random`` and the
:class:`Limits` of the target, and returns a new *valid* trace or ``None`` when
it does not apply (deleting from a one-request trace, say). :class:`Mutator`
stacks operators (havoc), splices two traces, and learns which operators pay off
(a bandit over their success rates). :class:`NullMutator` ignores its parent and
generates a fresh random trace: the baseline of the fuzzing benchmark. The
operators of :mod:`fuzzer.search.shapes` (shapes of public reports: long outputs
that stop early, a long stream left after a few tokens, a long prompt beside a
live stream, a prefix burst) are havoc operators like the others.

New request ids record how they were made, as in GRIEF's reports: ``r04_d``
(duplicate), ``r04_s3`` (storm clone 3), ``r04_retry``, ``f2`` (fill), ``long0`` /
``behind3`` / ``r04_after`` / ``live`` / ``big`` / ``lburst_0`` (shapes).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Callable, Collection, Mapping

from fuzzer.oracle.signature import LEAVING, leak_signature, leaving, leaving_clients

from fuzzer.search.shapes import SHAPE_OPERATORS
from fuzzer.search.shapes import fresh_id as _fresh_id
from fuzzer.search.shapes import fresh_name as _fresh_name
from fuzzer.trace import LOGPROB_VALUES, N_VALUES, Request, Trace, disconnects, validate

# A fuzzing trace with more requests than this is a load test: slower to run, slower to
# minimize, and it finds queueing rather than scheduling pathologies.
MAX_FUZZ_REQUESTS = 48
# Storms clone a request this many times at most (GRIEF's "storm" operator).
MAX_STORM = 12
# Havoc stacks up to 2**HAVOC_STACK_POW2 operators (AFL uses 2**4 on bytes; traces are
# small structured inputs, so fewer).
HAVOC_STACK_POW2 = 3
# Share of random requests (generation, add_request) that ask for sampling work: n, logprobs or both.
SAMPLING_RATE = 0.1
_SAMPLING_KINDS = ("n", "logprobs", "both")
# Bandit: add-one smoothing and a floor, so no operator starves before it had a chance.
OPERATOR_FLOOR = 0.2


@dataclass(frozen=True)
class Limits:
    """What the target accepts and where its scheduler has boundaries worth probing."""

    max_model_len: int = 32768
    block_size: int = 16
    token_budget: int = 2048
    max_requests: int = MAX_FUZZ_REQUESTS
    max_output_tokens: int = 1024
    #: Features the target rejected in the capability probe (e.g. {"n", "logprobs", "chat"}).
    unsupported: frozenset[str] = frozenset()
    #: The largest n the target accepted in the capability probe (None: no limit seen).
    max_n: int | None = None
    #: The largest logprobs the target accepted in the capability probe (None: no limit seen).
    max_logprobs: int | None = None
    #: Tokens the server's KV cache holds, where it reports them (vLLM's cache_config_info): the
    #: KV-pressure shapes are sized from it (None: unknown, they do not apply).
    kv_tokens: int | None = None

    def fits(self, prompt_tokens: int, max_tokens: int) -> bool:
        return prompt_tokens + max_tokens <= self.max_model_len

    def n_values(self) -> tuple[int, ...]:
        """The n > 1 values to draw that the target takes (none where it refuses n)."""
        return () if "n" in self.unsupported else tuple(v for v in N_VALUES if self.max_n is None or v <= self.max_n)

    def logprob_values(self) -> tuple[int, ...]:
        """The logprobs values to draw that the target takes (none where it refuses logprobs)."""
        return () if "logprobs" in self.unsupported else tuple(
            v for v in LOGPROB_VALUES if self.max_logprobs is None or v <= self.max_logprobs)

    def to_dict(self) -> dict:
        return {
            "max_model_len": self.max_model_len, "block_size": self.block_size, "token_budget": self.token_budget,
            "max_requests": self.max_requests, "max_output_tokens": self.max_output_tokens,
            "unsupported": sorted(self.unsupported), "max_n": self.max_n,
            "max_logprobs": self.max_logprobs, "kv_tokens": self.kv_tokens,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> Limits:
        """Read what :meth:`to_dict` wrote; a field it lacks keeps its default."""
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if "unsupported" in known:
            known["unsupported"] = frozenset(known["unsupported"])
        return cls(**known)


Operator = Callable[[Trace, random.Random, Limits], "Trace | None"]


# --- helpers ------------------------------------------------------------------------


def _pick(trace: Trace, rng: random.Random, predicate: Callable[[Request], bool] = lambda r: True) -> Request | None:
    choices = [r for r in trace.requests if predicate(r)]
    return rng.choice(choices) if choices else None


def _replace_request(trace: Trace, old: Request, new: Request) -> Trace:
    return trace.with_requests([new if r is old else r for r in trace.requests])


def _clamp_prompt(value: int, request: Request, trace: Trace, limits: Limits) -> int:
    low = trace.prefix_tokens(request) or 1
    high = max(low, limits.max_model_len - request.max_tokens)
    return max(low, min(int(value), high))


def random_request(rng: random.Random, limits: Limits, request_id: str, at_ms: float, prefix: str | None = None,
                   prefix_tokens: int = 0) -> Request:
    """A request drawn from a log-uniform size distribution (short and long both common)."""
    out_cap = max(1, min(limits.max_output_tokens, limits.max_model_len // 4))
    max_tokens = max(1, int(2 ** rng.uniform(0, math.log2(out_cap))))
    prompt_cap = max(prefix_tokens + 1, limits.max_model_len - max_tokens)
    prompt = max(prefix_tokens or 1, int(2 ** rng.uniform(3, math.log2(max(9, min(prompt_cap, 8192))))))
    stream = rng.random() < 0.8
    api = "chat" if "chat" not in limits.unsupported and rng.random() < 0.2 else "completions"
    n, logprobs = 1, None
    if rng.random() < SAMPLING_RATE:  # sampling work is part of the input space (random baseline too)
        n, logprobs = _sampling(rng, limits, rng.choice(_SAMPLING_KINDS))
    return Request(
        id=request_id,
        at_ms=float(round(at_ms)),
        prompt_tokens=min(prompt, prompt_cap),
        max_tokens=max_tokens,
        prefix=prefix,
        stream=stream,
        api=api,
        n=n,
        logprobs=logprobs,
        temperature=1.0 if n > 1 else 0.0,
    )


def _sampling(rng: random.Random, limits: Limits, what: str, request: Request | None = None) -> tuple[int, int | None]:
    """(n, logprobs) for ``what`` in "n", "logprobs", "both" (unsupported parameters stay as they were)."""
    n = request.n if request is not None else 1
    logprobs = request.logprobs if request is not None else None
    if what in ("n", "both") and (choices := limits.n_values()):
        n = rng.choice(choices)
    if what in ("logprobs", "both") and (values := limits.logprob_values()):
        logprobs = rng.choice(values)
    return n, logprobs


# --- operators --------------------------------------------------------------------


def add_request(trace, rng, limits):
    if len(trace.requests) >= limits.max_requests:
        return None
    at = rng.uniform(0, max(50.0, trace.duration_ms() * 1.2))
    prefix = rng.choice([None, *trace.prefixes]) if trace.prefixes else None
    req = random_request(rng, limits, _fresh_id(trace, "a"), at, prefix, trace.prefixes.get(prefix, 0) if prefix else 0)
    return trace.with_requests([*trace.requests, req])


def delete_request(trace, rng, limits):
    if len(trace.requests) < 2:
        return None
    victim = rng.choice(trace.requests)
    return trace.with_requests([r for r in trace.requests if r is not victim])


def duplicate_request(trace, rng, limits):
    if len(trace.requests) >= limits.max_requests:
        return None
    src = rng.choice(trace.requests)
    clone = replace(src, id=_fresh_id(trace, f"{src.id}_d"), at_ms=src.at_ms + rng.choice([0.0, 1.0, 5.0, 20.0]))
    return trace.with_requests([*trace.requests, clone])


def storm(trace, rng, limits):
    room = limits.max_requests - len(trace.requests)
    if room < 2:
        return None
    src = rng.choice(trace.requests)
    count = rng.randint(2, min(MAX_STORM, room))
    gap = rng.choice([0.0, 0.5, 1.0, 2.0])
    clones = []
    current = trace
    for i in range(count):
        clone = replace(src, id=_fresh_id(current, f"{src.id}_s{i + 1}"), at_ms=src.at_ms + gap * (i + 1))
        clones.append(clone)
        current = current.with_requests([*current.requests, clone])
    return current


def scale_prompt(trace, rng, limits):
    req = rng.choice(trace.requests)
    factor = rng.choice([0.25, 0.5, 2.0, 4.0])
    return _replace_request(trace, req, replace(req, prompt_tokens=_clamp_prompt(req.prompt_tokens * factor, req, trace, limits)))


def snap_prompt(trace, rng, limits):
    """Move a prompt length onto a scheduler boundary: KV block +-1, the token budget, max_model_len - e."""
    req = rng.choice(trace.requests)
    block = limits.block_size
    base = max(block, round(req.prompt_tokens / block) * block)
    candidates = [
        base - 1, base, base + 1,
        limits.token_budget - 1, limits.token_budget, limits.token_budget + 1,
        limits.max_model_len - req.max_tokens - 1,
    ]
    value = rng.choice(candidates)
    return _replace_request(trace, req, replace(req, prompt_tokens=_clamp_prompt(value, req, trace, limits)))


def change_max_tokens(trace, rng, limits):
    req = rng.choice(trace.requests)
    value = rng.choice([1, 2, req.max_tokens // 2, req.max_tokens * 2, rng.randint(1, limits.max_output_tokens)])
    value = max(1, min(int(value), limits.max_output_tokens, limits.max_model_len - req.prompt_tokens))
    if value < 1:
        return None
    cancel = req.cancel_after_tokens if req.cancel_after_tokens and req.cancel_after_tokens < value else None
    return _replace_request(trace, req, replace(req, max_tokens=value, cancel_after_tokens=cancel))


def toggle_stream(trace, rng, limits):
    req = rng.choice(trace.requests)
    return _replace_request(trace, req, replace(req, stream=not req.stream, cancel_after_tokens=None))


def toggle_api(trace, rng, limits):
    if "chat" in limits.unsupported:
        return None
    req = rng.choice(trace.requests)
    return _replace_request(trace, req, replace(req, api="chat" if req.api == "completions" else "completions"))


def add_prefix(trace, rng, limits):
    """Make a few requests share a new prefix group (or join an existing one)."""
    name = _fresh_name(set(trace.prefixes), "p")
    members = [r for r in trace.requests if rng.random() < 0.6] or [rng.choice(trace.requests)]
    shortest = min(r.prompt_tokens for r in members)
    tokens = max(1, min(shortest, rng.choice([limits.block_size - 1, limits.block_size, limits.block_size + 1, 32, 256, 1024])))
    prefixes = {**trace.prefixes, name: tokens}
    chosen = {id(r) for r in members}
    requests = [replace(r, prefix=name) if id(r) in chosen else r for r in trace.requests]
    return Trace(requests=tuple(requests), prefixes=prefixes, name=trace.name).with_requests(requests)


def remove_prefix(trace, rng, limits):
    if not trace.prefixes:
        return None
    name = rng.choice(list(trace.prefixes))
    return trace.with_requests([replace(r, prefix=None) if r.prefix == name else r for r in trace.requests])


def resize_prefix(trace, rng, limits):
    if not trace.prefixes:
        return None
    name = rng.choice(list(trace.prefixes))
    members = [r for r in trace.requests if r.prefix == name]
    if not members:
        return None
    cap = min(r.prompt_tokens for r in members)
    value = rng.choice([trace.prefixes[name] * 2, trace.prefixes[name] // 2, limits.block_size + rng.choice([-1, 0, 1]), cap])
    prefixes = {**trace.prefixes, name: max(1, min(int(value), cap))}
    return Trace(requests=trace.requests, prefixes=prefixes, name=trace.name)


def compress_gaps(trace, rng, limits):
    """Squash arrivals into a burst."""
    factor = rng.choice([0.0, 0.01, 0.1, 0.5])
    start = trace.requests[0].at_ms
    return trace.with_requests([replace(r, at_ms=float(round(start + (r.at_ms - start) * factor))) for r in trace.requests])


def spread_gaps(trace, rng, limits):
    factor = rng.choice([2.0, 4.0, 10.0])
    start = trace.requests[0].at_ms
    spread = [replace(r, at_ms=float(min(600_000, round(start + max(r.at_ms - start, 1.0) * factor)))) for r in trace.requests]
    return trace.with_requests(spread)


def reorder(trace, rng, limits):
    """Swap the arrival times of two requests (who comes first matters to FCFS)."""
    if len(trace.requests) < 2:
        return None
    a, b = rng.sample(list(trace.requests), 2)
    return trace.with_requests([
        replace(r, at_ms=b.at_ms) if r is a else replace(r, at_ms=a.at_ms) if r is b else r for r in trace.requests
    ])


def cancel_and_retry(trace, rng, limits):
    """A client disconnects mid-stream, then retries the same request (GRIEF's `_retry`)."""
    req = _pick(trace, rng, lambda r: r.max_tokens > 1)
    if req is None or len(trace.requests) >= limits.max_requests:
        return None
    cancelled = replace(req, stream=True, cancel_after_tokens=rng.randint(1, req.max_tokens - 1))
    retry = replace(req, id=_fresh_id(trace, f"{req.id}_retry"), at_ms=req.at_ms + rng.choice([10.0, 50.0, 200.0]), cancel_after_tokens=None)
    return trace.with_requests([*(cancelled if r is req else r for r in trace.requests), retry])


def uncancel(trace, rng, limits):
    req = _pick(trace, rng, disconnects)
    return None if req is None else _replace_request(trace, req, replace(req, cancel_after_tokens=None,
                                                                       disconnect_after_ms=None))


#: The output a request whose client timed out keeps when its disconnect is taken away.
KEPT_AFTER_TIMEOUT = 16


def without_cancellations(trace: Trace, ways: Collection[str] | None = None) -> Trace:
    """``trace`` with no client disconnects (only those that leave in one of ``ways``, see
    :func:`fuzzer.oracle.signature.leaving`, when given): each request that had one asks for what
    its client read (its cancel_after_tokens; KEPT_AFTER_TIMEOUT tokens after a timeout) and is
    served to its end. Not to max_tokens: the disconnect shapes ask for thousands of tokens so that
    a leak outlasts the idle check, and served whole they made every child of theirs run for 20-60 s
    on the held-out server (n = 8 x 3072 tokens)."""
    def strips(r: Request) -> bool:
        return disconnects(r) and (ways is None or leaving(r) in ways)

    if not any(map(strips, trace.requests)):
        return trace

    def kept(r: Request) -> Request:
        if not strips(r):
            return r
        out = r.cancel_after_tokens if r.cancel_after_tokens is not None else KEPT_AFTER_TIMEOUT
        return replace(r, cancel_after_tokens=None, disconnect_after_ms=None, max_tokens=min(r.max_tokens, out))

    return trace.with_requests([kept(r) for r in trace.requests])


def without_found_leaks(trace: Trace, found: Collection[str]) -> Trace:
    """``trace`` without the disconnects whose leak is among the ``found`` signatures. A way of
    leaving whose leak is not confirmed (an n > 1 request, after a single one) stays."""
    known = {w for w in LEAVING if leak_signature({w}) in found}
    trace = without_cancellations(trace, known) if known else trace
    left = leaving_clients(trace)
    return without_cancellations(trace) if left and leak_signature(left) in found else trace


def n_logprobs(trace, rng, limits):
    """Raise a request's sampling work: n choices, logprobs, or both at once (vLLM 37343).

    The cost of vLLM 37343 needs n > 1 *and* logprobs on one request, and grows with
    their product: setting one of them per application, with small values half the
    time, reached it in none of 300 executions; "both" with large values does.
    """
    options = [o for o in ("n", "logprobs") if o not in limits.unsupported]
    if not options:
        return None
    if len(options) == 2:
        options += ["both", "both"]  # both at once half of the time
    req = rng.choice(trace.requests)
    what = rng.choice(options)
    if what != "both" and rng.random() < 0.5:
        # Switch it off again (the minimizer's direction; also keeps traces cheap).
        n, logprobs = (1, req.logprobs) if what == "n" else (req.n, None)
    else:
        n, logprobs = _sampling(rng, limits, what, req)
    temperature = 1.0 if n > 1 and req.temperature == 0 else req.temperature
    new = replace(req, n=n, logprobs=logprobs, temperature=temperature)
    return None if new == req else _replace_request(trace, req, new)


def seed_request(trace, rng, limits):
    """Set a request's sampling seed (with sampling on), or clear one already set."""
    seeded = [r for r in trace.requests if r.seed is not None]
    if seeded and rng.random() < 0.5:
        req = rng.choice(seeded)
        return _replace_request(trace, req, replace(req, seed=None))
    req = rng.choice(trace.requests)
    return _replace_request(trace, req, replace(req, seed=rng.randrange(1 << 31), temperature=req.temperature or 1.0))


def fill(trace, rng, limits):
    """"Fill" (arXiv 2602.07878): long prompts with long outputs to exhaust the KV cache."""
    room = limits.max_requests - len(trace.requests)
    if room < 2:
        return None
    count = rng.randint(2, min(16, room))
    out = min(limits.max_output_tokens, max(64, limits.max_model_len // 8))
    prompt = max(1, min(rng.choice([2048, 3000, 4096]), limits.max_model_len - out))
    at = rng.uniform(0, max(1.0, trace.duration_ms()))
    current = trace
    for i in range(count):
        req = Request(id=_fresh_id(current, f"f{i}"), at_ms=float(round(at + i)), prompt_tokens=prompt, max_tokens=out)
        current = current.with_requests([*current.requests, req])
    return current


def squeeze(trace, rng, limits):
    """"Squeeze": keep the KV cache near full with a steady stream of medium requests (preemption)."""
    room = limits.max_requests - len(trace.requests)
    if room < 4:
        return None
    count = rng.randint(4, min(24, room))
    gap = rng.choice([5.0, 20.0, 50.0])
    prompt = max(1, min(rng.choice([512, 1024, 1536]), limits.max_model_len - limits.max_output_tokens))
    at = trace.requests[0].at_ms
    current = trace
    for i in range(count):
        req = Request(id=_fresh_id(current, f"q{i}"), at_ms=float(round(at + gap * i)), prompt_tokens=prompt,
                      max_tokens=limits.max_output_tokens)
        current = current.with_requests([*current.requests, req])
    return current


OPERATORS: Mapping[str, Operator] = {
    f.__name__: f
    for f in (
        add_request, delete_request, duplicate_request, storm, scale_prompt, snap_prompt, change_max_tokens,
        toggle_stream, toggle_api, add_prefix, remove_prefix, resize_prefix, compress_gaps, spread_gaps,
        reorder, cancel_and_retry, uncancel, n_logprobs, seed_request, fill, squeeze, *SHAPE_OPERATORS,
    )
}


def splice(a: Trace, b: Trace, rng: random.Random, limits: Limits) -> Trace | None:
    """Requests of ``a`` before a cut time, then those of ``b`` after it (ids and prefixes kept apart)."""
    cut = rng.uniform(0, max(a.duration_ms(), b.duration_ms(), 1.0))
    head = [r for r in a.requests if r.at_ms <= cut]
    tail = [r for r in b.requests if r.at_ms > cut] or list(b.requests[-1:])
    taken_names = set(a.prefixes)  # a name of ``a`` (say an earlier splice's b_burst) is never reused
    renamed_prefix = {}
    for name in b.prefixes:
        renamed_prefix[name] = _fresh_name(taken_names, f"b_{name}")
        taken_names.add(renamed_prefix[name])
    taken = {r.id for r in head}
    requests = list(head)
    for r in tail:
        new_id = r.id if r.id not in taken else f"b_{r.id}"[:64]
        if new_id in taken:
            continue
        taken.add(new_id)
        requests.append(replace(r, id=new_id, prefix=renamed_prefix.get(r.prefix) if r.prefix else None))
    requests = requests[: limits.max_requests]
    if not requests:
        return None
    prefixes = {**a.prefixes, **{renamed_prefix[k]: v for k, v in b.prefixes.items()}}
    return Trace(requests=tuple(requests), prefixes=prefixes, name=a.name).with_requests(requests)


# --- the mutator ------------------------------------------------------------------


@dataclass
class OperatorStats:
    """Successes per operator; choice probability follows the smoothed success rate."""

    tries: dict[str, int] = field(default_factory=dict)
    wins: dict[str, int] = field(default_factory=dict)

    def weight(self, name: str) -> float:
        rate = (self.wins.get(name, 0) + 1) / (self.tries.get(name, 0) + 2)
        return max(OPERATOR_FLOOR * 0.5, rate) + OPERATOR_FLOOR * 0.5

    def choose(self, names: list[str], rng: random.Random) -> str:
        return rng.choices(names, weights=[self.weight(n) for n in names])[0]

    def record(self, ops: tuple[str, ...], success: bool) -> None:
        for op in set(ops):
            self.tries[op] = self.tries.get(op, 0) + 1
            if success:
                self.wins[op] = self.wins.get(op, 0) + 1

    def to_dict(self) -> dict:
        return {"tries": dict(self.tries), "wins": dict(self.wins)}

    @classmethod
    def from_dict(cls, data: Mapping) -> "OperatorStats":
        return cls(tries=dict(data.get("tries", {})), wins=dict(data.get("wins", {})))


@dataclass(frozen=True)
class Child:
    """A mutated trace and how it was made."""

    trace: Trace
    operators: tuple[str, ...]


class Mutator:
    """Havoc over the structure-aware operators, with splicing and a bandit over operators."""

    name = "guided"

    def __init__(self, limits: Limits | None = None, stats: OperatorStats | None = None, splice_rate: float = 0.1):
        self.limits = limits or Limits()
        self.stats = stats or OperatorStats()
        self.splice_rate = splice_rate

    def mutate(self, parent: Trace, rng: random.Random, other: Trace | None = None) -> Child:
        """A valid child of ``parent`` that differs from it (falls back to a fresh trace after many misses)."""
        names = [n for n in OPERATORS if not (n == "toggle_api" and "chat" in self.limits.unsupported)]
        for _ in range(32):
            current, ops = parent, []
            if other is not None and rng.random() < self.splice_rate:
                spliced = splice(parent, other, rng, self.limits)
                if spliced is not None:
                    current, ops = spliced, ["splice"]
            for _ in range(2 ** rng.randint(0, HAVOC_STACK_POW2)):
                name = self.stats.choose(names, rng)
                out = OPERATORS[name](current, rng, self.limits)
                if out is not None:
                    current = out
                    ops.append(name)
            if ops and current.content_hash() != parent.content_hash():
                return Child(validate(current), tuple(ops))
        return Child(generate(rng, self.limits), ("generate",))

    def feedback(self, child: Child, success: bool) -> None:
        self.stats.record(child.operators, success)


class NullMutator:
    """Ignores the parent: pure random generation, the baseline of the fuzzing benchmark."""

    name = "null"

    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()
        self.stats = OperatorStats()

    def mutate(self, parent: Trace, rng: random.Random, other: Trace | None = None) -> Child:
        return Child(generate(rng, self.limits), ("generate",))

    def feedback(self, child: Child, success: bool) -> None:
        self.stats.record(child.operators, success)


def generate(rng: random.Random, limits: Limits | None = None, max_requests: int = 12) -> Trace:
    """A fresh random trace: a few requests over up to a second, sometimes sharing a prefix."""
    limits = limits or Limits()
    count = rng.randint(1, min(max_requests, limits.max_requests))
    span = rng.choice([0.0, 40.0, 200.0, 1000.0])
    prefixes = {"p0": rng.choice([16, 32, 256])} if rng.random() < 0.3 else {}
    requests = []
    for i in range(count):
        prefix = "p0" if prefixes and rng.random() < 0.7 else None
        requests.append(random_request(rng, limits, f"r{i:02d}", rng.uniform(0, span), prefix, prefixes.get("p0", 0) if prefix else 0))
    if prefixes and not any(r.prefix for r in requests):
        prefixes = {}
    return validate(Trace(requests=tuple(requests), prefixes=prefixes, name="generated"))
