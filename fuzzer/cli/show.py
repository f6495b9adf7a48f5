"""``fuzz show``: one finding in full."""

from __future__ import annotations

import json

import click

from fuzzer.cli import _console
from fuzzer.cli._options import db_option, json_option
from fuzzer.cli._render import finding_summary, trace_table, when
from fuzzer.oracle.verdict import over_bound_of
from fuzzer.oracle.summary import summarize
from fuzzer.store import Store


@click.command("show")
@click.argument("finding_id")
@db_option
@json_option
def command(finding_id, db_path, as_json) -> None:
    """Show FINDING_ID: its trace, verdict and per-request table.

    \b
    Example:
        fuzz show 3 --db night.db
    """
    with Store.open(db_path, create=False) as store:
        finding = store.get_finding(finding_id)
        trace = store.get_trace(finding.trace_hash)
        minimized = store.get_trace(finding.minimized_trace_hash) if finding.minimized else None
        executions = [store.get_execution(i) for i in store.execution_ids(trace_hash=finding.trace_hash)] if as_json else []
    if as_json:
        data = {
            **finding_summary(finding),
            "verdict": dict(finding.verdict),
            "details": dict(finding.details),
            "trace": trace.to_dict(),
            "minimized_trace": minimized.to_dict() if minimized else None,
            # AIPerf-shaped summaries over every stored execution of the finding's trace.
            "metrics": summarize(executions),
            "executions": len(executions),
        }
        click.echo(json.dumps(data, indent=1))
        return
    out = _console.out
    out.print(f"[bold]finding {finding.id}[/bold]: {finding.kind}, found {when(finding.created_at)}")
    out.print(f"signature: {finding.signature}")
    if finding.slowdown is not None:
        option = finding.verdict.get("ablated")
        statistic = "ITL" if finding.verdict.get("compared") == "itl" else "e2e"
        what = f" (the other requests' median {statistic} with {option} over without it)" if option else " over idle"
        beyond = over_bound_of(finding.verdict)
        bound = f", {beyond:.1f}x its FCFS bound" if beyond else ""
        out.print(f"slowdown: {finding.slowdown:.1f}x{what}{bound}, reproduced {finding.reproduced or '-'}")
    out.print(trace_table(trace, title=f"trace {finding.trace_hash[:12]} ({len(trace.requests)} requests)"))
    if minimized:
        out.print(trace_table(minimized, title=f"minimized {finding.minimized_trace_hash[:12]}"))
    if finding.verdict:
        out.print("verdict: " + json.dumps(dict(finding.verdict), indent=1))
    if finding.details:
        out.print("details: " + json.dumps(dict(finding.details), indent=1))
