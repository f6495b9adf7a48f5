"""The SLO section of ``fuzz report --goodput``: SLO attainment and goodput over the stored
executions (of the campaign, or of the whole database when there is none) and the
``slo-violation`` findings, beside the scheduler-pathology ones."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from fuzzer.oracle.kinds import FindingKind
from fuzzer.oracle.slo import Slo, goodput
from fuzzer.store import Store, StoredFinding

#: Executions read for the section (the newest): a night's campaign holds thousands, and
#: attainment over the last few hundred says the same in a fraction of the time.
MAX_EXECUTIONS = 500


def gather(store: Store, slo: Slo, campaign: Mapping[str, Any] | None,
           findings: Sequence[StoredFinding]) -> dict[str, Any]:
    """Attainment (good requests / requests) and mean goodput over the newest stored executions."""
    rows = store.execution_rows(campaign_id=campaign["id"] if campaign else None)[-MAX_EXECUTIONS:]
    runs = [goodput(store.get_execution(r["id"]), slo) for r in rows]
    good = sum(r["good"] for r in runs)
    total = sum(r["requests"] for r in runs)
    rates = [r["goodput_rps"] for r in runs if r["goodput_rps"] is not None]
    return {
        "slo_ms": dict(slo.items()),
        "executions": len(runs),
        "attainment": good / total if total else None,
        "goodput_rps": sum(rates) / len(rates) if rates else None,
        "findings": [f.id for f in findings if f.kind == FindingKind.SLO_VIOLATION.value],
    }


def section(data: Mapping[str, Any]) -> str:
    """The HTML of the section."""
    att, rate = data["attainment"], data["goodput_rps"]
    slo = " ".join(f"{k}:{v:g}" for k, v in data["slo_ms"].items())
    ids = ", ".join(str(i) for i in data["findings"]) or "none"
    return (
        f"<h2>SLO ({html.escape(slo)} ms)</h2>"
        f"<p>SLO attainment {'-' if att is None else f'{att:.1%}'} of the requests and goodput "
        f"{'-' if rate is None else f'{rate:.2f}'} requests/s (mean per execution) over the newest "
        f"{data['executions']} stored executions. slo-violation findings: {html.escape(ids)} "
        "(judged beside the scheduler kinds, never instead of them).</p>"
    )
