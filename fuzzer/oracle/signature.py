"""Signatures: the deduplication key of a finding, the kind plus the shape around its victim.

Two findings with one signature are "the same bug" as a maintainer would count them: ids,
exact numbers and timings are left out, log2 size classes kept. A *family* is coarser: the kind,
whether the victim fans out or reuses a resident prefix, and what the trace does to everyone's
batch or KV (a seeded request, a client that times out, a burst beyond the KV cache); one bug
met in many trace shapes has many signatures but one family, so a campaign confirms a family it
has found again only now and then (fuzzer.search.confirming).
"""

from __future__ import annotations

import hashlib
from typing import Any

from fuzzer.oracle.kinds import FindingKind
from fuzzer.trace import Request, Trace, canonical_json, disconnects


#: Request-shape classes are log2 buckets: a 2000- and a 2100-token prompt are the same
#: shape, a 128- and a 2048-token prompt are not. Noise never moves a trace across them.
def log2_class(tokens: int) -> int:
    """log2 bucket of a token count (0 for 1 token, 11 for 2048-4095)."""
    return max(0, int(tokens).bit_length() - 1)


def _count_class(count: int) -> str:
    if count <= 1:
        return str(count)
    return "2-3" if count <= 3 else ("4-7" if count <= 7 else "8+")


def request_shape(trace: Trace, request: Request) -> dict[str, Any]:
    """The shape of a request in its trace: what a maintainer would call "the same bug".

    The victim's own class (prompt size, output size, stream, api, n/logprobs, shared
    prefix) and what arrived before it (how many, the largest prompt, whether one shares
    its prefix). Ids, exact numbers and timings are left out, so reruns and small
    mutations of the same situation map to the same shape.
    """
    position = next(i for i, r in enumerate(trace.requests) if r.id == request.id)
    before = trace.requests[:position]
    return {
        "prompt": log2_class(request.prompt_tokens),
        "output": log2_class(request.max_tokens),
        "stream": request.stream,
        "api": request.api,
        "fanout": request.n > 1 or request.logprobs is not None,
        "shared_prefix": request.prefix is not None,
        "cancel": request.cancel_after_tokens is not None,
        "before": _count_class(len(before)),
        "before_max_prompt": log2_class(max((r.prompt_tokens for r in before), default=0)) if before else None,
        "before_same_prefix": any(r.prefix is not None and r.prefix == request.prefix for r in before),
        # Keys added after the first release only where they hold, so earlier signatures stay.
        **({"timed_out": True} if request.disconnect_after_ms is not None else {}),
        **_batch_traits(trace),
    }


def _batch_traits(trace: Trace) -> dict[str, bool]:
    """What any request of the trace does to everyone's batch or KV, beyond sizes: a seeded
    request (a per-request sampler path), a client that leaves after a time (an abort the
    engine may lose). Present only where true."""
    out = {}
    if any(r.seed is not None for r in trace.requests):
        out["seeded"] = True
    if any(r.disconnect_after_ms is not None for r in trace.requests):
        out["timeouts"] = True
    return out


def signature(kind: FindingKind, trace: Trace, request_id: str | None = None, **extra: Any) -> str:
    """A deduplication key: the kind plus the shape of the trace around the victim.

    ``extra`` adds evidence that separates bugs of one kind (the HTTP status of an error).
    The key reads ``<kind>:<12 hex digits>``.
    """
    shape: dict[str, Any] = {"kind": kind.value, **{k: v for k, v in sorted(extra.items())}}
    if request_id is not None:
        shape["victim"] = request_shape(trace, trace.request(request_id))
    elif kind is FindingKind.LEAK:
        return leak_signature(leaving_clients(trace))
    else:
        shape["trace"] = _trace_shape(trace)
    return _key(kind, shape)


#: How a client leaves, as a leak signature tells leaks apart: a leak is a lost abort, and engines
#: lose them on different paths (vLLM PR #29987: the client gone before its first output; PR
#: #14326: an n > 1 request whose sibling sequences run on). A timeout may fall before the first
#: token; a cancel after k tokens never does.
LEAVING = ("timeout", "cancel", "fanout")


def leaving(request: Request) -> str | None:
    """How the client of ``request`` leaves (one of LEAVING), None when it stays to the end."""
    if not disconnects(request):
        return None
    if request.n > 1:
        return "fanout"
    return "timeout" if request.disconnect_after_ms is not None else "cancel"


def leaving_clients(trace: Trace) -> frozenset[str]:
    """The ways clients of ``trace`` leave (empty when none does)."""
    return frozenset(w for w in map(leaving, trace.requests) if w is not None)


def leak_signature(ways: frozenset[str] | set[str] = frozenset()) -> str:
    """The signature of a leak: a server that does not return to idle is one bug whatever the trace's
    size; what tells two leaks apart is how the trace's clients left (:data:`LEAVING`), so an n > 1
    leak is not taken for the single-request leak found before it. A trace whose clients all stay,
    and one whose clients only cancel after some tokens, keep the signature of the first release."""
    shape: dict[str, Any] = {"cancel": bool(ways)}
    if ways - {"cancel"}:
        shape["leaving"] = sorted(ways)
    return _key(FindingKind.LEAK, {"kind": FindingKind.LEAK.value, "trace": shape})


def option_signature(option: str) -> str:
    """The signature of an option-slowdown (fuzzer.oracle.ablation): one per option, whatever the
    trace, as a maintainer counts "a seeded request slows the batch" once."""
    return _key(FindingKind.OPTION_SLOWDOWN, {"kind": FindingKind.OPTION_SLOWDOWN.value, "option": option})


def _key(kind: FindingKind, shape: dict[str, Any]) -> str:
    return f"{kind.value}:{hashlib.sha256(canonical_json(shape).encode()).hexdigest()[:12]}"


def _trace_shape(trace: Trace) -> dict[str, Any]:
    return {
        "requests": _count_class(len(trace.requests)),
        "max_prompt": log2_class(max(r.prompt_tokens for r in trace.requests)),
        "cancel": any(r.cancel_after_tokens is not None for r in trace.requests),
        "fanout": any(r.n > 1 or r.logprobs is not None for r in trace.requests),
        "shared_prefix": any(r.prefix is not None for r in trace.requests),
        **_batch_traits(trace),
    }


#: Requests sent within this long of each other count as one burst for the KV a trace asks for at once.
BURST_WINDOW_MS = 2000.0


def family(kind: FindingKind, trace: Trace, request_id: str | None, kv_tokens: int | None = None,
           held_choice: bool = False) -> str:
    """The coarse key of a latency finding: its kind, whether its victim fans out (n > 1 or
    logprobs), whether it reuses a prefix an earlier request of the trace computed, whether the
    trace holds a seeded request or a client that times out, and whether a burst of it asks for more
    KV than the server's ``kv_tokens`` (where known); sizes, neighbours, timings and the victim's
    API, streaming and own cancel left out. A stall only in a stream's later choices
    (``held_choice``, fuzzer.oracle.judge.later_choice_stall) is one family of its own.
    Other kinds keep their signature: a leak is one per way of leaving already, a failure is told
    apart by its outcome."""
    if request_id is None or kind not in LATENCY_KINDS:
        return signature(kind, trace, request_id)
    coarse: dict[str, Any] = {"version": 2, **family_traits(trace, request_id, kv_tokens, held_choice)}
    return _key(kind, {"kind": kind.value, "family": coarse}).replace(":", ":family-", 1)


#: The kinds whose findings have a family of traits (the others' family is their signature).
LATENCY_KINDS = (FindingKind.TTFT_OUTLIER, FindingKind.ITL_STALL, FindingKind.E2E_OUTLIER)
#: The traits of a family, in the order of trait_vector.
TRAITS = ("fanout", "seeded", "timeouts", "reuses_prefix", "over_kv", "held_choice")


def family_traits(trace: Trace, request_id: str, kv_tokens: int | None = None,
                  held_choice: bool = False) -> dict[str, bool]:
    """What makes a latency finding's family (see :func:`family`): ``fanout`` always, the others
    only where they hold."""
    if held_choice:
        # Choice 0 streamed within its bound while a later choice went silent: the code that fans a request's
        # choices out and streams them, whatever the batch (heldout12's choices held back until choice 0
        # finished met six families of the batch traits, ten findings in one campaign).
        return {"fanout": True, "held_choice": True}
    shape = request_shape(trace, trace.request(request_id))
    # Whether the victim streams, its API or its own cancel do not tell a scheduler bug apart (one bug
    # met 9 families of those and of shared prefixes in a campaign on the held-out server); fan-out and
    # what the trace does to everyone's batch (a seeded request, a client that times out) may, and so
    # may the engine's prefix cache and KV pressure: admission that counts resident prefix blocks
    # (vLLM #37308's class) and preemption order (vLLM #41951) are other code than a step's
    # composition, and with one family their findings waited behind a compute bug's back-off.
    traits: dict[str, bool] = {"fanout": shape["fanout"], **_batch_traits(trace)}
    # Keys added after the first release only where they hold, so earlier families stay.
    if shape["before_same_prefix"]:
        traits["reuses_prefix"] = True
    if kv_tokens and burst_kv(trace) > kv_tokens:
        traits["over_kv"] = True
    return traits


def trait_vector(traits: dict[str, bool]) -> tuple[bool, ...]:
    """The traits as one value each (absent: False), in TRAITS order: families' distances are counted on it."""
    return tuple(bool(traits.get(t, False)) for t in TRAITS)


def burst_kv(trace: Trace) -> int:
    """The most KV tokens the requests sent within BURST_WINDOW_MS of each other ask for: prompts
    (a shared prefix once) and every choice's max_tokens."""
    ordered = sorted(trace.requests, key=lambda r: r.at_ms)
    most = 0
    for i, first in enumerate(ordered):
        burst = [r for r in ordered[i:] if r.at_ms - first.at_ms <= BURST_WINDOW_MS]
        prefixes = {r.prefix for r in burst if r.prefix is not None}
        shared = sum(trace.prefixes.get(p, 0) * (sum(r.prefix == p for r in burst) - 1) for p in prefixes)
        most = max(most, sum(r.prompt_tokens + r.n * r.max_tokens for r in burst) - shared)
    return most
