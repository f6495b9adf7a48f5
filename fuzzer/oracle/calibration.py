"""The calibrated model of one target: the :class:`Calibration` value type, stored (ARCHITECTURE.md, "Oracle").

:mod:`fuzzer.oracle.calibrate` measures a target and fits it; this is what comes out: the
:class:`~fuzzer.oracle.expectation.StepModel`, the :class:`Fit` lines it came from, the
measured noise and the baseline ratios confirmation tests against. It says whether it
is stale or too noisy to judge, round-trips through the store as a dict (versioned by
``FORMAT_VERSION``), and :func:`calibration_keys` names where it is stored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from fuzzer.errors import TargetError
from fuzzer.oracle.kinds import Metric
from fuzzer.oracle.model import SchedulerAssumption, StepModel

#: Version of the stored calibration format. History:
#:   1 - first version.
FORMAT_VERSION = 1

#: Executions thrown away first: a cold server (CUDA graphs, allocator, clocks) is slower
#: than a warm one, and calibrating on it would excuse every later cold start.
WARMUP_RUNS = 2

#: A calibration older than this is measured again before it judges anything (every command
#: goes through fuzzer.oracle.calibrate.reuse_or_calibrate; a long campaign refreshes its own
#: as it ages): GPU clocks, memory fragmentation and co-tenants drift over hours
#: (ARCHITECTURE.md, "Oracle").
REFRESH_AFTER_S = 3600.0
#: Relative noise (TTFT or E2E) from which the numbers are not to be trusted yet
#: (pyperf's advice: a spread of 10% or more); `fuzz calibrate` advises calibrating again.
NOISY = 0.10
#: Relative noise from which a calibration cannot judge: the oracle's 2x effect is then
#: under two noise widths (ln 2 / 2 = 0.35 on the log scale the noise is measured on), so
#: a confirmed slowdown may be the host's load. Calibration measures once more when it
#: gets this much; verdicts on such a calibration say so. A CPU llama-server on a loaded
#: 2-core host measured 76-130 % (benchmarks/README.md, "Real server: llama.cpp").
UNRELIABLE_NOISE = 0.35


@dataclass(frozen=True)
class Fit:
    """A robust straight line y = intercept + slope * x, with the slope's 95% interval."""

    intercept: float
    slope: float
    slope_low: float
    slope_high: float
    n: int

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x

    def to_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("intercept", "slope", "slope_low", "slope_high", "n")}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Fit:
        return cls(float(data["intercept"]), float(data["slope"]), float(data["slope_low"]), float(data["slope_high"]), int(data["n"]))


@dataclass(frozen=True)
class Calibration:
    """The calibrated model of one target, its noise and its baseline residuals."""

    target: str
    created_at: float
    model: StepModel
    assumption: SchedulerAssumption
    #: Idle TTFT versus uncached prompt tokens.
    ttft_fit: Fit
    #: Extra idle TTFT versus cached prompt tokens (a prefix hit still costs the frontend).
    cached_fit: Fit | None
    #: Single-sequence inter-token latency versus context tokens.
    context_fit: Fit
    #: Inter-token latency (context cost removed) versus decoding batch size.
    batch_fit: Fit
    #: Relative noise per metric: 1.4826 x MAD of log(observed / expected).
    noise: Mapping[Metric, float]
    #: Absolute noise per metric, seconds: 1.4826 x MAD of observed - expected.
    noise_s: Mapping[Metric, float]
    #: Ratios observed / expected of the probes, per metric: the confirmation baseline.
    baseline: Mapping[Metric, tuple[float, ...]]
    probes: int = 0
    warmup_runs: int = WARMUP_RUNS
    format: int = FORMAT_VERSION
    #: How many repeats of the probes were run and why (calibration stops early once its fit is settled).
    probing: str = ""

    def age_s(self, now: float) -> float:
        return now - self.created_at

    def is_stale(self, now: float, *, max_age_s: float = REFRESH_AFTER_S) -> bool:
        """Too old to judge by: measure again (``now`` and ``created_at`` are wall-clock seconds)."""
        return self.age_s(now) > max_age_s

    def judged_noise(self) -> tuple[Metric | None, float]:
        """The noisiest metric a verdict rests on and its relative noise.

        Max ITL is left out: single gaps of a few ms carry the client's own timing jitter.
        """
        judged = [(m, v) for m, v in self.noise.items() if m is not Metric.MAX_ITL]
        return max(judged, key=lambda mv: mv[1], default=(None, 0.0))

    @property
    def reliable(self) -> bool:
        """False when the noise is too high to tell a 2x slowdown from noise (UNRELIABLE_NOISE)."""
        return self.judged_noise()[1] < UNRELIABLE_NOISE

    def reliability_note(self) -> str | None:
        """One line saying why this calibration cannot judge reliably; None when it can."""
        metric, noise = self.judged_noise()
        if self.reliable or metric is None:
            return None
        return (f"the calibration's {metric.value} noise is {noise * 100:.0f} % (over {UNRELIABLE_NOISE * 100:.0f} %): "
                "a 2x slowdown cannot be told from noise reliably; calibrate again on a quiet server")

    def with_model(self, model: StepModel) -> Calibration:
        """The same calibration over another step model (the bounds of a slower engine)."""
        return replace(self, model=model)

    def with_assumption(self, assumption: SchedulerAssumption) -> Calibration:
        """The same measurements under another scheduler assumption (a user override).

        The KV capacity the server reported is kept when the new assumption names none.
        """
        from dataclasses import replace

        if assumption.kv_blocks is None and self.assumption.kv_blocks is not None:
            assumption = replace(assumption, kv_blocks=self.assumption.kv_blocks)
        return replace(self, assumption=assumption)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "target": self.target,
            "created_at": self.created_at,
            "model": self.model.to_dict(),
            "assumption": self.assumption.to_dict(),
            "ttft_fit": self.ttft_fit.to_dict(),
            "cached_fit": self.cached_fit.to_dict() if self.cached_fit else None,
            "context_fit": self.context_fit.to_dict(),
            "batch_fit": self.batch_fit.to_dict(),
            "noise": {m.value: v for m, v in self.noise.items()},
            "noise_s": {m.value: v for m, v in self.noise_s.items()},
            "baseline": {m.value: list(v) for m, v in self.baseline.items()},
            "probes": self.probes,
            "warmup_runs": self.warmup_runs,
            "probing": self.probing,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        fmt = data.get("format")
        if fmt != FORMAT_VERSION:
            raise TargetError(
                f"stored calibration has format {fmt!r}, this fuzzer reads {FORMAT_VERSION}; run `fuzz calibrate` again"
            )
        return cls(
            target=data["target"],
            created_at=float(data["created_at"]),
            model=StepModel.from_dict(data["model"]),
            assumption=SchedulerAssumption.from_dict(data["assumption"]),
            ttft_fit=Fit.from_dict(data["ttft_fit"]),
            cached_fit=Fit.from_dict(data["cached_fit"]) if data.get("cached_fit") else None,
            context_fit=Fit.from_dict(data["context_fit"]),
            batch_fit=Fit.from_dict(data["batch_fit"]),
            noise={Metric(k): float(v) for k, v in data["noise"].items()},
            noise_s={Metric(k): float(v) for k, v in data["noise_s"].items()},
            baseline={Metric(k): tuple(float(x) for x in v) for k, v in data["baseline"].items()},
            probes=int(data.get("probes", 0)),
            warmup_runs=int(data.get("warmup_runs", WARMUP_RUNS)),
            probing=str(data.get("probing", "")),
        )


# --- where a calibration is stored ---------------------------------------------------------------

#: The built-in simulator's calibrations: its port changes from run to run, its idle
#: behaviour does not. Planted pathologies and faults act on traffic patterns the probes
#: (one request at a time, a clean server) never make, so only ``--speed`` changes it.
SIM_CALIBRATION_KEY = "sim:builtin"
_SIM_PREFIX = "sim:"


def calibration_keys(target: str | None, model: str | None = None) -> tuple[str, ...]:
    """The keys a target's calibration is looked up under; every command stores under the first.

    ``target`` is a server URL (the key is the URL and the served model: a server restarted
    with another model needs another calibration), a built-in simulator as the CLI names it
    (``sim:PATHOLOGIES;speed=X;...``, see ``fuzzer.cli._target.sim_key``) or None for the
    plain simulator (``sim:builtin``, ``sim:builtin;speed=X``). The other keys are where
    earlier versions stored it (the bare URL; the simulator's full name), still read so an
    existing database keeps its calibrations.
    """
    if target is None or target.startswith(_SIM_PREFIX):
        speed = 1.0
        for part in (target or "").split(";")[1:]:
            name, _, value = part.partition("=")
            if name == "speed":
                try:
                    speed = float(value)
                except ValueError:
                    pass
        primary = SIM_CALIBRATION_KEY if speed == 1.0 else f"{SIM_CALIBRATION_KEY};speed={speed:g}"
        older = (target,) if target else ()
    else:
        primary = f"{target.rstrip('/')}#{model or ''}"
        older = (target, target.rstrip("/"))
    return tuple(dict.fromkeys((primary, *older)))


def calibration_key(target: str | None, model: str | None = None) -> str:
    """The key every command stores a target's calibration under (see :func:`calibration_keys`)."""
    return calibration_keys(target, model)[0]
