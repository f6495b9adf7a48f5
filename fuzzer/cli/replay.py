"""``fuzz replay``: execute a trace against a server and show what every request saw."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
from typing import Any

import click
import numpy as np
from rich.table import Table

from fuzzer import trace as trace_format
from fuzzer.cli import EXIT_FINDING
from fuzzer.cli._calibration import calibration_for
from fuzzer.cli._console import err, out
from fuzzer.cli._options import json_option, model_option, server_option, target_option
from fuzzer.cli._slo import goodput_option, parse_slo, slo_json, slo_lines
from fuzzer.cli._launch import launch_options, resolve
from fuzzer.cli._variants import compare_option, parse_variants, variant_option
from fuzzer.cli._target import API_KEY_ENV, open_target, sim_key
from fuzzer.errors import ConfigError, TargetError
from fuzzer.execute.adapters import ServerInfo
from fuzzer.execution import ExecutionResult, RequestResult, Target, server_down
from fuzzer.oracle.calibration import calibration_keys
from fuzzer.oracle.capcheck import probe_cap
from fuzzer.oracle import slo as slo_oracle
from fuzzer.oracle.confirm import examine
from fuzzer.oracle.judge import crashed
from fuzzer.oracle.summary import summarize
from fuzzer.store import Store
from fuzzer.trace import Trace

#: Exit status of a replay stopped by Ctrl-C (128 + SIGINT, as `fuzz minimize`'s): not 1, a finding.
EXIT_INTERRUPTED = 130


@click.command("replay")
@click.argument("trace_path", metavar="TRACE.json", type=click.Path(dir_okay=False))
@target_option
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True, help="Executions of the trace.")
@click.option("--db", "db_path", default=None, type=click.Path(dir_okay=False), help="Store executions here.")
@server_option
@model_option
@click.option(
    "--api-key-env",
    default=API_KEY_ENV,
    show_default=True,
    metavar="VAR",
    help="Environment variable holding the API key (never stored or printed).",
)
@click.option("--seed", type=int, default=None, help="Seed of the prompt text. Default: a fresh one (printed with --json).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              help="Seconds without a byte from the server before a request counts as hung.")
@click.option("--pathologies", default=None, help="Built-in simulator only: pathologies to plant ('all', 'a,b').")
@launch_options
@variant_option
@compare_option
@goodput_option
@json_option
def command(trace_path, target, launch, target_file, variants, compare, runs, db_path, server, model, api_key_env, seed,
            timeout_s, pathologies, goodput_specs, as_json) -> None:
    """Replay TRACE.json, show every request and the oracle's verdict; exit 1 on a finding.

    Requests are sent open-loop at their at_ms offsets. Without --target the
    built-in simulator is started in its own process. The oracle needs the
    target's calibration: it is taken from --db when stored there (and under an
    hour old), else measured first (about a minute) and stored when --db is given.
    With --db every execution is stored as soon as it is made, so Ctrl-C (exit
    130) keeps what ran.

    \b
    Example:
        fuzz replay corpus/vllm-37308.json --runs 5
        fuzz replay trace.json --target http://127.0.0.1:8000 --json
        fuzz replay corpus/n-logprobs.json --pathologies logprobs-batch-cost
        fuzz replay corpus/kv-fill.json --goodput ttft:500 tpot:50 e2el:5000
        fuzz replay trace.json --launch "llama-server -m tiny.gguf --port {port} --metrics"
        fuzz replay trace.json --launch "llama-server -m tiny.gguf --port {port} --metrics" --variant np1="-np 1"
        fuzz replay trace.json --launch "old/llama-server --port {port}" --compare "new/llama-server --port {port}"

    With --variant (or a target file's [variants]) the trace runs on the launch command
    and on each variant, each started fresh and calibrated, and a table says per
    configuration how often each finding reproduced and its effect. --compare CMD runs
    it on another command too (another version) and says where each finding reproduces.
    """
    slo = parse_slo(goodput_specs)
    managed = resolve(target, launch, target_file)
    trace = trace_format.load(trace_path)
    planted: tuple[str, ...] = ()
    if pathologies is not None:
        if target is not None or managed is not None:
            raise ConfigError("--pathologies applies to the built-in simulator only; drop it or drop --target / --launch")
        from fuzzer.sim.pathologies import parse  # noqa: PLC0415

        planted = parse(pathologies)
    if seed is None:
        seed = random.SystemRandom().randrange(1 << 32)
    variants = parse_variants(variants, managed.variants if managed else None)
    if variants or compare is not None:
        if managed is None:
            raise ConfigError("--variant and --compare need --launch or --target-file: they are run beside the "
                              "launch command")
        from fuzzer.cli._variant_replay import replay_variants  # noqa: PLC0415

        raise SystemExit(replay_variants(trace, managed.spec, variants, runs=runs, seed=seed, db_path=db_path,
                                         server=server, model=model, timeout_s=timeout_s, api_key_env=api_key_env,
                                         as_json=as_json, compare=compare))
    try:
        with Store.open(db_path) if db_path is not None else contextlib.nullcontext() as store:
            info, exam, results, slo_verdicts, slo_runs = asyncio.run(
                _replay(trace, target, runs, server, model, api_key_env, seed, timeout_s, store, planted, slo,
                        launch=managed.spec if managed else None)
            )
    except KeyboardInterrupt:
        kept = f"; the executions made so far are stored in {db_path}" if db_path is not None else ""
        err.print(f"interrupted{kept}")
        raise SystemExit(EXIT_INTERRUPTED) from None
    if as_json:
        data = _as_json(trace, info, results, seed)
        data["verdicts"] = [v.to_dict() for v in exam.verdicts]
        data["findings"] = [v.to_dict() for v in exam.findings]
        data["cap_probes"] = list(exam.notes)
        data["metrics"] = summarize(exam.results)
        if slo is not None:
            data["slo"] = slo_json(slo, slo_runs, slo_verdicts)
        out.print_json(json.dumps(data))
    else:
        for i, result in enumerate(exam.results, 1):
            out.print(_table(result, title=f"run {i}/{len(exam.results)}: {trace.name or trace_path} on {result.target}"))
            for line in _summary(result):
                out.print(line)
            out.print()
        out.print(_verdict_table(exam.verdicts))
        for note in exam.notes:
            out.print(note)
        extra = len(results) - len(exam.results)
        if extra:
            out.print(f"{extra} more execution(s) were run to confirm candidates")
        for v in exam.findings:
            slow = "" if v.slowdown is None else f", {v.slowdown:.1f}x idle"
            out.print(f"FINDING {v.kind} on {v.request_id or 'the execution'}{slow}, reproduced {v.reproduction}, "
                      f"p={_p(v.p_value)}: {v.detail or v.method}")
        if not exam.findings:
            out.print("no confirmed finding")
        if slo is not None:
            for line in slo_lines(slo, slo_runs, slo_verdicts):
                out.print(line)
    if exam.findings or any(v.is_finding for v in slo_verdicts):
        raise SystemExit(EXIT_FINDING)


async def _replay(
    trace: Trace, target: str | None, runs: int, server: str, model: str | None, api_key_env: str,
    seed: int, timeout_s: float, store: Store | None, planted: tuple[str, ...], slo: slo_oracle.Slo | None = None,
    launch=None,
):
    identity = launch.identity if launch is not None else target or sim_key(planted)
    # The simulator keeps its default seed (its noise); --seed is the prompt text's.
    async with open_target(
        target, server=server, model=model, pathologies=planted, prompt_seed=seed, timeout_s=timeout_s,
        api_key_env=api_key_env, launch=launch,
    ) as http:
        info = http.info
        assert info is not None
        keys = calibration_keys(identity, info.model)
        hint = "" if store is not None else "; pass --db to keep it for the next replay"
        calibration = await calibration_for(http, store, keys, seed=seed, hint=hint)
        target_id = None
        if store is not None:
            target_id = store.upsert_target(identity, info.kind, info.model, info.version, dict(info.capabilities))
        recorder = _Recorder(http, store, target_id)
        try:
            exam = await examine(recorder, trace, calibration, runs=runs, rng=np.random.default_rng(seed),
                                 cap_probe=lambda by, tokens: probe_cap(http, by, tokens))
        except TargetError as error:
            raise TargetError(went_down(recorder.results, error, stored=store is not None)) from None
        slo_verdicts, slo_runs = [], list(exam.results)
        if slo is not None:  # beside the scheduler verdicts, on the same runs plus a bounded few
            slo_verdicts, extra = await slo_oracle.examine(recorder, trace, exam.results, slo)
            slo_runs += extra
        return info, exam, recorder.results, slo_verdicts, slo_runs


def went_down(results: list[ExecutionResult], error: TargetError, *, stored: bool) -> str:
    """What to say when the server could not be reached for a run: after a run that took it down (a trace that
    crashes an unmanaged server cannot be re-run until someone starts it again), that run's crash."""
    if not results or not crashed(results[-1]):
        return str(error)
    why = server_down(results[-1]) or "connection errors from some request on"
    kept = f"; the {len(results)} run(s) made are stored in --db" if stored else ""
    return (f"the trace took the server down in run {len(results)} ({why}), so it could not be run again ({error}): "
            f"a crash candidate, not confirmed. Start the server again and replay, or replay with --launch so the "
            f"fuzzer restarts it{kept}")


class _Recorder:
    """The target as the oracle sees it: every execution, confirmation runs included, is kept,
    and stored in ``store`` (when there is one) before the next one starts."""

    def __init__(self, target: Target, store: Store | None, target_id: int | None):
        self._target = target
        self._store = store
        self._target_id = target_id
        self.name = target.name
        self.results: list[ExecutionResult] = []
        if hasattr(target, "fresh_start"):  # a launched server: a cold start is checked on fresh ones too
            self.fresh_start = target.fresh_start

    async def execute(self, trace: Trace, *, cut_s: float | None = None) -> ExecutionResult:
        result = await self._target.execute(trace, cut_s=cut_s)
        self.results.append(result)
        if self._store is not None:
            self._store.record_execution(result, trace, target_id=self._target_id)
        return result

    async def aclose(self) -> None:
        return None


def _p(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}"


def _verdict_table(verdicts) -> Table:
    table = Table(title="oracle verdicts")
    for name in ("request", "decision", "kind", "metric", "observed ms", "FCFS bound ms", "idle ms", "effect",
                 "p-value", "reproduced"):
        table.add_column(name, justify="left" if name in ("request", "decision", "kind", "metric") else "right")
    for v in verdicts:
        table.add_row(
            v.request_id or "(execution)", str(v.decision), str(v.kind or "-"), str(v.metric or "-"),
            _ms(v.observed_s), _ms(v.expected_s), _ms(v.idle_s),
            "-" if v.effect is None else f"{v.effect:.2f}x", _p(v.p_value), v.reproduction,
        )
    return table


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
        f"dispatch lateness max {_ms(max(late))} ms; client lag max {_ms(result.client_lag_s)} ms; "
        f"idle before {idle_before}, back to idle after: {idle_after}; "
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
                "client_lag_s": res.client_lag_s,
                "failed": len(res.failures),
                "samples": len(res.samples),
                "warnings": list(res.warnings),
                "requests": [_request_json(r) for r in res.requests],
            }
            for i, res in enumerate(results, 1)
        ],
    }
