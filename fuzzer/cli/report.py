"""``fuzz report``: a self-contained HTML report of a campaign."""

from __future__ import annotations

import time
from pathlib import Path

import click

from fuzzer.cli._console import out
from fuzzer.cli._options import db_option
from fuzzer.cli._slo import goodput_option, parse_slo
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
@goodput_option
def command(db_path, out_path, goodput_specs) -> None:
    """Write an HTML campaign report with plots and the findings table.

    One file with its images inlined: coverage and findings over time, executions
    per minute, corpus growth (plots need matplotlib, the `plot` extra).

    \b
    Example:
        fuzz report --db night.db --out night.html
        fuzz report --db night.db --goodput ttft:500 tpot:50
    """
    from fuzzer.report import fleet as fleet_report  # noqa: PLC0415
    from fuzzer.report import html as report  # noqa: PLC0415 - matplotlib only for this command
    from fuzzer.report import slo as slo_report  # noqa: PLC0415
    from fuzzer.store import Store  # noqa: PLC0415

    slo = parse_slo(goodput_specs)
    sections, slo_data = [], None
    with Store.open(db_path, create=False) as store:
        data = report.gather(store)
        targets = fleet_report.rows(store, store.latest_campaign())
        if targets:
            sections.append(fleet_report.section(targets))
        if slo is not None:
            slo_data = slo_report.gather(store, slo, data.campaign, data.findings)
            sections.append(slo_report.section(slo_data))
    page = report.render_html(data, generated_at=time.time(), sections=sections)
    target = Path(out_path)
    try:
        target.write_text(page)
    except OSError as e:
        raise OutputError(f"cannot write {target}: {e.strerror or e}") from None
    what = f"campaign {data.campaign['id']}" if data.campaign else "no campaign"
    out.print(f"wrote {target} ({what}, {len(data.executions)} executions, {len(data.findings)} findings)")
    for row in targets:
        rate = "-" if row["execs_per_min"] is None else f"{row['execs_per_min']:.1f}/min"
        out.print(f"  {row['target']}: {row['status']}, {row['executions']} executions ({rate}), "
                  f"findings {row['findings']}")
    if slo_data is not None:
        att, rate = slo_data["attainment"], slo_data["goodput_rps"]
        out.print(f"SLO {slo.describe()} (ms): attainment {'-' if att is None else f'{att:.0%}'}, goodput "
                  f"{'-' if rate is None else f'{rate:.2f}'} requests/s over {slo_data['executions']} executions, "
                  f"{len(slo_data['findings'])} slo-violation finding(s)")
