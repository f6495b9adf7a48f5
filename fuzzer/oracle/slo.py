"""SLO findings: requests that miss the user's service-level objectives, written as vLLM's
``--goodput ttft:MS tpot:MS e2el:MS`` (ARCHITECTURE.md, "Oracle").

A run *misses* for a request when its worst observed/SLO ratio over the given metrics is
above 1 (a failed request misses). A request is an ``slo-violation`` when it misses in at
least MIN_MISSES runs and MISS_QUORUM of them, the order check's rule; the p-value is a
one-sided sign test of the misses against a coin, the effect the median observed/SLO ratio.
An SLO verdict sits beside the scheduler-pathology verdicts, never in their place: a
request can be both slower than its FCFS bound and over the SLO, or only one of them.

Goodput (vLLM's, DistServe's): the requests of a run that meet every SLO, per second of the
run; attainment: their share of the run's requests.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scipy import stats

from fuzzer.errors import ConfigError
from fuzzer.execution import ExecutionResult, RequestResult, Target
from fuzzer.oracle.kinds import Decision, FindingKind, Metric
from fuzzer.oracle.signature import signature
from fuzzer.oracle.summary import inter_token_s
from fuzzer.oracle.verdict import Verdict
from fuzzer.trace import Trace

#: The order check's confirmation rule, reused: a miss must recur in this many runs ...
MIN_MISSES = 3
#: ... and in this share of them.
MISS_QUORUM = 0.6
#: Runs an undecided SLO candidate may take in all (the first runs included): bounded, so an
#: SLO the server meets half the time costs a few executions, not a campaign.
MAX_SLO_RUNS = 6

_SPEC = re.compile(r"^(ttft|tpot|e2el):([0-9]+(?:\.[0-9]+)?)$")
_METRIC = {"ttft": Metric.TTFT, "tpot": None, "e2el": Metric.E2E}


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; None where the user set none."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, specs: Sequence[str]) -> Slo | None:
        """``["ttft:500 tpot:50", "e2el:2000"]`` (vLLM's ``--goodput`` words; spaces or commas apart)."""
        words = [w for spec in specs for w in re.split(r"[\s,]+", spec) if w]
        if not words:
            return None
        found: dict[str, float] = {}
        for word in words:
            m = _SPEC.match(word)
            if not m or float(m.group(2)) <= 0:
                raise ConfigError(f"--goodput takes ttft:MS, tpot:MS and e2el:MS with MS > 0 (vLLM's syntax), got {word!r}")
            found[m.group(1)] = float(m.group(2))
        return cls(found.get("ttft"), found.get("tpot"), found.get("e2el"))

    def describe(self) -> str:
        return " ".join(f"{k}:{v:g}" for k, v in self.items())

    def items(self) -> list[tuple[str, float]]:
        return [(k, v) for k, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms))
                if v is not None]

    def ratios(self, r: RequestResult) -> dict[str, float]:
        """Observed/SLO per metric the request shows; a failed request is infinitely over."""
        if r.outcome.failed:
            return {k: float("inf") for k, _ in self.items()}
        observed = {"ttft": r.ttft_s, "tpot": inter_token_s(r), "e2el": r.e2e_s}
        return {k: observed[k] * 1000.0 / v for k, v in self.items() if observed[k] is not None}

    def worst(self, r: RequestResult) -> tuple[str | None, float]:
        """The metric furthest over (or closest to) its SLO, and its ratio; (None, 0) when none is measured."""
        ratios = self.ratios(r)
        if not ratios:
            return None, 0.0
        name = max(ratios, key=lambda k: ratios[k])
        return name, ratios[name]


def goodput(result: ExecutionResult, slo: Slo) -> dict[str, Any]:
    """One run's goodput (requests/s meeting every SLO) and SLO attainment (their share)."""
    good = sum(1 for r in result.requests if slo.worst(r)[1] <= 1.0)
    total = len(result.requests)
    span = max((r.sent_s + (r.e2e_s or 0.0) for r in result.requests), default=0.0)
    return {"good": good, "requests": total, "attainment": good / total if total else None,
            "goodput_rps": good / span if span > 0 else None}


def verdicts(trace: Trace, results: Sequence[ExecutionResult], slo: Slo) -> list[Verdict]:
    """One verdict per request that missed the SLO in at least one run (a finding, or not yet)."""
    out = []
    for request in trace.requests:
        mine = [r for res in results for r in res.requests if r.request_id == request.id]
        worst = [slo.worst(r) for r in mine]
        misses = [(name, ratio) for name, ratio in worst if ratio > 1.0]
        if misses:
            out.append(_verdict(trace, request.id, mine, worst, misses, slo))
    return out


def undecided(verdict: Verdict) -> bool:
    """Would more runs decide this SLO verdict (it missed, but not yet in enough runs)?"""
    return verdict.decision is Decision.UNKNOWN and verdict.runs < MAX_SLO_RUNS


def _violated(k: int, n: int) -> bool:
    return k >= MIN_MISSES and k / n >= MISS_QUORUM


async def examine(target: Target, trace: Trace, results: Sequence[ExecutionResult], slo: Slo
                  ) -> tuple[list[Verdict], list[ExecutionResult]]:
    """The SLO verdicts of ``results``, re-running ``trace`` while one is undecided, up to MAX_SLO_RUNS runs;
    (the verdicts, the extra runs)."""
    every = list(results)
    found = verdicts(trace, every, slo)
    extra: list[ExecutionResult] = []
    while any(undecided(v) for v in found) and len(every) < MAX_SLO_RUNS:
        extra.append(await target.execute(trace))
        every.append(extra[-1])
        found = verdicts(trace, every, slo)
    return found, extra


def _verdict(trace: Trace, request_id: str, mine: Sequence[RequestResult], worst, misses, slo: Slo) -> Verdict:
    k, n = len(misses), len(worst)
    p = float(stats.binomtest(k, n, 0.5, alternative="greater").pvalue)
    metric_name = statistics.mode(name for name, _ in misses)
    ratios = [ratio for _, ratio in worst]
    effect = float(statistics.median(ratios))
    if _violated(k, n):
        decision = Decision.DIFFERENT
    elif n >= MAX_SLO_RUNS or not _violated(k + MAX_SLO_RUNS - n, MAX_SLO_RUNS):
        decision = Decision.UNSTABLE  # misses in some runs, and more runs up to the cap cannot make it one
    else:
        decision = Decision.UNKNOWN
    limit = dict(slo.items())[metric_name]
    seen = [x for r in mine if (x := slo.ratios(r).get(metric_name)) is not None and x != float("inf")]
    observed_s = statistics.median(seen) * limit / 1000.0 if seen else None
    return Verdict(
        kind=FindingKind.SLO_VIOLATION, decision=decision,
        method=f"runs over the SLO ({slo.describe()}), one-sided sign test; a violation needs >= {MIN_MISSES} "
               f"runs and >= {MISS_QUORUM:.0%} of them",
        request_id=request_id, metric=_METRIC[metric_name], p_value=p, effect=effect, threshold=1.0,
        n_sample=n, reproduced=k, runs=n, observed_s=observed_s, signature=signature(FindingKind.SLO_VIOLATION, trace, request_id,
                                                              slo=metric_name),
        detail=f"{metric_name} over its SLO of {limit:g} ms in {k}/{n} runs (median {effect:.2f}x the SLO)",
        evidence="the user's SLO, not the FCFS bound",
    )
