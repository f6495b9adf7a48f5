"""``fuzz minimize``: shrink a finding's trace to the smallest that still reproduces."""

from __future__ import annotations

import click

from fuzzer.cli._notbuilt import not_built
from fuzzer.cli._options import db_option, model_option, server_option, target_option


@click.command("minimize")
@click.argument("finding_id")
@db_option
@target_option
@server_option
@model_option
def command(finding_id, db_path, target, server, model) -> None:
    """Minimize the trace of finding FINDING_ID (resumable).

    \b
    Example:
        fuzz minimize 3 --db night.db --target http://127.0.0.1:8000
    """
    raise not_built("minimize", "the minimizer")
