"""The corpus of interesting traces, and which one to fuzz next (ARCHITECTURE.md, "Search").

A trace is kept when it reaches a feature no entry has reached, or when it sets a
new maximum slowdown for a request class (PerfFuzz keeps the best input per key;
those "top-rated" entries are favoured). Entries are executed several times and
only the features seen in every run count ("stable"); the rest are unstable and
ignored, and the campaign reports stability as AFL does. An entry may be kept
*provisionally* on its first run and settled (re-run, flickering features dropped)
when it is first picked to be fuzzed: early in a campaign nearly every new trace
brings new behaviour, and most kept traces are never picked, so re-running each one
at once would spend most executions on stability runs.

Scheduling follows AFL's "fast" power schedule in spirit: favoured entries and
entries fuzzed rarely get more energy, entries whose children stopped finding
anything ("stale") get less.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from fuzzer.search.coverage import Coverage
from fuzzer.trace import Trace

# A new maximum must beat the old one by this much to count: timing noise of a few
# percent must not refill the corpus with copies of the same trace.
MIN_SCORE_GAIN = 1.2
# Energy multipliers (AFL fast: favoured x1.15 on top of a 4 -> 0.4 factor over n_fuzz;
# our executions cost seconds, so the spread is wider and simpler).
FAVOURED_ENERGY = 4.0
STALE_AFTER = 20  # picks without a single kept child
STALE_ENERGY = 0.25
# AFL favours fast inputs; here an entry's energy is divided by 1 + its expected server time
# over this many seconds (when the campaign can tell it): a 45 s trace is picked about a twelfth as
# often as a 1 s one. Havoc and the shapes grow traces, and each child of a long one is long too:
# with every bug on, the held-out server's 30-minute campaign ran 27 fuzz executions of 21.5 s
# on average (traces of up to 48 requests and 80k tokens), half of its earlier count. 10 s until
# stop 63: the README's main job for 30 minutes (seed 1, side by side) then ran fuzz executions of
# 7.1 s on average and 252 executions in all; at 3 s, 5.4 s and 324, with the same findings
# (benchmarks/README.md, stop 63).
CHEAP_S = 3.0


@dataclass
class Entry:
    """One kept trace."""

    id: int
    trace: Trace
    features: frozenset[str]
    scores: dict[str, float]
    parent: int | None = None
    operators: tuple[str, ...] = ()
    found_at_exec: int = 0
    n_fuzz: int = 0
    finds: int = 0
    since_find: int = 0

    @functools.cached_property
    def hash(self) -> str:
        """The trace's content hash, computed once (an entry's trace never changes)."""
        return self.trace.content_hash()

    @property
    def score(self) -> float:
        return max(self.scores.values(), default=0.0)


@dataclass
class Corpus:
    entries: dict[int, Entry] = field(default_factory=dict)
    #: feature -> number of entries holding it as a stable feature (AFL's virgin map, inverted).
    seen: dict[str, int] = field(default_factory=dict)
    #: request-class key -> id of the entry with the highest stable score for it.
    top_rated: dict[str, int] = field(default_factory=dict)
    #: Features that differed between runs of the same trace; never count as new.
    unstable: set[str] = field(default_factory=set)
    stable_observations: int = 0
    unstable_observations: int = 0
    #: Entries kept on one run, not yet re-run (see :meth:`settle`).
    provisional: set[int] = field(default_factory=set)
    _next_id: int = 1

    # --- what is interesting ---------------------------------------------------------

    def novelty(self, coverage: Coverage) -> tuple[frozenset[str], frozenset[str]]:
        """(new features, request classes with a new maximum) of one execution."""
        new = frozenset(f for f in coverage.features if f not in self.seen and f not in self.unstable)
        better = frozenset(
            key for key, value in coverage.scores.items()
            if key not in self.top_rated or value > MIN_SCORE_GAIN * self.entries[self.top_rated[key]].scores.get(key, 0.0)
        )
        return new, better

    def is_interesting(self, coverage: Coverage) -> bool:
        new, better = self.novelty(coverage)
        return bool(new or better)

    def contains(self, trace: Trace) -> bool:
        digest = trace.content_hash()
        return any(e.hash == digest for e in self.entries.values())

    # --- adding ----------------------------------------------------------------------

    def add(
        self,
        trace: Trace,
        runs: Iterable[Coverage],
        *,
        parent: int | None = None,
        operators: tuple[str, ...] = (),
        found_at_exec: int = 0,
        provisional: bool = False,
    ) -> Entry | None:
        """Keep ``trace`` with the features stable over ``runs`` (its calibration executions).

        Returns the new entry, or None when nothing stable is new (the find was noise).
        ``provisional``: ``runs`` is the first execution only; :meth:`settle` re-runs come later.
        """
        runs = list(runs)
        candidate = self._first(runs) if provisional else self._stable(runs)
        new, better = self.novelty(candidate)
        if not (new or better) or self.contains(trace):
            return None
        entry = self._insert(trace, candidate, better, parent, operators, found_at_exec)
        if provisional:
            self.provisional.add(entry.id)
        return entry

    def add_forced(
        self,
        trace: Trace,
        runs: Iterable[Coverage],
        *,
        operators: tuple[str, ...] = (),
        found_at_exec: int = 0,
        provisional: bool = False,
    ) -> Entry | None:
        """Keep a seed even when it covers nothing new (AFL keeps every input it starts from)."""
        if self.contains(trace):
            return None
        runs = list(runs)
        candidate = self._first(runs) if provisional else self._stable(runs)
        _, better = self.novelty(candidate)
        entry = self._insert(trace, candidate, better, None, operators, found_at_exec)
        if provisional:
            self.provisional.add(entry.id)
        return entry

    def unsettled(self, digest: str) -> bool:
        """Whether ``digest`` is the trace of an entry not yet settled: its stability re-runs are to come (a
        whole confirmation run of it is one: the README's main job re-ran its logprobs seed 8.5 s after
        the option test had run it three times)."""
        return any(self.entries[i].hash == digest for i in self.provisional if i in self.entries)

    def settle(self, entry_id: int, runs: Iterable[Coverage]) -> Entry:
        """Re-runs of a provisional entry: keep only the features seen in every run, lowest scores."""
        entry = self.entries[entry_id]
        runs = list(runs)
        stable = entry.features.intersection(*(r.features for r in runs))
        union = entry.features.union(*(r.features for r in runs))
        self.stable_observations += len(stable)
        self.unstable_observations += len(union - stable)
        self.unstable |= union - stable
        for f in entry.features - stable:
            self.seen[f] -= 1
            if self.seen[f] == 0:
                del self.seen[f]
        entry.features = frozenset(stable)
        entry.scores = {k: min([v, *(r.scores.get(k, 0.0) for r in runs)]) for k, v in entry.scores.items()}
        self.provisional.discard(entry_id)
        return entry

    @staticmethod
    def _first(runs: list[Coverage]) -> Coverage:
        if not runs:
            raise ValueError("a corpus entry needs at least one execution")
        return runs[0]

    def _stable(self, runs: list[Coverage]) -> Coverage:
        """The features seen in every run, the smallest score per key; records stability."""
        if not runs:
            raise ValueError("a corpus entry needs at least one execution")
        union = frozenset().union(*(r.features for r in runs))
        stable = frozenset.intersection(*(r.features for r in runs))
        self.stable_observations += len(stable)
        self.unstable_observations += len(union - stable)
        self.unstable |= union - stable
        keys = set().union(*(r.scores for r in runs))
        return Coverage(features=stable, scores={k: min(r.scores.get(k, 0.0) for r in runs) for k in keys})

    def _insert(self, trace: Trace, coverage: Coverage, better: frozenset[str], parent: int | None,
                operators: tuple[str, ...], found_at_exec: int) -> Entry:
        entry = Entry(
            id=self._next_id, trace=trace, features=coverage.features, scores=dict(coverage.scores),
            parent=parent, operators=tuple(operators), found_at_exec=found_at_exec,
        )
        self._next_id += 1
        self.entries[entry.id] = entry
        for f in entry.features:
            self.seen[f] = self.seen.get(f, 0) + 1
        for key in better:
            self.top_rated[key] = entry.id
        if parent in self.entries:
            self.entries[parent].finds += 1
            self.entries[parent].since_find = 0
        return entry

    # --- scheduling --------------------------------------------------------------------

    @property
    def favoured(self) -> frozenset[int]:
        return frozenset(self.top_rated.values())

    def energy(self, entry: Entry, cost_s: float = 0.0, cheap_s: float = CHEAP_S) -> float:
        """AFL-fast-like energy; ``cost_s``: the entry's expected server time (0: unknown), weighed
        against ``cheap_s`` (CHEAP_S, less in a short campaign: fuzzer.search.pacing.cheap_s)."""
        e = 1.0 / (1.0 + math.log2(1 + entry.n_fuzz)) / (1.0 + max(0.0, cost_s) / cheap_s)
        if entry.id in self.favoured:
            e *= FAVOURED_ENERGY
        if entry.since_find >= STALE_AFTER:
            e *= STALE_ENERGY
        return e

    def choose(self, rng: random.Random, cost: Callable[[Entry], float] | None = None,
               cheap_s: float = CHEAP_S) -> Entry:
        """An entry to fuzz, by energy (``cost``: an entry's expected server time, when known; ``cheap_s``:
        see :meth:`energy`)."""
        if not self.entries:
            raise ValueError("the corpus is empty")
        ids = sorted(self.entries)
        weights = [self.energy(self.entries[i], cost(self.entries[i]) if cost else 0.0, cheap_s) for i in ids]
        entry = self.entries[rng.choices(ids, weights=weights)[0]]
        entry.n_fuzz += 1
        entry.since_find += 1
        return entry

    # --- statistics --------------------------------------------------------------------

    @property
    def stability(self) -> float:
        """Share of observed features that were stable across an entry's runs (1.0 = all)."""
        total = self.stable_observations + self.unstable_observations
        return 1.0 if total == 0 else self.stable_observations / total

    def __len__(self) -> int:
        return len(self.entries)

    # --- persistence -------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "entries": [
                {
                    "id": e.id, "trace_hash": e.hash, "features": sorted(e.features), "scores": e.scores,
                    "parent": e.parent, "operators": list(e.operators), "found_at_exec": e.found_at_exec,
                    "n_fuzz": e.n_fuzz, "finds": e.finds, "since_find": e.since_find,
                }
                for e in self.entries.values()
            ],
            "top_rated": self.top_rated,
            "unstable": sorted(self.unstable),
            "stable_observations": self.stable_observations,
            "unstable_observations": self.unstable_observations,
            "provisional": sorted(self.provisional),
            "next_id": self._next_id,
        }

    @classmethod
    def from_dict(cls, data: Mapping, traces: Mapping[str, Trace]) -> "Corpus":
        corpus = cls()
        for row in data.get("entries", []):
            entry = Entry(
                id=row["id"], trace=traces[row["trace_hash"]], features=frozenset(row["features"]),
                scores=dict(row["scores"]), parent=row["parent"], operators=tuple(row["operators"]),
                found_at_exec=row["found_at_exec"], n_fuzz=row["n_fuzz"], finds=row["finds"],
                since_find=row["since_find"],
            )
            corpus.entries[entry.id] = entry
            for f in entry.features:
                corpus.seen[f] = corpus.seen.get(f, 0) + 1
        corpus.top_rated = {k: int(v) for k, v in data.get("top_rated", {}).items()}
        corpus.unstable = set(data.get("unstable", []))
        corpus.stable_observations = data.get("stable_observations", 0)
        corpus.unstable_observations = data.get("unstable_observations", 0)
        corpus.provisional = {int(i) for i in data.get("provisional", []) if int(i) in corpus.entries}
        corpus._next_id = data.get("next_id", max(corpus.entries, default=0) + 1)
        return corpus

    # --- self-check ----------------------------------------------------------------------

    def _check_invariants(self) -> None:
        """Raise AssertionError when the corpus is inconsistent (tests call this)."""
        counts: dict[str, int] = {}
        hashes = set()
        for key, entry in self.entries.items():
            assert key == entry.id, f"entry {entry.id} filed under {key}"
            assert entry.id < self._next_id, f"entry id {entry.id} >= next id {self._next_id}"
            assert entry.hash not in hashes, f"trace {entry.hash[:12]} kept twice"
            hashes.add(entry.hash)
            assert entry.parent is None or entry.parent < entry.id, f"entry {entry.id} has a younger parent"
            for f in entry.features:
                counts[f] = counts.get(f, 0) + 1
        assert counts == self.seen, "the seen-feature counts disagree with the entries"
        for key, entry_id in self.top_rated.items():
            assert entry_id in self.entries, f"top-rated {key} points at a missing entry {entry_id}"
            best = self.entries[entry_id].scores.get(key)
            assert best is not None, f"top-rated entry {entry_id} has no score for {key}"
        assert 0.0 <= self.stability <= 1.0
        assert self.provisional <= set(self.entries), "a provisional id names no entry"
