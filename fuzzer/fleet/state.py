"""What a fleet coordinator knows, and how it is checkpointed in the campaign's state.

:class:`Task` is one typed task for a worker (``seed``, ``fuzz``, ``sync``, ``confirm``,
``recheck``); :class:`TargetState` is one target's standing (up or down, its corpus, its
queues, its counts). :func:`to_state` and :func:`from_state` write and read them as the
JSON state of the campaign row, so the same command takes a killed campaign up again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from fuzzer.fleet.targets import FleetTarget
from fuzzer.search.corpus import Corpus
from fuzzer.trace import Trace

UP, DOWN, STARTING = "up", "down", "starting"


@dataclass(frozen=True)
class Task:
    """One typed task for a worker. ``candidate``/``key``: a confirmation's; ``finding_id``: a re-check's."""

    kind: str
    trace: Trace
    parent: int | None = None
    operators: tuple[str, ...] = ()
    candidate: Mapping[str, Any] | None = None
    key: str | None = None
    finding_id: int | None = None
    #: Where a re-checked finding was first confirmed.
    origin: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "trace_hash": self.trace.content_hash(), "parent": self.parent,
                "operators": list(self.operators), "candidate": None if self.candidate is None else dict(self.candidate),
                "key": self.key, "finding_id": self.finding_id, "origin": self.origin}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], trace_of: Callable[[str], Trace]) -> "Task":
        return cls(data["kind"], trace_of(data["trace_hash"]), data.get("parent"), tuple(data.get("operators", ())),
                   data.get("candidate"), data.get("key"), data.get("finding_id"), data.get("origin"))


@dataclass
class TargetState:
    """One target of the fleet as the coordinator sees it."""

    spec: FleetTarget
    status: str = STARTING
    reason: str = ""
    target_id: int | None = None
    corpus: Corpus = field(default_factory=Corpus)
    #: Confirmations and re-checks to run here, first in first out (they go before fuzzing).
    confirm: deque[Task] = field(default_factory=deque)
    #: Corpus entries other targets found, to run here in a batch (AFL++ secondaries' sync).
    inbox: deque[Task] = field(default_factory=deque)
    seeded: int = 0
    #: Executions stored from this target, by purpose (all runs of the campaign).
    executions: dict[str, int] = field(default_factory=dict)
    #: Seconds the worker was busy on tasks (all runs), and findings first confirmed here.
    busy_s: float = 0.0
    findings: int = 0
    since_sync: int = 0
    #: Running a sync batch: the rest of the inbox goes first.
    syncing: bool = False
    #: Consecutive tasks that failed because the server could not be reached, and when to try again.
    errors: int = 0
    retry_at: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def total(self) -> int:
        return sum(self.executions.values())

    def counted(self, purpose: str, n: int = 1) -> None:
        self.executions[purpose] = self.executions.get(purpose, 0) + n


def to_state(targets: Mapping[str, TargetState], *, retry: list[Task], orphans: list[tuple[str, Task]],
             running: Mapping[str, list[Task]] | None = None) -> dict:
    """The targets' part of the campaign's checkpoint (corpora, queues, counts, standing).

    ``running``: confirmations under way per target, saved first in its queue (done again on resume).
    """
    running = running or {}
    return {
        "targets": {
            t.name: {
                "status": t.status, "reason": t.reason, "target_id": t.target_id, "kind": t.spec.kind,
                "corpus": t.corpus.to_dict(), "confirm": [task.to_dict() for task in (*running.get(t.name, ()), *t.confirm)],
                "inbox": [task.to_dict() for task in t.inbox], "seeded": t.seeded, "executions": t.executions,
                "busy_s": round(t.busy_s, 3), "findings": t.findings, "host": t.info.get("host"),
            }
            for t in targets.values()
        },
        "retry": [task.to_dict() for task in retry],
        "orphans": [{"target": name, **task.to_dict()} for name, task in orphans],
    }


def from_state(targets: Mapping[str, TargetState], state: Mapping[str, Any],
               trace_of: Callable[[str], Trace]) -> tuple[list[Task], list[tuple[str, Task]]]:
    """Take up a checkpoint: each known target's corpus, queues and counts; returns (retry, orphans).

    A target of the file the checkpoint does not know starts afresh; one the file no longer
    names is forgotten, its confirmations kept as orphans (done when a target of its kind is up).
    """
    saved = state.get("targets", {})
    orphans = [(o["target"], Task.from_dict(o, trace_of)) for o in state.get("orphans", [])]
    for name, data in saved.items():
        target = targets.get(name)
        pending = [Task.from_dict(d, trace_of) for d in data.get("confirm", [])]
        if target is None:
            orphans += [(name, task) for task in pending]
            continue
        entries = data.get("corpus", {}).get("entries", [])
        target.corpus = Corpus.from_dict(data.get("corpus", {}), {e["trace_hash"]: trace_of(e["trace_hash"]) for e in entries})
        target.confirm = deque(pending)
        target.inbox = deque(Task.from_dict(d, trace_of) for d in data.get("inbox", []))
        target.seeded = int(data.get("seeded", 0))
        target.executions = dict(data.get("executions", {}))
        target.busy_s = float(data.get("busy_s", 0.0))
        target.findings = int(data.get("findings", 0))
    retry = [Task.from_dict(d, trace_of) for d in state.get("retry", [])]
    return retry, orphans


def option_tests_from_state(state: dict, targets: set[str]) -> dict[str, dict[str, tuple[int, int]]]:
    """The option tests' counts of a checkpoint, per target; an older fleet's counts (per option, of every
    target together) are taken up by each target."""
    counts: dict[str, dict[str, tuple[int, int]]] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            counts.setdefault(key, {}).update({k: (int(v[0]), int(v[1])) for k, v in value.items()})
        else:
            for name in targets:
                counts.setdefault(name, {})[key] = (int(value[0]), int(value[1]))
    return counts
