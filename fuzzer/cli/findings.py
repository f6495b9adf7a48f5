"""``fuzz findings``: list the confirmed findings of a database."""

from __future__ import annotations

import json

import click

from fuzzer.cli import _console
from fuzzer.cli._options import db_option, json_option
from fuzzer.cli._render import finding_summary, findings_table
from fuzzer.store import Store


@click.command("findings")
@db_option
@json_option
def command(db_path, as_json) -> None:
    """List findings: id, kind, slowdown (over idle), over bound (over the FCFS bound), reproduction rate, requests, minimized.

    \b
    Example:
        fuzz findings --db night.db --json
    """
    with Store.open(db_path, create=False) as store:
        findings = store.list_findings()
    if as_json:
        click.echo(json.dumps([finding_summary(f) for f in findings], indent=1))
        return
    if not findings:
        _console.out.print(f"no findings in {db_path}")
        return
    _console.out.print(findings_table(findings))
    _console.out.print("next: fuzz show ID, fuzz minimize ID, fuzz export ID")
