"""The oracle's vocabulary: what a finding can be, which latency is judged, what a test decided.

Plain enums, imported by every stage that speaks of findings (search, shrink, report, store
rows) without pulling in the statistics.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


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
    """The kinds of finding of ARCHITECTURE.md, "Oracle"."""

    TTFT_OUTLIER = "ttft-outlier"
    ITL_STALL = "itl-stall"
    E2E_OUTLIER = "e2e-outlier"
    COLD_START = "cold-start"
    #: One request's sampling option (seed, logprobs) slows the other requests of its trace:
    #: tested against the same trace without the option (fuzzer.oracle.ablation).
    OPTION_SLOWDOWN = "option-slowdown"
    LEAK = "leak"
    ERROR = "error"
    HANG = "hang"
    PROTOCOL = "protocol"
    CRASH = "crash"
    #: A request misses the user's SLO (``--goodput ttft:MS tpot:MS e2el:MS``) in most runs:
    #: judged beside the scheduler-pathology kinds, never instead of them (fuzzer.oracle.slo).
    SLO_VIOLATION = "slo-violation"


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

#: The kinds of failure: one execution shows them or not by itself (fuzzer.oracle.judge.shows_failure),
#: and a verdict counts the runs that show one. The other kinds are latencies, tested against
#: the calibration baseline.
FAILURE_KINDS: frozenset[FindingKind] = frozenset({
    FindingKind.CRASH, FindingKind.LEAK, FindingKind.ERROR, FindingKind.HANG, FindingKind.PROTOCOL,
})
