"""The coordinator of a fleet campaign: central corpus, findings and database (issue 18).

One process (the CLI's) dispatches typed tasks to one worker per target
(:mod:`fuzzer.fleet.worker`, placed by :mod:`fuzzer.fleet.pool`) and is the only writer of
the campaign's database: every execution is stored with the id of the target it ran on.

- Each target has its own corpus: coverage is the behaviour of *that* server, judged by
  its own calibration. An entry one target keeps is sent to the others in batches of
  :data:`SYNC_BATCH` (AFL++ secondaries sync their queues): run there, kept where it reaches
  something new.
- A candidate is confirmed on the target it was seen on; a confirmed finding is deduplicated
  by signature across the targets of its ``kind`` (:meth:`Coordinator._scoped`: another kind is
  another server, whose finding is its own) and re-checked on every other target of that kind;
  its details say on which targets it reproduced. As in a campaign, a found family
  is confirmed again only now and then (:class:`fuzzer.search.confirming.Families`) and children
  lose the disconnects of a confirmed leak's way; a leak of several ways is confirmed as it is
  (a campaign confirms it one way at a time).
- As in a campaign, a sampling option (seed, logprobs) that enough requests ran beside is tested
  against the same trace without it (fuzzer.oracle.ablation) before the execution's latency
  candidates: a confirmation of kind ``option-slowdown``, a few times per option and target on growing
  batches (the counts are checkpointed), never once found. Latency candidates of a trace carrying
  an option are confirmed on the trace without it (fuzzer.search.causes.without_options).
- With ``--duration`` every task goes with a :class:`~fuzzer.fleet.worker.TimeCap`: its worker caps
  each run as a campaign caps its executions (confirmation runs too).
- A worker (or its node) that dies is detected when its task is collected: its target is
  marked down, its fuzzing work goes to the others, its confirmations to a target of the
  same kind (or stay pending until one is up). A server that cannot be reached several
  times in a row is marked down too.
- The campaign checkpoints its state (corpora, queues, random state, per-target counts) in
  the campaign row; the same command takes it up again after the coordinator was killed.
  Findings are written the moment they are confirmed.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fuzzer.errors import FuzzError, TargetError
from fuzzer.execution import ExecutionResult
from fuzzer.fleet.pool import WorkerLost
from fuzzer.fleet.state import DOWN, UP, Task, TargetState, from_state, option_tests_from_state, to_state
from fuzzer.fleet.targets import FleetTarget
from fuzzer.fleet.worker import TimeCap
from fuzzer.oracle.ablation import one_row, without_option
from fuzzer.oracle.kinds import FindingKind
from fuzzer.oracle.signature import family, option_signature, signature
from fuzzer.oracle.verdict import Verdict
from fuzzer.search.confirming import (
    Families,
    candidate_to_dict,
    option_candidate,
    option_due,
    recently_rejected,
)
from fuzzer.search.causes import without_found_causes, without_options
from fuzzer.search.crashes import avoiding, tried
from fuzzer.search.mutators import Child, Limits, Mutator, NullMutator, OperatorStats
from fuzzer.search.pacing import token_work
from fuzzer.search.settings import ExitReason, Settings, stop_reason
from fuzzer.store import Store
from fuzzer.trace import Trace

#: Entries another target found are run here once this many wait (or after SYNC_EVERY executions).
SYNC_BATCH = 4
SYNC_EVERY = 20
CHECKPOINT_EVERY = 10
#: Consecutive tasks a target's server could not be reached for before the target is marked down.
MAX_TARGET_ERRORS = 3
RETRY_AFTER_S = 2.0
#: How long collecting an in-flight task may block before the loop looks at its stop conditions.
POLL_S = 0.5
#: At the end, how long in-flight executions (and, at --max-execs, queued re-checks) may take to come back
#: (confirmations are kept pending).
DRAIN_S = 60.0
#: Seeding takes at most this share of a target's executions once its corpus has an entry.
SEED_SHARE = 0.3


@dataclass(frozen=True)
class FleetSummary:
    campaign_id: int
    reason: ExitReason
    resumed: bool
    executions: int
    elapsed_s: float
    new_findings: tuple[tuple[int, str, str], ...]
    #: Per target: status, reason, executions (all runs), busy seconds, findings, host.
    targets: dict[str, dict[str, Any]]
    #: CPU seconds the coordinator process spent per execution it stored in this run.
    coordinator_cpu_per_exec_s: float | None


class Coordinator:
    """One fleet campaign; see the module doc. ``pool``: a :class:`~fuzzer.fleet.pool.RayPool` (or a
    stand-in with spawn, submit, wait, get, kill). ``clock`` times ``--duration`` and throughput;
    ``cpu_clock`` the coordinator's own overhead. ``on_event`` hears one-line notes (a target
    down, a re-check), ``on_finding`` every new finding, ``on_execution`` every stored execution."""

    def __init__(
        self, pool, targets: Sequence[FleetTarget], store: Store, settings: Settings, *,
        seeds: Sequence[Trace] = (), clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.process_time, stop: threading.Event | None = None,
        on_event: Callable[[str], None] = lambda note: None,
        on_finding: Callable[[int, str, Verdict], None] = lambda i, name, v: None,
        on_execution: Callable[[str, int], None] = lambda name, n: None,
    ):
        self.pool = pool
        self.store = store
        self.settings = settings
        self.seeds = sorted(seeds, key=token_work)  # cheapest first, as a campaign runs them
        self.targets = {t.name: TargetState(t) for t in targets}
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._stop = stop or threading.Event()
        self._on_event = on_event
        self._on_finding = on_finding
        self._on_execution = on_execution
        self.retry: list[Task] = []
        self.orphans: list[tuple[str, Task]] = []
        self.rejected: dict[str, int] = {}
        self.found: set[str] = {f.signature for f in store.list_findings()}  # scoped (_scoped)
        self._kinds = {t.kind for t in targets}
        #: The back-off of found families, as a campaign's (fuzzer.search.confirming.Families).
        self.families = Families(store.list_findings())
        #: Target -> sampling option -> (times tested against its ablation there, the most requests beside it in
        #: a test): one target's SAME says nothing of another's per-row sampler (a kind's targets may differ in
        #: what a kind does not name: a build, a flag, the hardware).
        self.option_tests: dict[str, dict[str, tuple[int, int]]] = {}
        #: Traits that confirmed crashes need (fuzzer.search.crashes): later traces go without them.
        self.crash_avoid: list[str] = []
        self.new_findings: list[tuple[int, str, str]] = []
        self._inflight: dict[Any, tuple[str, Task]] = {}
        self._since_checkpoint = 0
        self._stored_here = 0
        self._new_features: dict[str, int] = {}

    # --- setup and resume ----------------------------------------------------------------

    def _open(self) -> bool:
        latest = self.store.latest_campaign()
        names = ",".join(sorted(self.targets))
        if latest is None or "fleet" not in latest["settings"]:
            self.campaign_id = self.store.start_campaign(
                seed=self.settings.seed, target=f"fleet:{names}",
                settings={**self.settings.to_dict(), "fleet": sorted(self.targets)})
            self.rng = random.Random(self.settings.seed)
            state: dict[str, Any] = {}
        else:
            self.campaign_id, state = latest["id"], latest["state"]
            self.rng = random.Random(latest["seed"])
            if "rng" in state:
                version, internal, gauss = state["rng"]
                self.rng.setstate((version, tuple(internal), gauss))
            self.retry, self.orphans = from_state(self.targets, state, self.store.get_trace)
            self.rejected = dict(state.get("rejected", {}))
            self.families.seen = dict(state.get("family_seen", {}))
            self.option_tests = option_tests_from_state(state.get("option_tests", {}), set(self.targets))
            self.crash_avoid = list(state.get("crash_avoid", []))
        self._operators = OperatorStats.from_dict(state.get("operators", {}))
        return latest is not None and "fleet" in latest["settings"]

    def _start_workers(self) -> None:
        """Place a worker per target and let it open and calibrate its target; the ones that fail are down."""
        policy = {k: v for k, v in self.settings.to_dict()["policy"].items()}
        refs = {}
        for t in self.targets.values():
            stored = self.store.latest_calibration(t.spec.identity)
            try:
                self.pool.spawn(t.spec, seed=self.rng.getrandbits(32), policy=policy, futility=self.settings.futility,
                                max_age_s=self.settings.recalibrate_after_s)
                refs[self.pool.submit(t.name, "start", stored)] = t.name
            except FuzzError as e:
                self._down(t, f"cannot place its worker: {e}")
        pending = dict(refs)
        while pending:
            for ref in self.pool.wait(list(pending), None):
                t = self.targets[pending.pop(ref)]
                try:
                    info = self.pool.get(ref, t.name)
                except (WorkerLost, FuzzError) as e:
                    self._down(t, f"did not start: {e}")
                    continue
                t.info, t.status, t.reason = info, UP, ""
                t.target_id = self.store.upsert_target(t.spec.identity, info["kind"], info["model"], info["version"],
                                                       info["capabilities"])
                if info["measured"] is not None:
                    self.store.save_calibration(t.spec.identity, info["measured"])
                self._on_event(f"{t.name}: up on {info['host']} ({info['kind']})")
        up = [t for t in self.targets.values() if t.status == UP]
        if not up:
            reasons = "; ".join(f"{t.name} {t.reason}" for t in self.targets.values())
            raise TargetError(f"no target of the fleet could be started: {reasons}")
        limits = _narrowest([Limits.from_dict(t.info["limits"]) for t in up], self.settings.limits)
        self.mutator = NullMutator(limits) if self.settings.mutator == "null" else Mutator(limits, self._operators)
        for name, task in list(self.orphans):  # confirmations a lost target left: it, or one of its kind, takes them
            own = self.targets.get(name)
            kin = None if own is None else next((t for t in up if t is own or t.spec.kind == own.spec.kind), None)
            if kin is not None:
                kin.confirm.append(task)
                self.orphans.remove((name, task))

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> FleetSummary:
        resumed = self._open()
        self._started, cpu_start = self._clock(), self._cpu_clock()
        reason = ExitReason.INTERRUPTED
        try:
            self._start_workers()
            self._checkpoint(force=True)
            while (reason := self._should_stop()) is None:
                self._dispatch()
                if not self._inflight:
                    if not any(t.status == UP for t in self.targets.values()):
                        raise TargetError("every target of the fleet is down: " + "; ".join(
                            f"{t.name} {t.reason}" for t in self.targets.values()))
                    self._stop.wait(POLL_S)  # every target waits to be retried
                    continue
                for ref in self.pool.wait(list(self._inflight), POLL_S):
                    self._collect(ref)
            self._drain(reason)
        finally:
            self._checkpoint(status="stopped", force=True)
        cpu = self._cpu_clock() - cpu_start
        return FleetSummary(
            self.campaign_id, reason or ExitReason.INTERRUPTED, resumed, self.executions, self._clock() - self._started,
            tuple(self.new_findings), self.target_rows(),
            cpu / self._stored_here if self._stored_here else None,
        )

    @property
    def executions(self) -> int:
        return self.store.count_executions(campaign_id=self.campaign_id)

    def _should_stop(self) -> ExitReason | None:
        return stop_reason(self.settings, stopped=self._stop.is_set(), executions=self.executions,
                           elapsed_s=self._clock() - self._started)

    def _dispatch(self) -> None:
        busy = {name for name, _ in self._inflight.values()}
        budget = None if self.settings.max_execs is None else self.settings.max_execs - self.executions
        for t in self.targets.values():
            if t.status != UP or t.name in busy or self._clock() < t.retry_at:
                continue
            if budget is not None and budget <= len(self._inflight):
                return  # the executions still to come fill --max-execs
            self._submit(t, self._next_task(t))

    def _submit(self, t: TargetState, task: Task) -> None:
        cap = self._cap()
        self._inflight[self.pool.submit(t.name, "confirm" if task.candidate else "execute",
                                        *((task.trace, task.candidate, cap) if task.candidate else (task.trace, cap)))
                       ] = (t.name, task)

    def _dispatch_rechecks(self) -> None:
        """At a --max-execs stop, the re-checks of the findings made are run still (a finding's record is its
        targets'): each idle target takes the first queued."""
        busy = {name for name, _ in self._inflight.values()}
        for t in self.targets.values():
            task = next((q for q in t.confirm if q.kind == "recheck"), None)
            if t.status == UP and t.name not in busy and task is not None:
                t.confirm.remove(task)
                self._submit(t, task)

    def _cap(self) -> TimeCap | None:
        """What a worker needs to cap a task's runs (None: no --duration, no cap)."""
        if self.settings.duration_s is None:
            return None
        return TimeCap(self.settings.duration_s, self._clock() - self._started)

    def _next_task(self, t: TargetState) -> Task:
        """Confirmations first, then a due sync batch, work a lost worker left, seeds, fuzzing; an execution's
        trace without what a confirmed crash needs (it would only crash again)."""
        if (task := self._next_confirmation(t)) is not None:
            return task
        task = self._next_execution(t)
        plain = avoiding(task.trace, self.crash_avoid)
        return task if plain == task.trace else replace(task, trace=plain)

    def _next_execution(self, t: TargetState) -> Task:
        if t.inbox and (t.syncing or len(t.inbox) >= SYNC_BATCH or t.since_sync >= SYNC_EVERY):
            t.syncing, t.since_sync = len(t.inbox) > 1, 0  # the rest of the batch follows at once
            return t.inbox.popleft()
        if self.retry:
            return self.retry.pop(0)
        if t.seeded < len(self.seeds) and (not t.corpus.entries or
                                           t.executions.get("seed", 0) <= SEED_SHARE * max(1, t.total)):
            t.seeded += 1
            return Task("seed", self.seeds[t.seeded - 1], operators=("seed",))
        if not t.corpus.entries:
            return Task("fuzz", NullMutator(self.mutator.limits).mutate(Trace(requests=()), self.rng).trace,
                        operators=("generate",))
        parent = t.corpus.choose(self.rng)
        other = t.corpus.choose(self.rng).trace if len(t.corpus) > 1 else None
        child: Child = self.mutator.mutate(parent.trace, self.rng, other)
        # As a campaign's: without what a confirmed finding already explains.
        return Task("fuzz", without_found_causes(child.trace, self._found_on(t)), parent=parent.id,
                    operators=child.operators)

    # --- results ---------------------------------------------------------------------------

    def _collect(self, ref: Any) -> None:
        name, task = self._inflight.pop(ref)
        t = self.targets[name]
        try:
            value = self.pool.get(ref, name)
        except WorkerLost as e:
            self._down(t, f"worker lost: {e.reason}", task)
            return
        except Exception as e:  # noqa: BLE001 - the server could not be asked (TargetError), or the task failed:
            # either way the target is tried again, then marked down with the reason; the fleet goes on.
            t.errors += 1
            t.retry_at = self._clock() + RETRY_AFTER_S * t.errors
            (t.confirm.appendleft if task.candidate else self.retry.append)(task)
            if t.errors >= MAX_TARGET_ERRORS:
                self._down(t, f"{t.errors} tasks in a row failed, the last: {type(e).__name__}: {e}")
            return
        t.errors = 0
        t.busy_s += value.busy_s
        if task.candidate is not None:
            self._confirmed(t, task, value)
        else:
            self._executed(t, task, value)
        self._checkpoint()

    def _record(self, t: TargetState, trace: Trace, result, purpose: str) -> None:
        self.store.record_execution(result, trace, target_id=t.target_id, campaign_id=self.campaign_id,
                                    purpose=purpose, number=self.executions + 1)
        t.counted(purpose)
        t.since_sync += 1
        self._since_checkpoint += 1
        self._stored_here += 1
        self._on_execution(t.name, self.executions)

    def _executed(self, t: TargetState, task: Task, done) -> None:
        self._record(t, task.trace, done.result, task.kind)
        if task.kind == "seed":
            entry = t.corpus.add_forced(task.trace, [done.coverage], operators=("seed",), found_at_exec=self.executions)
        else:
            entry = t.corpus.add(task.trace, [done.coverage], parent=task.parent, operators=task.operators,
                                 found_at_exec=self.executions)
        if task.kind == "fuzz":
            self.mutator.feedback(Child(task.trace, task.operators), entry is not None)
        if entry is not None:
            for f in entry.features:  # coverage_features: one namespace per target
                self._new_features.setdefault(f"{t.name}/{f}", entry.id)
        if entry is not None and task.kind != "sync":
            for other in self.targets.values():
                if other is not t and other.status == UP:
                    other.inbox.append(Task("sync", task.trace, operators=("sync",)))
        # A sampling option slowing everyone first: its victims' latencies are then its doing.
        self._test_option(t, task.trace, done.result)
        # Latency candidates of a trace with a sampling option are confirmed without it (without_options).
        plain = without_options(task.trace)
        sighted: set[str] = set()  # a found family is sighted once per execution
        for candidate in done.candidates:
            kind, victim = FindingKind(candidate["kind"]), candidate.get("request_id")
            judged = plain if candidate.get("metric") is not None else task.trace
            key = self._scoped(t, signature(kind, judged, victim))
            if self._skip(key):
                continue
            fam = family(kind, judged, victim, self._kv(t), bool(candidate.get("held_choice")))
            if self.families.pass_over(self._scoped(t, fam), sighted):
                continue
            if judged is not task.trace:
                self.store.put_trace(judged)  # a checkpointed task names its trace by hash
            t.confirm.append(Task("confirm", judged, candidate=candidate, key=key))
            self._checkpoint(force=True)  # a candidate must survive the coordinator
            break  # one confirmation per execution keeps the fuzzing going

    def _test_option(self, t: TargetState, trace: Trace, result: ExecutionResult) -> None:
        """Queue the test of a sampling option of ``trace`` against its ablation when one is due
        (fuzzer.search.confirming.option_due: the campaign's rule), counted when queued, for ``t``."""
        policy = self.settings.policy
        counts = self.option_tests.get(t.name, {})
        due = option_due(trace, result, counts, self._found_on(t), policy)
        if due is None:
            return
        option, size = due
        key = self._scoped(t, option_signature(option))
        here = [*t.confirm, *(task for name, task in self._inflight.values() if name == t.name)]
        if any(q.key == key for q in here):
            return  # queued or under way here (another target's test of it says nothing of this one)
        tests, largest = counts.get(option, (0, 0))
        self.option_tests[t.name] = {**counts, option: (tests + 1, max(largest, size))}
        t.confirm.append(Task("confirm", trace, candidate=candidate_to_dict(option_candidate(trace, option, result)), key=key))
        self._checkpoint(force=True)

    def _next_confirmation(self, t: TargetState) -> Task | None:
        """The first confirmation queued on ``t`` that may run now: not one of a signature found since it was
        queued (an option's test that another target confirmed; the finding's re-checks run instead)."""
        chosen = None
        while t.confirm and chosen is None:
            task = t.confirm.popleft()
            if task.kind != "confirm" or task.key not in self.found:
                chosen = self._without_options(t, task)
        return chosen

    def _without_options(self, t: TargetState, task: Task) -> Task | None:
        """A latency candidate of a trace with a sampling option, queued by a checkpoint of an older fleet,
        is confirmed on the trace without it, as one queued now is (None: known or rejected there)."""
        if not _is_latency(task):
            return task
        plain = without_options(task.trace)
        if plain is task.trace:
            return task
        key = self._scoped(t, signature(FindingKind(task.candidate["kind"]), plain, task.candidate.get("request_id")))
        if self._skip(key):
            return None
        self.store.put_trace(plain)
        return replace(task, trace=plain, key=key)

    def _skip(self, key: str) -> bool:
        if key in self.found or any(q.key == key for t in self.targets.values() for q in t.confirm):
            return True
        if any(task.key == key for _, task in self._inflight.values()):
            return True
        return recently_rejected(self.rejected, key)

    def _confirmed(self, t: TargetState, task: Task, done) -> None:
        option = _option_of(task)
        ran = {task.trace.content_hash(): task.trace}
        if option is not None:  # the test's other runs: the trace without the option, and one carrier row alone
            probe = one_row(task.trace, option)
            for other in (without_option(task.trace, option), probe, without_option(probe, option)):
                ran[other.content_hash()] = other
        if done.crash_needs or any(run.trace_hash not in ran for run in done.runs):
            ran |= {x.content_hash(): x for x in tried(task.trace)}  # what a confirmed crash needs: its tries
        for run in done.runs:
            self._record(t, ran.get(run.trace_hash, task.trace), run, task.kind)
        verdict = Verdict.from_dict(done.verdict)
        if task.kind == "recheck":
            self._learn_crash(done.crash_needs, task.finding_id)
            self._rechecked(t, task, verdict)
            return
        if not verdict.is_finding:
            if option is None:  # an option's tests are counted instead (option_tests)
                self.rejected[task.key] = 0
            return
        sig = self._scoped(t, verdict.signature) if verdict.signature else task.key
        details = {"request_id": verdict.request_id, "pre_signature": task.key, "target": t.name,
                   "targets": {t.name: verdict.reproduction}}
        held = bool((asked := task.candidate or {}).get("held_choice")) and str(verdict.kind) == asked.get("kind")
        if held:
            details["held_choice"] = True
        if verdict.kind is not None and verdict.request_id is not None:
            details["family"] = self._scoped(t, family(verdict.kind, task.trace, verdict.request_id, self._kv(t), held))
            self.families.record(details["family"])
        finding_id, created = self.store.add_finding(
            kind=str(verdict.kind), signature=sig, trace=task.trace, verdict=verdict.to_dict(),
            slowdown=verdict.slowdown, reproduced=verdict.reproduction, campaign_id=self.campaign_id,
            target_id=t.target_id, details=details,
        )
        self.found.update({sig, task.key})
        self._learn_crash(done.crash_needs, finding_id)
        if not created:  # confirmed here too (an option's test under way on two targets): its re-check here
            self.store.set_finding_target(finding_id, t.name, verdict.reproduction)
            t.confirm = deque(q for q in t.confirm if not (q.kind == "recheck" and q.finding_id == finding_id))
            return
        t.findings += 1
        self.new_findings.append((finding_id, str(verdict.kind), t.name))
        self._on_finding(finding_id, t.name, verdict)
        for other in self.targets.values():
            if other is not t and other.status == UP and other.spec.kind == t.spec.kind:
                other.confirm.append(Task("recheck", task.trace, candidate=task.candidate, key=task.key,
                                          finding_id=finding_id, origin=t.name))
        self._checkpoint(force=True)

    def _learn_crash(self, needs: Sequence[str], finding_id: int | None) -> None:
        """What a confirmed crash needs (a worker's fuzzer.search.crashes.crash_needs): later traces go without it."""
        if not needs:
            return
        self.crash_avoid += [n for n in needs if n not in self.crash_avoid]
        if finding_id is not None:
            self.store.update_finding_details(finding_id, {"crash_needs": list(needs)})

    def _scoped(self, t: TargetState, key: str) -> str:
        """``key`` (a signature or family) of ``t``'s kind: itself in a fleet of one kind, else tagged
        with the kind, so that one server's finding neither stands for nor holds back another's."""
        return key if len(self._kinds) == 1 else f"{key}@{t.spec.kind}"

    def _found_on(self, t: TargetState) -> set[str]:
        """The signatures found on ``t``'s kind, untagged (:meth:`_scoped`)."""
        if len(self._kinds) == 1:
            return self.found
        tag = self._scoped(t, "")
        return {s.removesuffix(tag) for s in self.found if s.endswith(tag)}

    @staticmethod
    def _kv(t: TargetState) -> int | None:
        """The target's KV cache in tokens, where it reports its size (a family trait)."""
        return Limits.from_dict(t.info["limits"]).kv_tokens if t.info.get("limits") else None

    def _rechecked(self, t: TargetState, task: Task, verdict: Verdict) -> None:
        outcome = verdict.reproduction if verdict.is_finding else f"not reproduced ({verdict.decision})"
        self.store.set_finding_target(task.finding_id, t.name, outcome)
        self._on_event(f"finding {task.finding_id} (from {task.origin}) re-checked on {t.name}: {outcome}")

    # --- faults ----------------------------------------------------------------------------

    def _down(self, t: TargetState, reason: str, task: Task | None = None) -> None:
        """Mark ``t`` down; its work goes to the others (confirmations to a target of its kind)."""
        t.status, t.reason = DOWN, reason
        self._on_event(f"{t.name}: down ({reason})")
        with_kind = [o for o in self.targets.values() if o is not t and o.status == UP and o.spec.kind == t.spec.kind]
        lost = [task] if task is not None else []
        lost += [*t.confirm, *t.inbox]
        t.confirm.clear()
        t.inbox.clear()
        for item in lost:
            if item.kind == "fuzz":
                self.retry.append(item)
            elif item.kind == "confirm" and with_kind:
                with_kind[0].confirm.append(item)
            elif item.kind == "confirm":
                self.orphans.append((t.name, item))
            elif item.kind == "recheck":
                self.store.set_finding_target(item.finding_id, t.name, f"not checked: target down ({reason})")
        self._checkpoint(force=True)

    def _drain(self, reason: ExitReason | None) -> None:
        """Collect the in-flight executions (a --max-execs stop waits for confirmations and runs the queued
        re-checks too)."""
        deadline = self._clock() + DRAIN_S
        while self._clock() < deadline:
            if reason is ExitReason.MAX_EXECS:
                self._dispatch_rechecks()
            if not self._inflight:
                break
            if reason is not ExitReason.MAX_EXECS:
                for ref, (name, task) in list(self._inflight.items()):
                    if task.candidate is not None:  # kept pending: confirmed first on resume
                        del self._inflight[ref]
                        self.targets[name].confirm.appendleft(task)
            for ref in self.pool.wait(list(self._inflight), POLL_S):
                self._collect(ref)

    # --- state -----------------------------------------------------------------------------

    def target_rows(self) -> dict[str, dict[str, Any]]:
        return self._state()["targets"]

    def _state(self) -> dict[str, Any]:
        running: dict[str, list[Task]] = {}
        for name, task in self._inflight.values():
            if task.candidate is not None:  # a confirmation under way is saved as pending
                running.setdefault(name, []).append(task)
        return to_state(self.targets, retry=self.retry, orphans=self.orphans, running=running)

    def _checkpoint(self, *, status: str = "running", force: bool = False) -> None:
        if not force and self._since_checkpoint < CHECKPOINT_EVERY:
            return
        version, internal, gauss = self.rng.getstate()
        elapsed = max(1e-9, self._clock() - getattr(self, "_started", self._clock()))
        state = {
            "rng": [version, list(internal), gauss],
            "operators": self._operators.to_dict(),
            "rejected": self.rejected,
            "family_seen": self.families.seen,
            "option_tests": {name: {k: list(v) for k, v in counts.items()} for name, counts in self.option_tests.items()},
            "crash_avoid": list(self.crash_avoid),
            **self._state(),
            "stats": {"executions": self.executions, "elapsed_s": elapsed,
                      "execs_per_min": 60.0 * self._stored_here / elapsed,
                      "corpus": sum(len(t.corpus) for t in self.targets.values()),
                      "findings": len(self.store.list_findings(campaign_id=self.campaign_id))},
        }
        self.store.save_campaign(self.campaign_id, state=state, status=status, new_features=self._new_features)
        self._new_features = {}
        self._since_checkpoint = 0


def _option_of(task: Task) -> str | None:
    """The sampling option a confirmation tests (an option-slowdown's detail), else None."""
    if task.candidate is None or task.candidate.get("kind") != str(FindingKind.OPTION_SLOWDOWN):
        return None
    return task.candidate.get("detail") or None


def _is_latency(task: Task) -> bool:
    """Whether ``task`` confirms a latency candidate (one with a metric) first seen in this fleet."""
    return task.kind == "confirm" and task.candidate is not None and task.candidate.get("metric") is not None


def _narrowest(limits: Sequence[Limits], settings: Limits) -> Limits:
    """What every target accepts within the campaign's own limits: the shortest context, every feature
    one of them rejects, the smallest max n and logprobs, the smallest KV cache (trace sizes as the settings say)."""
    def least(name: str) -> int | None:
        known = [getattr(x, name) for x in (*limits, settings) if getattr(x, name) is not None]
        return min(known) if known else None

    return replace(settings, max_model_len=min(x.max_model_len for x in (*limits, settings)),
                   unsupported=frozenset().union(*(x.unsupported for x in (*limits, settings))),
                   max_n=least("max_n"), max_logprobs=least("max_logprobs"), kv_tokens=least("kv_tokens"))
