"""``fuzz export ID --variant NAME="ARGS"``: does the finding survive the engine's mitigation knobs?"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Sequence

from fuzzer.cli._calibration import calibration_for
from fuzzer.cli._console import err
from fuzzer.cli._launch import relaunch, resolve
from fuzzer.cli._target import open_target
from fuzzer.cli._variants import VLLM_SUGGESTED, configurations, parse_variants, rows, run_configurations
from fuzzer.errors import ConfigError
from fuzzer.oracle.kinds import FindingKind
from fuzzer.report import variants as report_variants

#: Seed of the prompt text of the variant runs (one per export: the runs are comparable).
SEED = 0


def configurations_section(store, finding, *, launch: str | None, target_file: str | None, variants: Sequence[str],
                           runs: int) -> str | None:
    """The report's Configurations section: a table when variants are given, a suggestion for vLLM, else None."""
    managed = resolve(None, launch, target_file)
    chosen = parse_variants(variants, managed.variants if managed else None)
    target = store.get_target(finding.target_id) if finding.target_id is not None else None
    if not chosen:
        if launch or target_file:
            raise ConfigError("--launch and --target-file are for running variants: add --variant NAME=\"ARGS\"")
        if target is not None and target.get("kind") == "vllm":
            return report_variants.suggestion(finding.id, VLLM_SUGGESTED)
        return None
    spec = managed.spec if managed else relaunch(store, finding.target_id, None)
    if spec is None:
        where = target["url"] if target else "the built-in simulator"
        raise ConfigError(f"--variant needs the server's launch command: this finding was found on {where}; "
                          f"pass --launch CMD or --target-file FILE")
    trace = store.get_trace(finding.minimized_trace_hash or finding.trace_hash)
    configs = configurations(spec, chosen)

    def launched(s):
        return open_target(None, launch=s, prompt_seed=SEED)

    outcomes = asyncio.run(run_configurations(
        trace, configs, runs=runs, seed=SEED, store=store, open_target=launched,
        calibration_for=partial(calibration_for, hint=""),
        on_start=lambda c: err.print(f"configuration {c.name}: {c.spec.identity.partition(':')[2]}"),
    ))
    key = (FindingKind(finding.kind), finding.verdict.get("request_id"))
    table = [r.__dict__ for r in rows(outcomes, [key])]
    return report_variants.section(table, runs=runs, command=spec.identity.partition(":")[2])
