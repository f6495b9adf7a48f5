"""Calibration's probe traces: requests run one at a time, each spaced by its expected duration.

:class:`Plan` builds one probe trace, :class:`Pace` says how far apart its probes must be
(from the pilot's smallest and largest probe of a kind), :func:`run_plan` executes it and
keeps what each probe measured, and :class:`Probes` gathers the four kinds of a round
(:mod:`fuzzer.oracle.calibrate` designs the rounds and fits the model to them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fuzzer.errors import TargetError
from fuzzer.execution import ExecutionResult, Outcome, RequestResult, Target
from fuzzer.trace import Request, Trace

#: Probes run one at a time: each is followed by this many times its expected duration (from
#: the pilot's smallest and largest probe of its kind), but never less than MIN_SPACING_S. The
#: pilot runs first, so its largest probe measures a warm server; the factor covers the noise.
SPACING_FACTOR = 1.5
MIN_SPACING_S = 0.05
#: The prompt of each sequence of the short batched-decode probes (longer prompts make the
#: long-context batch, fuzzer.oracle.calibrate.LONG_BATCH).
BATCH_PROMPT_TOKENS = 16


@dataclass(frozen=True)
class Probe:
    """One measured probe request: what it was and what the client saw."""

    prompt: int
    cached: int
    max_tokens: int
    batch: int
    result: RequestResult


@dataclass(frozen=True)
class Pace:
    """How long a probe of one kind takes, by its size, from the pilot's smallest and largest.

    Probes run one at a time in an open-loop trace, so each is given room for its own
    expected duration (interpolated between the two pilot sizes, never below the smaller
    one's, which is taken as at most the larger one's) times SPACING_FACTOR, but never less than MIN_SPACING_S: a short probe does not
    wait out the longest one's time.
    """

    small: tuple[float, float]
    large: tuple[float, float]

    def spacing_s(self, size: float) -> float:
        (x0, y0), (x1, y1) = self.small, self.large
        if x1 > x0 and y1 > 0:
            # A probe's cost grows with its size: a smaller one measured slower than the larger was an outlier, and as
            # the floor it would set the pace of every probe of its kind (on a GPU llama-server a 16-token probe took
            # 1.2 s, its 8190-token one 0.12 s, and every prefill probe waited 1.8 s).
            y0 = min(y0, y1)
        expected = y1 if x1 <= x0 else y0 + (y1 - y0) * (size - x0) / (x1 - x0)
        return max(MIN_SPACING_S, SPACING_FACTOR * max(expected, y0, 0.0))


@dataclass
class Plan:
    """Builds one probe trace: each probe (or group sent together) spaced by its own expected duration."""

    #: None for a plan whose every probe is given its spacing (the pilot's).
    pace: Pace | None
    requests: list[Request] = field(default_factory=list)
    prefixes: dict[str, int] = field(default_factory=dict)
    meta: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    slot: int = 0
    at_s: float = 0.0

    def add(self, prompt: int, max_tokens: int, *, batch: int = 1, lead_in: bool = False, size: float | None = None,
            spacing_s: float | None = None) -> None:
        """A probe (or ``batch`` identical ones sent together) in the next slot, followed by
        ``spacing_s`` or else by what the pace gives for ``size`` (default: its prompt)."""
        at_ms = round(self.at_s * 1000.0, 3)
        for i in range(batch):
            rid = f"s{self.slot}" + (f"b{i}" if batch > 1 else "")
            self.requests.append(Request(id=rid, at_ms=at_ms, prompt_tokens=prompt, max_tokens=max_tokens))
            if not lead_in:
                self.meta[rid] = (prompt, 0, max_tokens, batch)
        self.slot += 1
        if spacing_s is None:
            assert self.pace is not None
            spacing_s = self.pace.spacing_s(prompt if size is None else size)
        self.at_s += spacing_s

    def add_pair(self, prefix: int, suffix: int, *, hit: int) -> None:
        """A request that computes a prefix, then (once it is done) a probe that reuses it."""
        group = f"g{self.slot}"
        self.prefixes[group] = prefix
        assert self.pace is not None
        gap = self.pace.spacing_s(prefix + suffix)
        for i, rid in enumerate((f"w{self.slot}", f"c{self.slot}")):
            at_ms = round((self.at_s + i * gap) * 1000.0, 3)
            self.requests.append(Request(id=rid, at_ms=at_ms, prompt_tokens=prefix + suffix, max_tokens=2, prefix=group))
        self.meta[f"c{self.slot}"] = (prefix + suffix, hit, 2, 1)
        self.slot += 2
        self.at_s += 2 * gap

    def trace(self, name: str) -> Trace:
        return Trace(requests=tuple(self.requests), prefixes=dict(self.prefixes), name=name)


#: A probe execution whose only failures are dropped connections is run again this many times: in CI,
#: llama-server once dropped one of a calibration's batch probes (ServerDisconnected) under load, and
#: the whole command failed. A server that keeps dropping them still fails the calibration.
CONNECTION_RETRIES = 1


async def run_plan(target: Target, plan: Plan, name: str) -> list[Probe]:
    for attempt in range(CONNECTION_RETRIES + 1):
        result: ExecutionResult = await target.execute(plan.trace(name))
        failed = [r for r in result.requests if r.request_id in plan.meta and r.outcome.failed]
        if not failed or attempt == CONNECTION_RETRIES or any(r.outcome is not Outcome.CONNECTION_ERROR for r in failed):
            break
    probes = []
    for r in result.requests:
        if r.request_id not in plan.meta:
            continue
        if r.outcome.failed:
            raise TargetError(
                f"calibration probe {r.request_id} of {name} failed ({r.outcome.value}"
                + (f": {r.detail}" if r.detail else "")
                + "); the target must serve plain requests before it can be fuzzed"
            )
        prompt, cached, max_tokens, batch = plan.meta[r.request_id]
        probes.append(Probe(prompt, cached, max_tokens, batch, r))
    return probes


def usable(probes: Sequence[Probe], *, streamed: bool = True) -> list[Probe]:
    return [p for p in probes if (p.result.ttft_s is not None) or not streamed]


@dataclass(frozen=True)
class Probes:
    """What one or more rounds of probes measured, by kind."""

    prefill: tuple[Probe, ...] = ()
    cached: tuple[Probe, ...] = ()
    single: tuple[Probe, ...] = ()
    batched: tuple[Probe, ...] = ()

    def __add__(self, other: Probes) -> Probes:
        return Probes(self.prefill + other.prefill, self.cached + other.cached, self.single + other.single,
                      self.batched + other.batched)

    def __len__(self) -> int:
        return len(self.prefill) + len(self.cached) + len(self.single) + len(self.batched)
