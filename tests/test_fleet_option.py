"""A fleet campaign's option-slowdown test and per-execution time cap, as a single-target campaign's.

No Ray: the workers run in this process, each task when it is submitted (:class:`InlinePool`, a
stand-in for fuzzer.fleet.pool.RayPool), on paper targets (tests/paper_target.py) or the simulator
on virtual time, so every test takes well under a second of server time.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from paper_target import PaperTarget
from test_ablation import _seeded_batch

from fuzzer.fleet.coordinator import Coordinator
from fuzzer.fleet.state import UP, Task
from fuzzer.fleet.targets import FleetTarget
from fuzzer.fleet.worker import TimeCap, Worker
from fuzzer.oracle.ablation import option_work, without_option
from fuzzer.oracle.judge import Candidate
from fuzzer.oracle.kinds import Decision, FindingKind
from fuzzer.oracle.signature import option_signature
from fuzzer.oracle.verdict import Verdict
from fuzzer.search.confirming import candidate_to_dict
from fuzzer.search.coverage import Coverage
from fuzzer.search.mutators import Limits, NullMutator
from fuzzer.search.pacing import execution_cut_s
from fuzzer.search.settings import ExitReason, Settings
from fuzzer.sim.virtual import VirtualTarget
from fuzzer.store import Store
from fuzzer.trace import Request, Trace

LIMITS = Limits(max_requests=10, max_output_tokens=128)


#: The sampling work of _seeded_batch's carrier: a test's size is the overlap times it.
WORK = option_work(_seeded_batch(), "seed")


class _Paper(PaperTarget):
    info = None  # what a worker reads of a server's /version and friends: nothing here


class _Virtual(VirtualTarget):
    info = None


class _Worker(Worker):
    """A worker whose target is given (not opened over HTTP)."""

    def __init__(self, spec, target, **options):
        super().__init__(spec, **options)
        self._given = target

    async def _open(self):
        return self._given


class InlinePool:
    """RayPool's stand-in: workers in this process, a task run when submitted; ``calls`` records
    (target, method, arguments) of every task."""

    def __init__(self, targets, **worker_options):
        self._targets = targets
        self._worker_options = worker_options
        self.workers: dict[str, Worker] = {}
        self.calls: list[tuple[str, str, tuple]] = []
        self._done: dict[int, tuple[object, BaseException | None]] = {}
        self._refs = itertools.count()

    def spawn(self, spec, **options):
        self.workers[spec.name] = _Worker(spec, self._targets[spec.name], **options, **self._worker_options)

    def submit(self, name, method, *args):
        ref = next(self._refs)
        self.calls.append((name, method, args))
        try:
            self._done[ref] = (getattr(self.workers[name], method)(*args), None)
        except Exception as e:  # noqa: BLE001 - surfaces at get, as a Ray task's error
            self._done[ref] = (None, e)
        return ref

    def wait(self, refs, timeout_s):
        return list(refs)

    def get(self, ref, name, timeout_s=None):
        value, error = self._done.pop(ref)
        if error is not None:
            raise error
        return value

    def close(self):
        for worker in self.workers.values():
            worker.stop()


def _fleet(store, targets, settings, seeds, **options):
    pool = InlinePool({name: target for name, (target, _) in targets.items()}, **options.pop("worker", {}))
    specs = [FleetTarget(name, url=f"http://127.0.0.1:{9000 + i}", kind=kind)
             for i, (name, (_, kind)) in enumerate(targets.items())]
    try:
        summary = Coordinator(pool, specs, store, settings, seeds=seeds, **options).run()
    finally:
        pool.close()
    return summary, pool


def _executions(store):
    """Every stored execution with its trace hash, in order (ids of a fresh database count from 1)."""
    return [store.get_execution(i) for i in range(1, store.count_executions() + 1)]


def test_a_fleet_tests_a_seed_that_slows_the_batch_before_its_victims_and_rechecks_it_on_its_kind(tmp_path):
    # 2.5x: the other requests are over their bounds too, and would be confirmed as e2e outliers of
    # whichever stream the judge ranks first, the seed nowhere in the finding (without the test).
    with Store.open(tmp_path / "fleet.db") as store:
        trace = _seeded_batch()
        summary, pool = _fleet(store, {"a": (_Paper(seeded_slowdown=2.5, seed=1), "k"),
                                       "b": (_Paper(seeded_slowdown=2.5, seed=2), "k")},
                               Settings(max_execs=24, seed=1, limits=LIMITS), [trace])  # with the own-cost probes
        findings = store.list_findings()
        assert summary.reason is ExitReason.MAX_EXECS
        assert [f.kind for f in findings] == ["option-slowdown"], [(f.kind, f.details) for f in findings]
        [found] = findings
        assert found.signature == option_signature("seed") and found.trace_hash == trace.content_hash()
        assert found.details["request_id"] == "carrier"
        # First confirmed where it was seen, then re-checked on the other target of the kind.
        assert set(found.details["targets"]) == {"a", "b"}
        assert all(outcome.startswith("3/") for outcome in found.details["targets"].values()), found.details
        # The test's runs alternate the trace and the trace without the seed: both are stored.
        ablated = without_option(trace, "seed").content_hash()
        ran = [e.trace_hash for e in _executions(store)]
        assert ran.count(ablated) >= 6
        # The option test was the first confirmation of the campaign (before the seed's victims).
        methods = [(name, method, args[1]["kind"]) for name, method, args in pool.calls if method == "confirm"]
        assert methods[0] == ("a", "confirm", "option-slowdown")
        # A latency candidate of a seeded trace is confirmed on the trace without the seed.
        latency = [args for _, method, args in pool.calls if method == "confirm" and args[1]["metric"] is not None]
        assert latency and all(r.seed is None for args in latency for r in args[0].requests)
        state = store.latest_campaign()["state"]
        assert state["option_tests"]["a"]["seed"] == [1, 16 * WORK]  # tested once (other options of its children may be)


def _coordinator(store, settings=None, kinds=("k", "k")):
    coordinator = Coordinator(None, [FleetTarget("a", url="http://127.0.0.1:1", kind=kinds[0]),
                                     FleetTarget("b", url="http://127.0.0.1:2", kind=kinds[1])], store,
                              settings or Settings())
    coordinator._open()
    coordinator.mutator = NullMutator(Limits())
    for t in coordinator.targets.values():
        t.status, t.info = UP, {"limits": Limits().to_dict()}
    return coordinator


def _run(coordinator, name, trace, target):
    """What a worker's execute task returns for ``trace`` on ``target`` (no candidate of its own)."""
    result = target.run(trace)
    store = coordinator.store
    store.put_trace(trace)
    coordinator._executed(coordinator.targets[name], Task("fuzz", trace, operators=("x",)),
                          SimpleNamespace(result=result, coverage=Coverage(frozenset({trace.content_hash()})),
                                          candidates=[]))


def test_the_fleet_tests_an_option_as_a_campaign_does_and_its_checkpoint_keeps_the_counts(store):
    """At most option_tests times on each target, each on a test option_growth times larger (option_size) than the
    largest tested there, never twice at once on one target; a test that came back SAME is no rejection
    (the counts decide); a resumed fleet takes the counts up."""
    coordinator = _coordinator(store)
    a = coordinator.targets["a"]
    target = PaperTarget(seed=3)
    _run(coordinator, "a", _seeded_batch(), target)
    [task] = a.confirm
    assert task.kind == "confirm" and task.key == option_signature("seed")
    assert (task.candidate["kind"], task.candidate["request_id"], task.candidate["detail"]) == (
        "option-slowdown", "carrier", "seed")
    assert coordinator.option_tests == {"a": {"seed": (1, 16 * WORK)}}
    _run(coordinator, "a", _seeded_batch(rows=40), target)  # queued on a already: not again, not counted
    assert len(a.confirm) == 1 and coordinator.option_tests == {"a": {"seed": (1, 16 * WORK)}}
    # It came back SAME.
    a.confirm.clear()
    same = Verdict(None, Decision.SAME, "test", request_id="carrier")
    coordinator._confirmed(a, task, SimpleNamespace(runs=[], verdict=same.to_dict(), crash_needs=()))
    assert task.key not in coordinator.rejected and not store.list_findings()
    _run(coordinator, "a", _seeded_batch(rows=20), target)  # not 1.5 x 16 requests beside it
    assert not a.confirm
    _run(coordinator, "a", _seeded_batch(rows=24), target)
    assert [t.key for t in a.confirm] == [option_signature("seed")] and coordinator.option_tests == {"a": {"seed": (2, 24 * WORK)}}
    coordinator._checkpoint(force=True)
    resumed = _coordinator(store)
    assert resumed.option_tests == {"a": {"seed": (2, 24 * WORK)}}
    assert [t.candidate["kind"] for t in resumed.targets["a"].confirm] == ["option-slowdown"]


def test_an_options_tests_are_counted_per_target(store):
    """One target's SAME spends none of another's tests, even of its kind (the fleet test of stop 43: the
    seed trace's test ran on the clean simulator first, and the planted one's per-row logprobs were never
    tested on a batch it slowed); an older fleet's checkpoint (counts per option) is taken up by each."""
    coordinator = _coordinator(store)
    a, b = coordinator.targets["a"], coordinator.targets["b"]
    target = PaperTarget(seed=3)
    _run(coordinator, "a", _seeded_batch(), target)
    [task] = a.confirm
    coordinator._inflight[object()] = ("a", a.confirm.popleft())  # under way on a
    _run(coordinator, "a", _seeded_batch(rows=40), target)  # not twice at once on a
    assert not a.confirm
    _run(coordinator, "b", _seeded_batch(), target)  # the same batch: b's first test
    assert [t.key for t in b.confirm] == [option_signature("seed")]
    assert coordinator.option_tests == {"a": {"seed": (1, 16 * WORK)}, "b": {"seed": (1, 16 * WORK)}}
    coordinator._checkpoint(force=True)
    assert _coordinator(store).option_tests == coordinator.option_tests
    old = store.latest_campaign()
    store.save_campaign(old["id"], state={**old["state"], "option_tests": {"seed": [2, 24]}}, status=old["status"])
    resumed = _coordinator(store)
    assert resumed.option_tests == {"a": {"seed": (2, 24)}, "b": {"seed": (2, 24)}}


def test_an_option_confirmed_on_two_targets_at_once_is_one_finding_with_both_outcomes(store):
    """Each target tests an option itself: one found while the other's test was under way is recorded
    there as its re-check; one still queued elsewhere gives way to the finding's re-check."""
    coordinator = _coordinator(store)
    a, b = coordinator.targets["a"], coordinator.targets["b"]
    target = PaperTarget(seed=3)
    for name in ("a", "b"):
        _run(coordinator, name, _seeded_batch(), target)
    tests = {"a": a.confirm.popleft(), "b": b.confirm.popleft()}
    found = Verdict(FindingKind.OPTION_SLOWDOWN, Decision.DIFFERENT, "test", request_id="carrier",
                    signature=option_signature("seed"), reproduced=3, runs=3)
    done = SimpleNamespace(runs=[], verdict=found.to_dict(), crash_needs=())
    coordinator._confirmed(a, tests["a"], done)
    assert [t.kind for t in b.confirm] == ["recheck"]
    coordinator._confirmed(b, tests["b"], done)  # b's own test was under way: it is b's re-check
    [finding] = store.list_findings()
    assert finding.details["targets"] == {"a": "3/3", "b": "3/3"} and not b.confirm
    # A test still queued when its option was found elsewhere is not run: the re-check is.
    b.confirm.extend([tests["b"], Task("recheck", tests["b"].trace, candidate=tests["b"].candidate,
                                       key=tests["b"].key, finding_id=finding.id, origin="a")])
    assert coordinator._next_task(b).kind == "recheck"


def test_an_option_found_on_one_kind_is_still_tested_and_found_on_another_as_its_own_finding(store):
    """Another kind is another server: the fleet test of stop 48's CI, where the hol simulator (its own kind)
    confirmed the logprobs option-slowdown first, the logprobs simulator's test was then merged into that
    finding (a target of another kind in its targets) and the planted bug had no finding of its own."""
    coordinator = _coordinator(store, kinds=("x", "y"))
    a, b = coordinator.targets["a"], coordinator.targets["b"]
    target = PaperTarget(seed=3)
    _run(coordinator, "a", _seeded_batch(), target)
    found = Verdict(FindingKind.OPTION_SLOWDOWN, Decision.DIFFERENT, "test", request_id="carrier",
                    signature=option_signature("seed"), reproduced=3, runs=3)
    coordinator._confirmed(a, a.confirm.popleft(), SimpleNamespace(runs=[], verdict=found.to_dict(), crash_needs=()))
    assert not b.confirm  # no re-check on another kind
    # b's own test is due, and b's children keep the option (a's finding explains nothing of b).
    _run(coordinator, "b", _seeded_batch(), target)
    [test] = b.confirm
    assert test.candidate["kind"] == "option-slowdown" and coordinator._found_on(b) == set()
    assert coordinator._found_on(a) == {option_signature("seed")}
    coordinator._confirmed(b, b.confirm.popleft(), SimpleNamespace(runs=[], verdict=found.to_dict(), crash_needs=()))
    findings = {f.details["target"]: f for f in store.list_findings()}
    assert set(findings) == {"a", "b"} and all(f.details["targets"] == {n: "3/3"} for n, f in findings.items())
    assert len({f.signature for f in findings.values()}) == 2
    # A resumed fleet knows both as found, each on its own kind.
    resumed = _coordinator(store, kinds=("x", "y"))
    assert all(resumed._found_on(t) == {option_signature("seed")} for t in resumed.targets.values())


class _AnsweringPool:
    """A pool whose every task comes back at once with ``done``; ``calls``: (target, method, task kind)."""

    def __init__(self, done):
        self.done, self.calls = done, []

    def submit(self, name, method, *args):
        self.calls.append((name, method, args[1]["kind"] if method == "confirm" else None))
        return len(self.calls)

    def wait(self, refs, timeout_s):
        return list(refs)

    def get(self, ref, name, timeout_s=None):
        return self.done


def test_a_max_execs_stop_runs_the_rechecks_of_its_findings_and_a_duration_stop_keeps_them():
    """The fleet test of stop 44's CI: a finding confirmed on the last executions --max-execs allowed had its
    re-check queued and never run, its record one target short. A --max-execs stop runs them (as it waits
    for the confirmations under way); a --duration stop keeps them queued in the checkpoint, for a resume."""
    found = Verdict(FindingKind.OPTION_SLOWDOWN, Decision.DIFFERENT, "test", request_id="carrier",
                    signature=option_signature("seed"), reproduced=3, runs=3)
    done = SimpleNamespace(runs=[], verdict=found.to_dict(), crash_needs=(), busy_s=0.0)
    for reason in (ExitReason.MAX_EXECS, ExitReason.DURATION):
        with Store.memory() as db:
            coordinator = _coordinator(db)
            a, b = coordinator.targets["a"], coordinator.targets["b"]
            _run(coordinator, "a", _seeded_batch(), PaperTarget(seed=3))
            coordinator._confirmed(a, a.confirm.popleft(), done)
            assert [t.kind for t in b.confirm] == ["recheck"]
            coordinator.pool = _AnsweringPool(done)
            coordinator._drain(reason)
            [finding] = db.list_findings()
            if reason is ExitReason.MAX_EXECS:
                assert coordinator.pool.calls == [("b", "confirm", "option-slowdown")] and not b.confirm
                assert finding.details["targets"] == {"a": "3/3", "b": "3/3"}
            else:
                assert coordinator.pool.calls == [] and [t.kind for t in b.confirm] == ["recheck"]
                assert finding.details["targets"] == {"a": "3/3"}


def test_latency_candidates_are_confirmed_without_the_options_of_their_trace(store):
    """As in a campaign (fuzzer.search.causes.without_options), whether the option was found or not:
    one seen now, and one an older fleet's checkpoint queued on the trace as it ran."""
    coordinator = _coordinator(store)
    a = coordinator.targets["a"]
    trace = _seeded_batch()
    victim = {"kind": str(FindingKind.E2E_OUTLIER), "request_id": "row3", "metric": "e2e", "ratio": 2.5,
              "after_idle": False, "detail": ""}
    store.put_trace(trace)
    coordinator._executed(a, Task("fuzz", trace, operators=("x",)), SimpleNamespace(
        result=PaperTarget(seed=3).run(trace), coverage=Coverage(frozenset({"f"})), candidates=[victim]))
    seen = [t for t in a.confirm if t.candidate["metric"] is not None]
    assert [t.candidate["request_id"] for t in seen] == ["row3"], a.confirm
    assert all(r.seed is None for r in seen[0].trace.requests)
    assert store.get_trace(seen[0].trace.content_hash()) == seen[0].trace  # a checkpoint names it by hash
    a.confirm.clear()
    a.confirm.append(Task("confirm", trace, candidate=victim, key="k-seeded"))
    task = coordinator._next_task(a)
    assert task.candidate == victim and task.key != "k-seeded"
    assert all(r.seed is None for r in task.trace.requests)
    assert store.get_trace(task.trace.content_hash()) == task.trace  # a checkpoint names it by hash
    # The option's own test, and a candidate without a latency, keep the trace they were seen on.
    test = Task("confirm", trace, candidate=candidate_to_dict(
        Candidate(FindingKind.OPTION_SLOWDOWN, "carrier", detail="seed")), key=option_signature("logprobs"))
    a.confirm.append(test)
    assert coordinator._next_task(a) is test


def _long_seed() -> Trace:
    """Two requests of 1024 output tokens: 3.6 seconds on the simulator (virtual time)."""
    return Trace(requests=tuple(Request(id=f"r{i}", at_ms=float(i), prompt_tokens=64, max_tokens=1024)
                                for i in range(2)))


def test_with_a_duration_every_fleet_execution_is_capped_and_what_runs_past_the_cap_is_closed(tmp_path):
    """The cap of a campaign (fuzzer.search.pacing.execution_cut_s): near the end of a 20-second
    campaign the budget (1 s) past it; the fleet's clock stands at 19 s once it has started."""
    ticks = iter([0.0])

    def clock():
        return next(ticks, 19.0)

    with Store.open(tmp_path / "fleet.db") as store:
        _, pool = _fleet(store, {"a": (_Virtual(seed=1), "k")},
                         Settings(max_execs=2, duration_s=20.0, seed=1, limits=LIMITS, mutator="null"),
                         [_long_seed()], clock=clock, worker={"clock": lambda: 0.0})
        executions = _executions(store)
    caps = [args[-1] for _, method, args in pool.calls if method in ("execute", "confirm")]
    assert caps and all(c == TimeCap(20.0, 19.0) for c in caps)
    seed = executions[0]
    assert seed.trace_hash == _long_seed().content_hash()
    assert seed.duration_s <= 1.0 + 0.1, seed.duration_s
    assert any(r.outcome.value == "cut" for r in seed.requests), [r.outcome for r in seed.requests]


def test_a_worker_caps_each_run_of_a_task_by_its_own_fcfs_bound_as_a_campaign_does():
    class Recording(_Paper):
        def __init__(self):
            super().__init__(seed=4)
            self.cuts = []

        async def execute(self, trace, *, cut_s=None):
            self.cuts.append(cut_s)
            return self.run(trace)

    now = [100.0]
    target = Recording()
    worker = _Worker(FleetTarget("a", url="http://127.0.0.1:1"), target, seed=1, clock=lambda: now[0])
    try:
        worker.start()
        trace = _seeded_batch()
        worker.execute(trace)
        assert target.cuts[-1] is None  # no --duration: no cap
        target.cuts.clear()
        worker.execute(trace, TimeCap(600.0, 10.0))
        expected = worker.expected_end_s(trace)
        assert expected and target.cuts == [execution_cut_s(600.0, 10.0, expected, worker._policy.factor)]
        # A confirmation's runs are capped too (a campaign's are: each is one of its executions), the
        # ablated trace's by its own bound, with the time the task has taken so far.
        target.cuts.clear()
        ticking = iter(range(1000))
        worker._clock = lambda: 100.0 + 590.0 * min(1, next(ticking))
        candidate = candidate_to_dict(Candidate(FindingKind.OPTION_SLOWDOWN, "carrier", detail="seed"))
        done = worker.confirm(trace, candidate, TimeCap(600.0, 0.0))
        assert len(target.cuts) == len(done.runs) >= 2
        assert target.cuts[0] == execution_cut_s(600.0, 590.0, expected, worker._policy.factor)
        assert all(c is not None for c in target.cuts)
    finally:
        worker.stop()
