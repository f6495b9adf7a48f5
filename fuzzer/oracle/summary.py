"""Per-metric summaries in AIPerf's shape: ``{unit, avg, p1, p5, p10, p25, p50, p75, p90, p95, p99,
min, max, std}`` for each metric, under AIPerf's metric tags (its ``docs/metrics-reference.md``).

Per request (successful requests of every run pooled): ``time_to_first_token``,
``inter_token_latency`` ((request latency - TTFT) / (output tokens - 1)), ``request_latency``,
``output_token_throughput_per_user`` (1 / inter-token latency), ``output_sequence_length``,
``input_sequence_length``. Per run: ``output_token_throughput`` and ``request_throughput``
(over the span from the first send to the last response). ``std`` is the population one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fuzzer.execution import ExecutionResult, Outcome, RequestResult

PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99)


def describe(values: Sequence[float], unit: str) -> dict[str, Any]:
    """One metric in AIPerf's shape; every statistic is null when there are no values."""
    out: dict[str, Any] = {"unit": unit}
    data = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=float)
    stats = {"avg": None, **{f"p{q}": None for q in PERCENTILES}, "min": None, "max": None, "std": None}
    if data.size:
        stats["avg"] = float(data.mean())
        for q, v in zip(PERCENTILES, np.percentile(data, PERCENTILES)):
            stats[f"p{q}"] = float(v)
        stats.update(min=float(data.min()), max=float(data.max()), std=float(data.std()))
    out.update(stats)
    return out


def output_tokens(r: RequestResult) -> int | None:
    """Output tokens of a request: the server's usage, else the content events counted."""
    if r.completion_tokens is not None:
        return r.completion_tokens
    return len(r.token_times_s) or None


def inter_token_s(r: RequestResult) -> float | None:
    """AIPerf's (and vLLM's TPOT): time after the first token over the tokens after it."""
    osl = output_tokens(r)
    if r.ttft_s is None or r.e2e_s is None or osl is None or osl < 2:
        return None
    return (r.e2e_s - r.ttft_s) / (osl - 1)


def summarize(results: Sequence[ExecutionResult]) -> dict[str, dict[str, Any]]:
    """AIPerf-shaped summaries of every successful request of ``results``."""
    ok = [r for res in results for r in res.requests if r.outcome is Outcome.OK]
    itl = [inter_token_s(r) for r in ok]
    ms = 1000.0
    per_run_tokens, per_run_requests = [], []
    for res in results:
        done = [r for r in res.requests if r.outcome is Outcome.OK and r.e2e_s is not None]
        if not done:
            continue
        span = max(r.sent_s + r.e2e_s for r in done) - min(r.sent_s for r in res.requests)
        if span > 0:
            per_run_tokens.append(sum(output_tokens(r) or 0 for r in done) / span)
            per_run_requests.append(len(done) / span)
    return {
        "time_to_first_token": describe([r.ttft_s * ms for r in ok if r.ttft_s is not None], "ms"),
        "inter_token_latency": describe([v * ms for v in itl if v is not None], "ms"),
        "request_latency": describe([r.e2e_s * ms for r in ok if r.e2e_s is not None], "ms"),
        "output_token_throughput_per_user": describe([1.0 / v for v in itl if v], "tokens/sec/user"),
        "output_sequence_length": describe([output_tokens(r) for r in ok], "tokens"),
        "input_sequence_length": describe([r.prompt_tokens for r in ok], "tokens"),
        "output_token_throughput": describe(per_run_tokens, "tokens/sec"),
        "request_throughput": describe(per_run_requests, "requests/sec"),
    }
