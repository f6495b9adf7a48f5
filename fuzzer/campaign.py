"""The fuzzing campaign: the main job (SPEC §5-§7, §9).

A run goes through named phases and ends through an :class:`ExitReason`, the way
Hypothesis' engine does:

    calibrate -> seed (the corpus/ traces) -> fuzz (pick, mutate, execute, keep)
                 -> confirm candidates with the oracle -> record findings

Every execution is written to the store before the next one starts, and the
campaign checkpoints its state (RNG, corpus, counters) so that running it again
on the same database resumes where it stopped. The campaign never prints: it
hands :class:`Stats` snapshots and events to callbacks, and the CLI renders them.
"""

from __future__ import annotations

import asyncio
import enum
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Awaitable, Callable, Sequence

import numpy as np

from fuzzer import oracle
from fuzzer.calibration import Calibration, calibrate
from fuzzer.confirmation import confirm
from fuzzer.corpus import Corpus, Entry
from fuzzer.coverage import Coverage, measure
from fuzzer.errors import FuzzError, TargetError
from fuzzer.execution import ExecutionResult, Target
from fuzzer.expectation import expect
from fuzzer.mutators import Child, Limits, Mutator, NullMutator, OperatorStats
from fuzzer.oracle import OraclePolicy
from fuzzer.recovery import backoff
from fuzzer.store import Store
from fuzzer.trace import Request, Trace
from fuzzer.verdict import FindingKind, Metric, Verdict, signature

# AFL calibrates a new queue entry with 3-7 runs (CAL_CYCLES); our runs cost seconds, so 3.
STABILITY_RUNS = 3
# Checkpoint the campaign state at least every this many executions even when nothing changed,
# so a resumed campaign repeats little.
CHECKPOINT_EVERY = 10
# A candidate whose confirmation came back SAME is not confirmed again until it has been
# seen this many more times: noise must not eat the campaign's time.
RECONFIRM_AFTER = 5
# A periodic recalibration that fails (a flaky server failed a probe) keeps the previous
# calibration and is tried again this much later, not after every execution.
RECALIBRATE_RETRY_S = 600.0


class Phase(enum.StrEnum):
    CALIBRATE = "calibrate"
    SEED = "seed"
    FUZZ = "fuzz"
    CONFIRM = "confirm"
    RECOVER = "recover"
    DONE = "done"


class ExitReason(enum.StrEnum):
    DURATION = "duration"
    MAX_EXECS = "max-execs"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class Settings:
    duration_s: float | None = None
    max_execs: int | None = None
    seed: int = 0
    #: "guided" (coverage-guided mutation) or "null" (random generation, the baseline).
    mutator: str = "guided"
    stability_runs: int = STABILITY_RUNS
    recalibrate_after_s: float = 3600.0
    limits: Limits = field(default_factory=Limits)
    policy: OraclePolicy = field(default_factory=OraclePolicy)

    def to_dict(self) -> dict:
        return {
            "duration_s": self.duration_s, "max_execs": self.max_execs, "seed": self.seed,
            "mutator": self.mutator, "stability_runs": self.stability_runs,
        }


@dataclass(frozen=True)
class Stats:
    """A snapshot for the live status and `fuzz status` (AFL's fuzzer_stats)."""

    campaign_id: int
    phase: str
    executions: int
    execs_per_min: float
    corpus: int
    favoured: int
    features: int
    stability: float
    findings: int
    candidates: int
    confirmations: int
    elapsed_s: float
    since_last_find_s: float | None
    server: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Summary:
    campaign_id: int
    reason: ExitReason
    stats: Stats
    #: Findings recorded in this run (id, kind).
    new_findings: tuple[tuple[int, str], ...]
    resumed: bool


class Campaign:
    """One campaign on one target, stored in one database."""

    def __init__(
        self,
        target: Target,
        store: Store,
        settings: Settings,
        *,
        seeds: Sequence[Trace] = (),
        target_key: str | None = None,
        target_id: int | None = None,
        calibration: Calibration | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_stats: Callable[[Stats], None] | None = None,
        on_finding: Callable[[int, Verdict], None] | None = None,
        stop: asyncio.Event | None = None,
    ):
        self.target = target
        self.store = store
        self.settings = settings
        # Cheapest seeds first (AFL favours fast inputs): a short campaign gets through more of them.
        self.seeds = sorted(seeds, key=_work)
        self.target_key = target_key or target.name
        self.target_id = target_id
        self.calibration = calibration
        self._clock = clock
        self._sleep = sleep
        self._on_stats = on_stats or (lambda s: None)
        self._on_finding = on_finding or (lambda i, v: None)
        self._stop = stop or asyncio.Event()
        self._phase = Phase.CALIBRATE
        self._server = "up"
        self.corpus = Corpus()
        self._dirty: set[int] = set()
        self._new_features: dict[str, int] = {}
        self._rejected: dict[str, int] = {}
        self._found: set[str] = {f.signature for f in store.list_findings()}
        self._new_findings: list[tuple[int, str]] = []
        self._candidates = 0
        self._confirmations = 0
        self._last_find: float | None = None
        self._since_checkpoint = 0
        self._seeded = 0
        self._server_errors = 0
        self._last_server_error: str | None = None
        self._recalibrate_at: float | None = None

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
        else:
            self.campaign_id = latest["id"]
            state = latest["state"]
            self.rng = random.Random(latest["seed"])
            if "rng" in state:
                self.rng.setstate(_tuple_state(state["rng"]))
            rows = self.store.corpus_rows(self.campaign_id)
            traces = {row["trace_hash"]: self.store.get_trace(row["trace_hash"]) for row in rows}
            self.corpus = Corpus.from_dict({**state.get("corpus", {}), "entries": rows}, traces)
            op_stats = OperatorStats.from_dict(state.get("operators", {}))
            self._rejected = dict(state.get("rejected", {}))
            self._seeded = int(state.get("seeded", 0))
        self.np_rng = np.random.default_rng(self.rng.getrandbits(64))
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
            self._phase = Phase.SEED
            for trace in self.seeds[self._seeded:]:
                if (reason := self._should_stop()) is not None:
                    break
                await self._seed(trace)
                self._seeded += 1
            else:
                reason = None
            self._phase = Phase.FUZZ
            while reason is None:
                if (reason := self._should_stop()) is not None:
                    break
                await self._fuzz_one()
                if self._recalibration_due():
                    await self._ensure_calibration(force=True)
        except asyncio.CancelledError:
            reason = ExitReason.INTERRUPTED
        except _Stopped:
            reason = self._should_stop()
        finally:
            self._phase = Phase.DONE
            self._checkpoint(status="stopped", force=True)
        stats = self.stats()
        self._on_stats(stats)
        return Summary(self.campaign_id, reason or ExitReason.INTERRUPTED, stats, tuple(self._new_findings), resumed)

    def _should_stop(self) -> ExitReason | None:
        if self._stop.is_set():
            return ExitReason.INTERRUPTED
        s = self.settings
        if s.max_execs is not None and self.executions >= s.max_execs:
            return ExitReason.MAX_EXECS
        if s.duration_s is not None and self._clock() - self._started >= s.duration_s:
            return ExitReason.DURATION
        return None

    @property
    def executions(self) -> int:
        return self.store.count_executions(campaign_id=self.campaign_id)

    async def _ensure_calibration(self, force: bool = False) -> None:
        if self.calibration is not None and not force:
            return
        if not force:
            stored = self.store.latest_calibration(self.target_key)
            if stored is not None:
                self.calibration = Calibration.from_dict(stored)
                if not self.calibration.is_stale(time.time(), max_age_s=self.settings.recalibrate_after_s):
                    return
        previous = self._phase
        self._phase = Phase.CALIBRATE
        self._emit()
        assumption = self.calibration.assumption if self.calibration else None
        try:
            self.calibration = await calibrate(
                self.target, assumption=assumption, rng=random.Random(self.rng.getrandbits(64))
            )
        except TargetError as e:
            if self.calibration is None:
                raise  # no calibration to fall back on: the CLI says why in one line
            self._server_errors += 1
            self._last_server_error = f"recalibration failed, the previous calibration stays: {e}"
            self._recalibrate_at = self._clock() + RECALIBRATE_RETRY_S
        else:
            self.store.save_calibration(self.target_key, self.calibration.to_dict())
        self._phase = previous

    def _recalibration_due(self) -> bool:
        if self.calibration is None:
            return False
        if self._recalibrate_at is not None and self._clock() < self._recalibrate_at:
            return False
        return self.calibration.is_stale(time.time(), max_age_s=self.settings.recalibrate_after_s)

    # --- executing ---------------------------------------------------------------------

    async def _execute(self, trace: Trace, purpose: str) -> ExecutionResult:
        result = await self._execute_when_up(trace)
        number = self.executions + 1
        self.store.record_execution(
            result, trace, target_id=self.target_id, campaign_id=self.campaign_id, purpose=purpose, number=number
        )
        self._since_checkpoint += 1
        self._checkpoint()
        self._emit()
        return result

    async def _execute_when_up(self, trace: Trace) -> ExecutionResult:
        """Run ``trace``; when the target cannot even be asked (down, refusing), wait for it and retry.

        A request that fails is data (the executor returns it); a server that cannot be reached
        before the trace starts (its /tokenize or /metrics refused) raises TargetError. Nothing
        was measured then, so nothing is recorded: the campaign waits with backoff and runs the
        trace again once the server answers.
        """
        while True:
            try:
                return await self.target.execute(trace)
            except TargetError as e:
                self._server_errors += 1
                self._last_server_error = str(e)
                await self._wait_for_server()
                if self._should_stop() is not None:
                    raise _Stopped from None

    def _coverage(self, trace: Trace, result: ExecutionResult) -> Coverage:
        assert self.calibration is not None
        expectations = expect(trace, self.calibration.model, self.calibration.assumption, result)
        idle = {}
        for r in trace.requests:
            metric = Metric.TTFT if r.stream else Metric.E2E
            value = expectations[r.id].idle(metric)
            if value:
                idle[r.id] = value
        return measure(result, trace, idle)

    async def _seed(self, trace: Trace) -> None:
        runs = [await self._execute(trace, "seed") for _ in range(self.settings.stability_runs)]
        self._keep(trace, runs, parent=None, operators=("seed",), force=True)
        await self._examine(trace, runs[-1])

    async def _fuzz_one(self) -> None:
        if not self.corpus.entries:
            child = Child(NullMutator(self.settings.limits).mutate(Trace(requests=()), self.rng).trace, ("generate",))
            parent: Entry | None = None
        else:
            parent = self.corpus.choose(self.rng)
            other = self.corpus.choose(self.rng).trace if len(self.corpus) > 1 else None
            child = self.mutator.mutate(parent.trace, self.rng, other)
            self._dirty.add(parent.id)
        first = await self._execute(child.trace, "fuzz")
        kept = False
        if self.corpus.is_interesting(self._coverage(child.trace, first)):
            runs = [first] + [await self._execute(child.trace, "stability") for _ in range(self.settings.stability_runs - 1)]
            kept = self._keep(child.trace, runs, parent=parent.id if parent else None, operators=child.operators)
        self.mutator.feedback(child, kept)
        await self._examine(child.trace, first)

    def _keep(self, trace: Trace, runs: list[ExecutionResult], *, parent: int | None,
              operators: tuple[str, ...], force: bool = False) -> bool:
        coverages = [self._coverage(trace, r) for r in runs]
        entry = self.corpus.add(trace, coverages, parent=parent, operators=operators, found_at_exec=self.executions)
        if entry is None and force and not self.corpus.contains(trace):
            # Seeds are kept even when they add nothing new (AFL keeps every input of -i).
            entry = self.corpus.add_forced(trace, coverages, operators=operators, found_at_exec=self.executions)
        if entry is None:
            return False
        self._dirty.add(entry.id)
        if parent is not None:
            self._dirty.add(parent)
        for f in entry.features:
            self._new_features.setdefault(f, entry.id)
        self._checkpoint(force=True)
        return True

    # --- the oracle ----------------------------------------------------------------------

    async def _examine(self, trace: Trace, result: ExecutionResult) -> None:
        """Confirm the worst new candidate of an execution; record it when confirmed."""
        assert self.calibration is not None
        for candidate in oracle.candidates(trace, result, self.calibration, self.settings.policy):
            key = signature(candidate.kind, trace, candidate.request_id)
            if key in self._found:
                continue
            seen = self._rejected.get(key)
            if seen is not None and seen < RECONFIRM_AFTER:
                self._rejected[key] = seen + 1
                continue
            self._candidates += 1
            previous, self._phase = self._phase, Phase.CONFIRM
            self._emit()
            verdict = await self._confirm(trace, candidate)
            self._phase = previous
            if verdict.is_finding:
                self._record(trace, verdict, key)
                if candidate.kind is FindingKind.CRASH:
                    await self._wait_for_server()
            else:
                self._rejected[key] = 0
            return  # one confirmation per execution keeps the fuzzing going

    async def _confirm(self, trace: Trace, candidate: oracle.Candidate) -> Verdict:
        self._confirmations += 1
        counting = _CountingTarget(self)
        return await confirm(counting, trace, candidate, self.calibration, rng=self.np_rng,
                                    policy=self.settings.policy, sleep=self._sleep)

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

    async def _wait_for_server(self) -> None:
        """After a crash: wait with backoff until a one-token request is answered again."""
        previous = self._phase
        self._phase, self._server = Phase.RECOVER, "down"
        self._emit()
        probe = Trace(requests=(Request(id="health", at_ms=0, prompt_tokens=8, max_tokens=1),), name="health-probe")
        waits = backoff()
        while self._should_stop() is None:
            try:
                result = await self.target.execute(probe)
                if not result.failures:
                    break
            except FuzzError:
                pass
            await self._sleep(next(waits))
        self._phase, self._server = previous, "up"

    # --- state -------------------------------------------------------------------------

    def stats(self) -> Stats:
        elapsed = max(1e-9, self._clock() - self._started)
        done = self.executions
        return Stats(
            campaign_id=self.campaign_id, phase=str(self._phase), executions=done,
            execs_per_min=60.0 * (done - self._executions_at_start) / elapsed,
            corpus=len(self.corpus), favoured=len(self.corpus.favoured), features=len(self.corpus.seen),
            stability=self.corpus.stability, findings=len(self.store.list_findings(campaign_id=self.campaign_id)),
            candidates=self._candidates, confirmations=self._confirmations, elapsed_s=elapsed,
            since_last_find_s=None if self._last_find is None else self._clock() - self._last_find,
            server=self._server,
        )

    def _emit(self) -> None:
        self._on_stats(self.stats())

    def _checkpoint(self, *, status: str = "running", force: bool = False) -> None:
        if not force and self._since_checkpoint < CHECKPOINT_EVERY:
            return
        data = self.corpus.to_dict()
        state = {
            "rng": _list_state(self.rng.getstate()),
            "corpus": {k: v for k, v in data.items() if k != "entries"},
            "operators": self.mutator.stats.to_dict(),
            "rejected": self._rejected,
            "seeded": self._seeded,
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


class _Stopped(Exception):
    """Asked to stop while waiting for a server that is down."""


class _CountingTarget:
    """The campaign's target seen by the oracle: every confirmation run is stored too."""

    def __init__(self, campaign: Campaign):
        self._campaign = campaign
        self.name = campaign.target.name
        idle = getattr(campaign.target, "idle", None)
        if idle is not None:
            self.idle = idle

    async def execute(self, trace: Trace) -> ExecutionResult:
        return await self._campaign._execute(trace, "confirm")

    async def aclose(self) -> None:  # the campaign owns the real target
        return None


def _work(trace: Trace) -> int:
    return sum(r.prompt_tokens + r.max_tokens * r.n for r in trace.requests)


def _list_state(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _tuple_state(state: list) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)

