"""``fuzz report``: a self-contained HTML report of a campaign."""

from __future__ import annotations

import time
from pathlib import Path

import click

from fuzzer.cli._console import out
from fuzzer.cli._options import db_option
from fuzzer.errors import OutputError


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

    One file with its images inlined: coverage and findings over time, executions
    per minute, corpus growth (plots need matplotlib, the `plot` extra).

    \b
    Example:
        fuzz report --db night.db --out night.html
    """
    from fuzzer.report import html as report  # noqa: PLC0415 - matplotlib only for this command
    from fuzzer.store import Store  # noqa: PLC0415

    with Store.open(db_path, create=False) as store:
        data = report.gather(store)
    page = report.render_html(data, generated_at=time.time())
    target = Path(out_path)
    try:
        target.write_text(page)
    except OSError as e:
        raise OutputError(f"cannot write {target}: {e.strerror or e}") from None
    what = f"campaign {data.campaign['id']}" if data.campaign else "no campaign"
    out.print(f"wrote {target} ({what}, {len(data.executions)} executions, {len(data.findings)} findings)")
