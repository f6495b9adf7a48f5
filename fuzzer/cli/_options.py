"""Options shared by several commands, as decorators (the sqlite-utils way)."""

from __future__ import annotations

import click

DEFAULT_DB = "fuzz.db"
SERVER_KINDS = ("auto", "vllm", "sglang", "tgi", "llamacpp", "openai")

db_option = click.option(
    "--db",
    "db_path",
    default=DEFAULT_DB,
    show_default=True,
    type=click.Path(dir_okay=False),
    help="Campaign database (SQLite).",
)

target_option = click.option(
    "--target",
    metavar="URL",
    default=None,
    help="Base URL of an OpenAI-compatible server. Default: start the built-in simulator.",
)

server_option = click.option(
    "--server",
    type=click.Choice(SERVER_KINDS),
    default="auto",
    show_default=True,
    help="Server adapter: how to read the target's metrics and endpoints.",
)

model_option = click.option(
    "--model",
    metavar="NAME",
    default=None,
    help="Model name to request. Default: the first model the server lists.",
)

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
