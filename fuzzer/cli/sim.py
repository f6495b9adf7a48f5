"""``fuzz sim``: serve the built-in simulated LLM server."""

from __future__ import annotations

import sys

import click

from fuzzer.cli._console import out
from fuzzer.errors import ConfigError


@click.command("sim")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port (0: any free one).")
@click.option("--pathologies", default="none", show_default=True, help="Comma-separated names, 'all' or 'none'.")
@click.option("--speed", type=float, default=1.0, show_default=True, help="Divide every simulated time by this.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the simulator's noise.")
@click.option(
    "--ground-truth",
    "ground_truth",
    type=click.Path(dir_okay=False),
    default=None,
    help="Append per-request ground truth (JSON lines) to this file. Never served over HTTP.",
)
@click.option(
    "--faults",
    default="none",
    show_default=True,
    help="Fault modes, comma-separated, 'all' or 'none': " + "crash,hang,reset,http-500,malformed-sse,truncated-sse.",
)
@click.option(
    "--fault-rate",
    type=float,
    default=0.05,
    show_default=True,
    help="Share of requests each fault hits (fixed per request shape and --seed).",
)
@click.option(
    "--fault-grace",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Serve this many generation requests before any fault (e.g. 1000 lets a fuzzer calibrate first).",
)
@click.option("--long-prefill-token-threshold", "long_prefill", type=click.IntRange(min=0), default=0, show_default=True,
              metavar="N", help="A legitimate policy, not a pathology: a request computes at most N prompt tokens "
                                "a step beside others (vLLM's flag of that name; 0: no cap).")
@click.option("--max-long-partial-prefills", "long_partials", type=click.IntRange(min=0), default=0, show_default=True,
              metavar="K", help="With the cap: at most K prompts longer than it in partial prefill at a time, "
                                "shorter ones passing a waiting long one (vLLM v0's flag; 0: no limit).")
@click.option("--parent-pid", type=int, default=None, hidden=True, help="Exit when this process is gone.")
@click.option("--list", "list_only", is_flag=True, help="Describe the pathologies and faults, and exit.")
def command(host, port, pathologies, speed, seed, ground_truth, faults, fault_rate, fault_grace, long_prefill,
            long_partials, parent_pid, list_only) -> None:
    """Serve a simulated vLLM-like server until interrupted.

    It speaks vLLM's OpenAI-compatible API and metrics; planted pathologies are
    off unless named. Prints `ready on http://HOST:PORT` once listening.

    \b
    Example:
        fuzz sim --port 8000 --pathologies hol-prefix-burst,cold-start
        fuzz sim --faults http-500,crash --fault-rate 0.1
        fuzz sim --list
        fuzz sim --long-prefill-token-threshold 512 --max-long-partial-prefills 1
    """
    from fuzzer.sim import SimConfig, describe, parse  # noqa: PLC0415 - keep `fuzz --help` fast
    from fuzzer.sim import faults as sim_faults  # noqa: PLC0415
    from fuzzer.sim.server import serve_forever  # noqa: PLC0415

    if list_only:
        for info in describe():
            out.print(f"{info.name}  ({info.kind})", markup=False)
            out.print(f"    {info.summary}", markup=False)
            out.print(f"    models:  {info.models}", markup=False)
            out.print(f"    trigger: {info.trigger}", markup=False)
            out.print(f"    effect:  {info.effect}", markup=False)
        for fault in sim_faults.describe():
            out.print(f"{fault.name}  (fault, {fault.kind})", markup=False)
            out.print(f"    {fault.summary}", markup=False)
            out.print(f"    client sees: {fault.client_sees}", markup=False)
        return
    names = parse(pathologies)
    plan = sim_faults.FaultPlan(sim_faults.parse(faults), sim_faults.check_rate(fault_rate), seed, fault_grace)
    if not speed > 0:
        raise ConfigError(f"--speed must be > 0 (2 runs twice as fast), got {speed}")

    def ready(url: str) -> None:
        out.print(f"ready on {url}", markup=False)
        sys.stdout.flush()

    serve_forever(
        host, port, SimConfig(speed=speed, long_prefill_token_threshold=long_prefill,
                              max_long_partial_prefills=long_partials), names, seed, on_ready=ready, ground_truth_path=ground_truth,
        faults=plan, parent_pid=parent_pid,
    )
