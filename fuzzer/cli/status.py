"""``fuzz status``: statistics of the live or last campaign."""

from __future__ import annotations

import click

from fuzzer.cli._notbuilt import not_built
from fuzzer.cli._options import db_option, json_option


@click.command("status")
@db_option
@json_option
def command(db_path, as_json) -> None:
    """Show executions, execs/min, corpus, features, stability and findings.

    \b
    Example:
        fuzz status --db night.db
    """
    raise not_built("status", "the campaign statistics")
