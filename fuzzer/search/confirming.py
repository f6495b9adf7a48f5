"""The campaign's oracle steps: which candidates to confirm, confirming under the deadline, findings.

:class:`OracleSteps` is the part of :class:`fuzzer.search.campaign.Campaign` that talks to the
oracle: of an execution's candidates it confirms the worst one not already found or
recently rejected, counts every confirmation run as a campaign execution, records
confirmed findings, and when the deadline (or Ctrl-C) cuts a confirmation short keeps
the candidate as *pending* (checkpointed) so that the next run confirms it first.
"""

from __future__ import annotations

from fuzzer.execution import ExecutionResult
from fuzzer.oracle import judge as oracle
from fuzzer.oracle.confirm import confirm
from fuzzer.oracle.kinds import FindingKind, Metric
from fuzzer.oracle.signature import signature
from fuzzer.oracle.verdict import Verdict
from fuzzer.search.settings import Phase
from fuzzer.trace import Trace

# A candidate whose confirmation came back SAME is not confirmed again until it has been
# seen this many more times: noise must not eat the campaign's time.
RECONFIRM_AFTER = 5


class OutOfTime(Exception):
    """The deadline passed (or Ctrl-C) before a stability or confirmation run."""


class OracleSteps:
    """Mixed into Campaign: uses its calibration, store, settings, phase, rng and _execute."""

    async def _examine(self, trace: Trace, result: ExecutionResult, *, cold: bool = False) -> Verdict | None:
        """Confirm the worst new candidate of an execution; record it when confirmed.

        ``cold``: the execution was a cold probe; its latency candidates are deduplicated as
        the cold-start they may be (a warm rejection of the same request does not count).
        """
        assert self.calibration is not None
        for candidate in oracle.candidates(trace, result, self.calibration, self.settings.policy):
            if cold and candidate.metric is not None and candidate.after_idle:
                key = signature(FindingKind.COLD_START, trace)
            else:
                key = signature(candidate.kind, trace, candidate.request_id)
            if key in self._found:
                continue
            seen = self._rejected.get(key)
            if seen is not None and seen < RECONFIRM_AFTER:
                self._rejected[key] = seen + 1
                continue
            self._candidates += 1
            return await self._confirm_candidate(trace, candidate, key)
        return None  # one confirmation per execution keeps the fuzzing going

    async def _confirm_candidate(self, trace: Trace, candidate: oracle.Candidate, key: str) -> Verdict | None:
        """Confirm; at the deadline (or Ctrl-C) save the candidate as pending and stop the run."""
        previous, self._phase = self._phase, Phase.CONFIRM
        self._emit()
        try:
            verdict = await self._confirm(trace, candidate)
        except OutOfTime:
            self._pending.append((trace, candidate, key))
            self._checkpoint(force=True)
            raise
        finally:
            self._phase = previous
        if verdict.is_finding:
            self._record(trace, verdict, key)
            if candidate.kind is FindingKind.CRASH:
                await self._wait_for_server()
        else:
            self._rejected[key] = 0
        return verdict

    async def _confirm_pending(self) -> None:
        """Confirm the first candidate a deadline left over (a resumed campaign starts here)."""
        trace, candidate, key = self._pending.pop(0)
        if key in self._found:
            return
        await self._confirm_candidate(trace, candidate, key)
        self._checkpoint(force=True)

    async def _confirm(self, trace: Trace, candidate: oracle.Candidate) -> Verdict:
        self._confirmations += 1
        counting = _CountingTarget(self)
        return await confirm(counting, trace, candidate, self.calibration, rng=self.np_rng,
                             policy=self.settings.policy, sleep=self._idle_sleep)

    def _record(self, trace: Trace, verdict: Verdict, key: str) -> None:
        sig = verdict.signature or key
        finding_id, created = self.store.add_finding(
            kind=str(verdict.kind), signature=sig, trace=trace, verdict=verdict.to_dict(),
            slowdown=verdict.slowdown, reproduced=verdict.reproduction, campaign_id=self.campaign_id,
            target_id=self.target_id, details={"request_id": verdict.request_id, "pre_signature": key},
        )
        self._found.update({sig, key})
        if created:
            self._new_findings.append((finding_id, str(verdict.kind)))
            self._last_find = self._clock()
            self._on_finding(finding_id, verdict)


class _CountingTarget:
    """The campaign's target seen by the oracle: every confirmation run is stored too."""

    def __init__(self, campaign: "OracleSteps"):
        self._campaign = campaign
        self.name = campaign.target.name
        idle = getattr(campaign.target, "idle", None)
        if idle is not None:
            self.idle = idle

    async def execute(self, trace: Trace) -> ExecutionResult:
        self._campaign._check_time()
        return await self._campaign._execute(trace, "confirm")

    async def aclose(self) -> None:  # the campaign owns the real target
        return None


def candidate_to_dict(c: oracle.Candidate) -> dict:
    return {"kind": str(c.kind), "request_id": c.request_id, "metric": None if c.metric is None else str(c.metric),
            "ratio": c.ratio, "after_idle": c.after_idle, "detail": c.detail}


def candidate_from_dict(d: dict) -> oracle.Candidate:
    return oracle.Candidate(FindingKind(d["kind"]), d.get("request_id"), None if d.get("metric") is None else Metric(d["metric"]),
                            d.get("ratio"), bool(d.get("after_idle")), d.get("detail", ""))
