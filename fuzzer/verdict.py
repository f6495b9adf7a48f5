"""Verdicts: what the oracle concludes about one request or one execution (SPEC §7).

A verdict is a frozen value, never a bare bool. It says which finding kind the
evidence points at, how it was tested (method, statistic, p-value), how big the
effect is (with a bootstrap confidence interval), on how many samples, how often
it reproduced (``k/n``) and which scheduler assumption the expectation used.

The statistical core is a three-valued sequential test in the style of Chromium
Pinpoint (research/fuzzing.md §6): p = min(Mann-Whitney U, Kolmogorov-Smirnov)
of the candidate's samples against a baseline sample. "MWU is bad at detecting
changes in variance, and K-S is bad with discrete distributions", so both are
asked. DIFFERENT when p <= alpha *and* the effect reaches the practical
threshold; SAME when even the upper end of the effect's interval stays below the
threshold, or when p is high on enough samples and the effect is small; UNKNOWN
otherwise, and the caller runs more.

Samples here are *ratios*: observed time divided by what the calibrated model
expects (1.0 means "as expected"), so samples from different requests, runs and
the idle calibration share one scale.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats

from fuzzer.trace import Request, Trace, canonical_json


class Decision(enum.StrEnum):
    """The outcome of testing a candidate. Only DIFFERENT makes a finding."""

    #: Significant (p <= alpha) and the effect reaches the threshold: a finding.
    DIFFERENT = "different"
    #: Indistinguishable from the baseline, or the effect is surely below the threshold.
    SAME = "same"
    #: Neither yet: more runs may decide (or the run cap was reached undecided).
    UNKNOWN = "unknown"
    #: Too few usable samples to test at all (say, the request never produced a token).
    INSUFFICIENT_DATA = "insufficient-data"
    #: Reproduces in some runs and not in others, with no stable answer at the cap.
    UNSTABLE = "unstable"


class FindingKind(enum.StrEnum):
    """The kinds of finding of SPEC §7."""

    TTFT_OUTLIER = "ttft-outlier"
    ITL_STALL = "itl-stall"
    E2E_OUTLIER = "e2e-outlier"
    COLD_START = "cold-start"
    LEAK = "leak"
    ERROR = "error"
    HANG = "hang"
    PROTOCOL = "protocol"
    CRASH = "crash"


class Metric(enum.StrEnum):
    """A per-request latency the oracle judges against its expectation."""

    TTFT = "ttft"
    MAX_ITL = "max_itl"
    E2E = "e2e"


#: Which latency kind a slow metric is evidence of.
METRIC_KIND: Mapping[Metric, FindingKind] = {
    Metric.TTFT: FindingKind.TTFT_OUTLIER,
    Metric.MAX_ITL: FindingKind.ITL_STALL,
    Metric.E2E: FindingKind.E2E_OUTLIER,
}

# --- tunables -------------------------------------------------------------------------

#: Pinpoint's significance level: a finding costs a maintainer's time, so one false
#: alarm in a hundred candidate tests is the most we accept from the statistics alone.
ALPHA = 0.01
#: Above this p the candidate is called SAME. Pinpoint derives its high threshold from
#: sample size and magnitude; a fixed, generous value keeps the rule explainable and errs
#: towards "run more" (UNKNOWN) rather than towards a premature SAME.
SAME_P = 0.2
#: Bootstrap resamples for the effect's interval: enough for a stable 95% percentile
#: interval of a median ratio, cheap (vectorized, well under a millisecond per 100).
BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95
#: Fewer candidate samples than this cannot be tested (MWU/KS need at least one each; a
#: single sample against a baseline of 40 cannot reach p <= 0.01 anyway).
MIN_CANDIDATE_SAMPLES = 2
#: SAME on a high p-value alone needs this many samples: two runs, one slow and one not,
#: give p ~ 0.2 and mean "run more", not "no difference" (Pinpoint's high threshold is
#: likewise stricter for small samples).
MIN_SAME_SAMPLES = 4
#: A baseline smaller than this is not a distribution; calibration records ~40 per metric.
MIN_BASELINE_SAMPLES = 8


@dataclass(frozen=True)
class Interval:
    """A confidence interval of an effect (ratio of medians)."""

    low: float
    high: float
    level: float = CONFIDENCE


@dataclass(frozen=True)
class Comparison:
    """One step of the three-valued sequential test: a sample against a baseline."""

    decision: Decision
    p_value: float | None
    #: The statistic of the test that gave the smaller p-value (U or D).
    statistic: float | None
    #: "mann-whitney-u" or "kolmogorov-smirnov": which test gave the p-value.
    test: str | None
    #: Median of the sample over median of the baseline.
    effect: float | None
    effect_ci: Interval | None
    n_sample: int
    n_baseline: int


def compare(
    sample: Sequence[float],
    baseline: Sequence[float],
    *,
    threshold: float,
    rng: np.random.Generator,
    alpha: float = ALPHA,
    same_p: float = SAME_P,
    resamples: int = BOOTSTRAP_RESAMPLES,
) -> Comparison:
    """Test ``sample`` against ``baseline``: DIFFERENT, SAME or UNKNOWN (or INSUFFICIENT_DATA).

    ``threshold`` is the practical effect (ratio of medians) a difference must reach to
    matter; a statistically clear 10% shift is SAME once its interval is below it.
    """
    x = np.asarray([v for v in sample if v is not None and math.isfinite(v)], dtype=float)
    y = np.asarray([v for v in baseline if v is not None and math.isfinite(v)], dtype=float)
    if len(x) < MIN_CANDIDATE_SAMPLES or len(y) < MIN_BASELINE_SAMPLES:
        return Comparison(Decision.INSUFFICIENT_DATA, None, None, None, None, None, len(x), len(y))

    base_median = float(np.median(y))
    effect = float(np.median(x)) / base_median if base_median > 0 else math.inf
    ci = _bootstrap_ratio_ci(x, y, rng, resamples)

    if np.ptp(np.concatenate([x, y])) == 0.0:
        # Every value identical: no test can reject, and nothing differs.
        return Comparison(Decision.SAME, 1.0, 0.0, "identical", effect, ci, len(x), len(y))
    mwu = stats.mannwhitneyu(x, y, alternative="two-sided")
    ks = stats.ks_2samp(x, y, alternative="two-sided")
    if float(mwu.pvalue) <= float(ks.pvalue):
        p, statistic, test = float(mwu.pvalue), float(mwu.statistic), "mann-whitney-u"
    else:
        p, statistic, test = float(ks.pvalue), float(ks.statistic), "kolmogorov-smirnov"

    if p <= alpha and effect >= threshold:
        decision = Decision.DIFFERENT
    elif ci.high < threshold or (p > same_p and len(x) >= MIN_SAME_SAMPLES and effect < threshold):
        decision = Decision.SAME
    else:
        decision = Decision.UNKNOWN
    return Comparison(decision, p, statistic, test, effect, ci, len(x), len(y))


def _bootstrap_ratio_ci(x: np.ndarray, y: np.ndarray, rng: np.random.Generator, resamples: int) -> Interval:
    bx = np.median(rng.choice(x, size=(resamples, len(x)), replace=True), axis=1)
    by = np.median(rng.choice(y, size=(resamples, len(y)), replace=True), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(by > 0, bx / by, np.inf)
    tail = (1.0 - CONFIDENCE) / 2.0
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return Interval(float(low), float(high))


# --- the verdict ----------------------------------------------------------------------


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
            "reproduced": self.reproduction,
            "observed_s": _finite(self.observed_s),
            "expected_s": _finite(self.expected_s),
            "idle_s": _finite(self.idle_s),
            "slowdown": _finite(self.slowdown),
            "excess_s": _finite(self.excess_s),
            "assumption": self.assumption,
            "signature": self.signature,
            "detail": self.detail,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Verdict:
        ci = data.get("effect_ci")
        k, _, n = str(data.get("reproduced") or "0/0").partition("/")
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
            reproduced=int(k or 0),
            runs=int(n or 0),
            observed_s=data.get("observed_s"),
            expected_s=data.get("expected_s"),
            idle_s=data.get("idle_s"),
            assumption=data.get("assumption", ""),
            signature=data.get("signature"),
            detail=data.get("detail", ""),
        )


def _finite(value: float | None) -> float | None:
    """JSON has no infinity: an unbounded value is written as null."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def _num(value: float | None) -> float:
    return math.inf if value is None else float(value)


# --- signatures -----------------------------------------------------------------------

#: Request-shape classes are log2 buckets: a 2000- and a 2100-token prompt are the same
#: shape, a 128- and a 2048-token prompt are not. Noise never moves a trace across them.
def size_class(tokens: int) -> int:
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
        "prompt": size_class(request.prompt_tokens),
        "output": size_class(request.max_tokens),
        "stream": request.stream,
        "api": request.api,
        "fanout": request.n > 1 or request.logprobs is not None,
        "shared_prefix": request.prefix is not None,
        "cancel": request.cancel_after_tokens is not None,
        "before": _count_class(len(before)),
        "before_max_prompt": size_class(max((r.prompt_tokens for r in before), default=0)) if before else None,
        "before_same_prefix": any(r.prefix is not None and r.prefix == request.prefix for r in before),
    }


def signature(kind: FindingKind, trace: Trace, request_id: str | None = None, **extra: Any) -> str:
    """A deduplication key: the kind plus the shape of the trace around the victim.

    ``extra`` adds evidence that separates bugs of one kind (the HTTP status of an error).
    The key reads ``<kind>:<12 hex digits>``.
    """
    shape: dict[str, Any] = {"kind": kind.value, **{k: v for k, v in sorted(extra.items())}}
    if request_id is not None:
        shape["victim"] = request_shape(trace, trace.request(request_id))
    else:
        shape["trace"] = _trace_shape(trace)
    digest = hashlib.sha256(canonical_json(shape).encode()).hexdigest()[:12]
    return f"{kind.value}:{digest}"


def _trace_shape(trace: Trace) -> dict[str, Any]:
    return {
        "requests": _count_class(len(trace.requests)),
        "max_prompt": size_class(max(r.prompt_tokens for r in trace.requests)),
        "cancel": any(r.cancel_after_tokens is not None for r in trace.requests),
        "fanout": any(r.n > 1 or r.logprobs is not None for r in trace.requests),
        "shared_prefix": any(r.prefix is not None for r in trace.requests),
    }
