"""``fuzz findings``: list the confirmed findings of a database."""

from __future__ import annotations

import click

from fuzzer.cli._notbuilt import not_built
from fuzzer.cli._options import db_option, json_option


@click.command("findings")
@db_option
@json_option
def command(db_path, as_json) -> None:
    """List findings: id, kind, slowdown, reproduction rate, requests, minimized.

    \b
    Example:
        fuzz findings --db night.db --json
    """
    raise not_built("findings", "the findings list")
