"""Minimizing a stored finding against a live target (ARCHITECTURE.md, "Shrink and report").

:mod:`fuzzer.shrink.engine` shrinks over any noisy predicate; this module makes that
predicate out of the oracle, for one finding: "does one execution of this trace
show a candidate of the finding's kind?" While shrinking, the candidate factor is
raised by :data:`HYSTERESIS` (Hypothesis' 1.25x deadline trick), so the result does
not sit on the border; the final 10-run confirmation uses the report threshold.

An option-slowdown (fuzzer.oracle.ablation) is a comparison, not a bound: one check runs
the trace and the same trace without the option (in alternating order), and holds when the
median ITL (or e2e: the verdict's ``compared``) of the requests without the option is the
factor times that without it. A
candidate needs a request with the option and MIN_OTHERS without it; the first request
with the option is kept (others may go, if one is enough).

The minimization's state is checkpointed in the store after every test, so an
interrupted ``fuzz minimize`` resumes; other problems met on the way are confirmed
with the oracle afterwards and saved as findings of their own.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Awaitable, Callable

import numpy as np

from fuzzer.errors import ConfigError
from fuzzer.execute.recovery import DEFAULT_PATIENCE_S, PatientTarget
from fuzzer.execution import ExecutionResult, Target
from fuzzer.oracle.ablation import MIN_OTHERS, carriers, run_pair
from fuzzer.oracle.calibration import Calibration
from fuzzer.oracle.confirm import confirm, let_idle
from fuzzer.oracle.judge import Candidate, observe, shows_failure
from fuzzer.oracle.kinds import FAILURE_KINDS, FindingKind, Metric
from fuzzer.oracle.policy import DEFAULT_POLICY, OraclePolicy
from fuzzer.oracle.signature import signature
from fuzzer.oracle.verdict import Verdict
from fuzzer.shrink.engine import Check, Minimizer, MinimizeResult, Progress
from fuzzer.store import Store, StoredFinding
from fuzzer.trace import Trace

#: Shrinking demands this much more than the report threshold (Hypothesis: deadline x 1.25).
HYSTERESIS = 1.25
#: Other problems met while shrinking that are confirmed and saved at the end, at most.
MAX_OTHERS = 3


@dataclass(frozen=True)
class Reduction:
    finding_id: int
    result: MinimizeResult
    #: Ids of findings saved from other problems met on the way.
    others: tuple[int, ...]


def _shows_latency(kind: FindingKind, metric: Metric | None, victim: str | None, trace: Trace,
                   result: ExecutionResult, calibration: Calibration, policy: OraclePolicy,
                   by_order: bool = False) -> tuple[bool, Candidate | None, float | None]:
    """Does the finding's victim (any request when it has none) exceed its bound on ``metric``?

    ``by_order``: the finding was decided by the order of first tokens, so the victim must be
    overtaken against FCFS order (fuzzer.oracle.order) instead, whatever its bound says; the
    evidence that made the finding is the one the shrunk trace must keep.
    Keeping the victim keeps the finding the same finding: its repro script judges that
    request. Also returns a failure of another kind seen on the way, if any, as a candidate,
    and the victim's effect (observed / FCFS bound, over the long-excess share where that factor
    held it; the largest when it has no victim; None when judged by the order).
    """
    found = False
    other = None
    effect = None
    for rep in observe(trace, result, calibration, policy):
        mine = victim is None or rep.request_id == victim
        observed = rep.observations.get(metric) if metric and mine else None
        if observed is not None and by_order:
            found = found or observed.order is not None
        elif observed is not None:
            # A long-excess observation's smaller factor counts as the policy's.
            ratio = observed.ratio / policy.long_excess_share if observed.min_excess_s is not None else observed.ratio
            effect = ratio if effect is None else max(effect, ratio)
            found = found or observed.candidate
        if other is None and rep.failure is not None and rep.failure is not kind:
            other = Candidate(rep.failure, rep.request_id, detail=rep.outcome.value)
    return found, other, effect


def make_check(
    target: Target,
    kind: FindingKind,
    metric: Metric | None,
    victim: str | None,
    calibration: Calibration,
    *,
    policy: OraclePolicy = DEFAULT_POLICY,
    sleep: Callable[[float], Awaitable[None]],
    record: Callable[[Trace, ExecutionResult], None] = lambda t, r: None,
    others: dict[str, Candidate] | None = None,
    by_order: bool = False,
    option: str | None = None,
    compared: str = "e2e",
) -> Callable[[Trace, bool], Awaitable[Check]]:
    """The noisy predicate of one finding, for :class:`fuzzer.shrink.engine.Minimizer`.

    ``option``: for an option-slowdown, the option whose removal gives the baseline
    (the verdict's ``ablated``); the factor is ``policy.option_factor``, over the other requests'
    ``compared`` (the verdict's: itl or e2e, fuzzer.oracle.ablation.statistic_of).
    """
    shrinking = replace(policy, factor=policy.factor * HYSTERESIS)
    if kind is FindingKind.OPTION_SLOWDOWN:
        if not option:
            raise ValueError("an option-slowdown check needs the option it ablates")
        return _option_check(target, option, calibration, policy=policy, record=record, others=others,
                             compared=compared)

    async def check(trace: Trace, strict: bool) -> Check:
        if kind is FindingKind.COLD_START:
            await let_idle(target, policy.cold_idle_s, sleep)
        result = await target.execute(trace)
        record(trace, result)
        if kind in FAILURE_KINDS:
            return Check(shows_failure(kind, result, victim))
        judged_by = shrinking if strict else policy
        ok, other, effect = _shows_latency(kind, metric, victim, trace, result, calibration, judged_by, by_order)
        sig = None
        if other is not None:
            sig = signature(other.kind, trace, other.request_id, outcome=other.detail)
            if others is not None:
                others.setdefault(sig, other)
        # The effect in shrinking thresholds: 1.0 is just reproduced while shrinking.
        strength = effect / shrinking.factor if effect is not None and math.isfinite(effect) and strict else None
        return Check(ok, sig, strength)

    return check


def _option_check(
    target: Target,
    option: str,
    calibration: Calibration,
    *,
    policy: OraclePolicy,
    record: Callable[[Trace, ExecutionResult], None],
    others: dict[str, Candidate] | None,
    compared: str = "e2e",
) -> Callable[[Trace, bool], Awaitable[Check]]:
    """One pair of runs, the trace and ``without_option(trace, option)``, the order alternating
    call by call (a drifting server favours neither): holds when the other requests' ``compared``
    (median ITL or e2e) with the option is the factor (x HYSTERESIS when ``strict``) times that without it."""
    shrinking_factor = policy.option_factor * HYSTERESIS
    calls = [0]

    async def check(trace: Trace, strict: bool) -> Check:
        mine = carriers(trace, option)
        if not mine or len(trace.requests) - len(mine) < MIN_OTHERS:
            return Check(False, None, 0.0 if strict else None)  # not this finding: no run needed
        with_s, without_s, runs = await run_pair(target, trace, option, trace_first=calls[0] % 2 == 0, record=record,
                                                 statistic=compared)
        calls[0] += 1
        sig = None
        for t, result in runs:
            if sig is None and result.failures:
                _, other, _ = _shows_latency(FindingKind.OPTION_SLOWDOWN, None, None, t, result, calibration, policy)
                if other is not None:
                    sig = signature(other.kind, t, other.request_id, outcome=other.detail)
                    if others is not None:
                        others.setdefault(sig, other)
        if with_s is None or without_s is None or without_s <= 0:
            return Check(False, sig, 0.0 if strict else None)
        ratio = with_s / without_s
        factor = shrinking_factor if strict else policy.option_factor
        # The effect in shrinking thresholds: 1.0 is just reproduced while shrinking.
        return Check(ratio >= factor, sig, ratio / shrinking_factor if strict and math.isfinite(ratio) else None)

    return check


async def minimize_finding(
    store: Store,
    finding: StoredFinding,
    target: Target,
    calibration: Calibration,
    *,
    policy: OraclePolicy = DEFAULT_POLICY,
    sleep: Callable[[float], Awaitable[None]],
    seed: int = 0,
    on_progress: Callable[[Progress], None] | None = None,
    repro: Callable[[StoredFinding, Trace], str | None] = lambda f, t: None,
    max_executions: int | None = None,
    patience_s: float = DEFAULT_PATIENCE_S,
    on_down: Callable[[str], None] = lambda reason: None,
) -> Reduction:
    """Shrink ``finding``'s trace on ``target``, store the result and its repro script.

    When the server goes down on the way (a crash finding takes it down by definition),
    every execution waits for it with backoff for up to ``patience_s``, then gives up with
    a TargetError; the state saved after every test lets the same call resume.
    """
    target = PatientTarget(target, sleep=sleep, patience_s=patience_s, on_down=on_down)
    kind = FindingKind(finding.kind)
    metric = Metric(finding.verdict["metric"]) if finding.verdict.get("metric") else None
    trace = store.get_trace(finding.trace_hash)
    others: list[tuple[Trace, str]] = []
    met: dict[str, Candidate] = {}

    def record(t: Trace, result: ExecutionResult) -> None:
        store.record_execution(result, t, target_id=finding.target_id, purpose="minimize")

    def on_other(t: Trace, sig: str) -> None:
        if len(others) < MAX_OTHERS and sig not in {s for _, s in others}:
            others.append((t, sig))

    kwargs = {} if max_executions is None else {"max_executions": max_executions}
    victim = finding.verdict.get("request_id")
    option = finding.verdict.get("ablated") if kind is FindingKind.OPTION_SLOWDOWN else None
    if kind is FindingKind.OPTION_SLOWDOWN and not option:
        raise ConfigError(f"finding {finding.id} is an option-slowdown whose verdict names no option (ablated)")
    if option:
        # The request with the option is kept (the first one, unless the verdict named another).
        mine = carriers(trace, option)
        victim = victim if victim in mine else (mine[0] if mine else None)
        if finding.verdict.get("threshold"):
            policy = replace(policy, option_factor=float(finding.verdict["threshold"]))
    minimizer = Minimizer(
        make_check(target, kind, metric, victim, calibration, policy=policy, sleep=sleep, record=record, others=met,
                   by_order=bool(finding.verdict.get("overtakers")), option=option,
                   compared=finding.verdict.get("compared") or "e2e"),
        keep=frozenset({victim} if victim and victim in {r.id for r in trace.requests} else ()),
        state=store.minimization_state(finding.id),
        on_state=lambda state: store.save_minimization(finding.id, state, status="running"),
        on_progress=on_progress,
        on_other=on_other,
        **kwargs,
    )
    result = await minimizer.run(trace)
    details = {
        "minimized": {
            "reproduced": result.reproduction,
            "executions": result.executions,
            "tests": result.tests,
            "stop": str(result.stop),
            "requests_before": len(trace.requests),
            "requests_after": len(result.minimized.requests),
        }
    }
    store.save_minimization(finding.id, minimizer.state(), status="done")
    store.set_minimized(finding.id, result.minimized, details=details)
    updated = store.get_finding(finding.id)
    script = repro(updated, result.minimized)
    if script is not None:
        store.set_minimized(finding.id, result.minimized, repro_script=script)
    saved = await _save_others(store, finding, target, calibration, others, met, policy=policy, sleep=sleep, seed=seed)
    return Reduction(finding.id, result, tuple(saved))


async def _save_others(store: Store, finding: StoredFinding, target: Target, calibration: Calibration,
                       others: list[tuple[Trace, str]], met: dict[str, Candidate], *, policy: OraclePolicy,
                       sleep: Callable[[float], Awaitable[None]], seed: int) -> list[int]:
    saved = []
    rng = np.random.default_rng(random.Random(seed).getrandbits(64))
    for trace, sig in others:
        verdict: Verdict = await confirm(target, trace, met[sig], calibration, rng=rng,
                                         policy=policy, sleep=sleep)
        if verdict.is_finding:
            fid, created = store.add_finding(
                kind=str(verdict.kind), signature=verdict.signature or sig, trace=trace, verdict=verdict.to_dict(),
                slowdown=verdict.slowdown, reproduced=verdict.reproduction, campaign_id=finding.campaign_id,
                target_id=finding.target_id, details={"request_id": verdict.request_id,
                                                      "met_while_minimizing": finding.id},
            )
            if created:
                saved.append(fid)
    return saved

