"""One trace on several configurations of a launched server (``--variant NAME="extra args"``).

Each configuration is the launch command plus its extra arguments; ``base`` is the command
alone. Every configuration is started fresh, calibrated (its calibration is stored under its
own command line) and runs the trace ``runs`` times through the oracle; the rows say, per
configuration and finding, how often it reproduced and with what effect.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import click
import numpy as np

from fuzzer.errors import ConfigError, FuzzError
from fuzzer.execute.launch import LaunchError, LaunchSpec
from fuzzer.oracle.capcheck import probe_cap
from fuzzer.oracle.kinds import FindingKind
from fuzzer.oracle.verdict import Verdict
from fuzzer.trace import Trace

BASE = "base"

#: vLLM's documented scheduler knobs that mitigate latency pathologies (vllm/config/scheduler.py,
#: vllm/engine/arg_utils.py): suggested when a finding on vLLM is exported without variants.
VLLM_SUGGESTED = {
    "long-prefill-512": "--long-prefill-token-threshold 512",
    "batched-tokens-8192": "--max-num-batched-tokens 8192",
    "no-prefix-caching": "--no-enable-prefix-caching",
    "no-chunked-prefill": "--no-enable-chunked-prefill",
}

variant_option = click.option(
    "--variant",
    "variants",
    multiple=True,
    metavar='NAME="ARGS"',
    help="A configuration to run too: the launch command plus ARGS (repeatable; needs --launch or --target-file).",
)


def parse_variants(values: Sequence[str], from_file: Mapping[str, str] | None = None) -> dict[str, str]:
    """NAME -> extra arguments, the target file's first, then --variant's (which win)."""
    out = dict(from_file or {})
    for value in values:
        name, sep, args = value.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ConfigError(f'--variant must look like NAME="extra args", got {value!r}')
        if name == BASE:
            raise ConfigError(f"--variant: {BASE!r} names the launch command itself; choose another name")
        out[name] = args.strip()
    return out


@dataclass(frozen=True)
class Configuration:
    name: str
    args: str
    spec: LaunchSpec


COMPARE = "compare"

compare_option = click.option(
    "--compare",
    "compare",
    metavar="CMD",
    default=None,
    help="Another launch command (another version) to run the trace on too, with {port}; says where it reproduces.",
)


def configurations(spec: LaunchSpec, variants: Mapping[str, str], compare: str | None = None) -> list[Configuration]:
    """The launch command (``base``), each variant, and ``--compare``'s command (``compare``)."""
    configs = [Configuration(BASE, "", spec)] + [Configuration(n, a, spec.with_args(a)) for n, a in variants.items()]
    if compare is not None:
        other = LaunchSpec.parse(compare, env=spec.env, ready_url=spec.ready_url, timeout_s=spec.timeout_s,
                                 log_file=spec.log_file, max_restarts=spec.max_restarts)
        configs.append(Configuration(COMPARE, compare, other))
    return configs


@dataclass(frozen=True)
class Outcome:
    """What one configuration did with the trace: its verdicts, or why it could not run."""

    configuration: Configuration
    verdicts: tuple[Verdict, ...] = ()
    error: str | None = None
    #: How it was judged when not as usual (its own calibration failed).
    note: str | None = None
    #: Each request's median TTFT over the configuration's runs (seconds): what changed, finding or not.
    ttft_median_s: Mapping[str, float] = field(default_factory=dict)

    @property
    def findings(self) -> tuple[Verdict, ...]:
        return tuple(v for v in self.verdicts if v.is_finding)


async def run_configurations(
    trace: Trace, configs: Sequence[Configuration], *, runs: int, seed: int, store, open_target, calibration_for,
    on_start=lambda config: None,
) -> list[Outcome]:
    """Start each configuration in turn, calibrate it, examine ``trace`` on it, stop it."""
    from fuzzer.oracle.calibration import calibration_keys  # noqa: PLC0415
    from fuzzer.oracle.confirm import examine  # noqa: PLC0415

    outcomes = []
    base_calibration = None
    for config in configs:
        on_start(config)
        note = None
        try:
            async with open_target(config.spec) as target:
                keys = calibration_keys(config.spec.identity, target.info.model if target.info else None)
                try:
                    calibration = await calibration_for(target, store, keys, seed=seed)
                except FuzzError as e:
                    if base_calibration is None or isinstance(e, LaunchError):
                        raise
                    # Some knobs defeat the calibration's probes (one slot: no batch to measure).
                    calibration, note = base_calibration, f"judged by the base calibration (its own failed: {e})"
                if base_calibration is None:
                    base_calibration = calibration
                exam = await examine(target, trace, calibration, runs=runs, rng=np.random.default_rng(seed),
                                     cap_probe=lambda by, tokens, target=target: probe_cap(target, by, tokens))
        except FuzzError as e:
            outcomes.append(Outcome(config, error=str(e)))
            continue
        ttfts: dict[str, list[float]] = {}
        for result in exam.results:
            for r in result.requests:
                if r.ttft_s is not None:
                    ttfts.setdefault(r.request_id, []).append(r.ttft_s)
        outcomes.append(Outcome(config, tuple(exam.verdicts), note=note,
                                ttft_median_s={k: float(np.median(v)) for k, v in ttfts.items()}))
    return outcomes


Key = tuple[FindingKind, "str | None"]


def finding_keys(outcomes: Sequence[Outcome]) -> list[Key]:
    """Every (kind, request) confirmed on some configuration, in order of first appearance."""
    keys: list[Key] = []
    for o in outcomes:
        for v in o.findings:
            if v.kind is not None and (v.kind, v.request_id) not in keys:
                keys.append((v.kind, v.request_id))
    return keys


@dataclass(frozen=True)
class Row:
    """configuration -> reproduced k/n, effect, for one finding."""

    configuration: str
    args: str
    finding: str
    reproduced: str
    effect: str
    reproduces: bool


def rows(outcomes: Sequence[Outcome], keys: Sequence[Key]) -> list[Row]:
    out = []
    for o in outcomes:
        c = o.configuration
        for kind, request in keys:
            label = f"{kind} on {request or 'the execution'}"
            if o.error is not None:
                out.append(Row(c.name, c.args, label, "-", f"did not run: {o.error}", False))
                continue
            same = [v for v in o.verdicts if v.request_id == request]
            match = next((v for v in same if v.kind is kind), None)
            if match is None:
                runs = max((v.runs for v in o.verdicts), default=0)
                out.append(Row(c.name, c.args, label, f"0/{runs}", "-", False))
                continue
            effect = match.effect if match.effect is not None else match.slowdown
            out.append(Row(c.name, c.args, label, f"{match.reproduced}/{match.runs}",
                           "-" if effect is None else f"{effect:.2f}x", match.is_finding))
    return out
