"""``fuzz calibrate``: measure a target's idle latencies, step-time model and noise."""

from __future__ import annotations

import asyncio
import json
import random

import click
from rich.table import Table

from fuzzer.cli._console import err, out
from fuzzer.cli._options import (
    db_option,
    json_option,
    model_option,
    server_option,
    target_option,
)
from fuzzer.cli._launch import launch_options, resolve
from fuzzer.cli._target import API_KEY_ENV, open_target
from fuzzer.oracle.calibrate import calibrate, scheduler_assumption
from fuzzer.oracle.calibration import NOISY, Calibration, Fit, calibration_key
from fuzzer.oracle.kinds import Metric


@click.command("calibrate")
@target_option
@launch_options
@db_option
@server_option
@model_option
@click.option("--token-budget", type=click.IntRange(min=1), default=None, metavar="N",
              help="Per-step token budget of the server's scheduler (vLLM --max-num-batched-tokens). "
                   "Default: the engine's documented default.")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=None, metavar="N",
              help="Running sequences at most. Default: the engine's documented default.")
@click.option("--block-size", type=click.IntRange(min=1), default=None, metavar="N",
              help="KV block size in tokens. Default: the engine's documented default.")
@click.option("--long-prefill-token-threshold", "long_prefill", type=click.IntRange(min=0), default=None, metavar="N",
              help="The server caps a request's prompt tokens per step at N beside others (vLLM's flag of that "
                   "name). Default: measured (a probe counts the steps of a long prompt beside a stream).")
@click.option("--repeats", type=click.IntRange(min=1, max=20), default=4, show_default=True,
              help="Repetitions of every probe, at most: half are run first, the rest only when the fit is not "
                   "yet settled, of the uncertain line's probes only when the noise is (more: a tighter fit and a "
                   "larger noise baseline).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the probe order and prompt text.")
@click.option("--api-key-env", default=API_KEY_ENV, show_default=True, metavar="VAR",
              help="Environment variable holding the API key (never stored or printed).")
@json_option
def command(target, launch, target_file, db_path, server, model, token_budget, max_num_seqs, block_size, long_prefill,
            repeats, seed, api_key_env, as_json) -> None:
    """Fit idle TTFT versus prompt length and decode step time; print the model.

    The server is warmed up first, then probed with requests that run one at a
    time. The fitted model (Theil-Sen), its noise and the scheduler assumption
    are stored in the database and used by the oracle to judge executions.

    \b
    Example:
        fuzz calibrate --target http://127.0.0.1:8000 --db night.db
        fuzz calibrate --token-budget 8192 --json
        fuzz calibrate --target-file llama.toml
    """
    managed = resolve(target, launch, target_file)
    overrides = {"token_budget": token_budget, "max_num_seqs": max_num_seqs, "block_size": block_size,
                 "long_prefill_threshold": long_prefill}
    key, cal = asyncio.run(_calibrate(target, server, model, api_key_env, overrides, repeats, seed,
                                      launch=managed.spec if managed else None))
    from fuzzer.store import Store

    with Store.open(db_path) as store:
        calibration_id = store.save_calibration(key, cal.to_dict(), created_at=cal.created_at)
    if as_json:
        out.print_json(json.dumps({"id": calibration_id, "target_key": key, **cal.to_dict()}))
    else:
        _show(cal, key, calibration_id, db_path)
    note = cal.reliability_note()
    worst = cal.judged_noise()[1]
    if note is not None:
        err.print(f"warning: {note} (verdicts on it say so)")
    elif worst >= NOISY:
        # pyperf's advice: a spread of 10% or more means the numbers are not to be trusted yet.
        err.print(f"warning: noise is {worst * 100:.0f} %; stop other load on the server and calibrate again "
                  "(or raise --repeats)")


async def _calibrate(
    target: str | None, server: str, model: str | None, api_key_env: str, overrides: dict, repeats: int, seed: int,
    launch=None,
) -> tuple[str, Calibration]:
    # The simulator keeps its default seed (its noise); --seed orders the probes and seeds the prompt text.
    async with open_target(target, server=server, model=model, prompt_seed=seed, api_key_env=api_key_env,
                           launch=launch) as http:
        info = http.info
        assert info is not None
        assumption = scheduler_assumption(info, **overrides)
        cal = await calibrate(http, assumption=assumption, rng=random.Random(seed), repeats=repeats,
                              max_model_len=info.max_model_len,
                              measure_cap=overrides.get("long_prefill_threshold") is None,
                              measure_budget=overrides.get("token_budget") is None)
        return calibration_key(launch.identity if launch is not None else target, info.model), cal


def _line(fit: Fit, unit: str) -> str:
    return (
        f"{fit.intercept * 1e3:.3f} ms + {fit.slope * 1e6:.4f} µs/{unit} "
        f"(slope 95%: {fit.slope_low * 1e6:.4f}-{fit.slope_high * 1e6:.4f}), n={fit.n}"
    )


def _show(cal: Calibration, key: str, calibration_id: int, db_path: str) -> None:
    m = cal.model
    out.print(f"calibration {calibration_id} of {key} saved in {db_path}")
    out.print(f"scheduler assumption: {cal.assumption.describe()}")
    if cal.probing:
        out.print(f"probing: {cal.probing}")
    fits = Table(title="fits (Theil-Sen)")
    fits.add_column("relation")
    fits.add_column("fit")
    fits.add_row("idle TTFT vs uncached prompt tokens", _line(cal.ttft_fit, "token"))
    if cal.cached_fit:
        fits.add_row("extra TTFT vs cached prompt tokens", _line(cal.cached_fit, "token"))
    fits.add_row("ITL (1 sequence) vs context tokens", _line(cal.context_fit, "token"))
    fits.add_row("ITL vs decoding batch size", _line(cal.batch_fit, "sequence"))
    out.print(fits)
    model = Table(title="step model")
    model.add_column("parameter")
    model.add_column("value", justify="right")
    model.add_row("step overhead", f"{m.overhead_s * 1e3:.3f} ms")
    model.add_row("per prefill token", f"{m.prefill_token_s * 1e6:.3f} µs")
    model.add_row("per decoding sequence", f"{m.decode_seq_s * 1e6:.3f} µs")
    model.add_row("per context token", f"{m.context_token_s * 1e9:.2f} ns")
    model.add_row("per prefill attention pair", f"{m.prefill_pair_s * 1e12:.2f} ps"
                  + (" (a long prompt's prefill grows faster than its length)" if m.prefill_pair_s > 0 else ""))
    model.add_row("frontend per prompt token", f"{m.frontend_token_s * 1e6:.3f} µs")
    if m.prefill_step_s:
        model.add_row("per step with a prompt", f"{m.prefill_step_s * 1e3:.3f} ms (steps that compute prompt tokens cost more)")
    model.add_row("request overhead", f"{m.request_overhead_s * 1e3:.3f} ms")
    out.print(model)
    noise = Table(title="noise (1.4826 x MAD of the residuals)")
    for name in ("metric", "relative", "absolute", "baseline samples"):
        noise.add_column(name, justify="left" if name == "metric" else "right")
    for metric in Metric:
        if metric in cal.noise:
            noise.add_row(metric.value, f"{cal.noise[metric] * 100:.1f} %", f"{cal.noise_s[metric] * 1e3:.3f} ms",
                          str(len(cal.baseline.get(metric, ()))))
    out.print(noise)
