"""Tables the CLI shows (rich), shared by several commands."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from typing import Any

from rich.table import Table

from fuzzer.oracle.verdict import over_bound_of
from fuzzer.store import StoredFinding
from fuzzer.trace import Trace


def finding_summary(f: StoredFinding) -> dict[str, Any]:
    """The fields of ARCHITECTURE.md, "Store and CLI" (`fuzz findings --json`), plus what identifies the finding."""
    return {
        "id": f.id,
        "kind": f.kind,
        "slowdown": f.slowdown,
        "over_bound": over_bound_of(f.verdict),
        "reproduced": f.reproduced,
        "requests": f.requests,
        "minimized": f.minimized,
        "signature": f.signature,
        "trace_hash": f.trace_hash,
        "created_at": f.created_at,
        "campaign_id": f.campaign_id,
    }


def findings_table(findings: list[StoredFinding]) -> Table:
    table = Table(title=f"{len(findings)} finding(s)")
    for name, justify in (
        ("id", "right"),
        ("kind", "left"),
        ("slowdown", "right"),
        ("over bound", "right"),
        ("reproduced", "right"),
        ("requests", "right"),
        ("minimized", "left"),
        ("found", "left"),
    ):
        table.add_column(name, justify=justify)
    for f in findings:
        table.add_row(
            str(f.id),
            f.kind,
            "-" if f.slowdown is None else f"{f.slowdown:.1f}x",
            _times(over_bound_of(f.verdict)),
            f.reproduced or "-",
            str(f.requests),
            "yes" if f.minimized else "no",
            when(f.created_at),
        )
    return table


def trace_table(trace: Trace, *, title: str | None = None) -> Table:
    table = Table(title=title or (trace.name or "trace"))
    for name in ("id", "at_ms", "prompt", "prefix", "max_tokens", "stream", "api", "cancel", "n", "logprobs",
                 "leaves_ms", "seed"):
        table.add_column(name, justify="left" if name in ("id", "prefix", "api", "stream") else "right")
    for r in trace.requests:
        prefix = f"{r.prefix}({trace.prefixes[r.prefix]})" if r.prefix else "-"
        table.add_row(
            r.id,
            f"{r.at_ms:g}",
            str(r.prompt_tokens),
            prefix,
            str(r.max_tokens),
            "yes" if r.stream else "no",
            r.api,
            "-" if r.cancel_after_tokens is None else str(r.cancel_after_tokens),
            str(r.n),
            "-" if r.logprobs is None else str(r.logprobs),
            "-" if r.disconnect_after_ms is None else f"{r.disconnect_after_ms:g}",
            "-" if r.seed is None else str(r.seed),
        )
    return table


def when(epoch_s: float) -> str:
    return _dt.datetime.fromtimestamp(epoch_s).strftime("%Y-%m-%d %H:%M:%S")


def time_line(seconds: Mapping[str, float]) -> str:
    """'fuzz 61% (366 s), confirm 20% (120 s), ...': the phases that took any time, largest first."""
    total = sum(seconds.values())
    if total <= 0:
        return "-"
    spent = sorted(((v, k) for k, v in seconds.items() if v > 0), reverse=True)
    return ", ".join(f"{k} {v / total:.0%} ({v:.0f} s)" for v, k in spent)


def slowdown_words(slowdown: float | None, ablated: str | None, over_bound: float | None = None) -> str:
    """A new finding's slowdown as a campaign's line says it: over idle and over its FCFS bound (a request that
    also waited by design can be far slower than idle and only a little beyond its bound), or, for an
    option-slowdown, over the same trace without the option."""
    if not slowdown:
        return ""
    if ablated:
        return f", {slowdown:.1f}x slower with {ablated} than without"
    return f", {slowdown:.1f}x slower than idle" + (f", {over_bound:.1f}x its FCFS bound" if over_bound else "")


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}x"
