"""A fleet campaign's checkpoint (fuzzer/fleet/state.py) without a cluster: what a killed
coordinator's successor takes up."""

from __future__ import annotations

from collections import deque

from fuzzer.fleet.coordinator import _narrowest
from fuzzer.fleet.state import DOWN, Task, TargetState, from_state, to_state
from fuzzer.fleet.targets import FleetTarget
from fuzzer.search.coverage import Coverage
from fuzzer.search.mutators import Limits
from fuzzer.trace import Request, Trace


def _trace(n: int) -> Trace:
    return Trace(requests=tuple(Request(id=f"r{i}", at_ms=i, prompt_tokens=16 * (n + 1), max_tokens=4)
                                for i in range(n + 1)))


def test_the_checkpoint_keeps_corpora_queues_running_confirmations_and_counts(store):
    traces = [_trace(i) for i in range(4)]
    for t in traces:
        store.put_trace(t)
    a, b = FleetTarget("a", url="http://127.0.0.1:1", kind="k"), FleetTarget("b", url="http://127.0.0.1:2", kind="k")
    states = {"a": TargetState(a), "b": TargetState(b, status=DOWN, reason="worker lost")}
    states["a"].corpus.add(traces[0], [Coverage(frozenset({"f1"}))])
    candidate = {"kind": "ttft-outlier", "request_id": "r0", "metric": "ttft", "ratio": 9.0, "after_idle": False,
                 "detail": ""}
    queued = Task("recheck", traces[1], candidate=candidate, key="k1", finding_id=3, origin="b")
    running = Task("confirm", traces[2], candidate=candidate, key="k2")
    states["a"].confirm.append(queued)
    states["a"].inbox.append(Task("sync", traces[3], operators=("sync",)))
    states["a"].counted("fuzz", 7)
    states["a"].seeded = 2
    lost = Task("fuzz", traces[3], parent=1, operators=("fill",))
    saved = to_state(states, retry=[lost], orphans=[("c", running)], running={"a": [running]})

    fresh = {"a": TargetState(a), "b": TargetState(b)}
    retry, orphans = from_state(fresh, saved, store.get_trace)
    assert [t.trace for t in retry] == [traces[3]] and retry[0].operators == ("fill",)
    assert orphans == [("c", running)]
    # The confirmation under way when the coordinator died comes first, then the queue.
    assert list(fresh["a"].confirm) == [running, queued]
    assert [t.trace for t in fresh["a"].inbox] == [traces[3]]
    assert fresh["a"].corpus.contains(traces[0]) and len(fresh["a"].corpus) == 1
    assert fresh["a"].executions == {"fuzz": 7} and fresh["a"].seeded == 2
    assert saved["targets"]["b"]["status"] == DOWN and saved["targets"]["b"]["reason"] == "worker lost"


def test_a_target_the_file_no_longer_names_leaves_its_confirmations_as_orphans(store):
    trace = _trace(1)
    store.put_trace(trace)
    gone = FleetTarget("gone", url="http://127.0.0.1:3")
    task = Task("confirm", trace, candidate={"kind": "leak"}, key="k")
    saved = to_state({"gone": TargetState(gone, confirm=deque([task]))}, retry=[], orphans=[])
    retry, orphans = from_state({}, saved, store.get_trace)
    assert retry == [] and orphans == [("gone", task)]


def test_mutants_fit_every_target_of_the_fleet_and_the_campaigns_own_limits():
    small = Limits(max_model_len=4096, unsupported=frozenset({"n"}), max_n=1)
    large = Limits(max_model_len=32768, unsupported=frozenset({"logprobs"}))
    settings = Limits(max_requests=10, max_output_tokens=128)
    got = _narrowest([small, large], settings)
    assert got.max_model_len == 4096 and got.unsupported == {"n", "logprobs"} and got.max_n == 1
    assert (got.max_requests, got.max_output_tokens) == (10, 128)


def _one_target_coordinator(store):
    """A coordinator of one target, up, that mutates nothing: (coordinator, its target's state)."""
    from fuzzer.fleet.coordinator import Coordinator
    from fuzzer.fleet.state import UP
    from fuzzer.search.mutators import NullMutator
    from fuzzer.search.settings import Settings

    coordinator = Coordinator(None, [FleetTarget("a", url="http://127.0.0.1:1", kind="k")], store, Settings())
    coordinator._open()
    coordinator.mutator = NullMutator(Limits())
    t = coordinator.targets["a"]
    t.status, t.info = UP, {"limits": Limits().to_dict()}
    return coordinator, t


def test_the_coordinator_backs_off_a_found_family_and_strips_a_found_leaks_disconnects(store):
    """The fleet confirms as a campaign does (fuzzer.search.confirming): a new signature of a found
    family once in FAMILY_EVERY sightings, and no child keeps a disconnect whose leak is confirmed."""
    from types import SimpleNamespace

    from fuzzer.execution import ExecutionResult
    from fuzzer.oracle.kinds import FindingKind
    from fuzzer.oracle.signature import family, leak_signature
    from fuzzer.oracle.verdict import Decision, Verdict
    from fuzzer.search.confirming import FAMILY_EVERY

    coordinator, t = _one_target_coordinator(store)
    kind = FindingKind.TTFT_OUTLIER
    # Traces in which a request v follows k others of growing prompts: new signatures, one family.
    traces = [Trace(requests=(*(Request(id=f"o{i}", at_ms=i, prompt_tokens=16 << k, max_tokens=8) for i in range(k)),
                              Request(id="v", at_ms=20, prompt_tokens=256, max_tokens=32)))
              for k in range(2 + FAMILY_EVERY)]
    assert len({family(kind, tr, "v") for tr in traces}) == 1
    candidate = {"kind": str(kind), "request_id": "v", "metric": "ttft", "ratio": 9.0, "after_idle": False,
                 "detail": ""}
    found = Verdict(kind, Decision.DIFFERENT, "test", request_id="v", reproduced=3, runs=3)
    coordinator._confirmed(t, Task("confirm", traces[0], candidate=candidate, key="k0"),
                           SimpleNamespace(runs=[], verdict=found.to_dict(), crash_needs=()))
    assert store.list_findings()[0].details["family"] == family(kind, traces[0], "v")
    queued = []
    for tr in traces[1:]:
        result = ExecutionResult(tr.content_hash(), "http://127.0.0.1:1", 0.0, 1.0, ())
        coordinator._executed(t, Task("fuzz", tr, operators=("x",)),
                              SimpleNamespace(result=result, coverage=Coverage(frozenset({tr.content_hash()})),
                                              candidates=[candidate]))
        queued.append(len(t.confirm))
        t.confirm.clear()
    # Passed over FAMILY_EVERY - 1 times, then confirmed once again (a second bug of the family is still found).
    assert queued[:FAMILY_EVERY] == [0] * (FAMILY_EVERY - 1) + [1]
    # A child made once a leak by cancels is confirmed keeps no cancel.
    coordinator.found.add(leak_signature({"cancel"}))
    parent = Trace(requests=(Request(id="c", at_ms=0, prompt_tokens=64, max_tokens=512, cancel_after_tokens=4),))
    t.corpus.add(parent, [Coverage(frozenset({"p"}))])
    child = coordinator._next_task(t).trace
    assert all(r.cancel_after_tokens is None for r in child.requests)
    # ... and once an option-slowdown of logprobs is, no logprobs (it would only slow everyone again).
    from fuzzer.oracle.signature import option_signature

    coordinator.found.add(option_signature("logprobs"))
    t.corpus.add(Trace(requests=(*(Request(id=f"b{i}", at_ms=0, prompt_tokens=64, max_tokens=64) for i in range(4)),
                                 Request(id="l", at_ms=0, prompt_tokens=64, max_tokens=64, logprobs=5))),
                 [Coverage(frozenset({"q"}))])
    children = [coordinator._next_task(t).trace for _ in range(8)]
    assert all(r.logprobs is None for c in children for r in c.requests)


def test_the_coordinator_keeps_a_held_back_choices_family_whatever_the_batch(store):
    """A fleet's held-choice finding is one family as a campaign's (fuzzer.oracle.judge.later_choice_stall)."""
    from types import SimpleNamespace

    from fuzzer.execution import ExecutionResult
    from fuzzer.oracle.kinds import FindingKind
    from fuzzer.oracle.signature import family
    from fuzzer.oracle.verdict import Decision, Verdict

    coordinator, t = _one_target_coordinator(store)
    kind = FindingKind.ITL_STALL
    plain = Trace(requests=(Request(id="o", at_ms=0, prompt_tokens=64, max_tokens=8),
                            Request(id="v", at_ms=5, prompt_tokens=128, max_tokens=64, n=2)))
    seeded = plain.with_requests([*plain.requests, Request(id="s", at_ms=9, prompt_tokens=8, max_tokens=4, seed=1)])
    held = {"kind": str(kind), "request_id": "v", "metric": "max_itl", "ratio": 9.0, "after_idle": False,
            "detail": "", "held_choice": True}
    found = Verdict(kind, Decision.DIFFERENT, "test", request_id="v", reproduced=3, runs=3)
    coordinator._confirmed(t, Task("confirm", plain, candidate=held, key="k0"),
                           SimpleNamespace(runs=[], verdict=found.to_dict(), crash_needs=()))
    (finding,) = store.list_findings()
    assert finding.details["held_choice"] and finding.details["family"] == family(kind, plain, "v", held_choice=True)

    def queued(candidate):
        result = ExecutionResult(seeded.content_hash(), "http://127.0.0.1:1", 0.0, 1.0, ())
        coordinator._executed(t, Task("fuzz", seeded, operators=("x",)),
                              SimpleNamespace(result=result, coverage=Coverage(frozenset({"c"})), candidates=[candidate]))
        out = len(t.confirm)
        t.confirm.clear()
        return out

    # A seeded batch is another family for a stall of choice 0, the same one for a held-back choice.
    assert queued(held) == 0 and queued({**held, "held_choice": False}) == 1
