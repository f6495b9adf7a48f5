"""``fuzz show``: one finding in full."""

from __future__ import annotations

import click

from fuzzer.cli._notbuilt import not_built
from fuzzer.cli._options import db_option, json_option


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
    raise not_built("show", "the finding view")
