"""The campaign's confirmations: which candidates to confirm, confirming under the deadline, findings.

:class:`Confirmer` is the campaign's collaborator that talks to the oracle: of an
execution's candidates it takes the most promising one not already found or recently
rejected, confirms it, records confirmed findings, and when the deadline (or Ctrl-C) cuts a
confirmation short keeps the candidate as *pending* (checkpointed with the campaign) so that
the next run confirms it first. It runs confirmations on the target it is given; the campaign
gives it one whose every run is stored and counted as a campaign execution, and that raises
:class:`OutOfTime` once the deadline has passed.

Confirmation share. A server with bugs shows candidates in nearly every execution, and each
real one costs MIN_RUNS runs of its trace: on the held-out vLLM-like server with every bug on,
confirmations took 44% of a 30-minute campaign, 12 of its 21 findings one bug's. When the
campaign gives a ``due`` test (its confirmation share of the server time, see
:class:`fuzzer.search.pacing.ServerTime`), a latency candidate that would go over it *waits*
in a bounded queue, ranked by novelty (how many of its family's traits differ from those of the
nearest finding of its kind) and then by how far over its bound it was, and the best waiting one
is confirmed once the share allows (AFL's favoured queue, applied to confirmation). A candidate of
a kind with no finding yet (as confirmed) never waits: it may be the campaign's only sight of a
bug. A failure (error, hang, protocol) of a kind already found waits the same way: on a held-out
server whose planted bug hangs requests, each new trace it hung cost three runs of 73-100 s at once,
58% of a campaign went to confirming. Leaks and crashes (each execution meanwhile pays for them:
the leaked work, the restart) and cold probes are confirmed at once. Re-runs that end
early (with their request, or an option test's with the batch): :mod:`fuzzer.search.cuts`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Container, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuzzer.execution import ExecutionResult, Target
from fuzzer.oracle import judge
from fuzzer.oracle.ablation import carriers, confirm_option, option_size, others_end_s, suspects
from fuzzer.oracle.calibration import Calibration
from fuzzer.oracle.capcheck import cap_checked
from fuzzer.oracle.confirm import confirm
from fuzzer.oracle.judge import Candidate
from fuzzer.oracle.kinds import FindingKind, Metric
from fuzzer.oracle.policy import OraclePolicy
from fuzzer.oracle.signature import (
    LATENCY_KINDS,
    family,
    family_traits,
    leak_signature,
    leaving_clients,
    option_signature,
    signature,
    trait_vector,
)
from fuzzer.oracle.slo import Slo
from fuzzer.oracle.verdict import Verdict
from fuzzer.search.crashes import crash_needs
from fuzzer.search.cuts import confirmation_cut_s
from fuzzer.search.causes import without_options
from fuzzer.search.mutators import without_cancellations
from fuzzer.search.settings import Phase
from fuzzer.search.slo_check import confirm_slo, first_eligible, slo_candidates
from fuzzer.store import Store
from fuzzer.trace import Trace

# A candidate whose confirmation came back SAME is not confirmed again until it has been
# seen this many more times: noise must not eat the campaign's time.
RECONFIRM_AFTER = 5
# A candidate of a new signature whose family (fuzzer.oracle.signature.family) is a confirmed
# finding's is confirmed once in this many sightings (executions that show the family: one with ten
# stalled streams is one sighting, not ten), doubled for each finding the family
# already has: one bug met in many trace shapes cost a campaign on the held-out vLLM-like server
# 8 confirmations (26 of its 128 executions) with a fixed 5, and with every bug on one bug was
# confirmed under 26 signatures (47% of the campaign's time), while a second bug of the same
# family is still confirmed, later.
FAMILY_EVERY = 5
# A latency candidate of a trace that already has a finding of its kind is passed over:
# the other victims of one execution are the same report to a maintainer. A 3-minute campaign
# confirmed the simulator's logprobs batch cost twice on one trace, for two of the streams it
# delayed (3 runs of 8.5 s each, a sixth of the campaign).
#: Latency candidates waiting for the confirmation share, at most this many: the lowest-ranked is
#: dropped (it is seen again if its trace is fuzzed again, as AFL forgets non-favoured paths).
WAITING_MAX = 16
#: A re-run's length, for the closing share's estimate, where a waiting candidate's end is unknown (seconds).
WAITING_RUN_S = 10.0


@dataclass(frozen=True)
class Waiting:
    """A latency candidate waiting for the confirmation share, and how it was keyed when seen."""

    trace: Trace
    candidate: Candidate
    key: str
    family: str | None


class OutOfTime(Exception):
    """The deadline passed (or Ctrl-C) before a stability or confirmation run."""


class Confirmer:
    """Confirms a campaign's candidates and records its findings; owns what it has learnt.

    ``target`` runs the confirmations (see the module doc); ``rng`` draws the statistical
    tests' resamples; ``sleep`` idles for a cold arm; ``checkpoint`` saves the campaign (a
    pending candidate must survive the process); ``clock`` stamps the last find;
    ``in_phase`` shows the campaign confirming while it does; ``recover`` waits until a
    server a confirmed crash took down answers again; ``on_finding`` hears of every new
    finding. ``state`` is the campaign's checkpoint to take up (its ``rejected`` and
    ``pending``, as :meth:`to_state` writes them).
    """

    def __init__(
        self,
        target: Target,
        store: Store,
        policy: OraclePolicy,
        *,
        campaign_id: int,
        target_id: int | None,
        rng: np.random.Generator,
        sleep: Callable[[float], Awaitable[None]],
        checkpoint: Callable[[], None],
        clock: Callable[[], float],
        in_phase: Callable[[Phase], AbstractContextManager[None]],
        recover: Callable[[], Awaitable[None]],
        on_finding: Callable[[int, Verdict], None],
        state: Mapping[str, Any] | None = None,
        slo: Slo | None = None,
        futility: bool = True,
        kv_tokens: int | None = None,
        due: Callable[[], bool] | None = None,
        cap_probe: Callable[[Calibration, int], Awaitable[Calibration]] | None = None,
    ):
        self._target = target
        self._store = store
        self._policy = policy
        self._campaign_id = campaign_id
        self._target_id = target_id
        self._rng = rng
        self._sleep = sleep
        self._checkpoint = checkpoint
        self._clock = clock
        self._in_phase = in_phase
        self._recover = recover
        self._on_finding = on_finding
        #: The user's SLOs (``--goodput``): checked when no scheduler candidate is left (search/slo_check.py).
        self._slo = slo
        #: Sequential confirmation: one re-run first, stop when it does not recur (fuzzer.oracle.confirm).
        self._futility = futility
        #: The server's KV cache in tokens where it reports it (the campaign's Limits): a family trait.
        self._kv_tokens = kv_tokens
        #: Whether the confirmation share allows a confirmation now; None: always (no queue).
        self._due = due
        #: The calibration with the long-prefill cap probed at a prompt size (fuzzer.oracle.capcheck); None: never.
        self._cap_probe = cap_probe
        self._caps: dict[tuple[float, int], Calibration] = {}  # (calibration's date, prompt size) -> that
        state = state or {}
        found = store.list_findings()
        #: Signatures (and pre-signatures) already found: never confirmed again.
        self.found: set[str] = {f.signature for f in found}
        #: The families of the latency findings, and their back-off.
        self.families = Families(found, state.get("family_seen", {}))
        #: The kinds found (as confirmed: a candidate may be confirmed as another kind).
        self.found_kinds: set[str] = {f.kind for f in found}
        #: (trace hash, latency kind) of the findings: one finding per trace and kind.
        self.found_on: set[tuple[str, str]] = {(f.trace_hash, f.kind) for f in found if f.kind in LATENCY_KINDS}
        #: Kind -> the trait vectors of its findings' victims (fuzzer.oracle.signature.trait_vector).
        self.found_traits: dict[str, set[tuple[bool, ...]]] = {}
        for f in found:
            if (victim := f.details.get("request_id")) is not None:
                self._found_traits_of(f.kind, store.get_trace(f.trace_hash), victim, bool(f.details.get("held_choice")))
        #: Pre-signatures whose confirmation came back SAME -> times seen since.
        self.rejected: dict[str, int] = dict(state.get("rejected", {}))
        #: Candidates whose confirmation the deadline cut short: (trace, candidate, key).
        self.pending: list[tuple[Trace, Candidate, str]] = [
            (store.get_trace(p["trace_hash"]), candidate_from_dict(p), p["key"]) for p in state.get("pending", [])
        ]
        #: Sampling option -> (times tested against its ablation, the most requests beside it in a test).
        self.option_tests: dict[str, tuple[int, int]] = {
            k: (int(v[0]), int(v[1])) for k, v in state.get("option_tests", {}).items()}
        #: Latency candidates waiting for the confirmation share (unordered; ranked when one is taken).
        self.waiting: list[Waiting] = [
            Waiting(store.get_trace(w["trace_hash"]), candidate_from_dict(w), w["key"], w.get("family"))
            for w in state.get("waiting", [])
        ]
        #: Traits that confirmed crashes need (fuzzer.search.crashes): the campaign runs traces without them.
        self.crash_avoid: list[str] = list(state.get("crash_avoid", []))
        self.candidates = 0
        self.confirmations = 0
        #: Findings recorded by this run (id, kind).
        self.new_findings: list[tuple[int, str]] = []
        self.last_find: float | None = None

    async def examine(self, trace: Trace, result: ExecutionResult, calibration: Calibration, *,
                      cold: bool = False) -> Verdict | None:
        """Confirm the worst new candidate of an execution; record it when confirmed.

        ``cold``: the execution was a cold probe; its latency candidates are deduplicated as
        the cold-start they may be (a warm rejection of the same request does not count).
        """
        # A sampling option slowing everyone first: its victims' latencies are then its doing.
        if not cold and (due := self._option_due(trace, result)) is not None:
            tested = await self._confirm_option(option_candidate(trace, due[0], result), trace, due[1])
            if tested.is_finding:
                return tested
        # Latency candidates of a trace with a sampling option are confirmed without it (without_options).
        plain = without_options(trace)
        sighted: set[str] = set()  # a found family is sighted once per execution, however many victims show it
        # A candidate of a found kind that waits does not end the look: a kind never found may follow (heldout5,
        # every bug: a seed's known hang waited, and its itl-stall and ttft-outliers, never found, went unconfirmed).
        waited = False
        for candidate in judge.candidates(trace, result, calibration, self._policy):
            if (result.trace_hash, str(candidate.kind)) in self.found_on:
                continue  # another victim of a finding of this trace, warm or after idle (see WAITING_MAX)
            judged = plain if candidate.metric is not None else trace
            warm_key = signature(candidate.kind, judged, candidate.request_id)
            if cold and candidate.metric is not None and candidate.after_idle:
                key = signature(FindingKind.COLD_START, judged)
                if warm_key in self.found:
                    continue  # slow when warm too, and found so: a cold arm could not tell it apart
            else:
                key = warm_key
            if candidate.kind is FindingKind.LEAK and len(ways := leaving_clients(judged)) > 1:
                split = await self._split_leak(judged, candidate, calibration)
                if split is not None:
                    return split
                if any(leak_signature({w}) in self.found for w in ways):
                    continue  # no way leaks alone, and one of them is a known leak: that explains it
            if self._skip(key):
                continue
            fam = (family(candidate.kind, judged, candidate.request_id, self._kv_tokens, candidate.held_choice)
                   if key == warm_key else None)
            if fam is not None and self.families.pass_over(fam, sighted):
                continue
            if self._cap_probe is not None:
                calibration, stands = await cap_checked(self._cap_probe, self._caps, trace, result, candidate,
                                                        calibration, self._policy)
                if not stands:
                    continue  # overtaken by the engine's cap at its size, and not slow beyond that
            if judged is not trace:
                self._store.put_trace(judged)  # confirmed or waiting, it is named by its hash (pending, waiting)
            if self._due is None or cold or candidate.kind in AT_ONCE or self._new_kind(candidate):
                self.candidates += 1
                return await self._confirm_candidate(judged, candidate, key, calibration, fam)
            if waited:
                continue  # the execution's worst of a found kind waits; the others it shows are sighted only
            self.candidates += 1
            self._wait(Waiting(judged, candidate, key, fam))
            waited = True
            if self._due():
                return await self.confirm_waiting(calibration)
        if waited:
            return None
        if self._slo is not None and not self.pending:
            return await self._check_slo(trace, result)
        return None  # one confirmation per execution keeps the fuzzing going

    def _option_due(self, trace: Trace, result: ExecutionResult) -> tuple[str, int] | None:
        """A sampling option of ``trace`` to test against its ablation now (fuzzer.oracle.ablation), and the
        test's size (:func:`option_due`), when the confirmation share allows it."""
        if self._due is not None and not self._due():
            return None
        return option_due(trace, result, self.option_tests, self.found, self._policy)

    async def _confirm_option(self, candidate: Candidate, trace: Trace, size: int | None) -> Verdict:
        """Test the option of ``candidate`` (:func:`option_candidate`) of ``trace`` against the trace without
        it; record a finding. At the deadline (or Ctrl-C) the test is kept as pending; ``size`` (the test's,
        :func:`option_due`) None: such a pending test, already counted."""
        option = candidate.detail
        if size is not None:
            self.candidates += 1
            tests, largest = self.option_tests.get(option, (0, 0))
            self.option_tests[option] = (tests + 1, max(largest, size))
        with self._in_phase(Phase.CONFIRM):
            try:
                self.confirmations += 1
                verdict = await confirm_option(self._target, trace, option, policy=self._policy,
                                               futility=self._futility, cut_s=confirmation_cut_s(candidate))
            except OutOfTime:
                self.pending.append((trace, candidate, option_signature(option)))
                self._checkpoint()
                raise
        if verdict.is_finding:
            self._record(trace, verdict, option_signature(option))
        return verdict

    def _found_traits_of(self, kind: str, trace: Trace, victim: str, held_choice: bool) -> None:
        self.found_traits.setdefault(kind, set()).add(
            trait_vector(family_traits(trace, victim, self._kv_tokens, held_choice)))

    def _new_kind(self, candidate: Candidate) -> bool:
        """No finding of the candidate's kind yet: it may be the campaign's only sight of a bug."""
        return str(candidate.kind) not in self.found_kinds

    def _rank(self, w: Waiting) -> tuple[int, int, float]:
        """Lower is better: a kind not found first; then the candidate whose family's traits differ most
        from those of every finding of its kind (the number of traits that differ from the nearest: with
        one bug met in many trace shapes, every other candidate is a family not yet found, so a family's
        mere novelty ranks nothing); then how far over its bound it was seen."""
        c = w.candidate
        if self._new_kind(c):
            return 0, 0, -(c.ratio or 0.0)
        mine = trait_vector(family_traits(w.trace, c.request_id, self._kv_tokens, c.held_choice)) if c.request_id else ()
        found = self.found_traits.get(str(c.kind), set())
        distance = min((sum(a != b for a, b in zip(mine, f)) for f in found), default=len(mine))
        return 1, -distance, -(c.ratio or 0.0)

    def _wait(self, waiting: Waiting) -> None:
        """Queue a candidate for the confirmation share; beyond WAITING_MAX the lowest-ranked goes."""
        self.waiting = [w for w in self.waiting if w.key != waiting.key] + [waiting]
        if len(self.waiting) > WAITING_MAX:
            self.waiting.remove(max(self.waiting, key=self._rank))

    def waiting_cost_s(self) -> float:
        """About how long confirming every waiting candidate takes: MIN_RUNS re-runs for one of each family, one for
        the others (once its family is found a candidate costs at most one), each run to its cut (WAITING_RUN_S where
        its end is unknown). An upper bound: a candidate that does not recur stops at one."""
        families: set[str | None] = set()
        total = 0.0
        for w in self.waiting:
            runs = 1 if w.family in families else self._policy.min_runs
            total += runs * (confirmation_cut_s(w.candidate) or WAITING_RUN_S)
            families.add(w.family)
        return total

    def waiting_due(self) -> bool:
        """Whether a waiting candidate should be confirmed now (the share allows one)."""
        return bool(self.waiting) and self._due is not None and self._due()

    async def confirm_waiting(self, calibration: Calibration) -> Verdict | None:
        """Confirm the best-ranked waiting candidate not found meanwhile (None when none is left)."""
        self.waiting = [w for w in self.waiting if w.key not in self.found
                        and (w.trace.content_hash(), str(w.candidate.kind)) not in self.found_on]
        if not self.waiting:
            return None
        best = min(self.waiting, key=self._rank)
        self.waiting.remove(best)
        return await self._confirm_candidate(best.trace, best.candidate, best.key, calibration, best.family)

    async def _split_leak(self, trace: Trace, candidate: Candidate, calibration: Calibration) -> Verdict | None:
        """A leak of a trace whose clients leave in several ways, confirmed one way at a time: the
        trace with only that way's disconnects (the others served to what they read), for each way
        whose leak is not known. A way that does not leak costs one run (futility). Returns the
        first finding, or None when no way leaks alone (the mix is confirmed as it is, if new)."""
        ways = leaving_clients(trace)
        for way in sorted(ways):
            key = leak_signature({way})
            if self._skip(key):
                continue
            self.candidates += 1
            verdict = await self._confirm_candidate(without_cancellations(trace, ways - {way}), candidate, key,
                                                    calibration)
            if verdict.is_finding:
                return verdict
        return None

    def _skip(self, key: str) -> bool:
        """Found already, or rejected and not yet seen RECONFIRM_AFTER times since (counted here)."""
        return key in self.found or recently_rejected(self.rejected, key)

    async def _check_slo(self, trace: Trace, result: ExecutionResult) -> Verdict | None:
        """Confirm the request furthest over the SLO (bounded re-runs); an OutOfTime drops it (no pending)."""
        assert self._slo is not None
        chosen = first_eligible(slo_candidates(trace, result, self._slo), self._skip)
        if chosen is None:
            return None
        request_id, key = chosen
        self.candidates += 1
        with self._in_phase(Phase.CONFIRM):
            self.confirmations += 1
            verdict = await confirm_slo(self._target, trace, request_id, self._slo)
        if verdict is not None and verdict.is_finding:
            self._record(trace, verdict, key)
        else:
            self.rejected[key] = 0
        return verdict

    async def confirm_pending(self, calibration: Calibration) -> Verdict | None:
        """Confirm the first candidate a deadline left over (a resumed campaign starts here)."""
        trace, candidate, key = self.pending.pop(0)
        if key in self.found:
            return None
        if candidate.kind is FindingKind.OPTION_SLOWDOWN:
            verdict = await self._confirm_option(candidate, trace, None)
            self._checkpoint()
            return verdict
        verdict = await self._confirm_candidate(trace, candidate, key, calibration)
        self._checkpoint()
        return verdict

    def to_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the confirmations (the campaign's ``rejected`` and ``pending``)."""
        return {
            "rejected": self.rejected,
            "family_seen": self.families.seen,
            "option_tests": {k: list(v) for k, v in self.option_tests.items()},
            "crash_avoid": list(self.crash_avoid),
            "pending": [{**candidate_to_dict(c), "trace_hash": t.content_hash(), "key": k} for t, c, k in self.pending],
            "waiting": [{**candidate_to_dict(w.candidate), "trace_hash": w.trace.content_hash(), "key": w.key,
                         "family": w.family} for w in self.waiting],
        }

    async def _confirm_candidate(self, trace: Trace, candidate: Candidate, key: str,
                                 calibration: Calibration, fam: str | None = None) -> Verdict:
        """Confirm; at the deadline (or Ctrl-C) save the candidate as pending and stop the run."""
        with self._in_phase(Phase.CONFIRM):
            try:
                self.confirmations += 1
                verdict = await confirm(self._target, trace, candidate, calibration, rng=self._rng,
                                        policy=self._policy, sleep=self._sleep, futility=self._futility,
                                        cut_s=confirmation_cut_s(candidate))
            except OutOfTime:
                self.pending.append((trace, candidate, key))
                self._checkpoint()
                raise
        if verdict.is_finding:
            finding_id = self._record(trace, verdict, key, fam, candidate.held_choice and verdict.kind is candidate.kind)
            if candidate.kind is FindingKind.CRASH:
                await self._recover()
                await self._avoid_crash(trace, finding_id)
        else:
            self.rejected[key] = 0
        return verdict

    async def _avoid_crash(self, trace: Trace, finding_id: int) -> None:
        """Learn what the confirmed crash of ``trace`` needs (fuzzer.search.crashes), so that the campaign's
        later traces go without it; the finding's details say it (``crash_needs``)."""
        async def crashes(t: Trace) -> bool:
            down = judge.crashed(await self._target.execute(t))
            if down:
                await self._recover()
            return down

        restarts_left = getattr(self._target, "restarts_left", lambda: None)
        with self._in_phase(Phase.CONFIRM):
            needs = await crash_needs(trace, crashes, restarts_left)
        self.crash_avoid += [t for t in needs if t not in self.crash_avoid]
        self._store.update_finding_details(finding_id, {"crash_needs": list(needs)})
        self._checkpoint()

    def _record(self, trace: Trace, verdict: Verdict, key: str, fam: str | None = None, held_choice: bool = False) -> int:
        sig = verdict.signature or key
        details: dict[str, Any] = {"request_id": verdict.request_id, "pre_signature": key}
        if held_choice:
            details["held_choice"] = True
        if verdict.kind is not None and verdict.request_id is not None:
            # The family of what was confirmed (a candidate's kind may have become another, say cold-start).
            fam = family(verdict.kind, trace, verdict.request_id, self._kv_tokens, held_choice)
        if fam is not None:
            details["family"] = fam
            self.families.record(fam)
        if verdict.kind is not None:
            self.found_kinds.add(str(verdict.kind))
            if verdict.kind in LATENCY_KINDS:
                self.found_on.add((trace.content_hash(), str(verdict.kind)))
            if verdict.request_id is not None:
                self._found_traits_of(str(verdict.kind), trace, verdict.request_id, held_choice)
        finding_id, created = self._store.add_finding(
            kind=str(verdict.kind), signature=sig, trace=trace, verdict=verdict.to_dict(),
            slowdown=verdict.slowdown, reproduced=verdict.reproduction, campaign_id=self._campaign_id,
            target_id=self._target_id, details=details,
        )
        self.found.update({sig, key})
        if created:
            self.new_findings.append((finding_id, str(verdict.kind)))
            self.last_find = self._clock()
            self._on_finding(finding_id, verdict)
        return finding_id


#: Candidates of these kinds are confirmed at once, found or not (see the module doc; option tests and
#: SLO checks take their own paths).
AT_ONCE = frozenset({FindingKind.LEAK, FindingKind.CRASH})


class Families:
    """The back-off of found families (a campaign's and a fleet's): a new signature of a family with
    findings is confirmed once in family_gap sightings, an execution that shows the family being one
    sighting however many of its requests show it.

    ``found``: the stored findings (their ``family`` detail counts); ``seen``: a checkpoint's sightings
    of each family since its last confirmation.
    """

    def __init__(self, found: Iterable[Any] = (), seen: Mapping[str, int] | None = None):
        #: Family -> its findings.
        self.counts: dict[str, int] = {}
        for f in found:
            if fam := f.details.get("family"):
                self.counts[fam] = self.counts.get(fam, 0) + 1
        #: Family -> sightings of new signatures of it since its last confirmation.
        self.seen: dict[str, int] = dict(seen or {})

    def pass_over(self, fam: str, sighted: set[str]) -> bool:
        """Whether to pass over a new signature of ``fam``: all but one in family_gap sightings
        (``sighted`` holds the families this execution has shown already)."""
        if fam not in self.counts:
            return False
        if fam in sighted:
            return True
        sighted.add(fam)
        seen = self.seen.get(fam, 0) + 1
        if seen >= family_gap(self.counts[fam]):
            self.seen[fam] = 0
            return False
        self.seen[fam] = seen
        return True

    def record(self, fam: str) -> None:
        self.counts[fam] = self.counts.get(fam, 0) + 1


def family_gap(findings: int) -> int:
    """Sightings of new signatures of a family with ``findings`` findings per one confirmed:
    FAMILY_EVERY, doubled per finding after the first (a bug nearly every trace shows costs a
    confirmation now and then, not one in five executions)."""
    return FAMILY_EVERY << max(0, min(findings, 16) - 1)


def recently_rejected(rejected: dict[str, int], key: str) -> bool:
    """Whether ``key``'s confirmation came back SAME fewer than RECONFIRM_AFTER sightings ago
    (this sighting is counted in ``rejected``)."""
    seen = rejected.get(key)
    if seen is not None and seen < RECONFIRM_AFTER:
        rejected[key] = seen + 1
        return True
    return False


def option_due(trace: Trace, result: ExecutionResult, tests: Mapping[str, tuple[int, int]],
               found: Container[str], policy: OraclePolicy) -> tuple[str, int] | None:
    """Of the options of ``trace`` that ``result`` makes suspect (fuzzer.oracle.ablation.suspects), the first to
    test now, and the test's size (fuzzer.oracle.ablation.option_size): it has no finding in ``found``, was tested
    (``tests``: option -> (tests, the largest size tested)) fewer than ``option_tests`` times and only on tests
    ``option_growth`` times smaller. A campaign's and a fleet's."""
    for option, overlap in suspects(trace, result, policy).items():
        count, largest = tests.get(option, (0, 0))
        size = option_size(trace, option, overlap)
        if (option_signature(option) not in found and count < policy.option_tests
                and size >= policy.option_growth * largest):
            return option, size
    return None


def option_candidate(trace: Trace, option: str, result: ExecutionResult | None = None) -> Candidate:
    """The test of ``option`` of ``trace`` as a candidate (a pending one, a fleet's task): of kind
    option-slowdown, naming the first request that carries it, the option its detail. ``result``: the
    execution that made it due; when its carriers outlasted the other requests, the test's runs close
    when those would have ended (``until_s``: when they did there; see :func:`confirmation_cut_s`)."""
    until_s = None if result is None else others_end_s(trace, result, option)
    return Candidate(FindingKind.OPTION_SLOWDOWN, carriers(trace, option)[0], detail=option, until_s=until_s)


def candidate_to_dict(c: Candidate) -> dict:
    return {"kind": str(c.kind), "request_id": c.request_id, "metric": None if c.metric is None else str(c.metric),
            "ratio": c.ratio, "after_idle": c.after_idle, "detail": c.detail, "until_s": c.until_s,
            "held_choice": c.held_choice}


def candidate_from_dict(d: Mapping[str, Any]) -> Candidate:
    return Candidate(FindingKind(d["kind"]), d.get("request_id"), None if d.get("metric") is None else Metric(d["metric"]),
                     d.get("ratio"), bool(d.get("after_idle")), d.get("detail", ""), d.get("until_s"),
                     bool(d.get("held_choice")))
