"""The campaign's value types: its settings, phases, exit reasons and status snapshots.

:mod:`fuzzer.search.campaign` runs the loop; these are what goes in (``Settings``) and what
comes out (``Stats`` for the live status and ``fuzz status``, ``Summary`` at the end).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from fuzzer.oracle.calibration import REFRESH_AFTER_S
from fuzzer.oracle.policy import OraclePolicy
from fuzzer.search.mutators import Limits
from fuzzer.search.pacing import CLOSING_SHARE, CONFIRM_SHARE, IDLE_SHARE, SEED_SHARE, fuzz_share

# AFL calibrates a new queue entry with 3-7 runs (CAL_CYCLES); our runs cost seconds, so 2 (the
# first run and one re-run), done when it is first fuzzed. 3 found the simulator's pathologies in
# as many or more executions in 33 of 34 paired runs (benchmarks/README.md, stop 38):
# a third run drops a few more flickering features (0-14 of 25-170 on heldout4), and a feature
# that flickers but stays in an entry only makes a child showing it less novel.
STABILITY_RUNS = 2
#: A campaign stops (state saved, non-zero exit) once its server has answered nothing for this
#: long: a supervised server restarts within minutes, one that exited does not come back, and an
#: overnight campaign that waits on it all night has searched nothing (vLLM's CPU build, stop 33:
#: its engine died on a seeded request's chunked prefill and a 12-minute campaign waited 724 s).
RECOVER_PATIENCE_S = 600.0


class Phase(enum.StrEnum):
    CALIBRATE = "calibrate"
    SEED = "seed"
    FUZZ = "fuzz"
    CONFIRM = "confirm"
    #: Letting the server go idle before a cold probe (fuzzer.search.pacing).
    IDLE = "idle"
    RECOVER = "recover"
    DONE = "done"


class ExitReason(enum.StrEnum):
    DURATION = "duration"
    MAX_EXECS = "max-execs"
    INTERRUPTED = "interrupted"
    #: The server answered nothing for ``Settings.recover_patience_s``.
    SERVER_DOWN = "server-down"


@dataclass(frozen=True)
class Settings:
    duration_s: float | None = None
    max_execs: int | None = None
    seed: int = 0
    #: "guided" (coverage-guided mutation) or "null" (random generation, the baseline).
    mutator: str = "guided"
    stability_runs: int = STABILITY_RUNS
    #: A calibration older than this is measured again (fuzzer.oracle.calibrate.reuse_or_calibrate).
    recalibrate_after_s: float = REFRESH_AFTER_S
    limits: Limits = field(default_factory=Limits)
    policy: OraclePolicy = field(default_factory=OraclePolicy)
    #: Share of wall time the campaign may spend idling on purpose to meet a cold server
    #: (cold probes, fuzzer.search.pacing); 0 turns cold probes off. Free on virtual time.
    idle_share: float = IDLE_SHARE
    #: Once the corpus has an entry, seeding may take at most this share of the server time.
    seed_share: float = SEED_SHARE
    #: Confirmation runs may take at most this share of the server time before a latency candidate
    #: of a kind already found waits, ranked (fuzzer.search.confirming); 1 confirms every one at once.
    confirm_share: float = CONFIRM_SHARE
    #: In this last share of --duration the candidates waiting for the confirmation share are confirmed.
    closing_share: float = CLOSING_SHARE
    #: The user's SLOs in ms (``--goodput``: ttft, tpot, e2el); None: no SLO check.
    slo_ms: Mapping[str, float] | None = None
    #: Sequential confirmation with a futility stop: one re-run first, SAME at once when it
    #: does not show the candidate again (fuzzer.oracle.confirm); False: MIN_RUNS first.
    futility: bool = True
    #: How long the campaign waits for a server that went down before it stops (None: for ever).
    recover_patience_s: float | None = RECOVER_PATIENCE_S

    def to_dict(self) -> dict[str, Any]:
        """Stored with the campaign: the thresholds that confirmed its findings (the oracle
        policy) and the limits its traces respected are part of it."""
        return {
            "duration_s": self.duration_s, "max_execs": self.max_execs, "seed": self.seed,
            "mutator": self.mutator, "stability_runs": self.stability_runs,
            "recalibrate_after_s": self.recalibrate_after_s,
            "idle_share": self.idle_share, "seed_share": self.seed_share, "confirm_share": self.confirm_share,
            "closing_share": self.closing_share,
            "limits": self.limits.to_dict(), "policy": asdict(self.policy),
            "slo_ms": dict(self.slo_ms) if self.slo_ms else None, "futility": self.futility,
            "recover_patience_s": self.recover_patience_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Settings:
        """Read what :meth:`to_dict` wrote. A row stored before the policy and the limits were
        (or without any other field) gets today's defaults for what it lacks."""
        known = {f.name for f in fields(cls)} - {"limits", "policy"}
        values: dict[str, Any] = {k: v for k, v in data.items() if k in known}
        if "limits" in data:
            values["limits"] = Limits.from_dict(data["limits"])
        if "policy" in data:
            policy_fields = {f.name for f in fields(OraclePolicy)}
            values["policy"] = OraclePolicy(**{k: v for k, v in data["policy"].items() if k in policy_fields})
        return cls(**values)


def stop_reason(settings: Settings, *, stopped: bool, executions: int, elapsed_s: float,
                down_s: float | None = None) -> ExitReason | None:
    """Why a campaign should stop now (asked to, its server down too long, --max-execs, --duration),
    or None to go on; ``down_s`` is how long the server has answered nothing (None: it is up)."""
    if stopped:
        return ExitReason.INTERRUPTED
    if down_s is not None and settings.recover_patience_s is not None and down_s >= settings.recover_patience_s:
        return ExitReason.SERVER_DOWN
    if settings.max_execs is not None and executions >= settings.max_execs:
        return ExitReason.MAX_EXECS
    if settings.duration_s is not None and elapsed_s >= settings.duration_s:
        return ExitReason.DURATION
    return None


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
    #: Wall seconds of the campaign by phase (fuzzer.search.pacing.TimeSpent.by_phase).
    time_s: Mapping[str, float] = field(default_factory=dict)
    #: Mutants this run skipped: their FCFS bound went past the execution budget.
    too_long: int = 0
    #: Executions of this run whose client's event loop stalled past clientlag.STARVED_S (a client short of
    #: CPU), and the worst stall (fuzzer.execute.clientlag).
    client_stalls: int = 0
    worst_client_stall_s: float = 0.0
    #: Latency candidates waiting for the confirmation share (fuzzer.search.confirming).
    waiting: int = 0
    #: Candidates whose confirmation a stop interrupted (a deadline, Ctrl-C, a server down): the same command
    #: confirms them first.
    pending: int = 0

    def to_dict(self) -> dict:
        return {**asdict(self), "time_s": dict(self.time_s)}

    @property
    def fuzz_share(self) -> float | None:
        """The share of the campaign's time spent in fuzz executions (None before any time passed)."""
        return fuzz_share(self.time_s)


@dataclass(frozen=True)
class Summary:
    campaign_id: int
    reason: ExitReason
    stats: Stats
    #: Findings recorded in this run (id, kind).
    new_findings: tuple[tuple[int, str], ...]
    resumed: bool
    #: Why the server could not be reached, last time, when it was down at the stop (SERVER_DOWN, or a deadline
    #: or Ctrl-C that came while the campaign waited for it).
    server_error: str | None = None


def listed_state(state: tuple) -> list:
    """A ``random.Random`` state as a checkpoint stores it (JSON lists)."""
    version, internal, gauss = state
    return [version, list(internal), gauss]


def tupled_state(state: list) -> tuple:
    """A checkpoint's ``random.Random`` state as ``setstate`` takes it."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
