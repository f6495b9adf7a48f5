"""Behavioural coverage of a black-box server (ARCHITECTURE.md, "Search").

A server has no edges we can see, so coverage is behaviour:

* server state, from the /metrics samples: running and waiting on a log2 scale,
  KV usage by tenths, preemptions in the window, prefix-cache hit ratio; the
  combined state and the transitions between consecutive states (the "edges");
* client behaviour, per request class (prompt size x stream x shared prefix x
  arrival rank): log2 buckets of TTFT slowdown versus idle, max inter-token
  gap, queueing beyond the idle TTFT, and the outcome of failed requests.

Each feature is counted within the execution and reported with its AFL hit-count
bucket, so "the KV cache sat at 90 % for 40 samples" is new coverage after "for 2
samples". Features are a pure function of the execution (and the idle
expectations given), so the same execution always yields the same set.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping

from fuzzer.execution import ExecutionResult, RequestResult
from fuzzer.trace import Request, Trace

# AFL's count classes (afl-fuzz-bitmap.c count_class_lookup8): 1, 2, 3, 4-7, 8-15, 16-31, 32-127, 128+.
_HIT_CLASSES = ((128, "128+"), (32, "32"), (16, "16"), (8, "8"), (4, "4"), (3, "3"), (2, "2"), (1, "1"))

# Prompt-size classes: below a KV block, a typical chat turn, a long document, beyond the token budget.
_SIZE_CLASSES = ((64, "t"), (256, "s"), (1024, "m"), (4096, "l"))


def hit_class(count: int) -> str:
    for low, name in _HIT_CLASSES:
        if count >= low:
            return name
    return "0"


def log2_bucket(value: float) -> int:
    """0 for values below 1, then floor(log2(value)) + 1: 1 -> 1, 2-3 -> 2, 4-7 -> 3, ..."""
    if value < 1:
        return 0
    return int(math.floor(math.log2(value))) + 1


def size_class(prompt_tokens: int) -> str:
    for high, name in _SIZE_CLASSES:
        if prompt_tokens < high:
            return name
    return "x"


def rank_class(rank: int) -> str:
    """Arrival rank 0, 1, 2-3, 4-7, 8+ (who came first matters to FCFS)."""
    return str(min(log2_bucket(rank), 4))


def request_class(request: Request, rank: int) -> str:
    stream = "s" if request.stream else "n"
    shared = "p" if request.prefix else "u"
    return f"{size_class(request.prompt_tokens)}{stream}{shared}{rank_class(rank)}"


@dataclass(frozen=True)
class Coverage:
    """What one execution covered."""

    features: frozenset[str]
    #: Per request class, the largest slowdown seen (PerfFuzz keeps the best trace per key).
    scores: Mapping[str, float] = field(default_factory=dict)

    @property
    def score(self) -> float:
        return max(self.scores.values(), default=0.0)


def measure(
    result: ExecutionResult,
    trace: Trace,
    idle_ttft_s: Mapping[str, float] | None = None,
) -> Coverage:
    """The coverage of ``result``, an execution of ``trace``.

    ``idle_ttft_s`` maps request ids to the TTFT (or E2E for non-streaming requests)
    the oracle expects on an idle server; without it, slowdown features use absolute
    times in milliseconds instead.
    """
    counts: Counter[str] = Counter()
    _server_features(result, counts)
    scores = _client_features(result, trace, idle_ttft_s or {}, counts)
    features = frozenset(f"{name}#{hit_class(n)}" for name, n in counts.items())
    return Coverage(features=features, scores=scores)


def _server_features(result: ExecutionResult, counts: Counter[str]) -> None:
    previous_state = None
    previous = None
    for sample in result.samples:
        v = sample.values
        parts = []
        if "running" in v:
            b = log2_bucket(v["running"])
            counts[f"run:{b}"] += 1
            parts.append(f"r{b}")
        if "waiting" in v:
            b = log2_bucket(v["waiting"])
            counts[f"wait:{b}"] += 1
            parts.append(f"w{b}")
        if "kv_usage" in v:
            b = min(10, int(v["kv_usage"] * 10))
            counts[f"kv:{b}"] += 1
            parts.append(f"k{b}")
        if previous is not None:
            if v.get("preemptions", 0) > previous.get("preemptions", 0):
                counts["preempt"] += 1
                parts.append("P")
            queries = v.get("prefix_cache_queries", 0) - previous.get("prefix_cache_queries", 0)
            if queries > 0:
                hits = v.get("prefix_cache_hits", 0) - previous.get("prefix_cache_hits", 0)
                counts[f"hit:{min(4, int(4 * hits / queries))}"] += 1
        state = "".join(parts)
        if state:
            counts[f"st:{state}"] += 1
            if previous_state is not None and state != previous_state:
                counts[f"tr:{previous_state}>{state}"] += 1
            previous_state = state
        previous = v


def _client_features(
    result: ExecutionResult,
    trace: Trace,
    idle: Mapping[str, float],
    counts: Counter[str],
) -> dict[str, float]:
    scores: dict[str, float] = {}
    requests = {r.id: (rank, r) for rank, r in enumerate(trace.requests)}
    for measured in result.requests:
        if measured.request_id not in requests:
            continue
        rank, request = requests[measured.request_id]
        cls = request_class(request, rank)
        if measured.outcome.failed:
            counts[f"c:{cls}:err:{measured.outcome.value}"] += 1
            continue
        latency = _latency(measured, request)
        if latency is None:
            continue
        expected = idle.get(request.id)
        if expected and expected > 0:
            slowdown = latency / expected
            counts[f"c:{cls}:slow:{log2_bucket(slowdown)}"] += 1
            counts[f"c:{cls}:queue:{log2_bucket((latency - expected) * 1000)}"] += 1
            scores[cls] = max(scores.get(cls, 0.0), slowdown)
        else:
            counts[f"c:{cls}:ms:{log2_bucket(latency * 1000)}"] += 1
            scores[cls] = max(scores.get(cls, 0.0), latency)
        if measured.max_itl_s is not None:
            counts[f"c:{cls}:itl:{log2_bucket(measured.max_itl_s * 1000)}"] += 1
    return scores


def _latency(measured: RequestResult, request: Request) -> float | None:
    """TTFT for streams, end-to-end for non-streaming requests."""
    return measured.ttft_s if request.stream else measured.e2e_s


def calibrated(trace: Trace, result: ExecutionResult, calibration) -> Coverage:
    """The coverage of ``result`` with its slowdowns against ``calibration``'s idle expectations
    (TTFT for streamed requests, E2E for the others)."""
    from fuzzer.oracle.expectation import expect  # noqa: PLC0415 - the features themselves need no oracle
    from fuzzer.oracle.kinds import Metric  # noqa: PLC0415

    expectations = expect(trace, calibration.model, calibration.assumption, result)
    idle = {}
    for r in trace.requests:
        value = expectations[r.id].idle(Metric.TTFT if r.stream else Metric.E2E)
        if value:
            idle[r.id] = value
    return measure(result, trace, idle)
