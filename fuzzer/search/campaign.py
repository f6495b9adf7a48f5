"""The fuzzing campaign: the main job (ARCHITECTURE.md, "Search" / "Oracle" / "Store and CLI").

A run goes through named phases and ends through an :class:`ExitReason`, the way
Hypothesis' engine does:

    calibrate -> seed (the corpus/ traces) -> fuzz (pick, mutate, execute, keep)
                 -> confirm candidates with the oracle -> record findings

Time (fuzzer.search.pacing): a new corpus entry (seed or child) is kept on its first run and re-run
for stability only when it is first picked to be fuzzed (most never are); seeds run cheapest first,
and once the corpus has an entry, seeding takes at most a share of the server time and goes on
between fuzz iterations. Now and then a fuzz iteration is a *cold probe*: the server is left idle
long enough to go cold before a corpus trace runs, so that cold-start slowdowns can be found at
all. ``--duration`` holds during stability runs and confirmations too: a confirmation cut short by
the deadline (or Ctrl-C) is saved as pending and done first on resume; in its closing share the
candidates that waited for the confirmation share are confirmed (``Settings.closing_share``).
Choosing, confirming and recording candidates is the campaign's
:class:`~fuzzer.search.confirming.Confirmer`'s; calibrating (at the start, and again as
the calibration ages) follows :func:`fuzzer.oracle.calibrate.reuse_or_calibrate`.

Every execution is written to the store before the next one starts, and the
campaign checkpoints its state (RNG, corpus, counters) so that running it again
on the same database resumes where it stopped. The campaign never prints: it
hands :class:`Stats` snapshots and events to callbacks, and the CLI renders them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import replace

import numpy as np

from fuzzer.errors import FuzzError, TargetError
from fuzzer.execute import clientlag
from fuzzer.execute.managed import CrashLoop
from fuzzer.execute.recovery import HEALTH_PROBE, backoff
from fuzzer.execution import ExecutionResult, Outcome, Target
from fuzzer.oracle.calibrate import reuse_or_calibrate, with_target_kv
from fuzzer.oracle.calibration import Calibration
from fuzzer.oracle.capcheck import probe_cap
from fuzzer.oracle.confirm import let_idle
from fuzzer.oracle.kinds import FindingKind
from fuzzer.oracle.slo import Slo
from fuzzer.oracle.verdict import Verdict
from fuzzer.search.causes import without_found_causes
from fuzzer.search.confirming import Confirmer, OutOfTime
from fuzzer.search.cuts import ConfirmationTarget
from fuzzer.search.corpus import Corpus, Entry
from fuzzer.search.crashes import avoiding
from fuzzer.search.coverage import Coverage, calibrated
from fuzzer.search.mutators import Child, Mutator, NullMutator, OperatorStats
from fuzzer.search.pacing import (
    AFFORD_TRIES,
    ColdProbes,
    ScheduleEnds,
    ServerTime,
    Stopped,
    TimeSpent,
    closing,
    cheap_s,
    earliest_cut_s,
    execution_budget_s,
    execution_cut_s,
    token_work,
    unless_stopped,
)
from fuzzer.search.settings import ExitReason, Phase, Settings, Stats, Summary, listed_state, stop_reason, tupled_state
from fuzzer.store import Store
from fuzzer.trace import Trace

#: Checkpoint at least every this many executions even when nothing changed (a resume repeats little).
CHECKPOINT_EVERY = 10
#: A failed periodic recalibration (a flaky server failed a probe) keeps the old one, tried again this much later.
RECALIBRATE_RETRY_S = 600.0
#: Children made from one parent before the next is picked.
CHILDREN_PER_PICK = 4


class Campaign:
    """One campaign on one target, stored in one database.

    ``clock`` measures durations (``--duration``, execs/min, idle time; a simulator's virtual
    clock in tests); ``wall_clock`` dates calibrations, whose age decides when they are
    measured again. ``calibration``: the target's stored calibration, if the caller has
    read one (else the campaign reads its own under ``calibration_key``); a stale one is
    measured again before the first execution.
    """

    def __init__(
        self,
        target: Target,
        store: Store,
        settings: Settings,
        *,
        seeds: Sequence[Trace] = (),
        target_key: str | None = None,
        calibration_key: str | None = None,
        target_id: int | None = None,
        calibration: Calibration | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_stats: Callable[[Stats], None] | None = None,
        on_finding: Callable[[int, Verdict], None] | None = None,
        stop: asyncio.Event | None = None,
    ):
        self.target = target
        self.store = store
        self.settings = settings
        # Cheapest seeds first (AFL favours fast inputs): a short campaign gets through more of them.
        self.seeds = sorted(seeds, key=token_work)
        self.target_key = target_key or target.name
        #: Where calibrations are stored and read (one key for every command); the target's name by default.
        self.calibration_key = calibration_key or self.target_key
        self.target_id = target_id
        self.calibration = calibration
        self._clock = clock
        self._wall_clock = wall_clock
        self._sleep = sleep
        self._on_stats = on_stats or (lambda s: None)
        self._on_finding = on_finding or (lambda i, v: None)
        self._stop = stop or asyncio.Event()
        self._phase = Phase.CALIBRATE
        self._server = "up"
        self.corpus = Corpus()
        self._dirty: set[int] = set()
        self._new_features: dict[str, int] = {}
        self._since_checkpoint = 0
        self._seeded = 0
        self._last_server_error: str | None = None
        self._down_since: float | None = None  # when the server was found down; None: up
        self._recalibrate_at: float | None = None
        self.probes = ColdProbes()
        self.server_time = ServerTime()
        self.time_spent = TimeSpent()
        #: Mutants passed over for the execution budget, and mutants run over it when no try fitted (AFFORD_TRIES).
        self.too_long = self.over_budget = 0
        self._ends = ScheduleEnds()  # expected_duration_s of each trace, under the calibration of the moment
        self._ran_s: dict[str, float] = {}  # trace hash -> its longest execution in this run of the campaign
        #: Trace hash of an unsettled corpus entry -> the coverage of its whole confirmation runs: its stability re-runs.
        self._confirmed_runs: dict[str, list[Coverage]] = {}
        #: Executions whose client stalled past clientlag.STARVED_S, and the worst stall seen.
        self.client_stalls = 0
        self.worst_client_stall_s = 0.0

    # --- setup and resume ---------------------------------------------------------------

    def _open(self) -> bool:
        """Start a new campaign in the store or take up the last one. Returns True when resuming."""
        latest = self.store.latest_campaign()
        resumed = latest is not None
        if latest is None:
            self.campaign_id = self.store.start_campaign(
                seed=self.settings.seed, target=self.target_key, settings=self.settings.to_dict()
            )
            self.rng = random.Random(self.settings.seed)
            op_stats = OperatorStats()
            state = {}
        else:
            self.campaign_id = latest["id"]
            state = latest["state"]
            self.rng = random.Random(latest["seed"])
            if "rng" in state:
                self.rng.setstate(tupled_state(state["rng"]))
            rows = self.store.corpus_rows(self.campaign_id)
            traces = {row["trace_hash"]: self.store.get_trace(row["trace_hash"]) for row in rows}
            self.corpus = Corpus.from_dict({**state.get("corpus", {}), "entries": rows}, traces)
            op_stats = OperatorStats.from_dict(state.get("operators", {}))
            self._seeded = int(state.get("seeded", 0))
            self.probes = ColdProbes.from_dict(state.get("cold_probes"))
            self.server_time = ServerTime.from_dict(state.get("server_time"))
            self.time_spent = TimeSpent.from_dict(state.get("time_spent"))
        self.confirmer = Confirmer(
            ConfirmationTarget(self.target, self._confirmation_run), self.store, self.settings.policy,
            campaign_id=self.campaign_id, target_id=self.target_id,
            rng=np.random.default_rng(self.rng.getrandbits(64)), sleep=self._idle_sleep,
            checkpoint=lambda: self._checkpoint(force=True), clock=self._clock, in_phase=self._in_phase,
            recover=self._wait_for_server, on_finding=self._on_finding, state=state,
            slo=Slo(**{f"{k}_ms": v for k, v in self.settings.slo_ms.items()}) if self.settings.slo_ms else None,
            futility=self.settings.futility, kv_tokens=self.settings.limits.kv_tokens, cap_probe=self._probe_cap,
            due=lambda: (self.server_time.confirm_due(self.settings.confirm_share)
                         or closing(self._clock() - self._started, self.settings.duration_s, self.settings.closing_share,
                                    self.confirmer.waiting_cost_s())),
        )
        if self.settings.mutator == "null":
            self.mutator = NullMutator(self.settings.limits)
        else:
            self.mutator = Mutator(self.settings.limits, op_stats)
        self._started = self._clock()
        self._executions_at_start = self.store.count_executions(campaign_id=self.campaign_id)
        return resumed

    # --- the loop ---------------------------------------------------------------------

    async def run(self) -> Summary:
        resumed = self._open()
        reason = ExitReason.INTERRUPTED
        try:
            await self._ensure_calibration()
            while (reason := self._should_stop()) is None:
                if self.confirmer.pending or self.confirmer.waiting_due():
                    assert self.calibration is not None
                    confirm = self.confirmer.confirm_pending if self.confirmer.pending else self.confirmer.confirm_waiting
                    await confirm(self.calibration)
                elif self._seeded < len(self.seeds) and self.server_time.seed_due(len(self.corpus), self.settings.seed_share):
                    self._phase = Phase.SEED
                    await self._seed(self.seeds[self._seeded])
                else:
                    self._phase = Phase.FUZZ
                    if self._cold_probe_due():
                        await self._cold_probe()
                    else:
                        await self._fuzz_one()
                if not self._out_of_time() and self._recalibration_due():
                    await self._ensure_calibration()
        except asyncio.CancelledError:
            reason = ExitReason.INTERRUPTED
        except (Stopped, OutOfTime):
            reason = self._should_stop()
        finally:
            self._phase = Phase.DONE
            self._checkpoint(status="stopped", force=True)
        stats = self.stats()
        self._on_stats(stats)
        return Summary(self.campaign_id, reason or ExitReason.INTERRUPTED, stats, tuple(self.confirmer.new_findings),
                       resumed, (self._last_server_error or "no answer") if self._server == "down" else None)

    def _should_stop(self) -> ExitReason | None:
        down_s = None if self._down_since is None else self._clock() - self._down_since
        return stop_reason(self.settings, stopped=self._stop.is_set(), executions=self.executions,
                           elapsed_s=self._clock() - self._started, down_s=down_s)

    @property
    def executions(self) -> int:
        return self.store.count_executions(campaign_id=self.campaign_id)

    async def _ensure_calibration(self) -> None:
        """The calibration to judge by: the current (or stored) one while fresh, else measured again.

        Without a calibration to fall back on, a failed measurement raises TargetError (the
        CLI says why in one line); a failed refresh keeps the previous calibration.
        """
        current = self.calibration
        if current is None:
            stored = self.store.latest_calibration(self.calibration_key)
            current = None if stored is None else Calibration.from_dict(stored)
        previous = self._phase
        measured_from: list[float] = []

        def measuring(stale: Calibration | None) -> None:
            measured_from.append(self._clock())
            self._phase = Phase.CALIBRATE
            self._emit()

        try:
            self.calibration = await unless_stopped(reuse_or_calibrate(
                self.target, current, rng=lambda: random.Random(self.rng.getrandbits(64)),
                save=lambda fresh: self.store.save_calibration(self.calibration_key, fresh.to_dict()),
                clock=self._wall_clock, max_age_s=self.settings.recalibrate_after_s,
                on_measure=measuring, on_refresh_failed=self._refresh_failed,
            ), self._stop, tick=self._emit)
        finally:
            self._phase = previous
            if measured_from:
                self.time_spent.add("calibrate", self._clock() - measured_from[0])

    async def _probe_cap(self, calibration: Calibration, tokens: int) -> Calibration:
        """The cap probed at ``tokens`` prompt tokens (fuzzer.oracle.capcheck), timed as calibration; a cap found is kept."""
        self._check_time()
        with self.time_spent.timing("calibrate", self._clock), self._in_phase(Phase.CALIBRATE):
            probed = await unless_stopped(probe_cap(self.target, calibration, tokens), self._stop, tick=self._emit)
        if probed.assumption.long_prefill_threshold and calibration is self.calibration:
            self.calibration = probed
            self.store.save_calibration(self.calibration_key, probed.to_dict())
        return probed

    def _refresh_failed(self, error: TargetError) -> None:
        self._last_server_error = f"recalibration failed, the previous calibration stays: {error}"
        self._recalibrate_at = self._clock() + RECALIBRATE_RETRY_S

    def _recalibration_due(self) -> bool:
        if self.calibration is None:
            return False
        if self._recalibrate_at is not None and self._clock() < self._recalibrate_at:
            return False
        return self.calibration.is_stale(self._wall_clock(), max_age_s=self.settings.recalibrate_after_s)

    # --- executing ---------------------------------------------------------------------

    async def _execute(self, trace: Trace, purpose: str, *, idled_s: float = 0.0,
                       cut_s: float | None = None) -> ExecutionResult:
        start, recovering = self._clock(), self.time_spent.seconds.get("recover", 0.0)
        result = await self._execute_when_up(trace, cut_s)
        # Waits for a server that went down are the recovery's, not this execution's.
        self.time_spent.add(purpose, self._clock() - start - (self.time_spent.seconds.get("recover", 0.0) - recovering))
        if idled_s and (result.idle_before_s or 0.0) < idled_s:
            # We left the server idle this long on purpose; an HTTP idle barrier only sees its own polls.
            result = replace(result, idle_before_s=idled_s)
        self.server_time.record(purpose, result.duration_s)
        if purpose == "confirm" and self.corpus.unsettled(result.trace_hash) and not any(
                r.outcome is Outcome.CUT for r in result.requests):
            self._confirmed_runs.setdefault(result.trace_hash, []).append(self._coverage(trace, result))
        self._ran_s[result.trace_hash] = max(self._ran_s.get(result.trace_hash, 0.0), result.duration_s)
        if (result.client_lag_s or 0.0) > clientlag.STARVED_S:
            self.client_stalls += 1
            self.worst_client_stall_s = max(self.worst_client_stall_s, result.client_lag_s or 0.0)
        if self.calibration is not None and self.calibration.assumption.kv_blocks is None:
            # A server may report its KV capacity only once its engine is up (vLLM's cache_config_info).
            self.calibration = with_target_kv(self.calibration, self.target)
        number = self.executions + 1
        self.store.record_execution(
            result, trace, target_id=self.target_id, campaign_id=self.campaign_id, purpose=purpose, number=number
        )
        self._since_checkpoint += 1
        self._checkpoint()
        self._emit()
        return result

    async def _execute_when_up(self, trace: Trace, cut_s: float | None = None) -> ExecutionResult:
        """Run ``trace``; when the target cannot even be asked (down, refusing), wait for it and retry.

        A request that fails is data (the executor returns it); a server that cannot be reached
        before the trace starts (its /tokenize or /metrics refused) raises TargetError. Nothing
        was measured then, so nothing is recorded: the campaign waits with backoff and runs the
        trace again once the server answers.
        """
        while True:
            try:
                return await self.target.execute(trace, cut_s=earliest_cut_s(self.execution_cut_s(trace), cut_s))
            except TargetError as e:
                self._last_server_error = str(e)
                await self._wait_for_server()
                # Down too long, or the deadline came while waiting: a confirmation keeps its candidate pending.
                if self._should_stop() is not None:
                    raise (OutOfTime if self._out_of_time() else Stopped) from None

    async def _confirmation_run(self, trace: Trace, cut_s: float | None = None) -> ExecutionResult:
        """One run of a confirmation: refused past the deadline, else stored as a campaign execution."""
        self._check_time()
        return await self._execute(trace, "confirm", cut_s=cut_s)

    async def _examine(self, trace: Trace, result: ExecutionResult, *, cold: bool = False) -> Verdict | None:
        assert self.calibration is not None
        return await self.confirmer.examine(trace, result, self.calibration, cold=cold)

    def _coverage(self, trace: Trace, result: ExecutionResult) -> Coverage:
        assert self.calibration is not None
        return calibrated(trace, result, self.calibration)

    async def _seed(self, trace: Trace) -> None:
        """Run a seed once and keep it provisionally (its stability runs come when it is first fuzzed)."""
        trace = self._avoiding(trace)
        result = await self._execute(trace, "seed")
        self._keep(trace, [result], parent=None, operators=("seed",), force=True)
        self._seeded += 1
        await self._examine(trace, result)

    async def _fuzz_one(self) -> None:
        if not self.corpus.entries:
            child = Child(NullMutator(self.settings.limits).mutate(Trace(requests=()), self.rng).trace, ("generate",))
            await self._try(child, None)
            return
        parent = self.corpus.choose(self.rng, cost=self._entry_cost, cheap_s=cheap_s(self.settings.duration_s))
        if self.settings.mutator != "null" and parent.id in self.corpus.provisional:
            await self._settle(parent)
        self._dirty.add(parent.id)
        # Several children per pick (AFL's stages): a fresh parent's stability runs are paid once.
        for _ in range(CHILDREN_PER_PICK):  # each only while time is left (the stability runs may have used it up)
            if self._should_stop() is not None:
                return
            other = self.corpus.choose(self.rng).trace if len(self.corpus) > 1 else None
            await self._try(self._affordable_child(parent.trace, other), parent)

    def _affordable_child(self, parent: Trace, other: Trace | None) -> Child:
        """A mutant of ``parent`` within the execution budget: up to AFFORD_TRIES mutants are
        made until one fits; when none does, the shortest of them (the search never stalls)."""
        budget = self.execution_budget_s()
        if budget is None:  # no --duration: no paper schedule of every mutant to compute
            return self.mutator.mutate(parent, self.rng, other)
        tried: list[tuple[float, Child]] = []
        for _ in range(AFFORD_TRIES):
            child = self.mutator.mutate(parent, self.rng, other)
            cost = self.expected_duration_s(child.trace, beyond=budget)
            if cost is None or cost <= budget:  # None: well within it
                return child
            self.too_long += 1
            tried.append((cost, child))
        self.over_budget += 1
        return min(tried, key=lambda t: t[0])[1]

    def _avoiding(self, trace: Trace) -> Trace:
        """``trace`` without what a confirmed crash needs (fuzzer.search.crashes): it would only crash again."""
        return avoiding(trace, self.confirmer.crash_avoid)

    def execution_budget_s(self) -> float | None:
        """The longest an execution should keep the server busy, by the FCFS bound; None: no limit."""
        return execution_budget_s(self.settings.duration_s)

    def execution_cut_s(self, trace: Trace) -> float | None:
        """The time cap of one execution of ``trace`` (fuzzer.search.pacing.execution_cut_s); None: no --duration."""
        if self.settings.duration_s is None:  # no cap: no paper schedule to compute
            return None
        return execution_cut_s(self.settings.duration_s, self._clock() - self._started,
                               self.expected_duration_s(trace, beyond=self.execution_budget_s()), self.settings.policy.factor)

    def _entry_cost(self, entry: Entry) -> float:
        """An entry's server time: the longer of its bound and its longest run (the bound does not know a
        pathology: a seed bounded at 0.4 s ran 8.5 s on the planted logprobs cost); 0 without --duration."""
        if not self.settings.duration_s:
            return 0.0
        return max(self.expected_duration_s(entry.trace, entry.hash) or 0.0, self._ran_s.get(entry.hash, 0.0))

    def expected_duration_s(self, trace: Trace, digest: str | None = None, *, beyond: float | None = None) -> float | None:
        """When ``trace`` (hash ``digest``) would end by its FCFS bounds (None before calibration, or well within
        ``beyond``: fuzzer.search.pacing.ScheduleEnds), kept per calibration."""
        return self._ends.end_s(trace, self.calibration, digest, beyond=beyond)

    async def _try(self, child: Child, parent: Entry | None) -> None:
        """Execute one child, keep it when it reaches something new, examine it."""
        child = replace(child, trace=self._avoiding(without_found_causes(child.trace, self.confirmer.found)))
        first = await self._execute(child.trace, "fuzz")
        kept = False
        # The null mutator never reads the corpus: re-running its children for stability would
        # only make the baseline of the fuzzing benchmark pay for guidance it does not get.
        if self.settings.mutator != "null" and self.corpus.is_interesting(self._coverage(child.trace, first)):
            kept = self._keep(child.trace, [first], parent=parent.id if parent else None, operators=child.operators)
        self.mutator.feedback(child, kept)
        await self._examine(child.trace, first)

    async def _settle(self, entry: Entry) -> None:
        """Re-run a provisional entry before it is first fuzzed, so its flickering features drop out.

        Up to ``stability_runs`` runs in all, and only while they disagree (AFL extends calibration for
        variable inputs; runs that agree are stable enough)."""
        runs: list[Coverage] = []
        features = entry.features
        # Not run again: an entry that carries what a confirmed crash needs (it would crash), a found option or
        # leak (each run would take the slowdown's time again; its children go without it).
        again = self._avoiding(entry.trace) == entry.trace == without_found_causes(entry.trace, self.confirmer.found)
        reruns = self.settings.stability_runs - 1 if again else 0
        spare = self._confirmed_runs.pop(entry.hash, [])
        while len(runs) < reruns:
            if spare:
                runs.append(spare.pop(0))
            else:
                self._check_time()
                runs.append(self._coverage(entry.trace, await self._execute(entry.trace, "stability")))
            if runs[-1].features == features:
                break
            features &= runs[-1].features
        self.corpus.settle(entry.id, runs)
        self._dirty.add(entry.id)

    # --- cold probes (fuzzer.search.pacing) -----------------------------------------------------------

    def _idle_cost_s(self) -> float:
        """Wall seconds one idle period costs: none when the target keeps a virtual clock."""
        return 0.0 if getattr(self.target, "idle", None) is not None else self.settings.policy.cold_idle_s

    def _cold_probe_due(self) -> bool:
        if not self.corpus.entries or self.settings.idle_share <= 0:
            return False
        return self.probes.due(self.rng, self._idle_cost_s(), elapsed_s=self._clock() - self._started,
                               horizon_s=self.settings.duration_s, share=self.settings.idle_share,
                               confirm_idles=self.settings.policy.min_runs)

    async def _cold_probe(self) -> None:
        """Leave the server idle until it may be cold, run a corpus trace, and examine that run."""
        entries = [self.corpus.entries[i] for i in sorted(self.corpus.entries)]
        # Any trace shows a cold start in its first requests: cheap ones are preferred (with --duration).
        entry = self.rng.choices(entries, weights=[1.0 / (1.0 + self._entry_cost(e)) for e in entries])[0]
        idle_s = self.settings.policy.cold_idle_s
        with self._in_phase(Phase.IDLE):
            await let_idle(self.target, idle_s, self._idle_sleep)
        trace = self._avoiding(entry.trace)
        result = await self._execute(trace, "cold-probe", idled_s=idle_s)
        before = self.confirmer.candidates
        verdict = await self._examine(trace, result, cold=True)
        found = verdict is not None and verdict.is_finding and verdict.kind is FindingKind.COLD_START
        self.probes.record(candidate=self.confirmer.candidates > before, cold_start_found=found)
        self._checkpoint(force=True)

    async def _idle_sleep(self, seconds: float) -> None:
        """Sleep on purpose (a probe, a confirmation's cold arm), counting the wall time it takes."""
        start = self._clock()
        try:
            await self._sleep(seconds)
        finally:
            self.probes.idle_spent_s += max(0.0, self._clock() - start)
            self.time_spent.add("idle", self._clock() - start)

    def _keep(self, trace: Trace, runs: list[ExecutionResult], *, parent: int | None,
              operators: tuple[str, ...], force: bool = False) -> bool:
        """Keep ``trace`` provisionally on its first run (:meth:`_settle` re-runs it when first fuzzed)."""
        coverages = [self._coverage(trace, r) for r in runs]
        entry = self.corpus.add(trace, coverages, parent=parent, operators=operators, found_at_exec=self.executions,
                                provisional=True)
        if entry is None and force and not self.corpus.contains(trace):
            # Seeds are kept even when they add nothing new (AFL keeps every input of -i).
            entry = self.corpus.add_forced(trace, coverages, operators=operators, found_at_exec=self.executions,
                                           provisional=True)
        if entry is None:
            return False
        self._dirty.add(entry.id)
        if parent is not None:
            self._dirty.add(parent)
        for f in entry.features:
            self._new_features.setdefault(f, entry.id)
        self._checkpoint(force=True)
        return True

    def _out_of_time(self) -> bool:
        """Past ``--duration``, or asked to stop (a cap on executions lets a confirmation finish)."""
        return self._should_stop() in (ExitReason.DURATION, ExitReason.INTERRUPTED, ExitReason.SERVER_DOWN)

    def _check_time(self) -> None:
        if self._out_of_time():
            raise OutOfTime

    async def _wait_for_server(self) -> None:
        """After a crash: wait with backoff until a one-token request is answered, or the campaign stops."""
        previous, start = self._phase, self._clock()
        self._phase, self._server = Phase.RECOVER, "down"
        self._down_since = start if self._down_since is None else self._down_since
        self._emit()
        waits = backoff()
        while self._should_stop() is None:
            try:
                result = await self.target.execute(HEALTH_PROBE)
                if not result.failures:
                    self._down_since, self._server = None, "up"
                    break
            except CrashLoop:
                raise  # a launched server that keeps dying stops the campaign (one clear message)
            except FuzzError as e:
                self._last_server_error = str(e)
            await self._sleep(next(waits))
        self._phase = previous
        self.time_spent.add("recover", self._clock() - start)

    # --- state -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _in_phase(self, phase: Phase) -> Iterator[None]:
        """Show ``phase`` in the status while the block runs, then the phase before it."""
        previous, self._phase = self._phase, phase
        self._emit()
        try:
            yield
        finally:
            self._phase = previous

    def stats(self) -> Stats:
        elapsed = max(1e-9, self._clock() - self._started)
        done = self.executions
        return Stats(
            campaign_id=self.campaign_id, phase=str(self._phase), executions=done,
            execs_per_min=60.0 * (done - self._executions_at_start) / elapsed,
            corpus=len(self.corpus), favoured=len(self.corpus.favoured), features=len(self.corpus.seen),
            stability=self.corpus.stability, findings=len(self.store.list_findings(campaign_id=self.campaign_id)),
            candidates=self.confirmer.candidates, confirmations=self.confirmer.confirmations, elapsed_s=elapsed,
            since_last_find_s=None if self.confirmer.last_find is None else self._clock() - self.confirmer.last_find,
            server=self._server, time_s=self.time_spent.by_phase(elapsed), too_long=self.too_long,
            client_stalls=self.client_stalls, worst_client_stall_s=self.worst_client_stall_s,
            waiting=len(self.confirmer.waiting), pending=len(self.confirmer.pending),
        )

    def _emit(self) -> None:
        self._on_stats(self.stats())

    def _checkpoint(self, *, status: str = "running", force: bool = False) -> None:
        if not force and self._since_checkpoint < CHECKPOINT_EVERY:
            return
        data = self.corpus.to_dict()
        state = {
            "rng": listed_state(self.rng.getstate()),
            "corpus": {k: v for k, v in data.items() if k != "entries"},
            "operators": self.mutator.stats.to_dict(),
            "seeded": self._seeded,
            "cold_probes": self.probes.to_dict(),
            "server_time": self.server_time.to_dict(),
            "time_spent": self.time_spent.to_dict(self._clock() - self._started),
            **self.confirmer.to_state(),  # "rejected" and "pending"
            "stats": self.stats().to_dict(),
        }
        rows = [
            {**row, "favoured": row["id"] in self.corpus.favoured}
            for row in data["entries"] if row["id"] in self._dirty
        ]
        self.store.save_campaign(self.campaign_id, state=state, status=status, corpus_rows=rows,
                                 new_features=self._new_features)
        self._dirty.clear()
        self._new_features = {}
        self._since_checkpoint = 0
