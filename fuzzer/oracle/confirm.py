"""Confirmation: re-execute a candidate until the three-valued test decides (ARCHITECTURE.md, "Oracle").

A candidate from :func:`fuzzer.oracle.judge.candidates` (or an undecided verdict of
:func:`fuzzer.oracle.judge.judge`) is re-executed: MIN_RUNS first, then STEP_RUNS more
while the test says UNKNOWN, up to MAX_RUNS. Latency candidates run warm first; if
the warm runs do not show the slowdown and it was seen after idleness, a cold arm
follows, each run after an idle period. Only DIFFERENT becomes a finding.

With ``futility`` (the campaign's confirmations) each arm starts with one run: a candidate
whose request that run shows within its bound and in FCFS order is SAME at once (the
budget of runs is a cap, not a plan); one that recurs gets the rest of MIN_RUNS and the
test as above, so a real finding costs what it did; and the warm arm stops once DIFFERENT is out of
reach within MAX_RUNS (:func:`out_of_reach`), UNSTABLE or SAME as the cap would have said.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from fuzzer.execution import ExecutionResult, Outcome, Target
from fuzzer.oracle.ablation import confirm_option, suspects
from fuzzer.oracle.calibration import Calibration
from fuzzer.oracle.capcheck import recheck
from fuzzer.oracle.judge import (
    Candidate,
    RequestReport,
    after_idle,
    count_decision,
    count_verdict,
    crashed,
    judge,
    latency_verdict,
    observe,
    shows_failure,
)
from fuzzer.oracle.kinds import FAILURE_KINDS, Decision, FindingKind, Metric
from fuzzer.oracle.policy import DEFAULT_POLICY, MIN_RUNS, OraclePolicy
from fuzzer.oracle.signature import signature
from fuzzer.oracle.verdict import Verdict
from fuzzer.trace import Trace


async def let_idle(target: Target, seconds: float, sleep: Callable[[float], Awaitable[None]]) -> None:
    """Leave the server idle: on virtual time if the target has a clock, else really wait."""
    advance = getattr(target, "idle", None)
    if advance is not None:
        outcome = advance(seconds)
        if inspect.isawaitable(outcome):
            await outcome
    else:
        await sleep(seconds)


async def confirm(
    target: Target,
    trace: Trace,
    candidate: Candidate,
    calibration: Calibration,
    *,
    rng: np.random.Generator,
    policy: OraclePolicy = DEFAULT_POLICY,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    futility: bool = False,
    cut_s: float | None = None,
) -> Verdict:
    """Re-execute ``trace`` until the candidate is DIFFERENT or SAME, or the run cap is reached.

    ``cut_s``: each latency re-run's time cap (``Target.execute``): what still runs after the
    candidate's request is done cannot change how long it took, and its bound plans every request
    as the trace asks (:mod:`fuzzer.oracle.expectation`), cut or not.

    Latency candidates are first re-run warm (back to back). If the warm runs do not
    show the slowdown, and it was first seen after idleness (or is a cold-start
    candidate), a cold arm follows: each run after ``policy.cold_idle_s`` of idleness.
    A slowdown only the cold arm shows is ``cold-start``.
    """
    if candidate.metric is None:
        return await _confirm_failure(target, trace, candidate, policy, futility)
    results: list[ExecutionResult] = []
    verdict = None
    while len(results) < policy.max_runs:
        for _ in range(_want(len(results), policy, futility)):
            results.append(await target.execute(trace, cut_s=cut_s))
        reports = _reports(trace, results, calibration, policy, candidate.request_id) if candidate.request_id else []
        if futility and len(results) == 1 and len(results) < policy.min_runs:
            if reports and not _recurs(reports[0]):
                verdict = _did_not_recur(trace, candidate, reports[0], calibration, "re-run")
                break
            continue  # it recurs: the rest of MIN_RUNS, then the test
        cold_runs = [after_idle(r, policy) for r in results]
        verdict = latency_verdict(
            trace, candidate.request_id, reports, cold_runs, calibration, rng, policy,
        ) if candidate.request_id else None
        if verdict is None or verdict.decision in (Decision.DIFFERENT, Decision.SAME, Decision.INSUFFICIENT_DATA):
            break
        if futility and (why := out_of_reach(reports, cold_runs, calibration, policy)) is not None:
            verdict = _curtailed(verdict, why)
            break
    assert verdict is not None
    if verdict.is_finding and verdict.kind is FindingKind.ITL_STALL:
        verdict = _placed(verdict, results, candidate.request_id)
    if verdict.is_finding or not (candidate.after_idle or candidate.kind is FindingKind.COLD_START):
        return verdict
    # Cold arm: idle, then run; repeat.
    cold_results: list[ExecutionResult] = []
    cold_verdict = verdict
    while len(cold_results) < policy.max_runs:
        for _ in range(_want(len(cold_results), policy, futility)):
            await let_idle(target, policy.cold_idle_s, sleep)
            cold_results.append(await target.execute(trace, cut_s=cut_s))
        if futility and len(cold_results) == 1 and len(cold_results) < policy.min_runs:
            first_cold = _reports(trace, cold_results, calibration, policy, candidate.request_id)
            if first_cold and not _recurs(first_cold[0]):
                break  # not slow after idleness either: the warm verdict stands
            continue
        every = [*results, *cold_results]
        marks = [False] * len(results) + [True] * len(cold_results)
        cold_verdict = latency_verdict(
            trace, candidate.request_id, _reports(trace, every, calibration, policy, candidate.request_id),
            marks, calibration, rng, policy,
        )
        if cold_verdict.kind is not FindingKind.COLD_START:
            break  # the cold runs are no slower than the warm ones (or the warm ones are slow too)
        if cold_verdict.decision in (Decision.DIFFERENT, Decision.INSUFFICIENT_DATA):
            break
    if cold_verdict.kind is FindingKind.COLD_START:
        from fuzzer.oracle.fresh import on_fresh_servers  # noqa: PLC0415 - a launched target only

        return await on_fresh_servers(
            target, trace, candidate.request_id, results, cold_verdict, calibration, rng=rng, policy=policy,
            reports=lambda runs: _reports(trace, runs, calibration, policy, candidate.request_id),
        )
    return verdict


#: An itl-stall is a scheduling decision only where it recurs at one point of the execution: most of its re-runs'
#: longest gaps end within the larger of these (seconds, share of the request's median e2e) of one another (a bug's
#: stall may move in one run: heldout9's bug4 paused `f04` 28-34 s in five re-runs, 1.6 s in a sixth). heldout2's clean
#: configuration on a host at a load of 2.7 (stop 54): every stream of the trace paused 0.16-0.36 s at once, 1.6 s,
#: 5.5 s and 8.4 s into three re-runs (tokens 124, 516 and 889 of 1024): the server process descheduled, confirmed
#: 3/3 as a 4.5x itl-stall; replayed at a load of 1.5, nothing. A prefill, a preemption or a planted stall comes
#: when the trace brings it (an arrival, a KV cache filling up), at the same point of every run.
STALL_SPREAD_S = 1.0
STALL_SPREAD_SHARE = 0.25


def _placed(verdict: Verdict, results: Sequence[ExecutionResult], request_id: str | None) -> Verdict:
    """``verdict`` (an itl-stall), or SAME when its re-runs paused its request at points too far apart (most of them
    not within STALL_SPREAD_S or STALL_SPREAD_SHARE of its median e2e of one another)."""
    ends, e2es = [], []
    for result in results:
        r = next((x for x in result.requests if x.request_id == request_id), None)
        if r is None or (gap := r.longest_gap_s) is None or r.sent_s is None:
            continue
        ends.append(r.sent_s + gap[1])
        e2es.append(r.e2e_s or gap[1])
    if len(ends) < 2:
        return verdict
    allowed = max(STALL_SPREAD_S, STALL_SPREAD_SHARE * float(np.median(e2es)))
    ends.sort()
    together = max(sum(1 for t in ends[i:] if t - start <= allowed) for i, start in enumerate(ends))
    if 2 * together > len(ends):
        return verdict
    where = ", ".join(f"{t:.1f}" for t in ends)
    return replace(verdict, kind=None, decision=Decision.SAME, detail=(
        f"{verdict.detail}; but its longest gaps ended {where} s into the re-runs, not most of them within {allowed:.1f} s: "
        "a pause of the host or the server's runtime, not a scheduling decision").lstrip("; "))


def _want(done: int, policy: OraclePolicy, futility: bool) -> int:
    """How many runs the next round of an arm makes (one first under ``futility``, then up to MIN_RUNS)."""
    if done == 0:
        return 1 if futility else policy.min_runs
    if done < policy.min_runs:
        return policy.min_runs - done
    return min(policy.step_runs, policy.max_runs - done)


def _recurs(report: RequestReport) -> bool:
    """Whether one re-run shows the request flagged again (or says nothing either way: it failed)."""
    if report.outcome is not Outcome.OK or not report.observations:
        return True  # no latency to hold against the bound: let the test decide
    return any(o.flagged for o in report.observations.values())


def _did_not_recur(trace: Trace, candidate: Candidate, report: RequestReport, calibration: Calibration,
                   what: str) -> Verdict:
    """SAME after one run: the candidate's request was within its bound and in FCFS order."""
    worst = report.worst
    assert worst is not None
    return Verdict(
        kind=None, decision=Decision.SAME, method=_FUTILITY_METHOD, request_id=candidate.request_id,
        metric=worst.metric, effect=worst.ratio, threshold=worst.factor, reproduced=0, runs=1,
        observed_s=worst.observed_s, expected_s=worst.expected_s, idle_s=worst.idle_s,
        assumption=calibration.assumption.describe(),
        detail=(f"did not recur: the first {what} served {candidate.request_id} within its FCFS bound and in "
                f"FCFS order (worst {worst.metric} {worst.ratio:.2g}x its bound, first seen "
                f"{candidate.ratio or 0:.2g}x); sequential confirmation stopped there"),
        evidence="the FCFS schedule of the trace over the calibrated step costs, and the order of first tokens",
    )


_FUTILITY_METHOD = "sequential futility: the first re-run did not show the candidate again"


def out_of_reach(reports: Sequence[RequestReport], cold: Sequence[bool], calibration: Calibration,
                 policy: OraclePolicy) -> str | None:
    """Why no continuation up to ``policy.max_runs`` runs can make the candidate DIFFERENT, or None.

    Curtailment, the exact stop of a sequential test: the bound's test needs the median ratio
    of its metric's sample to reach the factor (times the baseline's median), so at least half
    of the final sample must; the order check needs ``order_min_runs`` inversions and
    ``order_quorum`` of the runs. When the runs left cannot supply either for any metric, running
    them cannot change the outcome. The factor is the policy's smallest (its long-excess share;
    a KV-pressure factor is larger), so this errs towards running on.
    """
    left = policy.max_runs - len(reports)
    if left <= 0:
        return None
    warm = [rep for rep, c in zip(reports, cold) if not c] or list(reports)
    counts = []
    for metric in Metric:
        baseline = calibration.baseline.get(metric, ())
        obs = [o for rep in warm if (o := rep.observations.get(metric)) is not None]
        if not baseline or not obs:
            continue
        need = policy.factor * policy.long_excess_share * float(np.median(baseline))
        over = sum(o.ratio >= need for o in obs)
        if 2 * (over + left) >= len(obs) + left:
            return None  # half of the final sample can still reach the factor
        counts.append(f"{metric} {over}/{len(obs)}")
    ttft = [o for rep in reports if (o := rep.observations.get(Metric.TTFT)) is not None]
    overtaken = sum(o.order is not None for o in ttft)
    if overtaken + left >= policy.order_min_runs and (overtaken + left) >= policy.order_quorum * (len(ttft) + left):
        return None
    return (f"out of reach within {policy.max_runs} runs: at or above {policy.factor * policy.long_excess_share:g}x its bound in "
            f"{', '.join(counts) or 'no'} run(s), overtaken in {overtaken}/{len(ttft)}; "
            "sequential confirmation stopped there")


def _curtailed(verdict: Verdict, why: str) -> Verdict:
    """``verdict`` (UNKNOWN) decided early: SAME when no run reproduced it, else UNSTABLE."""
    decision = Decision.UNSTABLE if verdict.reproduced else Decision.SAME
    return replace(verdict, decision=decision, detail="; ".join(d for d in (verdict.detail, why) if d))


def _reports(
    trace: Trace, results: Sequence[ExecutionResult], calibration: Calibration, policy: OraclePolicy, request_id: str
) -> list[RequestReport]:
    out = []
    for r in results:
        for rep in observe(trace, r, calibration, policy):
            if rep.request_id == request_id:
                out.append(rep)
    return out


async def _confirm_failure(target: Target, trace: Trace, candidate: Candidate, policy: OraclePolicy,
                           futility: bool = False) -> Verdict:
    results = [await target.execute(trace)]
    hits = [shows_failure(candidate.kind, results[0], candidate.request_id)]
    if not (futility and candidate.kind is not FindingKind.CRASH and not hits[0]):
        while len(results) < policy.min_runs and not (futility and _count_settled(sum(hits), len(hits), policy)):
            results.append(await target.execute(trace))
            hits.append(shows_failure(candidate.kind, results[-1], candidate.request_id))
    extra = {"outcome": candidate.detail} if candidate.request_id else {}
    sig = signature(candidate.kind, trace, candidate.request_id, **extra)
    if len(results) == 1:  # futility: the first re-run did not fail that way
        return Verdict(kind=None, decision=Decision.SAME, method=_FUTILITY_METHOD, request_id=candidate.request_id,
                       reproduced=0, runs=1, n_sample=1, signature=sig,
                       detail=f"did not recur: the first re-run showed no {candidate.kind} ({candidate.detail}); "
                              "sequential confirmation stopped there")
    return count_verdict(candidate.kind, candidate.request_id, sum(hits), len(hits), sig,
                          detail=candidate.detail, quorum=policy.failure_quorum)


def _count_settled(k: int, n: int, policy: OraclePolicy) -> bool:
    """Whether ``k`` failures in ``n`` re-runs already decide the count test over ``policy.min_runs``: the
    runs left, all failing or none, would give the same decision (2 of 2 is DIFFERENT whatever a third
    shows at a quorum of a half), so under futility they are not made."""
    runs, quorum = policy.min_runs, policy.failure_quorum
    return count_decision(k, runs, quorum) is count_decision(k + runs - n, runs, quorum)


# --- replay: run, judge, confirm -------------------------------------------------------------


@dataclass(frozen=True)
class Examination:
    """What ``fuzz replay`` reports: the runs, one verdict per request, and the findings."""

    results: tuple[ExecutionResult, ...]
    verdicts: tuple[Verdict, ...]
    #: Verdicts that came from confirmation re-runs (they replace the first judgement).
    confirmations: tuple[Verdict, ...] = field(default=())
    #: A line per long-prefill cap probed again at an inversion's prompt size (fuzzer.oracle.capcheck.recheck).
    notes: tuple[str, ...] = field(default=())

    @property
    def findings(self) -> tuple[Verdict, ...]:
        """Confirmed findings, one per signature."""
        seen: dict[str | None, Verdict] = {}
        for v in self.verdicts:
            if v.is_finding and v.signature not in seen:
                seen[v.signature] = v
        return tuple(seen.values())


async def examine(
    target: Target,
    trace: Trace,
    calibration: Calibration,
    *,
    runs: int = MIN_RUNS,
    rng: np.random.Generator,
    policy: OraclePolicy = DEFAULT_POLICY,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    cap_probe: Callable[[Calibration, int], Awaitable[Calibration]] | None = None,
) -> Examination:
    """Execute ``trace`` ``runs`` times, judge every request, confirm the undecided candidates. With ``cap_probe``
    (:func:`fuzzer.oracle.capcheck.probe_cap` on ``target``), an inversion of a long prompt by shorter ones judged
    with no long-prefill cap is judged again under the cap probed at its size first, as a campaign's are."""
    results = tuple([await target.execute(trace) for _ in range(runs)])

    def judged(by: Calibration) -> list[Verdict]:
        return [_placed(v, results, v.request_id) if v.is_finding and v.kind is FindingKind.ITL_STALL else v
                for v in judge(trace, results, by, rng=rng, policy=policy)]

    verdicts = judged(calibration)
    by_request: dict[str, Calibration] = {}
    notes: list[str] = []
    if cap_probe is not None:
        checked = await recheck(cap_probe, trace, results, verdicts, calibration, judged, policy)
        calibration, verdicts, by_request, notes = (checked.calibration, checked.verdicts, checked.by_request,
                                                    checked.notes)
    confirmed: list[Verdict] = []
    seen: set[str] = set()
    # A trace that took the server down every run: the crash is the finding, and confirming a
    # latency beside it would take the server down again each run (a launched server's restarts
    # are a bounded budget: LaunchSpec.max_restarts).
    crashing = all(crashed(r) for r in results)
    for i, v in enumerate(verdicts):
        undecided = v.decision in (Decision.UNKNOWN, Decision.UNSTABLE, Decision.INSUFFICIENT_DATA)
        if not (undecided and v.kind is not None and v.reproduced > 0 and v.signature not in seen):
            continue
        if crashing and v.kind not in FAILURE_KINDS:
            continue
        if len(confirmed) >= policy.max_confirmations:
            break
        seen.add(v.signature or "")
        cand = Candidate(v.kind, v.request_id, v.metric, v.effect,
                         after_idle=v.kind is FindingKind.COLD_START or any(after_idle(r, policy) for r in results))
        better = await confirm(target, trace, cand, by_request.get(v.request_id or "", calibration), rng=rng,
                               policy=policy, sleep=sleep)
        confirmed.append(better)
        verdicts[i] = better
    if not crashing:
        # A sampling option slowing everyone is invisible to the bounds (fuzzer.oracle.ablation).
        for option in suspects(trace, results[0], policy):
            tested = await confirm_option(target, trace, option, policy=policy)
            confirmed.append(tested)
            verdicts.append(tested)
    return Examination(results, tuple(verdicts), tuple(confirmed), tuple(notes))
