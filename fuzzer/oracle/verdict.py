"""Verdicts: what the oracle concludes about one request or one execution.

A verdict is a frozen value, never a bare bool. It says which finding kind the evidence
points at, how it was tested (method, statistic, p-value; :mod:`fuzzer.oracle.statistics`),
how big the effect is (with a bootstrap confidence interval), on how many samples, how often
it reproduced (``k/n``) and which scheduler assumption the expectation used.

Dict form history (:meth:`Verdict.to_dict`, stored in a finding's ``verdict`` JSON):
    ``"reproduced": "k/n"`` text at first; now ``"reproduced": k`` and ``"runs": n`` as
    numbers, with ``"reproduction": "k/n"`` for display. :meth:`Verdict.from_dict` and
    :func:`reproduction_of` read both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fuzzer.oracle.kinds import Decision, FindingKind, Metric
from fuzzer.oracle.statistics import Interval


@dataclass(frozen=True)
class Verdict:
    """What the oracle concluded about one request (or one execution, for leak/crash)."""

    #: The kind the evidence points at; None when nothing is suspicious.
    kind: FindingKind | None
    decision: Decision
    #: How it was decided, in words ("min(Mann-Whitney U, Kolmogorov-Smirnov) of ... vs ...").
    method: str
    #: The request judged; None for verdicts about the whole execution (leak, crash).
    request_id: str | None = None
    metric: Metric | None = None
    statistic: float | None = None
    p_value: float | None = None
    #: Median observed / expected (or the candidate's ratio over the baseline's).
    effect: float | None = None
    effect_ci: Interval | None = None
    #: The effect a DIFFERENT needs (the candidate factor).
    threshold: float | None = None
    n_sample: int = 0
    n_baseline: int = 0
    #: Runs in which the request exceeded its bound (or failed the same way) ...
    reproduced: int = 0
    #: ... out of this many runs.
    runs: int = 0
    #: Median observed time, its FCFS bound and its idle expectation, in seconds.
    observed_s: float | None = None
    expected_s: float | None = None
    idle_s: float | None = None
    #: The scheduler assumption the expectation rests on, e.g. "max_num_batched_tokens=2048 (vLLM default)".
    assumption: str = ""
    signature: str | None = None
    detail: str = ""
    #: What decided the bound the request was held against: the FCFS model over the
    #: calibrated costs, or the order the executions themselves show (see ARCHITECTURE.md,
    #: "Oracle"), in words; empty for verdicts that hold nothing against a bound.
    evidence: str = ""
    #: For a verdict decided by the order of first tokens: the requests that overtook the
    #: victim in the runs that showed it (fuzzer.oracle.order).
    overtakers: tuple[str, ...] = ()
    #: When ``threshold`` is the long-excess factor (fuzzer.oracle.policy.LONG_EXCESS_SHARE): the
    #: excess over the bound, in seconds, every run needed as well.
    min_excess_s: float | None = None
    #: For an option-slowdown: the sampling option (seed, logprobs) whose removal from the trace
    #: gave the baseline (fuzzer.oracle.ablation).
    ablated: str | None = None
    #: For an option-slowdown: what of the other requests its pairs compared, "itl" (their median mean
    #: token gap) or "e2e" (their median e2e; also a verdict stored before this field).
    compared: str | None = None

    @property
    def is_finding(self) -> bool:
        """Only a DIFFERENT verdict with a kind becomes a finding."""
        return self.decision is Decision.DIFFERENT and self.kind is not None

    @property
    def reproduction(self) -> str:
        """The ``k/n`` reproduction rate maintainers know from GRIEF reports."""
        return f"{self.reproduced}/{self.runs}"

    @property
    def slowdown(self) -> float | None:
        """Observed over idle expectation: what a user feels."""
        if self.observed_s is None or not self.idle_s:
            return None
        return self.observed_s / self.idle_s

    @property
    def over_bound(self) -> float | None:
        """Observed over the FCFS bound: how far beyond what queueing by design explains, the figure
        a maintainer weighs (the slowdown over idle can be large for a request that also waited by design)."""
        return _over(self.observed_s, self.expected_s, self.ablated)

    @property
    def excess_s(self) -> float | None:
        """Observed minus the FCFS bound: what no reasonable FCFS scheduler explains."""
        if self.observed_s is None or self.expected_s is None:
            return None
        return self.observed_s - self.expected_s

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for the store and ``--json``)."""
        return {
            "kind": self.kind.value if self.kind else None,
            "decision": self.decision.value,
            "method": self.method,
            "request_id": self.request_id,
            "metric": self.metric.value if self.metric else None,
            "statistic": _finite(self.statistic),
            "p_value": _finite(self.p_value),
            "effect": _finite(self.effect),
            "effect_ci": [_finite(self.effect_ci.low), _finite(self.effect_ci.high), self.effect_ci.level]
            if self.effect_ci
            else None,
            "threshold": self.threshold,
            "n_sample": self.n_sample,
            "n_baseline": self.n_baseline,
            "reproduced": self.reproduced,
            "runs": self.runs,
            "reproduction": self.reproduction,
            "observed_s": _finite(self.observed_s),
            "expected_s": _finite(self.expected_s),
            "idle_s": _finite(self.idle_s),
            "slowdown": _finite(self.slowdown),
            "excess_s": _finite(self.excess_s),
            "over_bound": _finite(self.over_bound),
            "assumption": self.assumption,
            "signature": self.signature,
            "detail": self.detail,
            "evidence": self.evidence,
            "overtakers": list(self.overtakers),
            "min_excess_s": self.min_excess_s,
            "ablated": self.ablated,
            "compared": self.compared,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Verdict:
        ci = data.get("effect_ci")
        k, n = _counts(data)
        return cls(
            kind=FindingKind(data["kind"]) if data.get("kind") else None,
            decision=Decision(data["decision"]),
            method=data.get("method", ""),
            request_id=data.get("request_id"),
            metric=Metric(data["metric"]) if data.get("metric") else None,
            statistic=data.get("statistic"),
            p_value=data.get("p_value"),
            effect=data.get("effect"),
            effect_ci=Interval(_num(ci[0]), _num(ci[1]), ci[2]) if ci else None,
            threshold=data.get("threshold"),
            n_sample=data.get("n_sample", 0),
            n_baseline=data.get("n_baseline", 0),
            reproduced=k,
            runs=n,
            observed_s=data.get("observed_s"),
            expected_s=data.get("expected_s"),
            idle_s=data.get("idle_s"),
            assumption=data.get("assumption", ""),
            signature=data.get("signature"),
            detail=data.get("detail", ""),
            evidence=data.get("evidence", ""),
            overtakers=tuple(data.get("overtakers") or ()),
            min_excess_s=data.get("min_excess_s"),
            ablated=data.get("ablated"),
            compared=data.get("compared"),
        )


def over_bound_of(data: Mapping[str, Any]) -> float | None:
    """A stored verdict's observed over its FCFS bound (verdicts stored before the key was kept have both
    figures); None for verdicts held against no bound (option-slowdowns, order, leaks)."""
    if data.get("over_bound") is not None:
        return float(data["over_bound"])
    return _over(data.get("observed_s"), data.get("expected_s"), data.get("ablated"))


def _over(observed: float | None, expected: float | None, ablated: str | None) -> float | None:
    """Observed over the bound; None without both, or for an option-slowdown (its baseline is no bound)."""
    if observed is None or not expected or expected <= 0 or ablated:
        return None
    return float(observed) / float(expected)


def reproduction_of(data: Mapping[str, Any]) -> str | None:
    """The ``k/n`` reproduction of a verdict's dict form, new or old shape; None when it has none."""
    if "reproduction" in data:
        return data["reproduction"]
    reproduced = data.get("reproduced")
    if reproduced is None or isinstance(reproduced, str):
        return reproduced  # the old shape: already "k/n"
    return f"{reproduced}/{data.get('runs', 0)}"


def _counts(data: Mapping[str, Any]) -> tuple[int, int]:
    """(k, n) of a verdict's dict form: numbers, or the old ``"k/n"`` text."""
    reproduced = data.get("reproduced")
    if isinstance(reproduced, str):
        k, _, n = reproduced.partition("/")
        return int(k or 0), int(n or 0)
    return int(reproduced or 0), int(data.get("runs") or 0)


def _finite(value: float | None) -> float | None:
    """JSON has no infinity: an unbounded value is written as null."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def _num(value: float | None) -> float:
    return math.inf if value is None else float(value)
