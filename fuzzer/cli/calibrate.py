"""``fuzz calibrate``: measure a target's idle latencies and noise."""

from __future__ import annotations

import click

from fuzzer.cli._notbuilt import not_built
from fuzzer.cli._options import db_option, model_option, server_option, target_option


@click.command("calibrate")
@target_option
@db_option
@server_option
@model_option
def command(target, db_path, server, model) -> None:
    """Fit idle TTFT versus prompt length and decode step time; print the model.

    \b
    Example:
        fuzz calibrate --target http://127.0.0.1:8000 --db night.db
    """
    raise not_built("calibrate", "the oracle's calibration")
