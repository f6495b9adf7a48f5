"""The oracle: what is a finding (ARCHITECTURE.md, "Oracle").

Read top-down, as one execution goes through it. The thresholds are the policy's
(:mod:`fuzzer.oracle.policy`). Three steps, each a function (the third lives in
:mod:`fuzzer.oracle.confirm`):

- :func:`observe` holds every request of one execution against its expectations
  (:mod:`fuzzer.oracle.expectation`): slowdown versus idle, excess over the FCFS bound, and
  whether it is a *candidate*: a TTFT, max ITL or E2E above ``factor x bound`` and
  more than a margin above the measured noise (three quarters of the factor for one far
  above its bound in absolute terms: ``OraclePolicy.long_excess_s``). Queueing that FCFS explains is not a
  candidate, however slow. Failed requests, a server that never returned to idle
  (leak) and a server that went away (crash) are candidates of their own kinds
  (:func:`shows_failure`); :func:`candidates` lists them, worst first.
- :func:`judge` gives one :class:`~fuzzer.oracle.verdict.Verdict` per request (and per execution-level
  problem) from executions of a trace: its ratios observed/bound against the calibration baseline, and a
  candidate in most runs. Runs right after an idle period are held apart from warm runs: a slowdown
  seen only there is ``cold-start``, never ``ttft-outlier``.
- :func:`fuzzer.oracle.confirm.confirm` re-executes a trace for one candidate with the three-valued
  sequential test (more runs while UNKNOWN, up to a cap), first warm, then, if the
  warm runs do not show it, after idle periods. Only DIFFERENT becomes a finding.

:func:`fuzzer.oracle.confirm.examine` strings them together for ``fuzz replay``: run, judge, confirm the
undecided candidates. The oracle never reads ``ExecutionResult.ground_truth``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fuzzer.execute.http import SPEED_CHECK
from fuzzer.execution import FAILURE_KIND, ExecutionResult, Outcome, RequestResult, left_over, server_down
from fuzzer.oracle.calibration import Calibration
from fuzzer.oracle.evidence import bounds, preemptions, queued_out, thrash
from fuzzer.oracle.expectation import Expectation
from fuzzer.oracle.kinds import METRIC_KIND, Decision, FindingKind, Metric
from fuzzer.oracle.order import Inversion, inversions
from fuzzer.oracle.policy import CANDIDATE_FACTOR, DEFAULT_POLICY, FAILURE_QUORUM, OraclePolicy
from fuzzer.oracle.signature import signature
from fuzzer.oracle.statistics import Comparison, compare
from fuzzer.oracle.verdict import Verdict
from fuzzer.trace import Trace


# --- observation of one execution --------------------------------------------------------


@dataclass(frozen=True)
class Observation:
    """One metric of one request in one execution, against its expectations."""

    metric: Metric
    observed_s: float
    #: The FCFS bound and the idle expectation.
    expected_s: float
    idle_s: float
    candidate: bool
    #: The factor over the bound that made (or would make) it a candidate.
    factor: float = CANDIDATE_FACTOR
    #: Judged against the KV-unaware bound because the execution thrashed (:func:`thrash`).
    thrashed: bool = False
    #: How much slower than calibrated the engine was after the execution (its speed check, which scaled the bounds).
    load: float = 1.0
    #: For a TTFT: the requests that overtook this one although FCFS serves it first
    #: (fuzzer.oracle.order), whatever the bound says; None when none did.
    order: Inversion | None = None
    #: What this bound waits for as the execution observed it (``Expectation.behind``), if anything.
    behind: str | None = None
    #: When ``factor`` is the long-excess one (far above the bound): the excess it needs, seconds.
    min_excess_s: float | None = None
    #: A lower bound: the request was still running at its execution's time cap (Outcome.CUT).
    censored: bool = False

    @property
    def flagged(self) -> bool:
        """Worth confirming: above its bound (``candidate``) or overtaken against FCFS order."""
        return self.candidate or self.order is not None

    @property
    def ratio(self) -> float:
        return self.observed_s / self.expected_s if self.expected_s > 0 else math.inf

    @property
    def slowdown(self) -> float:
        """Observed / idle: what the user feels."""
        return self.observed_s / self.idle_s if self.idle_s > 0 else math.inf

    @property
    def excess_s(self) -> float:
        """Observed - FCFS bound: what by-design queueing does not explain."""
        return self.observed_s - self.expected_s


@dataclass(frozen=True)
class RequestReport:
    """Everything the oracle saw about one request in one execution."""

    request_id: str
    outcome: Outcome
    expectation: Expectation
    observations: Mapping[Metric, Observation]
    #: The finding kind a failed outcome is evidence of (error, hang, protocol), if any.
    failure: FindingKind | None = None

    @property
    def worst(self) -> Observation | None:
        """The metric furthest above its bound."""
        return max(self.observations.values(), key=lambda o: o.ratio, default=None)


def observe(
    trace: Trace, result: ExecutionResult, calibration: Calibration, policy: OraclePolicy = DEFAULT_POLICY
) -> tuple[RequestReport, ...]:
    """Hold every request of ``result`` against its idle expectation and its FCFS bound."""
    load = slower_engine(result, calibration, policy)
    if load > 1.0:
        calibration = calibration.with_model(calibration.model.scaled(load))
    thrashed = thrash(trace, result, calibration, policy)
    expectations, factor = bounds(trace, result, calibration, thrashed, policy)
    overtaken = inversions(trace, result, calibration, preemptions(result) > 0, policy)
    planned = {q.id: q for q in trace.requests}
    long_s = policy.long_excess_s(calibration)
    reports = []
    for r in result.requests:
        e = expectations[r.request_id]
        observations: dict[Metric, Observation] = {}
        cut = r.outcome is Outcome.CUT
        streamed = r.request_id not in planned or planned[r.request_id].stream
        if r.outcome is Outcome.OK or cut:
            for metric, value in (_at_least(r, streamed) if cut else _measured(r)).items():
                bound, idle = e.bound(metric), e.idle(metric)
                if value is None or bound is None or idle is None:
                    continue
                margin = policy.margin_s(calibration, metric, result.client_lag_s)
                far = max(margin, idle + long_s)  # its own work keeps the full factor's room
                f = policy.factor_for(factor, value - bound, far)
                slow = value >= f * bound and value - bound >= margin
                if cut and not slow:
                    continue  # a lower bound within the bound's room says nothing either way
                inverted = overtaken.get(r.request_id) if metric is Metric.TTFT else None
                behind = e.behind if metric is not Metric.MAX_ITL else None
                observations[metric] = Observation(metric, value, bound, idle, slow, f, thrashed, load, inverted,
                                                   behind, far if f < factor else None, cut)
        failure = None if queued_out(r, e, result, factor, streamed) else failure_kind(r.outcome)
        reports.append(RequestReport(r.request_id, r.outcome, e, observations, failure))
    return tuple(reports)


def later_choice_stall(r: RequestResult, o: Observation) -> bool:
    """Whether ``o``, a slow max ITL of ``r``, is only a later choice's silence: choice 0's own gaps (what
    a client times) stay under the factor over the bound, and another choice went silent longer."""
    if o.metric is not Metric.MAX_ITL or r.choice_gap_s is None:
        return False
    own = max(r.itl_s, default=0.0)
    return r.choice_gap_s > own and own < o.factor * o.expected_s


def slower_engine(result: ExecutionResult, calibration: Calibration, policy: OraclePolicy = DEFAULT_POLICY) -> float:
    """How much slower than calibrated the engine was right after ``result`` (1.0 when not).

    The speed check's median inter-token gap is one decode step of one short sequence; the
    calibrated model says what that step cost then. A ratio within the check's noise
    (below ``slower_engine_min``) counts as 1; it is capped at ``slower_engine_max``.
    """
    if result.speed_check_itl_s is None:
        return 1.0
    (check,) = SPEED_CHECK.requests
    expected = calibration.model.step_s(0, 1, check.prompt_tokens + check.max_tokens // 2)
    if expected <= 0:
        return 1.0
    ratio = result.speed_check_itl_s / expected
    return min(ratio, policy.slower_engine_max) if ratio >= policy.slower_engine_min else 1.0


def _measured(r: RequestResult) -> dict[Metric, float | None]:
    return {Metric.TTFT: r.ttft_s, Metric.MAX_ITL: r.max_itl_s, Metric.E2E: r.e2e_s}


def _at_least(r: RequestResult, streamed: bool) -> dict[Metric, float | None]:
    """What a request cut at its execution's time cap took at least: its e2e ran to the cut (``e2e_s``);
    a stream without a first token waited that long for it; the gap since its last token was still open."""
    if r.e2e_s is None:  # never sent
        return {}
    if not streamed:
        return {Metric.E2E: r.e2e_s}
    open_gap = r.e2e_s - r.token_times_s[-1] if r.token_times_s else None
    return {Metric.TTFT: r.e2e_s if r.ttft_s is None else r.ttft_s,
            Metric.MAX_ITL: None if open_gap is None else max(open_gap, r.max_itl_s or 0.0), Metric.E2E: r.e2e_s}


def failure_kind(outcome: Outcome) -> FindingKind | None:
    """The finding kind a request that ended with ``outcome`` is evidence of (error, hang, protocol); None if none."""
    kind = FAILURE_KIND.get(outcome)
    return None if kind is None else FindingKind(kind)


# --- what one execution shows -------------------------------------------------------------


def shows_failure(kind: FindingKind, result: ExecutionResult, request_id: str | None = None) -> bool:
    """Does this one execution show the failure ``kind`` (one of ``FAILURE_KINDS``)?

    A crash (:func:`crashed`) or a leak (the server did not return to idle) is the whole
    execution's; an error, hang or protocol failure is a request's: ``request_id``'s, any
    request's when None. False for a latency kind: one execution shows a slow request only
    against its bounds (:func:`observe`).
    """
    if kind is FindingKind.CRASH:
        return crashed(result)
    if kind is FindingKind.LEAK:  # a server that died cannot return to idle: that is the crash
        return result.idle_after is False and not crashed(result)
    return any(failure_kind(r.outcome) is kind and request_id in (None, r.request_id) for r in result.requests)


def crashed(result: ExecutionResult) -> bool:
    """The server went down: connection errors from some request on, and none answered after.

    A single reset followed by answered requests is an ``error``, not a crash. A launched
    server whose process died during the execution (``--launch``), or a server that refused a
    connection once it had not returned to idle after it, crashed whatever the requests saw
    (:func:`fuzzer.execution.server_down`).
    """
    if server_down(result) is not None:
        return True
    failed = [r.outcome is Outcome.CONNECTION_ERROR for r in sorted(result.requests, key=lambda r: r.sent_s)]
    if not any(failed):
        return False
    tail = failed[failed.index(True):]
    if not all(tail):
        return False  # a later request was answered: the server is up
    return len(tail) >= 2 or (len(failed) == 1 and result.idle_after is None)


def after_idle(result: ExecutionResult, policy: OraclePolicy = DEFAULT_POLICY) -> bool:
    """Could this execution have met a cold server?

    True when the server had been idle for at least a cold start's time before it, and
    when that is unknown (``idle_before_s`` None: a freshly started server, or one that
    does not say): such a run is never taken as proof of a warm-server slowdown.
    """
    return result.idle_before_s is None or result.idle_before_s >= policy.cold_idle_s


# --- candidates of one execution ------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """Something worth re-executing: a slow metric, a failure, a leak or a crash."""

    kind: FindingKind
    request_id: str | None = None
    metric: Metric | None = None
    #: Observed / FCFS bound when the candidate is a latency.
    ratio: float | None = None
    #: Whether the execution it was seen in came right after an idle period.
    after_idle: bool = False
    detail: str = ""
    #: A latency's request ended this long after its execution started; a TTFT's got its first token then
    #: (what its re-runs must show: fuzzer.search.cuts). None: unknown, or not a latency.
    until_s: float | None = None
    #: An itl-stall seen only in the choices after the first of an n > 1 stream: choice 0's own gaps were
    #: within the factor over the bound (the fan-out's code, whatever the batch: its own family).
    held_choice: bool = False


def candidates(
    trace: Trace, result: ExecutionResult, calibration: Calibration, policy: OraclePolicy = DEFAULT_POLICY
) -> list[Candidate]:
    """What in one execution deserves confirmation, worst first."""
    cold = after_idle(result, policy)
    out: list[Candidate] = []
    down = shows_failure(FindingKind.CRASH, result)
    if down:
        out.append(Candidate(FindingKind.CRASH, detail=server_down(result)
                             or "connection errors from some request on, none answered after"))
    if shows_failure(FindingKind.LEAK, result):
        held = left_over(result)
        out.append(Candidate(FindingKind.LEAK, detail="the server did not return to idle after every request ended"
                                                      + (f": {held}" if held else "")))
    latency = []
    by_id = {r.request_id: r for r in result.requests}
    for rep in observe(trace, result, calibration, policy):
        # A crash's errors (refused, reset, the error events of an engine that died) are the crash's symptoms.
        if rep.failure is not None and not (down and rep.failure is FindingKind.ERROR):
            out.append(Candidate(rep.failure, rep.request_id, detail=rep.outcome.value))
        slow = [o for o in rep.observations.values() if o.flagged]
        if slow:
            o = max(slow, key=lambda o: o.ratio)
            r = by_id[rep.request_id]
            mark = r.ttft_s if o.metric is Metric.TTFT else r.e2e_s
            latency.append(Candidate(METRIC_KIND[o.metric], rep.request_id, o.metric, o.ratio, cold,
                                     until_s=r.sent_s + mark if r.outcome is Outcome.OK and mark is not None else None,
                                     held_choice=later_choice_stall(r, o)))
    latency.sort(key=lambda c: -(c.ratio or 0.0))
    return out + latency


# --- judging one or more executions -----------------------------------------------------------


def judge(
    trace: Trace,
    results: Sequence[ExecutionResult],
    calibration: Calibration,
    *,
    rng: np.random.Generator,
    policy: OraclePolicy = DEFAULT_POLICY,
) -> list[Verdict]:
    """One verdict per request of ``trace`` (plus leak/crash verdicts) from executions of it.

    Each request's worst metric is tested across the runs against the calibration
    baseline. Runs after an idle period are judged apart: slow there and not in the warm
    runs is ``cold-start``.
    """
    if not results:
        return []
    reports = [{rep.request_id: rep for rep in observe(trace, r, calibration, policy)} for r in results]
    cold = [after_idle(r, policy) for r in results]
    verdicts: list[Verdict] = []
    verdicts += _execution_verdicts(trace, results)
    for request in trace.requests:
        per_run = [rep[request.id] for rep in reports if request.id in rep]
        failure = _failure_verdict(trace, request.id, per_run)
        if failure is not None:
            verdicts.append(failure)
            continue
        verdicts.append(latency_verdict(trace, request.id, per_run, cold, calibration, rng, policy))
    return verdicts


def _execution_verdicts(trace: Trace, results: Sequence[ExecutionResult]) -> list[Verdict]:
    out = []
    for kind in (FindingKind.CRASH, FindingKind.LEAK):
        k = sum(shows_failure(kind, r) for r in results)
        if k:
            # A launched server's death quotes its log's last lines (the last run that killed it); a gone one, how.
            deaths = [d for r in results if (d := server_down(r))] if kind is FindingKind.CRASH else []
            detail = deaths[-1] if deaths else ""
            out.append(count_verdict(kind, None, k, len(results), signature(kind, trace), detail=detail))
    return out


def _failure_verdict(trace: Trace, request_id: str, per_run: Sequence[RequestReport]) -> Verdict | None:
    kinds = [rep.failure for rep in per_run if rep.failure is not None]
    if not kinds:
        return None
    kind = max(set(kinds), key=kinds.count)
    outcome = next(rep.outcome for rep in per_run if rep.failure is kind)
    sig = signature(kind, trace, request_id, outcome=outcome.value)
    return count_verdict(kind, request_id, kinds.count(kind), len(per_run), sig, detail=outcome.value)


def latency_verdict(
    trace: Trace,
    request_id: str,
    per_run: Sequence[RequestReport],
    cold: Sequence[bool],
    calibration: Calibration,
    rng: np.random.Generator,
    policy: OraclePolicy,
) -> Verdict:
    worst = [rep.worst for rep in per_run if rep.worst is not None]
    assumption = calibration.assumption.describe()
    if not worst:
        return Verdict(kind=None, decision=Decision.INSUFFICIENT_DATA, method=_METHOD, request_id=request_id,
                       runs=len(per_run), assumption=assumption, detail="no latency measured in any run")
    modelled = _model_verdict(trace, request_id, per_run, worst, cold, calibration, rng, policy, assumption)
    ordered = order_verdict(trace, request_id, per_run, assumption, policy)
    if ordered is None or modelled.is_finding:
        return modelled
    if ordered.is_finding or modelled.kind is None or modelled.decision is Decision.SAME:
        return ordered  # decided by the order, or the bound saw nothing and the order is still in question
    return modelled


def _model_verdict(
    trace: Trace,
    request_id: str,
    per_run: Sequence[RequestReport],
    worst: Sequence[Observation],
    cold: Sequence[bool],
    calibration: Calibration,
    rng: np.random.Generator,
    policy: OraclePolicy,
    assumption: str,
) -> Verdict:
    """The request judged against its FCFS bound over the calibrated step costs."""
    metric = _judged_metric(per_run) or max(worst, key=lambda o: o.ratio).metric
    obs = [rep.observations.get(metric) for rep in per_run]
    warm = [o for o, c in zip(obs, cold) if o is not None and not c]
    cold_obs = [o for o, c in zip(obs, cold) if o is not None and c]
    baseline = calibration.baseline.get(metric, ())

    def test(sample: Sequence[Observation]) -> Comparison:
        threshold = max((o.factor for o in sample), default=policy.factor)
        return compare([o.ratio for o in sample], baseline, threshold=threshold, rng=rng,
                       alpha=policy.alpha, same_p=policy.same_p)

    everything = [o for o in obs if o is not None]
    # A verdict on a calibration too noisy to judge says so (it is not withheld: the effect may be real).
    unreliable = [note] if (note := calibration.reliability_note()) is not None else []
    if cold_obs and warm and all(o.candidate for o in cold_obs) and not any(o.candidate for o in warm):
        # Slow only right after idleness: a cold start, whatever the warm runs say.
        c = test(cold_obs)
        decision = Decision.UNKNOWN if c.decision is Decision.INSUFFICIENT_DATA else c.decision
        if decision is Decision.SAME:
            decision = Decision.UNKNOWN
        return _make_verdict(FindingKind.COLD_START, decision, c, request_id, metric, cold_obs, assumption,
                             signature(FindingKind.COLD_START, trace), threshold=max(o.factor for o in cold_obs),
                             detail="; ".join([f"slow in {len(cold_obs)} run(s) after >= {policy.cold_idle_s:g} s idle, "
                                               f"not in {len(warm)} warm run(s)", *unreliable]))
    sample = warm if warm else everything
    c = test(sample)
    k = sum(o.candidate for o in sample)
    kind = METRIC_KIND[metric] if k else None
    decision = c.decision
    if decision is Decision.DIFFERENT and 2 * k <= len(sample):
        # Most runs must reach the factor too (a busy host shifts a run's ratios: fuzz replay on the clean
        # simulator beside three CPU hogs confirmed a ttft-outlier reproduced 1/3).
        decision = Decision.UNKNOWN
    if decision is Decision.UNKNOWN and len(sample) >= policy.max_runs and 0 < k < len(sample):
        decision = Decision.UNSTABLE
    notes = [] if warm else ["every run came after an idle period; a cold start cannot be ruled out"]
    notes += unreliable
    threshold = max((o.factor for o in sample), default=policy.factor)
    far = _min_excess(sample)
    if far is not None:
        notes.append(f"{far:.2f} s or more above its bound in every run: candidate factor {threshold:g}x, "
                     f"{policy.long_excess_share:g} of the usual one")
    if cut := sum(o.censored for o in sample):
        notes.append(f"still running when {cut} of {len(sample)} run(s) reached the execution's time cap: "
                     "those runs' latencies are lower bounds")
    if any(o.thrashed for o in sample):
        notes.append("the server preempted far more often than a KV-aware FCFS scheduler would (thrash): "
                     "judged against the bound that never runs out of KV")
    if threshold > policy.factor * (policy.long_excess_share if far is not None else 1.0):
        notes.append(f"the server reported preemptions (KV cache full): candidate factor {threshold:g}x, "
                     "not the KV-unaware FCFS bound's usual one")
    detail = "; ".join(notes)
    sig = signature(kind, trace, request_id) if kind else None
    return _make_verdict(kind, decision, c, request_id, metric, sample, assumption, sig, threshold=threshold,
                         detail=detail)


def order_verdict(
    trace: Trace, request_id: str, per_run: Sequence[RequestReport], assumption: str, policy: OraclePolicy,
) -> Verdict | None:
    """The request judged by the order of first tokens alone (fuzzer.oracle.order); None
    when no run shows it overtaken.

    DIFFERENT when it was overtaken in at least ``order_min_runs`` runs and in at least
    ``order_quorum`` of them; UNSTABLE at the run cap below that; UNKNOWN before. The
    effect is the victim's TTFT over its TTFT had it been served no later than the earliest
    request that overtook it (fuzzer.oracle.order.Inversion.bound_s).
    """
    obs = [o for rep in per_run if (o := rep.observations.get(Metric.TTFT)) is not None]
    hit = [o for o in obs if o.order is not None]
    if not hit:
        return None
    k, n = len(hit), len(obs)
    if k >= policy.order_min_runs and k / n >= policy.order_quorum:
        decision = Decision.DIFFERENT
    elif n >= policy.max_runs:
        decision = Decision.UNSTABLE
    else:
        decision = Decision.UNKNOWN
    bounds = [o.order.bound_s for o in hit if o.order is not None]
    observed = float(np.median([o.observed_s for o in hit]))
    median = sorted(hit, key=lambda o: o.observed_s)[len(hit) // 2]
    assert median.order is not None
    effect = float(np.median([o.observed_s / b for o, b in zip(hit, bounds) if b > 0])) if any(b > 0 for b in bounds) else None
    return Verdict(
        kind=FindingKind.TTFT_OUTLIER, decision=decision, method=_ORDER_METHOD, request_id=request_id,
        metric=Metric.TTFT, effect=effect, threshold=1.0, n_sample=n, reproduced=k, runs=n,
        observed_s=observed, expected_s=float(np.median(bounds)),
        idle_s=float(np.median([o.idle_s for o in hit])), assumption=assumption,
        signature=signature(FindingKind.TTFT_OUTLIER, trace, request_id),
        detail=(f"overtaken in {k}/{n} runs; in the median one its {median.order.describe()}; "
                f"its TTFT was {median.ratio:.2f}x its FCFS bound over the calibrated step costs"),
        evidence=("the order of first tokens in the executions themselves, no step model: FCFS serves a "
                  "request that reached the engine first no later than one that came after it with no less work "
                  "(or any later one, where admissions stop at the first request that cannot be scheduled and "
                  "its prefill is not capped per step)"),
        overtakers=tuple(sorted({name for o in hit if o.order is not None for name in o.order.overtakers})),
    )


#: Which latency symptom names a finding when several are above their bounds: the first
#: one a user meets.
_SYMPTOM_ORDER = (Metric.TTFT, Metric.MAX_ITL, Metric.E2E)


def _judged_metric(per_run: Sequence[RequestReport]) -> Metric | None:
    """The metric to judge a request on, or None when no run made it a candidate.

    The earliest symptom that made a candidate in at least half of the runs (a late first
    token also delays the end; blaming the end would hide the cause). A symptom that made
    one only now and then is not the one to test when another does so in most runs: a
    request that streams every token 40x too slowly and whose first token is borderline
    slow in 2 runs of 10 is an inter-token stall, not a TTFT that tests SAME. When no
    symptom reaches half of the runs (a slowdown only after idle periods, say), the one
    that made a candidate most often, earliest first on a tie.
    """
    counts = {m: sum(1 for rep in per_run if (o := rep.observations.get(m)) is not None and o.flagged)
              for m in _SYMPTOM_ORDER}
    steady = [m for m in _SYMPTOM_ORDER if counts[m] and 2 * counts[m] >= len(per_run)]
    if steady:
        return steady[0]
    best = max(counts.values())
    return next((m for m in _SYMPTOM_ORDER if counts[m] == best), None) if best else None


# --- verdict construction -------------------------------------------------------------------

_METHOD = "min(Mann-Whitney U, Kolmogorov-Smirnov) of observed/FCFS-bound ratios vs the calibration baseline"
_FAILURE_METHOD = "reproduction count over re-executions"
_ORDER_METHOD = "reproduction count of an ordering inversion over re-executions (FCFS order of first tokens)"


def count_decision(k: int, n: int, quorum: float = FAILURE_QUORUM) -> Decision:
    """The count test's decision for a failure seen in ``k`` of ``n`` re-runs."""
    if n < 2:
        return Decision.INSUFFICIENT_DATA
    if k >= 2 and k / n >= quorum:
        return Decision.DIFFERENT
    return Decision.SAME if k == 0 else Decision.UNSTABLE


def count_verdict(
    kind: FindingKind, request_id: str | None, k: int, n: int, sig: str, *, detail: str = "",
    quorum: float = FAILURE_QUORUM,
) -> Verdict:
    return Verdict(kind=kind, decision=count_decision(k, n, quorum), method=_FAILURE_METHOD, request_id=request_id,
                   reproduced=k, runs=n, n_sample=n, signature=sig, detail=detail)


def _make_verdict(
    kind: FindingKind | None,
    decision: Decision,
    c: Comparison,
    request_id: str,
    metric: Metric,
    sample: Sequence[Observation],
    assumption: str,
    sig: str | None,
    *,
    threshold: float,
    detail: str = "",
) -> Verdict:
    return Verdict(
        kind=kind,
        decision=decision,
        method=_METHOD + (f" ({c.test})" if c.test else ""),
        request_id=request_id,
        metric=metric,
        statistic=c.statistic,
        p_value=c.p_value,
        effect=c.effect,
        effect_ci=c.effect_ci,
        threshold=threshold,
        n_sample=c.n_sample,
        n_baseline=c.n_baseline,
        reproduced=sum(o.candidate for o in sample),
        runs=len(sample),
        observed_s=float(np.median([o.observed_s for o in sample])) if sample else None,
        expected_s=float(np.median([o.expected_s for o in sample])) if sample else None,
        idle_s=float(np.median([o.idle_s for o in sample])) if sample else None,
        assumption=assumption,
        signature=sig,
        detail=detail,
        evidence=_evidence(sample),
        min_excess_s=_min_excess(sample),
    )


def _min_excess(sample: Sequence[Observation]) -> float | None:
    """The excess the sample's long-excess factor needs, when every observation was held to it."""
    needs = [o.min_excess_s for o in sample]
    return max(n for n in needs if n is not None) if needs and None not in needs else None


def _evidence(sample: Sequence[Observation]) -> str:
    """What the bounds of ``sample`` rest on, in words."""
    text = "the FCFS schedule of the trace over the calibrated step costs"
    loads = [o.load for o in sample if o.load > 1.0]
    if loads:
        text += (f", scaled by the engine's speed check after {len(loads)}/{len(sample)} run(s) "
                 f"(up to {max(loads):.2g}x slower than calibrated)")
    behind = sorted({o.behind for o in sample if o.behind})
    if behind:
        text += (f", waiting as observed for {', '.join(behind)} (a request preempted for KV blocks by design, "
                 f"back at the head of the queue, or a free slot) in "
                 f"{sum(o.behind is not None for o in sample)}/{len(sample)} run(s)")
    return text
