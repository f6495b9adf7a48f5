"""The statistical core of the oracle: is a candidate's sample different from a baseline?

A three-valued sequential test in the style of Chromium Pinpoint (see ARCHITECTURE.md,
"Oracle"): p = min(Mann-Whitney U, Kolmogorov-Smirnov) of the candidate's samples against a
baseline sample. "MWU is bad at detecting changes in variance, and K-S is bad with discrete
distributions", so both are asked. DIFFERENT when p <= alpha *and* the effect reaches the
practical threshold; SAME when even the upper end of the effect's interval stays below the
threshold, or when p is high on enough samples and the effect is small; UNKNOWN otherwise,
and the caller runs more.

Samples here are *ratios*: observed time divided by what the calibrated model expects (1.0
means "as expected"), so samples from different requests, runs and the idle calibration
share one scale.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from fuzzer.oracle.kinds import Decision

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
