"""``fuzz replay TRACE --launch CMD --variant NAME="ARGS"``: the trace on every configuration."""

from __future__ import annotations

import asyncio
import contextlib
import json
from functools import partial
from typing import Mapping

from rich.table import Table

from fuzzer.cli import EXIT_ERROR, EXIT_FINDING, EXIT_OK
from fuzzer.cli._calibration import calibration_for
from fuzzer.cli._console import err, out
from fuzzer.cli._target import open_target
from fuzzer.cli._variants import configurations, finding_keys, rows, run_configurations
from fuzzer.execute.launch import LaunchSpec
from fuzzer.store import Store
from fuzzer.trace import Trace

EXIT_INTERRUPTED = 130


def replay_variants(
    trace: Trace, spec: LaunchSpec, variants: Mapping[str, str], *, runs: int, seed: int, db_path: str | None,
    server: str, model: str | None, timeout_s: float, api_key_env: str, as_json: bool, compare: str | None = None,
) -> int:
    """Run ``trace`` on the launch command, each variant and ``compare``'s command; print
    configuration -> reproduced k/n, effect."""
    configs = configurations(spec, variants, compare)

    def launched(s: LaunchSpec):
        return open_target(None, server=server, model=model, prompt_seed=seed, timeout_s=timeout_s,
                           api_key_env=api_key_env, launch=s)

    try:
        with Store.open(db_path) if db_path is not None else contextlib.nullcontext() as store:
            outcomes = asyncio.run(run_configurations(
                trace, configs, runs=runs, seed=seed, store=store, open_target=launched,
                calibration_for=partial(calibration_for, hint=""),
                on_start=lambda c: err.print(f"configuration {c.name}: {c.spec.identity.partition(':')[2]}"),
            ))
    except KeyboardInterrupt:
        err.print("interrupted")
        return EXIT_INTERRUPTED
    table_rows = rows(outcomes, finding_keys(outcomes))
    if as_json:
        out.print_json(json.dumps({
            "configurations": [{"name": o.configuration.name, "args": o.configuration.args, "error": o.error, "note": o.note,
                                "findings": [v.to_dict() for v in o.findings], "ttft_median_s": dict(o.ttft_median_s)}
                               for o in outcomes],
            "table": [r.__dict__ for r in table_rows],
        }))
    else:
        table = Table(title=f"{trace.name or 'trace'} on {len(configs)} configurations, {runs} runs each")
        for name in ("configuration", "extra args", "finding", "reproduced", "effect"):
            table.add_column(name)
        for r in table_rows:
            table.add_row(r.configuration, r.args or "-", r.finding, r.reproduced, r.effect)
        if compare is not None:
            for label in dict.fromkeys(r.finding for r in table_rows):
                where = [r.configuration for r in table_rows if r.finding == label and r.reproduces]
                out.print(f"{label}: reproduces on {', '.join(where) or 'neither'}")
        out.print(table)
        if not table_rows:
            out.print("no confirmed finding on any configuration")
        for o in outcomes:
            if o.error is not None:
                out.print(f"configuration {o.configuration.name} did not run: {o.error}")
            elif o.note is not None:
                out.print(f"configuration {o.configuration.name}: {o.note}")
    if all(o.error is not None for o in outcomes):
        return EXIT_ERROR  # nothing ran: not a clean bill
    return EXIT_FINDING if any(o.findings for o in outcomes) else EXIT_OK
