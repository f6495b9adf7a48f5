"""``fuzz replay``: execute a trace against a server and judge it."""

from __future__ import annotations

import click

from fuzzer import trace as trace_format
from fuzzer.cli._notbuilt import not_built
from fuzzer.cli._options import json_option, model_option, server_option, target_option


@click.command("replay")
@click.argument("trace_path", metavar="TRACE.json", type=click.Path(dir_okay=False))
@target_option
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True, help="Executions of the trace.")
@click.option("--db", "db_path", default=None, type=click.Path(dir_okay=False), help="Store executions here.")
@server_option
@model_option
@json_option
def command(trace_path, target, runs, db_path, server, model, as_json) -> None:
    """Replay TRACE.json; exit 1 when the oracle confirms a finding.

    \b
    Example:
        fuzz replay corpus/vllm-37308.json --runs 5
        fuzz replay trace.json --target http://127.0.0.1:8000 --json
    """
    trace_format.load(trace_path)
    raise not_built("replay", "the executor")
