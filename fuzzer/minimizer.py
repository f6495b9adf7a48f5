"""Shrinking a finding's trace over a noisy predicate (SPEC §8).

Delta debugging over the requests first, then passes to a fixed point that lower
numbers (prompt_tokens, max_tokens, arrival gaps) and drop features (prefix
groups, cancellations, n/logprobs, non-streaming). The predicate is noisy:

* a candidate is *tested* by running it up to ``runs`` times and accepted when it
  reproduces ``required`` times (2 of 3 by default; runs stop as soon as the
  answer is known);
* while shrinking the predicate uses a stricter threshold (hysteresis, 1.25x the
  report threshold in the oracle), so the result does not sit on the border;
* results are cached by trace hash, every candidate must be strictly smaller than
  the current trace (the trace never grows), and a stall budget ends the search;
* the result is confirmed with ``final_runs`` runs at the report threshold (k/10).

The minimizer knows nothing of servers: it calls an injected async predicate
``check(trace, strict) -> Check``. A different finding met on the way is handed
to ``on_other`` so the caller can save it. Its whole state is a plain dict handed
to ``on_state`` after every test, so an interrupted minimization resumes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Awaitable, Callable, Iterator, Mapping

from fuzzer import trace as trace_format
from fuzzer.trace import Request, Trace

# Hypothesis stops a shrink pass after a run of failures and the whole shrink after
# 200 calls without progress; our calls cost seconds of server time, so less.
DEFAULT_STALL_BUDGET = 40
DEFAULT_MAX_EXECUTIONS = 400
DEFAULT_RUNS = 3
DEFAULT_REQUIRED = 2
DEFAULT_FINAL_RUNS = 10


@dataclass(frozen=True)
class Check:
    """One execution of a candidate as the oracle saw it."""

    reproduced: bool
    #: Signature of a *different* confirmed-looking problem seen in this run, if any.
    other_signature: str | None = None


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
        stall_budget: int = DEFAULT_STALL_BUDGET,
        max_executions: int = DEFAULT_MAX_EXECUTIONS,
        state: Mapping | None = None,
        on_state: Callable[[dict], None] | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        on_other: Callable[[Trace, str], None] | None = None,
    ):
        if not 1 <= required <= runs:
            raise ValueError(f"required must be between 1 and runs ({runs}), got {required}")
        self._check = check
        self.runs, self.required, self.final_runs = runs, required, final_runs
        self.stall_budget, self.max_executions = stall_budget, max_executions
        self._on_state = on_state or (lambda s: None)
        self._on_progress = on_progress or (lambda p: None)
        self._on_other = on_other or (lambda t, s: None)
        state = dict(state or {})
        self._cache: dict[str, bool] = dict(state.get("cache", {}))
        self._current: Trace | None = trace_format.loads(state["current"]) if state.get("current") else None
        self.executions = int(state.get("executions", 0))
        self.tests = int(state.get("tests", 0))
        self.accepted = int(state.get("accepted", 0))
        self._since_progress = int(state.get("since_progress", 0))
        self._phase = "start"

    # --- state ------------------------------------------------------------------------

    def state(self) -> dict:
        return {
            "current": trace_format.dumps(self._current, indent=None) if self._current else None,
            "cache": dict(self._cache),
            "executions": self.executions,
            "tests": self.tests,
            "accepted": self.accepted,
            "since_progress": self._since_progress,
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
            return self._cache[digest]
        hits = misses = 0
        while hits < self.required and misses <= self.runs - self.required:
            result = await self._check(candidate, True)
            self.executions += 1
            if result.other_signature:
                self._on_other(candidate, result.other_signature)
            if result.reproduced:
                hits += 1
            else:
                misses += 1
        holds = hits >= self.required
        self._cache[digest] = holds
        self.tests += 1
        self._on_state(self.state())
        return holds

    async def _try(self, candidate: Trace | None) -> bool:
        """Accept ``candidate`` when it is strictly smaller and still reproduces."""
        assert self._current is not None
        if candidate is None or size_key(candidate) >= size_key(self._current):
            return False
        if self._out_of_budget():
            return False
        if await self._holds(candidate):
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
        stop = Stop.FIXED_POINT
        while True:
            before = size_key(self._current)
            for phase, candidates in self._passes():
                self._phase = phase
                self._report()
                for make in candidates:
                    if self._out_of_budget():
                        break
                    await self._try(make(self._current))
            reason = self._out_of_budget()
            if reason:
                stop = reason
                break
            if size_key(self._current) == before:
                break
        confirmed = 0
        self._phase = "confirm"
        self._report()
        for _ in range(self.final_runs):
            result = await self._check(self._current, False)
            self.executions += 1
            confirmed += result.reproduced
        self._on_state(self.state())
        return MinimizeResult(trace, self._current, self.executions, self.tests, stop, confirmed, self.final_runs)

    def _passes(self) -> Iterator[tuple[str, Iterator[Callable[[Trace], Trace | None]]]]:
        yield "delete requests", self._ddmin()
        yield "drop features", self._feature_drops()
        yield "lower prompt_tokens", self._lower_numbers("prompt_tokens")
        yield "lower max_tokens", self._lower_numbers("max_tokens")
        yield "compress gaps", self._compress_gaps()

    def _ddmin(self) -> Iterator[Callable[[Trace], Trace | None]]:
        """Delete chunks of requests, halving the chunk size down to one (ddmin's complement step)."""
        assert self._current is not None
        chunk = max(1, len(self._current.requests) // 2)
        while chunk >= 1:
            start = 0
            while start < len(self._current.requests):
                s = start

                def cut(t: Trace, s=s, c=chunk) -> Trace | None:
                    keep = t.requests[:s] + t.requests[s + c:]
                    return t.with_requests(keep) if keep else None

                size_before = len(self._current.requests)
                yield cut
                if len(self._current.requests) == size_before:
                    start += chunk
            chunk //= 2

    def _feature_drops(self) -> Iterator[Callable[[Trace], Trace | None]]:
        assert self._current is not None
        for name in list(self._current.prefixes):
            yield lambda t, name=name: t.with_requests([replace(r, prefix=None) if r.prefix == name else r for r in t.requests]) if name in t.prefixes else None
        for rid in [r.id for r in self._current.requests]:
            yield _edit(rid, lambda r: replace(r, cancel_after_tokens=None) if r.cancel_after_tokens else None)
            yield _edit(rid, lambda r: replace(r, n=1) if r.n > 1 else None)
            yield _edit(rid, lambda r: replace(r, logprobs=None) if r.logprobs is not None else None)
            yield _edit(rid, lambda r: replace(r, stream=True) if not r.stream else None)
            yield _edit(rid, lambda r: replace(r, api="completions") if r.api != "completions" else None)

    def _lower_numbers(self, field: str) -> Iterator[Callable[[Trace], Trace | None]]:
        """Per request: try the floor, then halve toward it (a few probes, not a full bisection)."""
        assert self._current is not None
        for rid in [r.id for r in self._current.requests]:
            for step in range(len(_LOWER_FRACTIONS)):
                yield _edit(rid, lambda r, step=step: _lowered(r, field, step, self._current))

    def _compress_gaps(self) -> Iterator[Callable[[Trace], Trace | None]]:
        for factor in (0.0, 0.5):
            def squash(t: Trace, factor=factor) -> Trace | None:
                start = t.requests[0].at_ms
                return t.with_requests([replace(r, at_ms=float(round(start + (r.at_ms - start) * factor))) for r in t.requests])

            yield squash


def _edit(request_id: str, change: Callable[[Request], Request | None]) -> Callable[[Trace], Trace | None]:
    def apply(t: Trace) -> Trace | None:
        for r in t.requests:
            if r.id == request_id:
                new = change(r)
                return None if new is None else t.with_requests([new if x is r else x for x in t.requests])
        return None

    return apply


# Fractions of the distance to the floor tried per request and field: the floor itself,
# then halfway (twice, each from the then-current value), then a quarter of the way down.
_LOWER_FRACTIONS = (0.0, 0.5, 0.5, 0.75)


def _lowered(r: Request, field: str, step: int, current: Trace | None) -> Request | None:
    value = getattr(r, field)
    if field == "prompt_tokens":
        floor = current.prefixes.get(r.prefix, 1) if current and r.prefix else 1
    else:
        floor = (r.cancel_after_tokens + 1) if r.cancel_after_tokens else 1
    target = floor + int((value - floor) * _LOWER_FRACTIONS[step])
    if target >= value:
        return None
    return replace(r, **{field: target})
