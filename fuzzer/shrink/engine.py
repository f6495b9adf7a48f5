"""Shrinking a finding's trace over a noisy predicate (ARCHITECTURE.md, "Shrink and report").

Delta debugging over the requests, then passes that lower numbers (max_tokens,
arrival gaps, prompt_tokens) and drop features (prefix groups, cancellations,
n/logprobs, non-streaming), in rounds to a fixed point. The predicate is noisy:

* while shrinking it uses a stricter threshold (hysteresis, 1.25x the report
  threshold in the oracle), so the result does not sit on the border;
* a *graded* predicate (one that reports the effect, :attr:`Check.effect`) accepts a
  candidate only when all ``runs`` (3) runs reproduce, and rejects it at its first
  miss: most rejections cost one execution, and a border-line candidate is rarely
  accepted (one that reproduces 45% of the time passes 2 of 3 in 43% of its tests,
  3 of 3 in 9%; once accepted, every later shrink builds on it). A plain yes/no
  predicate accepts ``required`` (2) of ``runs``, stopping once the answer is known;
* ``final_runs`` fresh runs at the report threshold confirm the result (k/10). Below
  ``final_required`` (8/10) the shrinks since the last deletion count as failing and
  the search goes on from the trace before it (at most ``max_retreats`` times); the
  k/10 reported is always that of the trace returned;
* results are cached by trace hash, every candidate must be strictly smaller than
  the current trace (the trace never grows), requests in ``keep`` (the victim) are
  never deleted, and a stall budget ends the search.

Fewer executions: deletions start with big chunks and with the requests farthest
from the victim's arrival; numbers go down for all requests at once, then by a short
binary search per request; what failed is tried again only when it may pass now
(:mod:`fuzzer.shrink.memory`); and when a change makes the trace strong enough for a
failed deletion, a new round starts at once (a deletion is worth more than lowering).

The minimizer knows nothing of servers: it calls an injected async predicate
``check(trace, strict) -> Check``. A different finding met on the way is handed to
``on_other``. Its whole state is a plain dict handed to ``on_state`` after every
test, so an interrupted minimization resumes.
"""

from __future__ import annotations

import enum
import math
import statistics
from dataclasses import dataclass, replace
from typing import Awaitable, Callable, Iterator, Mapping

from fuzzer import trace as trace_format
from fuzzer.shrink.memory import FailureMemory
from fuzzer.trace import Request, Trace

# Hypothesis stops a shrink pass after a run of failures and the whole shrink after
# 200 calls without progress; our calls cost seconds of server time, so less.
DEFAULT_STALL_BUDGET = 40
DEFAULT_MAX_EXECUTIONS = 400
DEFAULT_RUNS = 3
DEFAULT_REQUIRED = 2
DEFAULT_FINAL_RUNS = 10
#: A result confirmed in fewer than this share of the final runs is not reliable.
DEFAULT_FINAL_SHARE = 0.8
#: How many times the search may step back from a result that failed its confirmation,
#: and how many accepted traces it keeps to step back to.
DEFAULT_MAX_RETREATS = 2
TRAIL = 16
#: A per-request binary search stops when the value is within this factor of the lowest
#: value not known to fail.
BISECT_WITHIN = 2.0


@dataclass(frozen=True)
class Check:
    """One execution of a candidate as the oracle saw it."""

    reproduced: bool
    #: Signature of a *different* confirmed-looking problem seen in this run, if any.
    other_signature: str | None = None
    #: How strong the effect was, in shrinking thresholds (1.0: just reproduced while
    #: shrinking); None when the predicate does not measure it (a plain yes/no).
    effect: float | None = None


class Stop(enum.StrEnum):
    FIXED_POINT = "fixed-point"
    STALLED = "stalled"
    BUDGET = "budget"


@dataclass(frozen=True)
class Progress:
    phase: str
    requests: int
    tests: int
    executions: int
    accepted: int


@dataclass(frozen=True)
class MinimizeResult:
    original: Trace
    minimized: Trace
    executions: int
    tests: int
    stop: Stop
    #: Final confirmation at the report threshold: k reproductions of n runs.
    confirmed: int
    confirm_runs: int

    @property
    def reproduction(self) -> str:
        return f"{self.confirmed}/{self.confirm_runs}"


Predicate = Callable[[Trace, bool], Awaitable[Check]]


def size_key(trace: Trace) -> tuple:
    """Shortlex-like order: fewer requests first, then less work, then fewer features, then a shorter span."""
    reqs = trace.requests
    features = (
        len(trace.prefixes)
        + sum(r.cancel_after_tokens is not None for r in reqs)
        + sum(r.disconnect_after_ms is not None for r in reqs)
        + sum(r.seed is not None for r in reqs)
        + sum(r.n > 1 for r in reqs)
        + sum(r.logprobs is not None for r in reqs)
        + sum(not r.stream for r in reqs)
        + sum(r.api != "completions" for r in reqs)
    )
    work = sum(r.prompt_tokens + r.max_tokens * r.n for r in reqs)
    return (len(reqs), work, features, trace.duration_ms())


class Minimizer:
    def __init__(
        self,
        check: Predicate,
        *,
        runs: int = DEFAULT_RUNS,
        required: int = DEFAULT_REQUIRED,
        final_runs: int = DEFAULT_FINAL_RUNS,
        final_required: int | None = None,
        max_retreats: int = DEFAULT_MAX_RETREATS,
        stall_budget: int = DEFAULT_STALL_BUDGET,
        max_executions: int = DEFAULT_MAX_EXECUTIONS,
        keep: frozenset[str] | set[str] | tuple[str, ...] = frozenset(),
        state: Mapping | None = None,
        on_state: Callable[[dict], None] | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        on_other: Callable[[Trace, str], None] | None = None,
    ):
        if not 1 <= required <= runs:
            raise ValueError(f"required must be between 1 and runs ({runs}), got {required}")
        self._check = check
        self.runs, self.required, self.final_runs = runs, required, final_runs
        self.final_required = math.ceil(final_runs * DEFAULT_FINAL_SHARE) if final_required is None else final_required
        self.max_retreats = max_retreats
        self.stall_budget, self.max_executions = stall_budget, max_executions
        self.keep = frozenset(keep)
        self._on_state = on_state or (lambda s: None)
        self._on_progress = on_progress or (lambda p: None)
        self._on_other = on_other or (lambda t, s: None)
        state = dict(state or {})
        self._cache: dict[str, bool] = dict(state.get("cache", {}))
        #: The median effect of each tested candidate, by hash (graded predicates only).
        self._effects: dict[str, float] = dict(state.get("effects", {}))
        self._current: Trace | None = trace_format.loads(state["current"]) if state.get("current") else None
        #: The effect the current trace showed when it was accepted (None: not measured).
        self._effect: float | None = state.get("effect")
        #: The traces accepted before the current one, newest last (the last TRAIL only).
        self._trail: list[str] = list(state.get("trail", []))
        self._retreats = int(state.get("retreats", 0))
        self._failed = FailureMemory(state.get("failed"))
        self.executions = int(state.get("executions", 0))
        self.tests = int(state.get("tests", 0))
        self.accepted = int(state.get("accepted", 0))
        self._since_progress = int(state.get("since_progress", 0))
        #: Search rounds done; after the first, requests are deleted one at a time.
        self._rounds = int(state.get("rounds", 0))
        self._last_effect: float | None = None
        self._phase = "start"

    # --- state ------------------------------------------------------------------------

    def state(self) -> dict:
        return {
            "current": trace_format.dumps(self._current, indent=None) if self._current else None,
            "cache": dict(self._cache),
            "effects": dict(self._effects),
            "effect": self._effect,
            "trail": list(self._trail),
            "retreats": self._retreats,
            "failed": self._failed.state(),
            "executions": self.executions,
            "tests": self.tests,
            "accepted": self.accepted,
            "since_progress": self._since_progress,
            "rounds": self._rounds,
        }

    def _out_of_budget(self) -> Stop | None:
        if self.executions >= self.max_executions:
            return Stop.BUDGET
        if self._since_progress >= self.stall_budget:
            return Stop.STALLED
        return None

    # --- testing ----------------------------------------------------------------------

    async def _holds(self, candidate: Trace) -> bool:
        digest = candidate.content_hash()
        if digest in self._cache:
            self._last_effect = self._effects.get(digest)
            return self._cache[digest]
        hits = misses = 0
        graded = False
        effects: list[float] = []
        need = self.required
        while hits < need and misses <= self.runs - self.required:
            result = await self._check(candidate, True)
            self.executions += 1
            if result.other_signature:
                self._on_other(candidate, result.other_signature)
            if result.effect is not None:
                effects.append(result.effect)
            if result.reproduced:
                hits += 1
            else:
                misses += 1
            if result.effect is not None:
                graded, need = True, self.runs
                if misses:
                    break  # graded: every run must reproduce at the shrinking threshold
        holds = hits >= need and not (graded and misses)
        self._last_effect = statistics.median(effects) if effects else None
        if self._last_effect is not None:
            self._effects[digest] = self._last_effect
        self._cache[digest] = holds
        self.tests += 1
        self._on_state(self.state())
        return holds

    async def _try(self, candidate: Trace | None) -> bool:
        """Accept ``candidate`` when it is strictly smaller, keeps the kept requests and still reproduces."""
        assert self._current is not None
        if candidate is None or size_key(candidate) >= size_key(self._current):
            return False
        ids = {r.id for r in candidate.requests}
        if not self.keep <= ids and self.keep <= {r.id for r in self._current.requests}:
            return False
        if self._out_of_budget():
            return False
        if await self._holds(candidate):
            self._failed.forget(self._current, candidate, measured=self._last_effect is not None)
            self._effect = self._last_effect
            self._trail.append(trace_format.dumps(self._current, indent=None))
            del self._trail[:-TRAIL]
            self._current = candidate
            self.accepted += 1
            self._since_progress = 0
            self._on_state(self.state())
            self._report()
            return True
        self._since_progress += 1
        return False

    def _report(self) -> None:
        assert self._current is not None
        self._on_progress(Progress(self._phase, len(self._current.requests), self.tests, self.executions, self.accepted))

    # --- the search -------------------------------------------------------------------

    async def run(self, trace: Trace) -> MinimizeResult:
        if self._current is None:
            self._current = trace
            self._cache.setdefault(trace.content_hash(), True)
        while True:
            stop = await self._search()
            confirmed = await self._confirm()
            if confirmed >= self.final_required or not self._trail or self._retreats >= self.max_retreats:
                break
            self._retreat()
            self._on_state(self.state())
            if self._retreats >= self.max_retreats:  # no more searching: confirm where it stepped back to
                confirmed = await self._confirm()
                break
        self._on_state(self.state())
        return MinimizeResult(trace, self._current, self.executions, self.tests, stop, confirmed, self.final_runs)

    def _retreat(self) -> None:
        """Fresh runs showed the result does not reproduce reliably: its runs while shrinking
        were lucky, at the last deletion or after it. Go back to the trace before the last
        deletion; the shrinks since count as failing, and the search goes on from there."""
        assert self._current is not None and self._trail
        trail = [trace_format.loads(t) for t in self._trail]
        back = next((i for i in range(len(trail) - 1, -1, -1)
                     if len(trail[i].requests) > len(self._current.requests)), len(trail) - 1)
        distrusted = trail[back + 1:] + [self._current]
        for t in distrusted:
            self._cache[t.content_hash()] = False
        self._current = trail[back]
        # Nor is that deletion tried again before the trace changes.
        for rid in {r.id for r in self._current.requests} - {r.id for r in distrusted[0].requests}:
            self._failed.fail(f"{rid} delete", 1, self._digest(), None, None)
        del self._trail[back:]
        self._effect = self._effects.get(self._current.content_hash())
        self._retreats += 1

    async def _search(self) -> Stop:
        """Rounds of all passes until a round changes nothing (or the budget ends it); a new
        round starts at once when a change leaves the trace strong enough for a deletion that
        failed (lowering the others would spend the strength that deletion needs)."""
        assert self._current is not None
        while True:
            before = size_key(self._current)
            restart = False
            for phase, candidates in self._passes():
                self._phase = phase
                self._report()
                for make in candidates:
                    if self._out_of_budget():
                        break
                    accepted = await self._try(make(self._current))
                    if accepted and phase != _DELETE and self._failed.retry_due(" delete", self._digest(), self._effect):
                        restart = True
                        break
                if restart:
                    break
            reason = self._out_of_budget()
            if reason:
                return reason
            self._rounds += 1
            if size_key(self._current) == before:
                return Stop.FIXED_POINT

    async def _confirm(self) -> int:
        """Fresh runs of the result at the report threshold (none of the search's runs count)."""
        assert self._current is not None
        confirmed = 0
        self._phase = "confirm"
        self._report()
        for _ in range(self.final_runs):
            result = await self._check(self._current, False)
            self.executions += 1
            confirmed += result.reproduced
        return confirmed

    def _passes(self) -> Iterator[tuple[str, Iterator[Callable[[Trace], Trace | None]]]]:
        # Gaps before prompts: requests that arrive closer together wait together, which
        # lets the prompts that set the victim's baseline go lower.
        yield _DELETE, self._ddmin()
        yield "lower max_tokens", self._lower_numbers("max_tokens")
        yield "drop features", self._feature_drops()
        yield "compress gaps", self._compress_gaps()
        yield "lower prompt_tokens", self._lower_numbers("prompt_tokens")

    # --- the passes -------------------------------------------------------------------

    def _digest(self) -> str:
        assert self._current is not None
        return self._current.content_hash()

    def _remembered(self, key: str, make: Callable[[Trace], Trace | None]) -> Iterator[Callable[[Trace], Trace | None]]:
        """Yield ``make`` unless it failed before and is not worth a new try; remember when it fails."""
        if self._failed.known(key, self._digest(), self._effect) is not None:
            return
        before, digest, effect = self._current, self._digest(), self._effect
        yield make
        if self._current is before:
            self._failed.fail(key, 1, digest, self._last_effect, effect)

    def _ddmin(self) -> Iterator[Callable[[Trace], Trace | None]]:
        """Delete chunks of the requests not kept, halving the chunk size down to one (ddmin's
        complements); later rounds delete one request at a time."""
        assert self._current is not None
        chunk = max(1, len(self._removable()) // 2) if self._rounds == 0 else 1
        while chunk >= 1:
            start = 0
            while start < len(self._removable()):
                ids = frozenset(self._removable()[start:start + chunk])
                size_before = len(self._current.requests)
                if chunk == 1:
                    yield from self._remembered(f"{min(ids)} delete", lambda t, ids=ids: _without(t, ids))
                else:
                    yield lambda t, ids=ids: _without(t, ids)
                if len(self._current.requests) == size_before:
                    start += chunk
            chunk //= 2

    def _removable(self) -> list[str]:
        """The requests not kept, farthest from the kept ones' arrival first (latest first on ties).

        A request sent long before or after the victim is the least likely to have delayed
        it, so the deletions most likely to pass are tried first.
        """
        assert self._current is not None
        reqs = self._current.requests
        anchors = [r.at_ms for r in reqs if r.id in self.keep] or [reqs[0].at_ms]
        others = [(i, r) for i, r in enumerate(reqs) if r.id not in self.keep]
        others.sort(key=lambda ir: (-min(abs(ir[1].at_ms - a) for a in anchors), -ir[0]))
        return [r.id for _, r in others]

    def _feature_drops(self) -> Iterator[Callable[[Trace], Trace | None]]:
        assert self._current is not None
        for name in list(self._current.prefixes):
            yield from self._remembered(f"prefix:{name} drop", lambda t, name=name: _without_prefix(t, name))
        for r in list(self._current.requests):
            changes = {
                "cancel": (r.cancel_after_tokens is not None, lambda x: replace(x, cancel_after_tokens=None)),
                "disconnect": (r.disconnect_after_ms is not None, lambda x: replace(x, disconnect_after_ms=None)),
                "seed": (r.seed is not None, lambda x: replace(x, seed=None)),
                "n": (r.n > 1, lambda x: replace(x, n=1)),
                "logprobs": (r.logprobs is not None, lambda x: replace(x, logprobs=None)),
                "stream": (not r.stream, lambda x: replace(x, stream=True)),
                "api": (r.api != "completions", lambda x: replace(x, api="completions")),
            }
            for name, (present, change) in changes.items():
                if present:
                    yield from self._remembered(f"{r.id} {name}", _edit(r.id, change))

    def _lower_numbers(self, field: str) -> Iterator[Callable[[Trace], Trace | None]]:
        """All requests at once (the floor, then halfway), then a binary search per request.

        Per request: the floor first, then half the value (when that fails, the value is
        needed to within 2x: stop), then the middle between the lowest value not known to
        fail and the current one, until the current value is within BISECT_WITHIN of that
        lowest value: a few probes, and a rejected one costs one execution.
        """
        assert self._current is not None
        for step in (0, 1):
            yield from self._remembered(f"* {field} {step}", lambda t, step=step: _lower_all(t, field, step))
        for rid in [r.id for r in self._current.requests]:
            key = f"{rid} {field}"
            first, halved = True, False
            while True:
                r = next((x for x in self._current.requests if x.id == rid), None)
                if r is None:
                    break
                value, floor = getattr(r, field), _floor(r, field, self._current)
                failed = self._failed.known(key, self._digest(), self._effect)
                lo = floor if failed is None else max(floor, failed + 1)  # the lowest value not known to fail
                at_floor = first and lo == floor
                if lo >= value or (not at_floor and value < lo * BISECT_WITHIN):
                    break
                if at_floor:
                    probe = lo
                elif not halved:
                    probe = max(lo, value // 2)  # fails when the value is needed to within 2x: stop
                else:
                    probe = (lo + value) // 2
                halved = halved or not at_floor
                first = False
                before, digest, effect = self._current, self._digest(), self._effect
                yield _edit(rid, lambda x, probe=probe: replace(x, **{field: probe}))
                if self._current is before:
                    self._failed.fail(key, probe, digest, self._last_effect, effect)

    def _compress_gaps(self) -> Iterator[Callable[[Trace], Trace | None]]:
        """All arrivals at once, else the gaps halved again and again while it still reproduces."""
        assert self._current is not None
        yield from self._remembered("gaps 0", lambda t: _squash(t, 0.0))
        while "gaps 0.5" not in self._failed and self._current.duration_ms() > 0:
            yield from self._remembered("gaps 0.5", lambda t: _squash(t, 0.5))


_DELETE = "delete requests"


def _without(t: Trace, ids: frozenset[str]) -> Trace | None:
    keep = [r for r in t.requests if r.id not in ids]
    return t.with_requests(keep) if keep and len(keep) < len(t.requests) else None


def _without_prefix(t: Trace, name: str) -> Trace | None:
    if name not in t.prefixes:
        return None
    return t.with_requests([replace(r, prefix=None) if r.prefix == name else r for r in t.requests])


def _squash(t: Trace, factor: float) -> Trace | None:
    start = t.requests[0].at_ms
    return t.with_requests([replace(r, at_ms=float(round(start + (r.at_ms - start) * factor))) for r in t.requests])


def _edit(request_id: str, change: Callable[[Request], Request | None]) -> Callable[[Trace], Trace | None]:
    def apply(t: Trace) -> Trace | None:
        for r in t.requests:
            if r.id == request_id:
                new = change(r)
                return None if new is None else t.with_requests([new if x is r else x for x in t.requests])
        return None

    return apply


def _floor(r: Request, field: str, current: Trace | None) -> int:
    """The least value of ``field``: the prefix length for prompts, past the cancellation for outputs."""
    if field == "prompt_tokens":
        return current.prefixes.get(r.prefix, 1) if current and r.prefix else 1
    return (r.cancel_after_tokens + 1) if r.cancel_after_tokens else 1


def _lower_all(t: Trace, field: str, step: int) -> Trace | None:
    """Every request's ``field`` at its floor (step 0) or halfway to it (step 1)."""
    lowered = []
    for r in t.requests:
        value, floor = getattr(r, field), _floor(r, field, t)
        lowered.append(replace(r, **{field: floor + (value - floor) // 2 if step else floor}))
    return t.with_requests(lowered) if lowered != list(t.requests) else None
