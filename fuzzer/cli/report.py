"""``fuzz report``: a self-contained HTML report of a campaign."""

from __future__ import annotations

import click

from fuzzer.cli._notbuilt import not_built
from fuzzer.cli._options import db_option


@click.command("report")
@db_option
@click.option(
    "--out",
    "out_path",
    default="report.html",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="HTML file to write.",
)
def command(db_path, out_path) -> None:
    """Write an HTML campaign report with plots and the findings table.

    \b
    Example:
        fuzz report --db night.db --out night.html
    """
    raise not_built("report", "the campaign report")
