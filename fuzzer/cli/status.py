"""``fuzz status``: statistics of the live or last campaign."""

from __future__ import annotations

import json

import click

from fuzzer.cli import _console
from fuzzer.cli._options import db_option, json_option
from fuzzer.store import Store


@click.command("status")
@db_option
@json_option
def command(db_path, as_json) -> None:
    """Show executions, execs/min, corpus, features, stability and findings.

    \b
    Example:
        fuzz status --db night.db
    """
    with Store.open(db_path, create=False) as store:
        stats = {
            "database": db_path,
            "schema_version": store.schema_version,
            "executions": store.count_executions(),
            "findings": len(store.list_findings()),
        }
    if as_json:
        click.echo(json.dumps(stats, indent=1))
        return
    for key, value in stats.items():
        _console.out.print(f"{key:>15}: {value}")
