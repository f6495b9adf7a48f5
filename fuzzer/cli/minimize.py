"""``fuzz minimize``: shrink a finding's trace to the smallest that still reproduces."""

from __future__ import annotations

import asyncio

import click

from fuzzer.cli import _console
from fuzzer.cli._calibration import calibration_for
from fuzzer.cli._options import db_option, model_option, server_option, target_option
from fuzzer.cli._render import trace_table
from fuzzer.cli._slo import refuse_slo_finding
from fuzzer.cli._launch import launch_options, relaunch, resolve
from fuzzer.cli._target import SIM_PREFIX, open_target, parse_sim_key
from fuzzer.errors import ConfigError
from fuzzer.execute.recovery import DEFAULT_PATIENCE_S
from fuzzer.oracle.calibration import calibration_keys
from fuzzer.report.export import repro_script, verdict_for
from fuzzer.shrink.engine import Progress
from fuzzer.shrink.finding import minimize_finding
from fuzzer.store import Store, minimization_lock


@click.command("minimize")
@click.argument("finding_id")
@db_option
@target_option
@launch_options
@server_option
@model_option
@click.option("--max-execs", type=click.IntRange(min=1), default=None, help="Execution budget of the search.")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0.01),
    default=None,
    help="Seconds without a byte from the server before a request counts as a hang (default 60).",
)
def command(finding_id, db_path, target, launch, target_file, server, model, max_execs, timeout_s) -> None:
    """Minimize the trace of finding FINDING_ID (resumable).

    Delta debugging over the requests, then passes that lower prompt and output
    lengths and gaps and drop features, each candidate accepted only when it
    reproduces in all of 3 runs (2 of 3 for crashes, leaks and errors); a 10-run
    confirmation ends it. For an option-slowdown a run is a pair, the trace and the
    same trace without the option (executions count pairs). Ctrl-C keeps the
    progress: the same command resumes.

    \b
    Example:
        fuzz minimize 3 --db night.db --target http://127.0.0.1:8000
        fuzz minimize 3 --db night.db --launch "llama-server -m tiny.gguf --port {port} --metrics"

    A finding found on a launched server is minimized on the same command line when
    neither --target nor --launch is given.
    """
    managed = resolve(target, launch, target_file)
    with Store.open(db_path, create=False) as store:
        finding = store.get_finding(finding_id)
        refuse_slo_finding(finding, "minimize")
        # One minimization of a finding at a time (a campaign on the same --db may run beside it).
        with minimization_lock(db_path, finding.id):
            spec = managed.spec if managed else relaunch(store, finding.target_id, target)
            if spec is not None:
                identity, url, planted, sim, seed = spec.identity, None, (), {}, 0
            else:
                identity, url, planted, sim, seed = _where(store, finding.target_id, target)
            try:
                reduction = asyncio.run(
                    _run(store, finding, identity, url, (planted, sim, seed), server, model, max_execs, timeout_s,
                         launch=spec)
                )
            except KeyboardInterrupt:
                _console.err.print(f"interrupted; progress is saved: `fuzz minimize {finding.id}` resumes")
                raise SystemExit(130) from None
            minimized = store.get_trace(store.get_finding(finding.id).minimized_trace_hash)
    r = reduction.result
    out = _console.out
    out.print(trace_table(minimized, title=f"finding {finding.id}, minimized"))
    out.print(
        f"{len(r.original.requests)} -> {len(r.minimized.requests)} requests in {r.executions} executions "
        f"({r.tests} tests, stopped: {r.stop}); reproduced {r.reproduction} at the report threshold"
    )
    for other in reduction.others:
        out.print(f"met on the way and confirmed: finding {other}")
    db = "" if db_path == "fuzz.db" else f" --db {db_path}"
    out.print(f"next: fuzz export {finding.id}{db}")


def _where(store: Store, target_id: int | None, given: str | None) -> tuple[str, str | None, tuple[str, ...], dict, int]:
    """(target identity, URL or None for the simulator, pathologies to plant, simulator options, seed)."""
    if given is not None:
        return given, given, (), {}, 0
    if target_id is None:
        return f"{SIM_PREFIX}none", None, (), {}, 0
    url = store.get_target(target_id)["url"]
    if url.startswith(SIM_PREFIX):
        planted, sim, seed = parse_sim_key(url)
        return url, None, planted, sim, seed
    raise ConfigError(f"this finding was found on {url}; pass --target {url} (or where that server runs now)")


async def _run(store, finding, identity, url, sim, server, model, max_execs, timeout_s, launch=None):
    planted, options, seed = sim
    async with open_target(
        url, server=server, model=model, pathologies=planted, sim_options=options, seed=seed, timeout_s=timeout_s,
        launch=launch,
    ) as target:
        keys = calibration_keys(identity, target.info.model if target.info else None)
        calibration = await calibration_for(target, store, keys, seed=0)

        def progress(p: Progress) -> None:
            _console.err.print(
                f"  {p.phase:20} requests {p.requests:3}  tests {p.tests:4}  executions {p.executions:4}  accepted {p.accepted}"
            )

        return await minimize_finding(
            store, finding, target, calibration, sleep=asyncio.sleep, on_progress=progress,
            repro=lambda f, t: _repro(store, f, t), max_executions=max_execs,
            on_down=lambda reason: _console.err.print(
                f"  the server is unreachable ({reason}); waiting for it, up to {DEFAULT_PATIENCE_S:g} s"
            ),
        )


def _repro(store: Store, finding, trace) -> str:
    """The stand-alone repro script of the minimized trace, judged against the minimized trace's own bound."""
    target = store.get_target(finding.target_id) if finding.target_id is not None else None
    verdict, _ = verdict_for(store, finding, trace, target)
    return repro_script(finding, trace, verdict, target=target)
