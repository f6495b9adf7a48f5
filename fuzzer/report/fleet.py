"""Per-target throughput and findings of a fleet campaign (``fuzz status``, ``fuzz report``).

A fleet campaign (``fuzz campaign --ray``) keeps each target's standing in its campaign
state; the executions and findings are in the store with the target's id. :func:`rows`
joins them: one row per target.
"""

from __future__ import annotations

import html
from typing import Any, Mapping

from fuzzer.store import Store

HEAD = ("target", "status", "host", "executions", "execs/min", "busy s", "findings", "reproduced elsewhere")


def rows(store: Store, campaign: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """One row per target of a fleet campaign (empty for a single-server campaign)."""
    if campaign is None or "fleet" not in campaign["settings"]:
        return []
    counts = store.executions_by_target(campaign["id"])
    findings = store.list_findings(campaign_id=campaign["id"])
    out = []
    for name, saved in campaign["state"].get("targets", {}).items():
        done = counts.get(saved.get("target_id"), {})
        n = done.get("executions", 0)
        span = (done.get("last") or 0.0) - (done.get("first") or 0.0)
        own = [f for f in findings if f.details.get("target") == name]
        elsewhere = sum(1 for f in findings if f.details.get("target") != name
                        and str(f.details.get("targets", {}).get(name, "")).split("/")[0].isdigit())
        out.append({
            "target": name, "status": saved.get("status", "?") + (f" ({saved['reason']})" if saved.get("reason") else ""),
            "host": saved.get("host"), "executions": n,
            "execs_per_min": round(60.0 * n / span, 1) if span > 0 else None,
            "busy_s": round(float(done.get("busy_s") or 0.0), 1), "findings": len(own), "reproduced_elsewhere": elsewhere,
        })
    return out


def section(table: list[dict[str, Any]]) -> str:
    """The report's "Targets" section (HTML)."""
    e = html.escape
    cells = "".join(f"<th>{e(h)}</th>" for h in HEAD)
    body = "".join(
        "<tr>" + "".join(f"<td>{e('-' if v is None else str(v))}</td>" for v in row.values()) + "</tr>" for row in table
    )
    return (f"<h2>Targets ({len(table)})</h2><p>A fleet campaign: each target's executions, its throughput "
            f"(executions per minute from its first execution's start to its last one's end) and the findings first confirmed on it.</p>"
            f"<table><tr>{cells}</tr>{body}</table>")
