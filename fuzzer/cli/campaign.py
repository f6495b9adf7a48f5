"""``fuzz campaign``: the main job, a coverage-guided fuzzing campaign."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import click
from rich.live import Live
from rich.table import Table

from fuzzer import trace as trace_format
from fuzzer.cli import _console
from fuzzer.cli._render import slowdown_words, time_line
from fuzzer.cli._calibration import stored_calibration
from fuzzer.cli._fleet import check_fleet_options, fleet_options, run_fleet
from fuzzer.cli._launch import launch_options, resolve
from fuzzer.cli._options import db_option, model_option, server_option, target_option
from fuzzer.cli._slo import goodput_option, parse_slo
from fuzzer.cli._target import (
    DEFAULT_SIM_PATHOLOGIES,
    limits_for,
    open_target,
    parse_duration,
    sim_key,
)
from fuzzer.errors import ConfigError, TargetError
from fuzzer.execute import clientlag
from fuzzer.oracle.calibration import Calibration, calibration_keys
from fuzzer.oracle.verdict import Verdict
from fuzzer.search.campaign import Campaign
from fuzzer.search.pacing import CONFIRM_SHARE, IDLE_SHARE
from fuzzer.search.settings import RECOVER_PATIENCE_S, ExitReason, Settings, Stats, Summary
from fuzzer.store import CampaignLock, Store

# AFL: stability "harmless when it stays over 90% or so".
STABILITY_WARNING = 0.90
# Without a terminal (CI logs, nohup) print one status line this often instead of a live panel.
PLAIN_STATUS_EVERY_S = 30.0
LIVE_REFRESH_PER_S = 4
# The seed traces of the project (corpus/ beside the package): found when fuzz runs from a
# checkout (pip install -e), whatever the working directory.
BUNDLED_CORPUS = Path(__file__).resolve().parents[2] / "corpus"


@click.command("campaign")
@target_option
@launch_options
@db_option
@click.option("--duration", default="8h", show_default=True, help="How long to fuzz: 90s, 10m, 8h.")
@click.option("--max-execs", type=click.IntRange(min=1), default=None, help="Stop after this many executions.")
@click.option("--seed", type=int, default=None, help="Random seed (default: a fresh one, stored for resume).")
@click.option(
    "--corpus",
    "corpus_dir",
    default=None,
    type=click.Path(),
    help="Folder of seed traces (*.json), one trace, or a production trace (Mooncake JSONL, Azure or BurstGPT CSV: "
         "its first windows become seeds) [default: ./corpus, else the seeds that come with fuzz].",
)
@server_option
@model_option
@click.option(
    "--pathologies",
    default=None,
    help=f"Built-in simulator only: what to plant (default {','.join(DEFAULT_SIM_PATHOLOGIES)}; 'none', 'all').",
)
@click.option(
    "--faults",
    default=None,
    help="Built-in simulator only: fault modes to switch on (crash,hang,reset,http-500,malformed-sse,truncated-sse; 'all').",
)
@click.option("--fault-rate", type=float, default=None, help="Built-in simulator only: share of requests a fault hits.")
@click.option("--speed", type=float, default=None, help="Built-in simulator only: run simulated time this much faster.")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0.01),
    default=None,
    help="Seconds without a byte from the server before a request counts as a hang (default 60).",
)
@click.option("--null-mutator", is_flag=True, help="Random generation instead of guided mutation (the baseline).")
@click.option(
    "--idle-share",
    type=click.FloatRange(min=0.0, max=0.5),
    default=IDLE_SHARE,
    show_default=True,
    help="Largest share of wall time spent letting the server idle on purpose (10 s at a time) to catch "
    "cold starts; 0 never does.",
)
@click.option(
    "--confirm-share",
    type=click.FloatRange(min=0.05, max=1.0),
    default=CONFIRM_SHARE,
    show_default=True,
    help="Largest share of server time spent confirming before a candidate of a kind already found waits "
    "(ranked: families least like any finding's first, then the largest slowdowns); 1 confirms each at once.",
)
@goodput_option
@fleet_options
def command(
    target, launch, target_file, db_path, duration, max_execs, seed, corpus_dir, server, model, pathologies, faults,
    fault_rate, speed, timeout_s, null_mutator, idle_share, confirm_share, goodput_specs, ray_address=None,
    targets_file=None,
) -> None:
    """Fuzz a server for latency pathologies; resume with the same --db.

    Without --target, a simulated vLLM-like server with planted pathologies is
    started on a free loopback port. Ctrl-C finishes the current execution,
    saves everything and prints what to run next. Only one campaign at a time
    may write to a database; a second one on the same --db is refused.

    \b
    Example:
        fuzz campaign --duration 2m
        fuzz campaign --target http://127.0.0.1:8000 --duration 8h --db night.db
        fuzz campaign --faults all --fault-rate 0.1 --speed 10 --timeout 2 --duration 5m
        fuzz campaign --corpus conversation_trace.jsonl --goodput ttft:2000 tpot:100 --duration 1h
        fuzz campaign --launch "llama-server -m tiny.gguf --port {port} --metrics" --duration 1h
        fuzz campaign --ray --targets targets.toml --duration 8h --db fleet.db
    """
    if check_fleet_options(ray_address, targets_file, target=target, launch=launch, target_file=target_file,
                           pathologies=pathologies, faults=faults, fault_rate=fault_rate, speed=speed,
                           goodput=goodput_specs, server=server != "auto", model=model, timeout=timeout_s):
        run_fleet(ray_address, targets_file, db_path, duration_s=parse_duration(duration), max_execs=max_execs,
                  seed=int.from_bytes(os.urandom(4), "big") if seed is None else seed,
                  seeds=_load_seeds(_seed_folder(corpus_dir)), null_mutator=null_mutator)
        return
    managed = resolve(target, launch, target_file)
    duration_s = parse_duration(duration)
    slo = parse_slo(goodput_specs)
    seeds = _load_seeds(_seed_folder(corpus_dir))
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "big")
    planted: tuple[str, ...] = ()
    sim: dict = {}
    if target is None and managed is None:
        from fuzzer.sim import faults as sim_faults  # noqa: PLC0415
        from fuzzer.sim import pathologies as sim_pathologies  # noqa: PLC0415

        planted = sim_pathologies.parse(pathologies) if pathologies else DEFAULT_SIM_PATHOLOGIES
        if speed is not None:
            if not speed > 0:
                raise ConfigError(f"--speed must be > 0 (2 runs twice as fast), got {speed}")
            sim["speed"] = speed
        if faults:
            sim["faults"] = sim_faults.parse(faults)
        if fault_rate is not None:
            sim["fault_rate"] = sim_faults.check_rate(fault_rate)
    elif pathologies or faults or fault_rate is not None or speed is not None:
        raise ConfigError("--pathologies, --faults, --fault-rate and --speed apply to the built-in simulator only; "
                          "drop them or drop --target / --launch")
    try:
        summary = asyncio.run(
            _run(target, db_path, duration_s, max_execs, seed, seeds, server, model, planted, sim, timeout_s,
                 null_mutator, idle_share, slo_ms=dict(slo.items()) if slo else None,
                 launch=managed.spec if managed else None, confirm_share=confirm_share)
        )
    except (asyncio.CancelledError, KeyboardInterrupt):  # stopped while the server was being started
        _console.err.print("interrupted before the campaign started; nothing was stored")
        raise SystemExit(130) from None
    _print_summary(summary, db_path)
    if summary.reason is ExitReason.SERVER_DOWN:
        raise TargetError(
            f"the server answered nothing for {RECOVER_PATIENCE_S:.0f} s ({summary.server_error or 'no answer'}); "
            "the campaign stopped with its state saved (a candidate under confirmation stays pending): restart the "
            "server, or run with --launch so the fuzzer restarts it, and run the same command to resume")


def _seed_folder(corpus_dir: str | None) -> Path | None:
    """The folder named by --corpus; else ./corpus; else the seeds of the checkout fuzz runs from."""
    if corpus_dir is not None:
        folder = Path(corpus_dir)
        if not folder.exists():
            raise ConfigError(f"--corpus folder {folder} does not exist")
        return folder
    for folder in (Path("corpus"), BUNDLED_CORPUS):
        if folder.is_dir():
            return folder
    _console.err.print("note: no ./corpus folder and no bundled seeds; the campaign starts from generated traces")
    return None


def _load_seeds(folder: Path | None) -> list[trace_format.Trace]:
    if folder is not None and folder.is_file():
        from fuzzer.formats.seeds import seeds_of_file  # noqa: PLC0415

        return seeds_of_file(folder)
    return [trace_format.load(p) for p in sorted(folder.glob("*.json"))] if folder is not None else []


async def _run(
    url, db_path, duration_s, max_execs, seed, seeds, server, model, planted, sim, timeout_s, null_mutator, idle_share,
    wall_clock: Callable[[], float] = time.time, slo_ms: dict[str, float] | None = None, launch=None,
    confirm_share: float = CONFIRM_SHARE,
) -> Summary:
    stop = asyncio.Event()
    running = asyncio.Event()
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()

    def on_interrupt() -> None:
        if (stop.is_set() or not running.is_set()) and main_task is not None:
            # A second Ctrl-C: stop now, the store is still consistent; before the campaign runs
            # (a launched server still starting), the first one does.
            main_task.cancel()
        stop.set()

    loop.add_signal_handler(signal.SIGINT, on_interrupt)
    loop.add_signal_handler(signal.SIGTERM, on_interrupt)
    try:
        with Store.open(db_path) as store, CampaignLock(db_path):
            identity = launch.identity if launch is not None else url or sim_key(planted, sim, seed)
            stored = stored_calibration(store, calibration_keys(identity))
            if sim.get("faults") and (stored is None or stored.is_stale(wall_clock())):
                # The campaign calibrates first (reuse_or_calibrate's rule): its probes must meet a
                # clean server (it stops at the first failure).
                from fuzzer.sim.faults import CALIBRATION_GRACE_REQUESTS  # noqa: PLC0415

                sim = {**sim, "fault_grace": CALIBRATION_GRACE_REQUESTS}
            async with open_target(
                url, server=server, model=model, pathologies=planted, seed=seed, sim_options=sim, timeout_s=timeout_s,
                launch=launch,
            ) as target:
                info = target.info
                target_id = store.upsert_target(
                    identity, info.kind if info else "unknown", info.model if info else None,
                    info.version if info else None, dict(info.capabilities) if info else {},
                )
                settings = Settings(
                    duration_s=duration_s, max_execs=max_execs, seed=seed,
                    mutator="null" if null_mutator else "guided", limits=limits_for(target), idle_share=idle_share,
                    confirm_share=confirm_share, slo_ms=slo_ms,
                )
                # One key for every command (fuzz calibrate stores there); older keys still read.
                # The campaign measures again when the stored calibration is stale.
                keys = calibration_keys(identity, info.model if info else None)
                with _StatusView() as view:
                    campaign = Campaign(
                        target, store, settings, seeds=seeds, target_key=identity, calibration_key=keys[0], target_id=target_id,
                        calibration=stored_calibration(store, keys), wall_clock=wall_clock,
                        on_stats=lambda s: view.update(s, campaign.calibration),
                        on_finding=view.finding, stop=stop,
                    )
                    running.set()
                    return await campaign.run()
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        loop.remove_signal_handler(signal.SIGTERM)


class _StatusView:
    """The live status panel (a terminal) or a status line every half minute (a log)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._live: Live | None = None
        self._last_plain = 0.0
        self._last: Stats | None = None
        self._warned: Calibration | None = None

    def __enter__(self) -> "_StatusView":
        if _console.out.is_terminal:
            self._live = Live(console=_console.out, refresh_per_second=LIVE_REFRESH_PER_S, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)

    def update(self, stats: Stats, calibration: Calibration | None = None) -> None:
        self._last = stats
        if calibration is not None and calibration is not self._warned and stats.phase != "calibrate":
            self._warned = calibration  # once per calibration (a long campaign recalibrates)
            _console.warn_if_unreliable(calibration)
        if self._live is not None:
            self._live.update(_stats_table(stats))
        elif self._clock() - self._last_plain >= PLAIN_STATUS_EVERY_S:
            self._last_plain = self._clock()
            _console.out.print(
                f"[{stats.elapsed_s:6.0f}s] {stats.phase:9} execs {stats.executions} ({stats.execs_per_min:.0f}/min) "
                f"corpus {stats.corpus} features {stats.features} stability {stats.stability:.0%} "
                f"findings {stats.findings} server {stats.server}"
            )

    def finding(self, finding_id: int, verdict: Verdict) -> None:
        slow = slowdown_words(verdict.slowdown, verdict.ablated, verdict.over_bound)
        _console.out.print(f"[bold]finding {finding_id}[/bold]: {verdict.kind}{slow}, reproduced {verdict.reproduction}")


def _stats_table(s: Stats) -> Table:
    table = Table(title=f"fuzz campaign {s.campaign_id}: {s.phase}", show_header=False)
    since = "never" if s.since_last_find_s is None else f"{s.since_last_find_s:.0f}s ago"
    rows = [
        ("run time", f"{s.elapsed_s:.0f}s"),
        ("executions", f"{s.executions} ({s.execs_per_min:.1f}/min)"),
        ("corpus", f"{s.corpus} ({s.favoured} favoured)"),
        ("features", str(s.features)),
        ("stability", f"{s.stability:.1%}" + ("  (low: timing noise)" if s.stability < STABILITY_WARNING else "")),
        ("candidates / confirmations", f"{s.candidates} / {s.confirmations}"
                                       + (f" ({s.waiting} waiting for the confirmation share)" if s.waiting else "")),
        ("findings", f"{s.findings} (last find: {since})"),
        ("server", s.server),
        ("time by phase", time_line(s.time_s)),
    ]
    if s.client_stalls:
        rows.append(("client stalls", f"{s.client_stalls} executions over {_STARVED_MS:.0f} ms, "
                                      f"worst {s.worst_client_stall_s:.2f} s"))
    for k, v in rows:
        table.add_row(k, v)
    return table


_STARVED_MS = 1000 * clientlag.STARVED_S


def client_stall_hint(s: Stats) -> str:
    """What a campaign whose client stalled should tell its user (the cause, the cost, the cure)."""
    return (f"  the fuzzer's event loop stalled over {_STARVED_MS:.0f} ms in {s.client_stalls} of {s.executions} executions "
            f"(worst {s.worst_client_stall_s:.2f} s): it was short of CPU, most often because the server "
            "runs on the same cores. Latencies within a stall are not held against the server, so smaller "
            "bugs go unseen; leave the fuzzer a core the server does not use (e.g. `taskset -a -p -c 0-N PID` "
            "on the server's busiest processes; README, \"vLLM on any machine\")")


def server_down_hint(summary: Summary) -> str | None:
    """What to do about a server that was down when the campaign stopped for another reason (its deadline,
    Ctrl-C); None when it was up, or when it stopped for being down (that one ends in its own error)."""
    if summary.server_error is None or summary.reason is ExitReason.SERVER_DOWN:
        return None
    pending = summary.stats.pending
    return (f"warning: the server was down when the campaign stopped ({summary.server_error}); "
            + (f"{pending} candidate(s) it was confirming stay pending; " if pending else "")
            + "its log says why it went down. Restart it (or run with --launch, and the fuzzer restarts it) and run "
            + "the same command to " + ("confirm them" if pending else "resume"))


def _print_summary(summary: Summary, db_path: str) -> None:
    out = _console.out
    s = summary.stats
    why = {ExitReason.DURATION: "duration reached", ExitReason.MAX_EXECS: "--max-execs reached",
           ExitReason.INTERRUPTED: "interrupted; everything is saved",
           ExitReason.SERVER_DOWN: "the server stopped answering; everything is saved"}[summary.reason]
    if summary.reason is ExitReason.INTERRUPTED and not s.executions and s.time_s.get("calibrate"):
        why = "interrupted while calibrating; no calibration was stored (the same command measures it again)"
    verb = "resumed" if summary.resumed else "ran"
    out.print(f"campaign {summary.campaign_id} {verb} {s.elapsed_s:.0f}s: {why}")
    out.print(f"  executions {s.executions} ({s.execs_per_min:.1f}/min), corpus {s.corpus}, features {s.features}, "
              f"stability {s.stability:.1%}, findings {s.findings}")
    if s.stability < STABILITY_WARNING:
        out.print("  stability is below 90%: timing noise is high; features that flicker are ignored")
    if s.time_s:
        out.print("  time: " + time_line(s.time_s))
    if s.waiting:
        out.print(f"  candidates waiting for the confirmation share: {s.waiting} (resuming the campaign confirms them, best first, as its share allows)")
    if s.too_long:
        out.print(f"  mutants passed over as longer than their share of --duration: {s.too_long}")
    if (down := server_down_hint(summary)) is not None:
        _console.err.print(down)
    if s.client_stalls:
        out.print(client_stall_hint(s))
    for finding_id, kind in summary.new_findings:
        out.print(f"  new finding {finding_id}: {kind}")
    db = "" if db_path == "fuzz.db" else f" --db {db_path}"
    out.print("next:")
    if s.findings:
        first = summary.new_findings[0][0] if summary.new_findings else 1
        out.print(f"  fuzz findings{db}")
        out.print(f"  fuzz show {first}{db}")
        if (first, "slo-violation") in summary.new_findings:  # not minimized or bundled: its trace as Mooncake
            out.print(f"  fuzz export {first}{db} --format mooncake")
        else:
            out.print(f"  fuzz minimize {first}{db}")
            out.print(f"  fuzz export {first}{db}")
    else:
        out.print(f"  fuzz campaign{db}   (the same command resumes where this one stopped)")
        out.print(f"  fuzz status{db}")
