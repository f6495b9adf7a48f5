"""``fuzz export``: write a finding's repro script, report and trace."""

from __future__ import annotations

import click

from fuzzer.cli._console import out
from fuzzer.cli._launch import launch_options
from fuzzer.cli._options import db_option
from fuzzer.cli._slo import refuse_slo_finding
from fuzzer.cli._variants import variant_option


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
@click.option("--format", "fmt", type=click.Choice(["bundle", "mooncake"]), default="bundle", show_default=True,
              help="bundle: repro.py, report.md, timeline.png, trace.json; mooncake: the trace as Mooncake JSONL.")
@click.option("--block-size", type=click.IntRange(min=1), default=512, show_default=True,
              help="Prompt tokens per Mooncake hash id (--format mooncake).")
@launch_options
@variant_option
@click.option("--runs", type=click.IntRange(min=1), default=5, show_default=True,
              help="Runs of the finding's trace on each configuration (with --variant).")
def command(finding_id, db_path, out_dir, fmt, block_size, launch, target_file, variants, runs) -> None:
    """Write repro.py, report.md, timeline.png and trace.json for FINDING_ID.

    repro.py needs only Python 3.9+ and exits 1 when the finding reproduces, 0 when
    not and 125 when it cannot test, so `git bisect run` can use it.

    \b
    Example:
        fuzz export 3 --db night.db --out findings/
        fuzz export 3 --db night.db --format mooncake
        fuzz export 3 --db night.db --launch "vllm serve M --port {port}" --variant no-caching="--no-enable-prefix-caching"

    With --variant, report.md gets a table "configuration -> reproduced k/n, effect": the
    finding's trace on the launch command (--launch, --target-file, or the command the
    finding was found on) and on each variant, each started fresh and calibrated.
    """
    if fmt == "mooncake":
        from fuzzer.cli._export_mooncake import export_mooncake  # noqa: PLC0415

        export_mooncake(db_path, finding_id, out_dir, block_size)
        return
    from fuzzer.report.export import export_finding  # noqa: PLC0415 - scipy/matplotlib only for this command
    from fuzzer.store import Store  # noqa: PLC0415

    with Store.open(db_path, create=False) as store:
        refuse_slo_finding(store.get_finding(finding_id), "a repro.py/report.md bundle")
        from fuzzer.cli._variant_export import configurations_section  # noqa: PLC0415

        extra = configurations_section(store, store.get_finding(finding_id), launch=launch, target_file=target_file,
                                       variants=variants, runs=runs)
        folder = export_finding(store, finding_id, out_dir)
        if extra:
            (folder / "report.md").write_text((folder / "report.md").read_text() + "\n" + extra)
    names = sorted(p.name for p in folder.iterdir())
    out.print(f"wrote {folder}/: {', '.join(names)}")
    if "timeline.png" not in names:
        out.print("  (no timeline.png: see report.md for why)")
    out.print("next:")
    out.print(f"  attach {folder / 'report.md'} (and timeline.png) to the engine's bug tracker")
    out.print(f"  python3 {folder / 'repro.py'} --base-url http://HOST:PORT   # exit 1 = reproduced, 0 = not, 125 = cannot test")
    out.print(f"  fuzz replay {folder / 'trace.json'} --target http://HOST:PORT")
