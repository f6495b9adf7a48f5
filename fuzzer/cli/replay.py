"""``fuzz replay``: execute a trace against a server and show what every request saw."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import statistics
from typing import Any, AsyncIterator

import click
from rich.table import Table

from fuzzer import trace as trace_format
from fuzzer.cli._console import out
from fuzzer.cli._options import json_option, model_option, server_option, target_option
from fuzzer.errors import NotBuiltError
from fuzzer.execution import ExecutionResult, RequestResult
from fuzzer.executor import HttpTarget
from fuzzer.servers import ServerInfo
from fuzzer.trace import Trace

#: Where the API key comes from by default: the variable OpenAI clients read.
DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"


@click.command("replay")
@click.argument("trace_path", metavar="TRACE.json", type=click.Path(dir_okay=False))
@target_option
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True, help="Executions of the trace.")
@click.option("--db", "db_path", default=None, type=click.Path(dir_okay=False), help="Store executions here.")
@server_option
@model_option
@click.option(
    "--api-key-env",
    default=DEFAULT_API_KEY_ENV,
    show_default=True,
    metavar="VAR",
    help="Environment variable holding the API key (never stored or printed).",
)
@click.option("--seed", type=int, default=None, help="Seed of the prompt text. Default: a fresh one (printed with --json).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              help="Seconds without a byte from the server before a request counts as hung.")
@json_option
def command(trace_path, target, runs, db_path, server, model, api_key_env, seed, timeout_s, as_json) -> None:
    """Replay TRACE.json and show each request's TTFT, max ITL, E2E and outcome.

    Requests are sent open-loop at their at_ms offsets. Without --target the
    built-in simulator is started in its own process.

    \b
    Example:
        fuzz replay corpus/vllm-37308.json --runs 5
        fuzz replay trace.json --target http://127.0.0.1:8000 --json
    """
    trace = trace_format.load(trace_path)
    if seed is None:
        seed = random.SystemRandom().randrange(1 << 32)
    api_key = os.environ.get(api_key_env) or None
    info, results = asyncio.run(_replay(trace, target, runs, server, model, api_key, seed, timeout_s))
    if db_path is not None:
        _store(db_path, trace, info, results)
    if as_json:
        out.print_json(json.dumps(_as_json(trace, info, results, seed)))
        return
    for i, result in enumerate(results, 1):
        out.print(_table(result, title=f"run {i}/{len(results)}: {trace.name or trace_path} on {result.target}"))
        for line in _summary(result):
            out.print(line)
        out.print()


async def _replay(
    trace: Trace, target: str | None, runs: int, server: str, model: str | None, api_key: str | None,
    seed: int, timeout_s: float,
) -> tuple[ServerInfo, list[ExecutionResult]]:
    async with _base_url(target) as url:
        async with HttpTarget(
            url, server=server, model=model, api_key=api_key, rng=random.Random(seed), timeout_s=timeout_s
        ) as http:
            results = [await http.execute(trace) for _ in range(runs)]
            assert http.info is not None
            return http.info, results


@contextlib.asynccontextmanager
async def _base_url(target: str | None) -> AsyncIterator[str]:
    if target is not None:
        yield target
        return
    try:
        from fuzzer.sim.process import SimProcess  # noqa: PLC0415 - the simulator is optional here
    except ImportError:
        raise NotBuiltError(
            "`fuzz replay` without --target needs the built-in simulator, which does not exist in this "
            "version; pass --target URL"
        ) from None
    async with SimProcess() as sim:
        yield sim.url


def _store(db_path: str, trace: Trace, info: ServerInfo, results: list[ExecutionResult]) -> None:
    from fuzzer.store import Store  # noqa: PLC0415 - only with --db

    with Store.open(db_path) as store:
        target_id = store.upsert_target(
            results[0].target, info.kind, info.model, info.version, dict(info.capabilities)
        )
        for result in results:
            store.record_execution(result, trace, target_id=target_id)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _table(result: ExecutionResult, *, title: str) -> Table:
    table = Table(title=title)
    columns = ("id", "sent ms", "late ms", "TTFT ms", "max ITL ms", "E2E ms", "prompt", "output", "outcome")
    for name in columns:
        table.add_column(name, justify="left" if name in ("id", "outcome") else "right")
    for r in result.requests:
        outcome = r.outcome.value if not r.detail else f"{r.outcome.value}: {r.detail[:60]}"
        table.add_row(
            r.request_id,
            _ms(r.sent_s),
            _ms(r.dispatch_lateness_s),
            _ms(r.ttft_s),
            _ms(r.max_itl_s),
            _ms(r.e2e_s),
            "-" if r.prompt_tokens is None else str(r.prompt_tokens),
            "-" if r.completion_tokens is None else str(r.completion_tokens),
            outcome,
        )
    return table


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def _summary(result: ExecutionResult) -> list[str]:
    ttfts = [r.ttft_s for r in result.requests if r.ttft_s is not None]
    late = [r.dispatch_lateness_s for r in result.requests]
    failed = len(result.failures)
    idle_before = "unknown" if result.idle_before_s is None else f"{result.idle_before_s:.2f} s"
    idle_after = {True: "yes", False: "NO", None: "unknown"}[result.idle_after]
    lines = [
        f"{len(result.requests)} requests, {failed} failed, {result.duration_s:.3f} s; "
        f"TTFT p50 {_ms(_percentile(ttfts, 50))} ms, p99 {_ms(_percentile(ttfts, 99))} ms; "
        f"dispatch lateness max {_ms(max(late))} ms; idle before {idle_before}, back to idle after: {idle_after}; "
        f"{len(result.samples)} metric samples"
    ]
    lines.extend(f"warning: {w}" for w in result.warnings)
    return lines


def _request_json(r: RequestResult) -> dict[str, Any]:
    return {
        "id": r.request_id,
        "x_request_id": r.x_request_id,
        "outcome": r.outcome.value,
        "scheduled_s": r.scheduled_s,
        "sent_s": r.sent_s,
        "dispatch_lateness_s": r.dispatch_lateness_s,
        "ttft_s": r.ttft_s,
        "first_event_s": r.first_event_s,
        "max_itl_s": r.max_itl_s,
        "e2e_s": r.e2e_s,
        "token_times_s": list(r.token_times_s),
        "finish_reason": r.finish_reason,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
        "http_status": r.http_status,
        "detail": r.detail,
    }


def _as_json(trace: Trace, info: ServerInfo, results: list[ExecutionResult], seed: int) -> dict[str, Any]:
    return {
        "trace": {"name": trace.name, "hash": trace.content_hash(), "requests": len(trace.requests)},
        "server": {
            "kind": info.kind,
            "version": info.version,
            "model": info.model,
            "max_model_len": info.max_model_len,
            "capabilities": dict(info.capabilities),
        },
        "seed": seed,
        "runs": [
            {
                "run": i,
                "target": res.target,
                "started_at": res.started_at,
                "duration_s": res.duration_s,
                "idle_before_s": res.idle_before_s,
                "idle_after": res.idle_after,
                "failed": len(res.failures),
                "samples": len(res.samples),
                "warnings": list(res.warnings),
                "requests": [_request_json(r) for r in res.requests],
            }
            for i, res in enumerate(results, 1)
        ],
    }
