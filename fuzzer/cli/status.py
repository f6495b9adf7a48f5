"""``fuzz status``: statistics of the live or last campaign (AFL's fuzzer_stats)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import click

from fuzzer.cli import _console
from fuzzer.cli._options import db_option, json_option
from fuzzer.cli._render import time_line, when
from fuzzer.report import fleet as fleet_report
from fuzzer.search.pacing import fuzz_share
from fuzzer.store import Store

# A running campaign checkpoints at least every few executions; silence longer than this
# means it died without saying so (killed) or is stuck on a hung server.
STALE_AFTER_S = 300.0


@click.command("status")
@db_option
@json_option
def command(db_path, as_json) -> None:
    """Show executions, execs/min, corpus, features, stability and findings.

    Works while a campaign is writing to the same database.

    \b
    Example:
        fuzz status --db night.db
    """
    with Store.open(db_path, create=False) as store:
        stats = _stats(store, db_path)
    if as_json:
        click.echo(json.dumps(stats, indent=1))
        return
    if "campaign" not in stats:
        _console.out.print(f"no campaign has run on {db_path} yet ({stats['executions']} executions stored)")
    for key, value in stats.items():
        if key == "targets":
            continue
        if key == "time_by_phase_s":
            value = time_line(value)
        elif isinstance(value, float):
            value = f"{value:.1%}" if key in ("stability", "fuzz_share") else f"{value:.1f}"
        _console.out.print(f"{key:>26}: {value}")
    for row in stats.get("targets", []):
        rate = "-" if row["execs_per_min"] is None else f"{row['execs_per_min']:.1f}/min"
        _console.out.print(f"{'target ' + row['target']:>26}: {row['status']}, {row['executions']} executions "
                           f"({rate}), findings {row['findings']}, reproduced elsewhere {row['reproduced_elsewhere']}")


def _stats(store: Store, db_path: str, clock: Callable[[], float] = time.time) -> dict[str, Any]:
    """What `fuzz status` shows; a running campaign silent for STALE_AFTER_S by ``clock`` is suspect."""
    campaign = store.latest_campaign()
    stats: dict[str, Any] = {
        "database": db_path,
        "executions": store.count_executions(),
        "findings": len(store.list_findings()),
    }
    if campaign is None:
        return stats
    saved = campaign["state"].get("stats", {})
    status = campaign["status"]
    if status == "running" and clock() - campaign["updated_at"] > STALE_AFTER_S:
        status = "running? (no checkpoint for over 5 minutes: killed or stuck)"
    stats.update(
        {
            "campaign": campaign["id"],
            "status": status,
            "target": campaign["target"],
            "seed": campaign["seed"],
            "started": when(campaign["started_at"]),
            "last_update": when(campaign["updated_at"]),
            "by_purpose": store.purposes(campaign_id=campaign["id"]),
            "features_covered": store.count_features(campaign["id"]),
            **{k: saved[k] for k in ("execs_per_min", "corpus", "favoured", "stability", "phase") if k in saved},
        }
    )
    if saved.get("time_s"):
        stats["time_by_phase_s"] = {k: round(v, 3) for k, v in saved["time_s"].items()}
        share = fuzz_share(saved["time_s"])
        if share is not None:
            stats["fuzz_share"] = round(share, 3)
    targets = fleet_report.rows(store, campaign)
    if targets:
        stats["targets"] = targets
    if saved.get("client_stalls"):  # the run's own count (a resumed campaign counts afresh)
        stats["client_stalls"] = {"executions": saved["client_stalls"],
                                  "worst_s": round(saved.get("worst_client_stall_s", 0.0), 3)}
    if saved.get("waiting"):  # candidates the confirmation share held back (a resumed campaign confirms them)
        stats["candidates_waiting"] = saved["waiting"]
    if saved.get("pending"):  # candidates a stop interrupted (a resumed campaign confirms them first)
        stats["candidates_pending"] = saved["pending"]
    if saved.get("server") == "down":  # down when the campaign last saved its state
        stats["server"] = "down"
    if saved.get("since_last_find_s") is not None:
        stats["last_find_s_before_update"] = round(saved["since_last_find_s"])
    return stats
