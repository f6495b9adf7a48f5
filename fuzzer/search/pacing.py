"""How a campaign spends its time: idling on purpose (cold probes) and the seeding share.

Cold probes. A server that sat idle for a while can be slow on its first requests
(vLLM #16858, #31602, the 37308 repro's run 1), but a campaign runs executions back
to back, so after its first execution it never meets a cold server. A *cold probe*
lets the server sit idle for the oracle's ``cold_idle_s`` before one execution of a
corpus trace, so that the oracle sees a cold run (and its confirmation then re-runs
the trace warm and after idle periods, as for any cold-start candidate).

* The first probe comes as soon as the corpus has an entry (a deterministic stage,
  like AFL's before havoc); later ones come with a probability per fuzz iteration
  that follows their success, as the operator bandit does: probes whose execution
  gave the oracle a candidate raise it, empty ones lower it, and once a cold-start
  finding is confirmed it drops to a floor (more probes would find the same bug on
  other traces).
* Idling costs nothing on virtual time (the target advances its clock) but real
  wall time over HTTP, so the wall seconds slept on purpose (probes and the cold arms
  of confirmation) may take at most ``idle_share`` of the campaign's wall time, counted
  against its planned duration when it has one; a probe comes only while that share
  affords it and the cold arm that would confirm a cold start it shows (no probe in a
  3-minute campaign: 18 s of 40).

Execution budget and time cap. With a --duration, a mutant whose FCFS bound would keep the
server busy past its share of the campaign is mutated again, and every execution has a time
cap past which what still runs is closed (``execution_cut_s``).

Confirmation share. Confirmation runs may take at most ``confirm_share`` of the server time;
a latency candidate that would go over it waits, ranked (fuzzer.search.confirming).

Stopping. A stop (Ctrl-C) ends the campaign after the current execution, but a calibration is
minutes of probes: a stop that comes during one cancels it (:func:`unless_stopped`) and nothing
of it is stored. On a GPU-backed llama-server one took over 290 s, and a campaign stopped 35 s
into it was still calibrating when it was killed.

Seeding share. Every seed is executed once and kept provisionally (its stability
runs come when it is first fuzzed, see :meth:`fuzzer.search.corpus.Corpus.settle`). Seeds run
cheapest first, and once the corpus has an entry, seeding may take at most
``seed_share`` of the server time spent so far: on a server where one seed takes a
minute, mutation starts after the first seed and seeding continues between fuzz
iterations instead of eating a short campaign.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Mapping, TypeVar

from fuzzer.oracle.calibration import Calibration
from fuzzer.oracle.expectation import PLAIN_END_ROOM, plain_end_s, schedule_end_s
from fuzzer.search.corpus import CHEAP_S
from fuzzer.trace import Trace

T = TypeVar("T")

#: Chance per fuzz iteration of a cold probe, before any feedback.
COLD_PROBE_RATE = 0.05
#: ... never below this (a server can turn cold-sensitive after a restart or a reload).
COLD_PROBE_FLOOR = 0.01
#: At most this share of the campaign's wall time is spent idling on purpose.
IDLE_SHARE = 0.1
#: Once the corpus has an entry, seeding may take at most this share of the server time.
SEED_SHARE = 0.5
#: Confirmation runs may take at most this share of the server time before a latency candidate waits
#: (fuzzer.search.confirming): with stability re-runs (~13%) and the rest (calibration, seeds, idle:
#: ~5%) it leaves 60% of a campaign to fuzz executions. On the held-out vLLM-like server with every
#: bug on, uncapped confirmation took 31-44% of 30-minute campaigns, most of it one bug's findings.
CONFIRM_SHARE = 0.2
#: In this last share of a campaign with --duration the confirmation share holds no candidate back: the
#: waiting ones are confirmed, best-ranked first, rather than fuzzing on for candidates no time is left to
#: confirm (heldout9 with every bug ended a 30-minute campaign with 16 waiting, one 153x over its bound,
#: and two of its bugs on no finding). A campaign with no finding waits on nothing: this costs it nothing.
CLOSING_SHARE = 0.1
#: The closing share starts sooner, as far back as this share, once the time left is no more than confirming
#: what waits takes (``Confirmer.waiting_cost_s``): with 10% alone, 30-minute campaigns with every bug on ended
#: with 7-14 candidates of 3-6 families waiting (heldout2, 3, 6, 9; up to 83x over its bound), their re-runs
#: 3-40 s each, the last three minutes enough for two or three.
MAX_CLOSING_SHARE = 0.3

#: A child the FCFS bound says would keep the server busy longer than its share of the
#: campaign (EXECUTION_SHARE of --duration, at most MAX_EXECUTION_S) is mutated again, up to
#: AFFORD_TRIES times (then the shortest is run): on a slow engine one mutant of 8 long prompts with 1024
#: output tokens each took 55 s per run on vLLM's CPU build, and its confirmation most of an
#: 8-minute campaign. Campaigns without a duration have no such budget.
EXECUTION_SHARE = 0.05
MAX_EXECUTION_S = 120.0
AFFORD_TRIES = 4
#: The bound is a forecast; a pathology can make a run far longer (a 3-minute campaign's mutant
#: bounded at 7 s ran 130 s on the simulator's planted logprobs batch cost, and the campaign
#: overran its duration by 113 s). So every execution of a campaign with a duration has a time
#: cap (``execution_cut_s``): the candidate factor times the later of the budget and the end of
#: its own FCFS schedule, and no later than the budget past the campaign's end. What still runs
#: then is closed. A request that arrived at ``a`` with bound ``b`` (a + b within that end) has
#: by then waited at least factor x (a + b) - a >= factor x b: every request the cap closes is
#: already a candidate, so waiting longer could only measure by how much.


def execution_budget_s(duration_s: float | None) -> float | None:
    """The longest one execution should keep the server busy, by its FCFS bound; None: no limit."""
    return None if duration_s is None else min(MAX_EXECUTION_S, EXECUTION_SHARE * duration_s)


#: In a short campaign an entry's server time is weighed against this share of one execution's budget
#: when it is below CHEAP_S (fuzzer.search.corpus): in a 90-second job (a 4.5 s budget) a 3 s trace
#: costs two thirds of what one execution may, and its children as much. In the README's 3-minute job
#: (a 9 s budget) this share gave 3 s where CHEAP_S was 10 s, and the job ran 53 and 59 executions where it
#: ran 46 and 55 (seeds 1 and 2, benchmarks/README.md, stop 41); since CHEAP_S is 3 s, only campaigns
#: shorter than 3 minutes weigh against less.
CHEAP_BUDGET_SHARE = 1 / 3


def cheap_s(duration_s: float | None) -> float:
    """What counts as a cheap entry's server time in a campaign of ``duration_s`` (None: no duration)."""
    budget = execution_budget_s(duration_s)
    return CHEAP_S if budget is None else min(CHEAP_S, CHEAP_BUDGET_SHARE * budget)


def execution_cut_s(duration_s: float | None, elapsed_s: float, expected_s: float | None, factor: float) -> float | None:
    """The time cap of one execution whose FCFS bound ends at ``expected_s`` (None: unknown), ``elapsed_s``
    into a campaign of ``duration_s`` (None: no cap), its candidate factor ``factor`` (see above)."""
    budget = execution_budget_s(duration_s)
    if budget is None:
        return None
    assert duration_s is not None
    return min(factor * max(budget, expected_s or 0.0), max(budget, duration_s - elapsed_s))


def earliest_cut_s(*caps: float | None) -> float | None:
    """The earliest of the time caps given (None: no cap): an execution's own and a confirmation's."""
    return min((c for c in caps if c is not None), default=None)


class ScheduleEnds:
    """When each trace's FCFS schedule ends (fuzzer.oracle.expectation.schedule_end_s), kept per
    calibration: a campaign's and a fleet worker's execution budget and time cap ask for it before
    every execution, and a trace is run many times."""

    def __init__(self) -> None:
        self._ends: dict[str, float] = {}
        self._plain: dict[str, float] = {}
        self._of: Calibration | None = None

    def end_s(self, trace: Trace, calibration: Calibration | None, digest: str | None = None, *,
              beyond: float | None = None) -> float | None:
        """When ``trace`` (hash ``digest``) would end under ``calibration``; None without one or requests, and,
        given ``beyond`` (an execution budget), where the trace's plain schedule says it ends well within it
        (fuzzer.oracle.expectation.plain_end_s: the envelope costs most of the fuzzer's own time between
        executions, and a budget of tens of seconds only needs it for the longest traces)."""
        if calibration is None or not trace.requests:
            return None
        if self._of is not calibration:
            self._ends, self._plain, self._of = {}, {}, calibration
        digest = digest or trace.content_hash()
        if beyond is not None and digest not in self._ends:
            if digest not in self._plain:
                self._plain[digest] = plain_end_s(trace, calibration.model, calibration.assumption)
            if self._plain[digest] * PLAIN_END_ROOM <= beyond:
                return None
        if digest not in self._ends:
            self._ends[digest] = schedule_end_s(trace, calibration.model, calibration.assumption)
        return self._ends[digest]


@dataclass
class ColdProbes:
    """The cold-probe schedule and what it has cost and found (checkpointed with the campaign)."""

    probes: int = 0
    #: Probes whose cold execution gave the oracle a candidate to confirm.
    candidates: int = 0
    #: Whether a cold-start finding has been confirmed in this campaign.
    found: bool = False
    #: Wall seconds slept on purpose: probes and confirmation's cold arms (0 on virtual time).
    idle_spent_s: float = 0.0

    def rate(self) -> float:
        """The chance of a probe per fuzz iteration (after the first probe)."""
        if self.found:
            return COLD_PROBE_FLOOR
        learned = COLD_PROBE_RATE * 2.0 * (self.candidates + 1) / (self.probes + 2)
        return max(COLD_PROBE_FLOOR, min(0.5, learned))

    def affordable(self, idle_cost_s: float, *, elapsed_s: float, horizon_s: float | None,
                   share: float = IDLE_SHARE) -> bool:
        """Whether idling ``idle_cost_s`` more wall seconds keeps within ``share`` of the campaign."""
        if idle_cost_s <= 0:
            return True
        span = max(elapsed_s + idle_cost_s, horizon_s or 0.0)
        return self.idle_spent_s + idle_cost_s <= share * span

    def due(self, rng: random.Random, idle_cost_s: float, *, elapsed_s: float, horizon_s: float | None,
            share: float = IDLE_SHARE, confirm_idles: int = 0) -> bool:
        """Whether the next fuzz iteration should be a cold probe: only while the share affords the probe's
        idle period and the ``confirm_idles`` of a cold arm that would confirm what it finds (a 3-minute
        campaign's 18 s cannot: its probe and the first cold run were 11% of the README's main job, and a
        cold-start it showed could never have been confirmed)."""
        cost = idle_cost_s * (1 + confirm_idles)
        if share <= 0 or not self.affordable(cost, elapsed_s=elapsed_s, horizon_s=horizon_s, share=share):
            return False
        return self.probes == 0 or rng.random() < self.rate()

    def record(self, *, candidate: bool, cold_start_found: bool) -> None:
        self.probes += 1
        self.candidates += int(candidate)
        self.found = self.found or cold_start_found

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping | None) -> "ColdProbes":
        data = data or {}
        return cls(probes=int(data.get("probes", 0)), candidates=int(data.get("candidates", 0)),
                   found=bool(data.get("found", False)), idle_spent_s=float(data.get("idle_spent_s", 0.0)))


def closing(elapsed_s: float, horizon_s: float | None, share: float = CLOSING_SHARE, waiting_s: float = 0.0) -> bool:
    """Whether a campaign ``elapsed_s`` into its planned ``horizon_s`` (None: no end planned) is in its
    closing ``share``: its last ``share``, or sooner (up to MAX_CLOSING_SHARE from the end) when what waits
    takes ``waiting_s`` to confirm and no more time is left."""
    if horizon_s is None or horizon_s <= 0 or share <= 0:
        return False
    return elapsed_s >= (1.0 - max(share, min(MAX_CLOSING_SHARE, waiting_s / horizon_s))) * horizon_s


@dataclass
class ServerTime:
    """Server seconds (execution durations) spent seeding, confirming and in all, for their shares."""

    seed_s: float = 0.0
    total_s: float = 0.0
    confirm_s: float = 0.0

    def record(self, purpose: str, duration_s: float) -> None:
        self.total_s += duration_s
        if purpose == "seed":
            self.seed_s += duration_s
        elif purpose == "confirm":
            self.confirm_s += duration_s

    def seed_due(self, corpus_size: int, share: float = SEED_SHARE) -> bool:
        """Seed next (rather than fuzz)? Always while the corpus is empty, then within ``share``."""
        return corpus_size == 0 or share >= 1.0 or self.seed_s <= share * self.total_s

    def confirm_due(self, share: float = CONFIRM_SHARE) -> bool:
        """May a confirmation start now? While confirmation runs are within ``share`` of the server time."""
        return share >= 1.0 or self.confirm_s <= share * self.total_s

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping | None) -> "ServerTime":
        data = data or {}
        return cls(seed_s=float(data.get("seed_s", 0.0)), total_s=float(data.get("total_s", 0.0)),
                   confirm_s=float(data.get("confirm_s", 0.0)))


#: The phases server time is attributed to (TimeSpent), in the order they are shown. Executions
#: count under their purpose (seed, fuzz, stability, confirm, cold-probe); "other" is what is
#: left of the wall time: the client judging, mutating and storing between executions.
TIME_PHASES = ("calibrate", "seed", "fuzz", "stability", "confirm", "cold-probe", "idle", "recover", "other")


@dataclass
class TimeSpent:
    """Wall seconds of a campaign by phase: where the server's time went.

    Every execution's wall time (send to the end of its speed check) is added under its
    purpose; a calibration, an idle period and a wait for a server that went down under
    their own names. ``other`` is derived: the campaign's elapsed time less all of those.
    ``before_s``: the elapsed time of the earlier runs of a resumed campaign.
    """

    seconds: dict[str, float] = field(default_factory=dict)
    before_s: float = 0.0

    def add(self, phase: str, seconds: float) -> None:
        if seconds > 0:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @contextlib.contextmanager
    def timing(self, phase: str, clock: Callable[[], float]) -> Iterator[None]:
        """Add the block's seconds by ``clock`` under ``phase``, however it ends."""
        start = clock()
        try:
            yield
        finally:
            self.add(phase, clock() - start)

    def by_phase(self, elapsed_s: float) -> dict[str, float]:
        """Seconds by phase (every phase of TIME_PHASES, in that order), ``other`` the rest of the
        campaign's time: ``elapsed_s`` of this run plus the earlier runs'."""
        out = {p: round(self.seconds.get(p, 0.0), 3) for p in TIME_PHASES if p != "other"}
        out.update({p: round(s, 3) for p, s in self.seconds.items() if p not in out})
        out["other"] = round(max(0.0, self.before_s + elapsed_s - sum(self.seconds.values())), 3)
        return out

    def to_dict(self, elapsed_s: float) -> dict:
        return {"seconds": dict(self.seconds), "elapsed_s": self.before_s + elapsed_s}

    @classmethod
    def from_dict(cls, data: Mapping | None) -> "TimeSpent":
        data = data or {}
        return cls({str(k): float(v) for k, v in (data.get("seconds") or {}).items()}, float(data.get("elapsed_s", 0.0)))


def fuzz_share(seconds: Mapping[str, float]) -> float | None:
    """The share of a campaign's time (TimeSpent.by_phase) spent in fuzz executions; None before any time."""
    total = sum(seconds.values())
    return seconds.get("fuzz", 0.0) / total if total > 0 else None


class Stopped(Exception):
    """Asked to stop while waiting: for a server that is down, or for a calibration."""


#: While a calibration runs, the campaign's status is told this often (a log gets its status line).
TICK_S = 30.0


async def unless_stopped(work: Awaitable[T], stop: asyncio.Event, *, tick: Callable[[], object] = lambda: None,
                         every_s: float = TICK_S) -> T:
    """``work``'s result, or Stopped (``work`` cancelled) when ``stop`` is set first; ``tick`` is called
    every ``every_s`` while it runs."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        while not (await asyncio.wait((task, stopping), timeout=every_s, return_when=asyncio.FIRST_COMPLETED))[0]:
            tick()
    finally:
        stopping.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise Stopped
    return task.result()


def token_work(trace: Trace) -> int:
    """The tokens ``trace`` asks the engine for (prompts, and outputs of every choice): the campaign runs cheap seeds first."""
    return sum(r.prompt_tokens + r.max_tokens * r.n for r in trace.requests)
