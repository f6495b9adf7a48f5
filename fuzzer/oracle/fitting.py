"""Fitting a target's step model to what the calibration's probes measured (ARCHITECTURE.md, "Oracle").

:mod:`fuzzer.oracle.calibrate` designs and runs the probes; :func:`fit` turns them into the
:class:`~fuzzer.oracle.model.StepModel`, the fitted lines, the noise and the baseline of a
:class:`~fuzzer.oracle.calibration.Calibration`. Each relation is fitted with the Theil-Sen
estimator (scipy), which ignores the stray slow request (a GC pause, a late packet) that would
drag a least-squares line; the residuals of every probe against the fitted model give the
measured noise and the *baseline*: the ratios observed / expected an unremarkable request shows.
"""

from __future__ import annotations

import math
from dataclasses import replace
from collections.abc import Sequence

import numpy as np
from scipy import optimize, stats

from fuzzer.errors import TargetError
from fuzzer.execution import RequestResult
from fuzzer.oracle.calibration import WARMUP_RUNS, Calibration, Fit
from fuzzer.oracle.expectation import idle_expectation
from fuzzer.oracle.kinds import Metric
from fuzzer.oracle.model import SchedulerAssumption, StepModel
from fuzzer.oracle.probes import BATCH_PROMPT_TOKENS, Probe

#: The chunked prompts must take this many times what the one-step line predicts before the
#: fit adds an attention term: a linear server's long prompts stay within its noise of it.
PAIR_EVIDENCE = 1.25
#: The cached probes' extra TTFT per prefix token (a prefix hit leaves only the frontend's tokenizing)
#: at least this share of an uncached token's TTFT, in the lower end of its interval: the server kept
#: no prefix. A clean paper server without prefix caching was otherwise fitted with its whole prefill
#: as frontend time, and its bound gave shared prefixes hits: 39 of 48 traces had candidates (8-36x).
PREFIX_UNSEEN_SHARE = 0.5
#: 1.4826 x MAD estimates a normal standard deviation robustly (Iglewicz-Hoaglin).
MAD_SCALE = 1.4826
#: Fewer usable probes than this in a fit means the target misbehaved; refuse to fit.
MIN_FIT_POINTS = 4


def theil_sen(x: Sequence[float], y: Sequence[float]) -> Fit:
    """Theil-Sen fit of y on x (median of pairwise slopes): robust to up to ~29% outliers."""
    if len(x) < MIN_FIT_POINTS or len(set(x)) < 2:
        raise TargetError(
            f"calibration got {len(x)} usable probe measurements at {len(set(x))} distinct sizes; "
            f"at least {MIN_FIT_POINTS} at 2 sizes are needed (is the server failing requests?)"
        )
    res = stats.theilslopes(np.asarray(y, dtype=float), np.asarray(x, dtype=float), alpha=0.95, method="joint")
    return Fit(float(res.intercept), float(res.slope), float(res.low_slope), float(res.high_slope), len(x))


def _median_itl(r: RequestResult) -> float | None:
    gaps = r.itl_s
    return float(np.median(gaps)) if gaps else None


def fit(
    *,
    target: str,
    created_at: float,
    assumption: SchedulerAssumption,
    prefill: Sequence[Probe],
    cached: Sequence[Probe],
    single: Sequence[Probe],
    batched: Sequence[Probe],
    warmup_runs: int = WARMUP_RUNS,
    frontend_cap_s: float | None = None,
    tokenizer_token_s: float = 0.0,
    probing: str = "",
) -> Calibration:
    """Fit the step model from probe measurements and measure the residual noise.

    ``frontend_cap_s``: the most frontend time per prompt token the server's own tokenizer
    explains (:func:`tokenize_token_s`); the rest of the cached prompts' extra time is the
    engine's (attention over the cached prefix), not the frontend's. ``tokenizer_token_s``: that
    tokenizer's own time per token, kept in the model (StepModel.tokenizer_token_s).
    """
    # Single-sequence decode: ITL = (overhead + one sequence) + context cost x context.
    pts = [(p.prompt + p.max_tokens / 2.0, _median_itl(p.result)) for p in single]
    pts = [(x, y) for x, y in pts if y is not None]
    context_fit = theil_sen([x for x, _ in pts], [y for _, y in pts])
    context_token_s = max(0.0, context_fit.slope)

    # Batched decode, per group (requests of one slot): ITL minus context cost, versus batch size.
    groups: dict[str, list[float]] = {}
    long_batches = [p for p in batched if p.prompt > BATCH_PROMPT_TOKENS]
    for p in batched:
        if p.prompt > BATCH_PROMPT_TOKENS:
            continue
        itl = _median_itl(p.result)
        if itl is not None:
            slot = p.result.request_id.split("b")[0]
            ctx = p.batch * (p.prompt + p.max_tokens / 2.0)
            groups.setdefault(f"{slot}:{p.batch}", []).append(itl - context_token_s * ctx)
    xs = [int(k.split(":")[1]) for k in groups]
    ys = [float(np.median(v)) for v in groups.values()]
    if assumption.max_num_seqs == 1 and ys:
        # One seat (llama-server -np 1): one sequence decodes at a time, so a step is the overhead and one
        # sequence together and the two cannot be told apart; the batch line needs two sizes (it refused to fit).
        overhead_s, decode_seq_s = max(0.0, float(np.median(ys))), 0.0
        batch_fit = Fit(overhead_s, 0.0, 0.0, 0.0, len(ys))
    else:
        batch_fit = theil_sen(xs, ys)
        overhead_s = max(0.0, batch_fit.intercept)
        decode_seq_s = max(0.0, batch_fit.slope)
    # Long sequences decoding together: what their steps take beyond the short batch's line is their context's.
    context_token_s = max(context_token_s, batch_context_cost(long_batches, overhead_s, decode_seq_s))

    # Idle TTFT: request overhead + step overhead (one a chunk) + (frontend + prefill) cost x
    # uncached tokens + attention cost x token pairs. The line of the one-step probes is kept
    # for the record; the model's costs come from the fit of all of them, chunked ones included.
    budget = assumption.token_budget
    short = [p for p in prefill if p.prompt <= budget]
    ttft_fit = theil_sen([p.prompt for p in short], [p.result.ttft_s for p in short])
    intercept, slope, prefill_pair_s = ttft_fit.intercept, ttft_fit.slope, 0.0
    if _beyond_the_line(prefill, ttft_fit, overhead_s, budget):
        intercept, slope, prefill_pair_s = _prefill_fit(prefill, overhead_s, budget) or (intercept, slope, 0.0)
    request_overhead_s = max(0.0, intercept - overhead_s)

    def uncached_ttft(tokens: int, context: int = 0) -> float:
        return intercept + slope * tokens + prefill_pair_s * tokens * (context + tokens / 2)

    # A cached prompt token skips the prefill but not the frontend (tokenization): the extra
    # TTFT per cached token is the frontend's per-token cost; the rest of the slope is prefill.
    cached_fit = None
    frontend_token_s = 0.0
    if len(cached) >= MIN_FIT_POINTS and len({p.cached for p in cached}) >= 2:
        extra = [p.result.ttft_s - uncached_ttft(p.prompt - p.cached, p.cached) for p in cached]
        cached_fit = theil_sen([p.cached for p in cached], extra)
        frontend_token_s = min(max(0.0, cached_fit.slope), max(0.0, ttft_fit.slope))
    if cached_fit is not None and slope > 0 and cached_fit.slope_low >= PREFIX_UNSEEN_SHARE * slope:
        # The "cached" prompts cost nearly what uncached ones do: the server kept no prefix (caching off,
        # or none at all). Their extra time is prefill, not frontend, and the bound gives no cache hit.
        frontend_token_s = 0.0 if frontend_cap_s is None else frontend_cap_s
        note = "no prefix-cache hit seen (cached probes as slow as uncached)"
        assumption = replace(assumption, prefix_caching=False, source=assumption.source if note in assumption.source
                             else f"{assumption.source}; {note}")
    if frontend_cap_s is not None:
        frontend_token_s = min(frontend_token_s, frontend_cap_s)
    frontend_token_s = min(frontend_token_s, max(0.0, slope))
    prefill_token_s = max(0.0, slope - frontend_token_s)

    model = StepModel(
        overhead_s=overhead_s,
        prefill_token_s=prefill_token_s,
        decode_seq_s=decode_seq_s,
        context_token_s=context_token_s,
        request_overhead_s=request_overhead_s,
        frontend_token_s=frontend_token_s,
        prefill_pair_s=prefill_pair_s,
        tokenizer_token_s=tokenizer_token_s,
    )
    noise, noise_s, baseline = _residuals(model, assumption, [*prefill, *cached, *single])
    return Calibration(
        target=target,
        created_at=created_at,
        model=model,
        assumption=assumption,
        ttft_fit=ttft_fit,
        cached_fit=cached_fit,
        context_fit=context_fit,
        batch_fit=batch_fit,
        noise=noise,
        noise_s=noise_s,
        baseline=baseline,
        probes=len(prefill) + len(cached) + len(single) + len(batched),
        probing=probing,
        warmup_runs=warmup_runs,
    )


def batch_context_cost(probes: Sequence[Probe], overhead_s: float, decode_seq_s: float) -> float:
    """Step time per context token of long sequences decoding together (0 without such probes).

    Per batch (one slot's requests of one execution, sent together): the median gap between tokens that came once
    every member had its first token (before that, other members' prompt chunks share the steps),
    less the short batch's line at its size, over its total context; the median of the batches.
    """
    slots: dict[tuple[str, str], list[Probe]] = {}
    for p in probes:  # one batch: its slot in the plan, in one execution (the X-Request-Id's suffix)
        r = p.result
        slots.setdefault((r.request_id.split("b")[0], r.x_request_id[len(r.request_id):]), []).append(p)
    costs = []
    for members in slots.values():
        r0 = [p.result for p in members]
        if any(r.ttft_s is None for r in r0):
            continue
        together = max(r.sent_s + r.ttft_s for r in r0)
        gaps = []
        for r in r0:
            times = [r.sent_s + t for t in r.token_times_s if r.sent_s + t > together]
            gaps += [b - a for a, b in zip(times, times[1:])]
        if len(gaps) < MIN_FIT_POINTS:
            continue
        context = sum(p.prompt + p.max_tokens / 2.0 for p in members)
        costs.append((float(np.median(gaps)) - overhead_s - decode_seq_s * len(members)) / context)
    return max(0.0, float(np.median(costs))) if costs else 0.0


def _beyond_the_line(prefill: Sequence[Probe], line: Fit, overhead_s: float, budget: int) -> bool:
    """Does the longest chunked prompt take clearly longer than the one-step prompts' line
    says (by PAIR_EVIDENCE, over the noise; the median of its repeats)? Then the prefill grows
    faster than the prompt. The longest alone: attention grows with the square of the length,
    and the line's slope already holds a budget's own attention (vLLM's CPU build on a 2-core
    AMD EPYC, from its fitted model: 4096 tokens ~1.23x the line, 6144 tokens ~1.45x; their
    median sat near the threshold and one CI run fitted no attention)."""
    chunked = [p for p in prefill if p.prompt > budget and p.result.ttft_s is not None]
    if not chunked:
        return False
    longest = max(p.prompt for p in chunked)
    ratios = [p.result.ttft_s / (line(p.prompt) + overhead_s * (math.ceil(p.prompt / budget) - 1))
              for p in chunked if p.prompt == longest]
    return float(np.median(ratios)) > PAIR_EVIDENCE


def _prefill_fit(prefill: Sequence[Probe], overhead_s: float, budget: int) -> tuple[float, float, float] | None:
    """Idle TTFT = intercept + slope x n + pair x n^2/2 (+ one step overhead a chunk after the
    first), fitted to each prompt length's median TTFT with no coefficient below zero; None
    with fewer than MIN_FIT_POINTS lengths."""
    by_length: dict[int, list[float]] = {}
    for p in prefill:
        if p.result.ttft_s is not None:
            by_length.setdefault(p.prompt, []).append(p.result.ttft_s)
    if len(by_length) < MIN_FIT_POINTS:
        return None
    n = np.array(sorted(by_length), dtype=np.float64)
    y = np.array([float(np.median(by_length[int(k)])) for k in n]) - overhead_s * (np.ceil(n / budget) - 1)
    # Each row scaled by its expected size: the short prompts' few ms weigh as much as the long ones' seconds.
    design = np.column_stack([np.ones_like(n), n, n * n / 2])
    weight = 1.0 / np.maximum(y, 1e-4)
    (intercept, slope, pair), _ = optimize.nnls(design * weight[:, None], y * weight)
    return float(intercept), float(slope), float(pair)


def _residuals(
    model: StepModel, assumption: SchedulerAssumption, probes: Sequence[Probe]
) -> tuple[dict[Metric, float], dict[Metric, float], dict[Metric, tuple[float, ...]]]:
    """Observed / expected of every probe, per metric, under the fitted model."""
    observed: dict[Metric, list[tuple[float, float]]] = {m: [] for m in Metric}
    for p in probes:
        e = idle_expectation(p.prompt, p.max_tokens, model, assumption, cached_tokens=p.cached)
        r = p.result
        for metric, value, expected in (
            (Metric.TTFT, r.ttft_s, e.ttft_s),
            (Metric.MAX_ITL, r.max_itl_s, e.max_itl_s),
            (Metric.E2E, r.e2e_s, e.e2e_s),
        ):
            if value is not None and expected and expected > 0 and value > 0:
                observed[metric].append((value, expected))
    noise: dict[Metric, float] = {}
    noise_s: dict[Metric, float] = {}
    baseline: dict[Metric, tuple[float, ...]] = {}
    for metric, pairs in observed.items():
        if not pairs:
            continue
        ratios = np.array([v / e for v, e in pairs])
        diffs = np.array([v - e for v, e in pairs])
        logs = np.log(ratios)
        noise[metric] = float(MAD_SCALE * np.median(np.abs(logs - np.median(logs))))
        noise_s[metric] = float(MAD_SCALE * np.median(np.abs(diffs - np.median(diffs))))
        baseline[metric] = tuple(float(x) for x in ratios)
    return noise, noise_s, baseline
