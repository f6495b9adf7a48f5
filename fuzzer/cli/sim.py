"""``fuzz sim``: serve the built-in simulated LLM server."""

from __future__ import annotations

import click

from fuzzer.cli._notbuilt import not_built


@click.command("sim")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port (0: any free one).")
@click.option("--pathologies", default="none", show_default=True, help="Comma-separated names, 'all' or 'none'.")
@click.option("--speed", type=float, default=1.0, show_default=True, help="Divide every simulated time by this.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the simulator's noise.")
@click.option("--list", "list_only", is_flag=True, help="Describe the pathologies and exit.")
def command(host, port, pathologies, speed, seed, list_only) -> None:
    """Serve a simulated vLLM-like server until interrupted.

    \b
    Example:
        fuzz sim --port 8000 --pathologies hol-prefix-burst,cold-start
        fuzz sim --list
    """
    raise not_built("sim", "the simulated server")
