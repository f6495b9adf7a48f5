"""``fuzz export``: write a finding's repro script, report and trace."""

from __future__ import annotations

import click

from fuzzer.cli._notbuilt import not_built
from fuzzer.cli._options import db_option


@click.command("export")
@click.argument("finding_id")
@db_option
@click.option(
    "--out",
    "out_dir",
    default="findings",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder to write <out>/<ID>/ into.",
)
def command(finding_id, db_path, out_dir) -> None:
    """Write repro.py, report.md, timeline.png and trace.json for FINDING_ID.

    \b
    Example:
        fuzz export 3 --db night.db --out findings/
    """
    raise not_built("export", "the exporter")
