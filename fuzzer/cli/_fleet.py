"""``fuzz campaign --ray [ADDRESS] --targets FILE``: one campaign across many servers (issue 18).

The command parses the options and hands over to :class:`fuzzer.fleet.coordinator.Coordinator`
(workers on Ray, this process the only writer of the database); this module prints.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence

import click

from fuzzer.cli import _console
from fuzzer.cli._render import slowdown_words
from fuzzer.errors import ConfigError
from fuzzer.oracle.verdict import Verdict
from fuzzer.search.settings import ExitReason, Settings
from fuzzer.store import CampaignLock, Store
from fuzzer.trace import Trace

#: ``--ray`` with no address: start a local Ray for this command.
LOCAL = "local"


def fleet_options(f):
    """Add --ray [ADDRESS] and --targets FILE to ``fuzz campaign``."""
    f = click.option(
        "--targets", "targets_file", metavar="FILE", default=None, type=click.Path(dir_okay=False),
        help="With --ray: TOML file of the fleet's servers ([[target]] name, url or launch, node or resources, kind).",
    )(f)
    return click.option(
        "--ray", "ray_address", metavar="ADDRESS", is_flag=False, flag_value=LOCAL, default=None,
        help="Run one campaign across the servers of --targets on Ray: a cluster's HOST:PORT, ray://HOST:PORT or "
             "auto; alone, a local Ray.",
    )(f)


def check_fleet_options(ray_address: str | None, targets_file: str | None, **single: object) -> bool:
    """True for a fleet campaign; a bad combination raises ConfigError."""
    if ray_address is None and targets_file is None:
        return False
    if ray_address is None:
        raise ConfigError("--targets needs --ray (a fleet campaign runs its workers on Ray)")
    if targets_file is None:
        raise ConfigError("--ray needs --targets FILE (which servers the fleet fuzzes)")
    given = sorted(name for name, value in single.items() if value)
    if given:
        raise ConfigError(f"--{given[0].replace('_', '-')} does not apply to a fleet campaign: each server is "
                          "an entry of --targets")
    return True


def run_fleet(ray_address: str, targets_file: str, db_path: str, *, duration_s: float, max_execs: int | None,
              seed: int, seeds: Sequence[Trace], null_mutator: bool) -> None:
    from fuzzer.fleet import targets as fleet_targets  # noqa: PLC0415
    from fuzzer.fleet.coordinator import Coordinator  # noqa: PLC0415
    from fuzzer.fleet.pool import RayPool, import_ray  # noqa: PLC0415

    targets = fleet_targets.load(targets_file)
    import_ray()  # says how to install Ray before anything is stored
    stop = threading.Event()
    settings = Settings(duration_s=duration_s, max_execs=max_execs, seed=seed,
                        mutator="null" if null_mutator else "guided")
    pool = RayPool(None if ray_address == LOCAL else ray_address)  # an unreachable cluster stores nothing
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Store.open(db_path) as store, CampaignLock(db_path):
            summary = Coordinator(
                pool, targets, store, settings, seeds=seeds, stop=stop,
                on_event=lambda note: _console.out.print(f"note: {note}"), on_finding=_print_finding,
            ).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        pool.close()
    _print_summary(summary, db_path)


def _print_finding(finding_id: int, target: str, verdict: Verdict) -> None:
    slow = slowdown_words(verdict.slowdown, verdict.ablated, verdict.over_bound)
    _console.out.print(f"[bold]finding {finding_id}[/bold] on {target}: {verdict.kind}{slow}, "
                       f"reproduced {verdict.reproduction}")


def _print_summary(summary, db_path: str) -> None:
    out = _console.out
    why = {ExitReason.DURATION: "duration reached", ExitReason.MAX_EXECS: "--max-execs reached",
           ExitReason.INTERRUPTED: "interrupted; everything is saved"}[summary.reason]
    verb = "resumed" if summary.resumed else "ran"
    out.print(f"fleet campaign {summary.campaign_id} {verb} {summary.elapsed_s:.0f}s: {why}; "
              f"{summary.executions} executions stored")
    if summary.coordinator_cpu_per_exec_s is not None:
        out.print(f"  coordinator CPU per execution: {1000 * summary.coordinator_cpu_per_exec_s:.1f} ms")
    for name, row in summary.targets.items():
        total = sum(row["executions"].values())
        note = f" ({row['reason']})" if row["status"] != "up" else ""
        out.print(f"  {name}: {row['status']}{note}, {total} executions, corpus {len(row['corpus']['entries'])}, "
                  f"findings {row['findings']}")
    for finding_id, kind, target in summary.new_findings:
        out.print(f"  new finding {finding_id} on {target}: {kind}")
    db = "" if db_path == "fuzz.db" else f" --db {db_path}"
    out.print("next:")
    out.print(f"  fuzz status{db}")
    if summary.new_findings:
        out.print(f"  fuzz findings{db}")
