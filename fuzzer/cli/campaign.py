"""``fuzz campaign``: the main job, a coverage-guided fuzzing campaign."""

from __future__ import annotations

import click

from fuzzer.cli._notbuilt import not_built
from fuzzer.cli._options import db_option, model_option, server_option, target_option


@click.command("campaign")
@target_option
@db_option
@click.option("--duration", default="8h", show_default=True, help="How long to fuzz: 90s, 10m, 8h.")
@click.option("--max-execs", type=click.IntRange(min=1), default=None, help="Stop after this many executions.")
@click.option("--seed", type=int, default=None, help="Random seed (default: a fresh one, stored for resume).")
@click.option(
    "--corpus",
    "corpus_dir",
    default="corpus",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder of seed traces (*.json).",
)
@server_option
@model_option
def command(target, db_path, duration, max_execs, seed, corpus_dir, server, model) -> None:
    """Fuzz a server for latency pathologies; resume with the same --db.

    \b
    Example:
        fuzz campaign --duration 2m
        fuzz campaign --target http://127.0.0.1:8000 --duration 8h --db night.db
    """
    raise not_built("campaign", "the campaign loop")
