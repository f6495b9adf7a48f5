"""Calibration: a target's idle latencies, step-time model and noise, measured (ARCHITECTURE.md, "Oracle").

The oracle judges a request against what the *calibrated* server should have given
it. Calibration measures that, on a warmed-up server, with probe traces whose
requests run one at a time (spaced further apart than each takes):

- idle TTFT versus prompt length, uncached (a fresh salt per execution) and cached
  (a second request reusing the prefix the first one computed);
- decode step time (inter-token latency) versus context length for one sequence,
  and versus batch size for many short sequences decoding together.

Each relation is fitted with the Theil-Sen estimator (scipy), which ignores the
stray slow request (a GC pause, a late packet) that would drag a least-squares line.
The fits give the :class:`~fuzzer.oracle.expectation.StepModel`; the residuals of every
probe against that model give the measured noise and the *baseline*: the ratios
observed / expected that an unremarkable request shows. Confirmation tests a
candidate's ratios against this baseline.

This module measures and fits; what comes out, the :class:`Calibration` value type
and the keys it is stored under, is :mod:`fuzzer.oracle.calibration`.
:func:`reuse_or_calibrate` is the one rule every command follows to get a calibration:
the stored one while it is fresh, else a new one measured now.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np
from scipy import optimize, stats

from fuzzer.errors import TargetError
from fuzzer.execute import adapters
from fuzzer.execution import RequestResult, Target
from fuzzer.oracle.calibration import REFRESH_AFTER_S, WARMUP_RUNS, Calibration, Fit
from fuzzer.oracle.chunkcap import chunk_cap
from fuzzer.oracle.expectation import idle_expectation
from fuzzer.oracle.kinds import Metric
from fuzzer.oracle.model import SchedulerAssumption, StepModel, assumption_for
from fuzzer.oracle.probes import Pace, Plan, Probe, Probes, run_plan, usable

# --- probe design -------------------------------------------------------------------------

#: Prompt lengths of the uncached TTFT probes, clipped to the token budget so each
#: prefill is one step. Denser at the short end, where the fixed overhead dominates.
PREFILL_LENGTHS = (16, 64, 128, 256, 512, 768, 1024, 1536, 2048)
#: ... and prompts of this many token budgets (chunked prefills of several steps), where
#: the max_model_len allows (4096 tokens when it is unknown): attention makes a prompt's
#: prefill grow faster than its length (StepModel.prefill_pair_s), which the short ones
#: barely show.
LONG_PREFILL_BUDGETS = (2, 3)
#: ... or, where the context holds no prompt of two budgets, the longest one it holds if that is
#: at least this many budgets (rounded down to LONG_PREFILL_ROUND tokens).
LONG_PREFILL_MIN_BUDGETS = 1.5
LONG_PREFILL_ROUND = 64
#: The chunked prompts must take this many times what the one-step line predicts before the
#: fit adds an attention term: a linear server's long prompts stay within its noise of it.
PAIR_EVIDENCE = 1.25
DEFAULT_MAX_MODEL_LEN = 4096
#: Prefix lengths of the cached probes (each followed by a short private suffix).
CACHED_PREFIXES = (256, 512, 1024, 2048)
CACHED_SUFFIX_TOKENS = 16
#: Context lengths of the single-sequence decode probes, and their output length: enough
#: inter-token gaps for a stable median without making the probe long.
DECODE_CONTEXTS = (16, 512, 1024, 2048, 4096)
#: Longer contexts make the (small) per-context-token cost measurable; used when the
#: server's max_model_len is known to allow them.
LONG_DECODE_CONTEXTS = (8192,)
DECODE_TOKENS = 32
#: Batch sizes of the batched decode probes (short prompts, all sent at once).
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
BATCH_PROMPT_TOKENS = 16
#: Each probe is repeated this often: with 9 lengths this gives ~36 TTFT residuals, a
#: baseline large enough for MWU/KS to reach p <= 0.01 with three candidate samples.
REPEATS = 4
#: Calibration runs half the repeats first and stops there when the fit is settled
#: (:func:`settled`): each fitted line's 95% slope interval moves its value at the largest
#: probe by at most this share ...
SETTLED_SPREAD = 0.10
#: ... and each judged metric has at least this many baseline ratios (three candidate samples
#: against 16 can still reach p <= 0.01 with Mann-Whitney U).
SETTLED_BASELINE = 16
#: The first pilot run knows nothing yet: its largest probes are this far apart, its smallest half that.
PILOT_SPACING_S = 1.0
#: 1.4826 x MAD estimates a normal standard deviation robustly (Iglewicz-Hoaglin).
MAD_SCALE = 1.4826
#: Fewer usable probes than this in a fit means the target misbehaved; refuse to fit.
MIN_FIT_POINTS = 4
#: The frontend's per-token time is read off cached prompts (a cached token skips the prefill,
#: not the tokenizer), but on a real engine a cached prefix also costs the suffix's attention
#: over it: vLLM's CPU build put 8.8 us per prompt token in the frontend that way, which let a
#: short prompt overtake a 3000-token one on its way to the engine on paper (vLLM does not).
#: Where the server tokenizes on request (/tokenize), its measured per-token time, times this
#: allowance for templates and request parsing, caps the frontend's share.
TOKENIZE_ALLOWANCE = 2.0
#: Prompt lengths of the tokenize timing, each timed this often (the fastest counts).
TOKENIZE_PROBE_TOKENS = (16, 4096)
TOKENIZE_REPEATS = 3


# --- fitting (the model from the probes: fit, below) -----------------------------------------


def theil_sen(x: Sequence[float], y: Sequence[float]) -> Fit:
    """Theil-Sen fit of y on x (median of pairwise slopes): robust to up to ~29% outliers."""
    if len(x) < MIN_FIT_POINTS or len(set(x)) < 2:
        raise TargetError(
            f"calibration got {len(x)} usable probe measurements at {len(set(x))} distinct sizes; "
            f"at least {MIN_FIT_POINTS} at 2 sizes are needed (is the server failing requests?)"
        )
    res = stats.theilslopes(np.asarray(y, dtype=float), np.asarray(x, dtype=float), alpha=0.95, method="joint")
    return Fit(float(res.intercept), float(res.slope), float(res.low_slope), float(res.high_slope), len(x))


# --- the KV capacity the server reports ----------------------------------------------------------


def reported_kv(target: Target) -> tuple[int, int] | None:
    """(KV blocks, tokens per block) the target reports through its optional ``kv_cache()``
    (an HTTP target: vLLM's ``vllm:cache_config_info``; the in-process simulator: its
    configuration, what its /metrics reports); None when it reports none."""
    report = getattr(target, "kv_cache", None)
    return report() if callable(report) else None


def scheduler_assumption(info: adapters.ServerInfo | None, **overrides: int | None) -> SchedulerAssumption:
    """What the oracle assumes of a server's scheduler: its adapter's documented defaults,
    then what the server itself reports (llama.cpp's slot count), then the user's overrides.
    No info (the in-process simulator): vLLM's defaults, which the simulator follows."""
    if info is None:
        return assumption_for("vllm", adapters.adapter("vllm").scheduler_defaults, **overrides) if overrides else SchedulerAssumption()
    return assumption_for(info.kind, {**adapters.adapter(info.kind).scheduler_defaults, **info.scheduler}, **overrides)


def with_reported_kv(assumption: SchedulerAssumption, target: Target) -> SchedulerAssumption:
    """``assumption`` with the KV capacity (and its block size) the target reports, unless it names one."""
    kv = reported_kv(target) if assumption.kv_blocks is None else None
    return assumption if kv is None else replace(assumption, kv_blocks=kv[0], block_size=kv[1])


def with_target_kv(calibration: Calibration, target: Target) -> Calibration:
    """A stored calibration with the KV capacity the target reports, when it names none (one
    made before capacities were read stays KV-unaware otherwise until it goes stale)."""
    assumption = with_reported_kv(calibration.assumption, target)
    return calibration if assumption is calibration.assumption else calibration.with_assumption(assumption)


async def calibrate(
    target: Target,
    *,
    assumption: SchedulerAssumption | None = None,
    rng: random.Random | None = None,
    clock: Callable[[], float] = time.time,
    repeats: int = REPEATS,
    warmup_runs: int = WARMUP_RUNS,
    max_model_len: int | None = None,
    remeasure: bool = True,
    early_stop: bool = True,
    measure_cap: bool = True,
) -> Calibration:
    """Warm ``target`` up, run the probe traces and fit the model. Raises TargetError on failure.

    With ``measure_cap`` and no cap in the assumption, the long-prefill cap is measured too
    (:func:`fuzzer.oracle.chunkcap.chunk_cap`); a user who names the cap (0 included) passes False.

    ``max_model_len`` (from the server's /v1/models) lets the decode probes use longer
    contexts; without it they stay at 4096 tokens, which every served model accepts.
    With ``remeasure``, a round whose noise makes the calibration unreliable
    (:attr:`Calibration.reliable`) is followed by one more; the quieter one is kept.
    """
    # None: what the target's adapter documents and the server reports (llama.cpp's slots), not vLLM's.
    assumption = with_reported_kv(assumption or scheduler_assumption(getattr(target, "info", None)), target)
    if max_model_len is None:  # the context the server reported (llama.cpp: per slot), so no probe exceeds it
        max_model_len = getattr(getattr(target, "info", None), "max_model_len", None)
    rng = rng or random.Random(0)
    budget = assumption.token_budget
    longest = (max_model_len or DEFAULT_MAX_MODEL_LEN) - 2
    # The longest-that-fits probe only where the server reported its context: 4096 is a guess.
    long = long_prefill_lengths(budget, longest, fallback=max_model_len is not None)
    lengths = sorted({min(n, budget) for n in PREFILL_LENGTHS} | set(long))
    prefixes = sorted({min(n, max(assumption.block_size, budget - CACHED_SUFFIX_TOKENS)) for n in CACHED_PREFIXES})
    contexts = list(DECODE_CONTEXTS)
    if max_model_len is not None:
        contexts = [n for n in (*DECODE_CONTEXTS, *LONG_DECODE_CONTEXTS) if n + DECODE_TOKENS <= max_model_len]

    # Warm-up and pilot: the smallest and largest probe of each kind tell how far apart probes must be.
    sizes_of = {"prefill": (min(lengths), max(lengths)), "decode": (min(contexts), max(contexts)),
                "batch": (min(batch_sizes(assumption)), max(batch_sizes(assumption)))}
    slowest: dict[tuple[str, int], float] = {}

    def pace(kind: str) -> Pace:
        lo, hi = sizes_of[kind]
        return Pace((lo, slowest.get((kind, lo), 0.0)), (hi, slowest.get((kind, hi), 0.0)))

    for run in range(max(1, warmup_runs)):
        # The first run is paced blind (PILOT_SPACING_S: half for the small probes), later ones by what it measured.
        pilot = Plan(None)
        kind_of: dict[str, tuple[str, int]] = {}
        for kind, (lo, hi) in sizes_of.items():
            for size in (lo, hi):
                kind_of[f"s{pilot.slot}"] = (kind, size)
                gap = pace(kind).spacing_s(size) if run else PILOT_SPACING_S / (2 if size == lo else 1)
                if kind == "prefill":
                    pilot.add(size, 2, spacing_s=gap)
                elif kind == "decode":
                    pilot.add(size, DECODE_TOKENS, spacing_s=gap)
                else:
                    pilot.add(BATCH_PROMPT_TOKENS, DECODE_TOKENS, batch=size, spacing_s=gap)
        for probe in await run_plan(target, pilot, "calibration-pilot"):
            key = kind_of[probe.result.request_id.split("b")[0]]
            slowest[key] = max(slowest.get(key, 0.0), probe.result.e2e_s or 0.0)

    spacing = {kind: pace(kind) for kind in sizes_of}
    # A server may report its KV capacity only once its engine is up (vLLM's cache_config_info).
    assumption = with_reported_kv(assumption, target)

    sizes = (lengths, prefixes, contexts)
    cap = await tokenize_token_s(target)

    def fitted(probes: Probes, rounds: str) -> Calibration:
        return fit(target=target.name, created_at=clock(), assumption=assumption, prefill=probes.prefill,
                   cached=probes.cached, single=probes.single, batched=probes.batched, warmup_runs=warmup_runs,
                   frontend_cap_s=cap, probing=rounds)

    async def measured() -> Calibration:
        # Half the repeats first; the other half only when the fit is not yet settled (settled()).
        first = max(1, repeats // 2) if early_stop else repeats
        probes = await _probe_round(target, assumption, rng, first, spacing, *sizes)
        cal = fitted(probes, f"{first} of {repeats} repeats")
        if first < repeats:
            unsettled = settled(cal, probes)
            if unsettled is None:
                return replace(cal, probing=f"{first} of {repeats} repeats: stopped early, the fit was settled "
                                            f"(each line within {SETTLED_SPREAD:.0%} at its largest probe, noise judged)")
            probes += await _probe_round(target, assumption, rng, repeats - first, spacing, *sizes)
            cal = fitted(probes, f"{repeats} of {repeats} repeats ({unsettled} after {first})")
        return cal

    cal = await measured()
    if remeasure and not cal.reliable:
        # A noisy round is often a burst of load on the host: measure once more, keep the quieter.
        again = await measured()
        cal = min((cal, again), key=lambda c: c.judged_noise()[1])
    if measure_cap and not assumption.long_prefill_threshold:  # a user's (or an earlier measurement's) cap stands
        found = await chunk_cap(target, cal, longest)
        if found:
            assumption = replace(assumption, long_prefill_threshold=found,
                                 source=f"{assumption.source}; long-prefill cap measured")
            cal = replace(cal, assumption=assumption)
    return cal


def settled(cal: Calibration, probes: Probes) -> str | None:
    """None when one round of probes has pinned the model down well enough, else what is not yet.

    Settled: the noise is judged reliable, every judged metric has SETTLED_BASELINE baseline
    ratios, and each fitted line's 95% slope interval moves its value at the largest probe by
    at most SETTLED_SPREAD of that value (a bound is no more uncertain than that from the fit).
    """
    if not cal.reliable:
        return "noisy"
    for metric in (Metric.TTFT, Metric.E2E):
        if len(cal.baseline.get(metric, ())) < SETTLED_BASELINE:
            return f"{len(cal.baseline.get(metric, ()))} {metric.value} baseline ratios"
    budget = cal.assumption.token_budget
    for name, line, sizes in (("prefill", cal.ttft_fit, [p.prompt for p in probes.prefill if p.prompt <= budget]),
                              ("decode", cal.context_fit, [p.prompt + p.max_tokens / 2.0 for p in probes.single]),
                              ("batch", cal.batch_fit, [p.batch for p in probes.batched])):
        if not sizes:
            continue
        largest = max(sizes)
        value = line(largest)
        spread = (line.slope_high - line.slope_low) / 2.0 * largest
        if value <= 0 or spread > SETTLED_SPREAD * value:
            return f"the {name} line uncertain ({spread / value:.0%} at {largest:g})" if value > 0 else f"{name} line <= 0"
    return None


async def reuse_or_calibrate(
    target: Target,
    stored: Calibration | None,
    *,
    rng: Callable[[], random.Random],
    save: Callable[[Calibration], object] = lambda calibration: None,
    clock: Callable[[], float] = time.time,
    max_age_s: float = REFRESH_AFTER_S,
    on_measure: Callable[[Calibration | None], None] = lambda stale: None,
    on_refresh_failed: Callable[[TargetError], None] | None = None,
) -> Calibration:
    """The calibration to judge ``target`` by: ``stored`` while it is fresh, else one measured now.

    The one rule of every command (``fuzz campaign`` and its periodic refresh, ``replay``,
    ``minimize``): a stored calibration, given the KV capacity the target reports when it
    names none (:func:`with_target_kv`), is used while it is at most ``max_age_s`` old by
    ``clock`` (:data:`~fuzzer.oracle.calibration.REFRESH_AFTER_S`: servers drift over hours).
    Otherwise ``on_measure`` is told (with the stale calibration, or None when there was
    none), the target is measured under the stale calibration's scheduler assumption (a
    user's override from ``fuzz calibrate --token-budget`` outlives the refresh) and the new
    calibration handed to ``save``. ``rng`` is called only to measure, so a campaign's
    random stream does not move when a calibration is reused.

    A measurement that fails raises TargetError, unless there is a stale calibration and
    ``on_refresh_failed`` is given: it is told why, and the stale calibration is returned.
    """
    stale = None if stored is None else with_target_kv(stored, target)
    if stale is not None and not stale.is_stale(clock(), max_age_s=max_age_s):
        return stale
    on_measure(stale)
    try:
        fresh = await calibrate(target, assumption=stale.assumption if stale else None, rng=rng(), clock=clock)
    except TargetError as e:
        if stale is None or on_refresh_failed is None:
            raise
        on_refresh_failed(e)
        return stale
    save(fresh)
    return fresh


async def tokenize_token_s(target: Target) -> float | None:
    """The most frontend time per prompt token the target's own tokenizer explains, or None.

    Timed on targets that can (``tokenize_seconds``: the HTTP executor with a server that
    tokenizes on request); the slope between a short and a long prompt, times
    TOKENIZE_ALLOWANCE. None on targets that cannot say (the in-process simulator).
    """
    timer = getattr(target, "tokenize_seconds", None)
    if timer is None:
        return None
    fastest = []
    for n in TOKENIZE_PROBE_TOKENS:
        times = [await timer(n) for _ in range(TOKENIZE_REPEATS)]
        if any(t is None for t in times):
            return None
        fastest.append(min(times))
    short, long = TOKENIZE_PROBE_TOKENS
    return TOKENIZE_ALLOWANCE * max(0.0, (fastest[1] - fastest[0]) / (long - short))


def long_prefill_lengths(budget: int, longest: int, *, fallback: bool = True) -> tuple[int, ...]:
    """The chunked-prefill probe lengths: LONG_PREFILL_BUDGETS token budgets where the context
    allows; where not even two fit but the context still holds a prompt of LONG_PREFILL_MIN_BUDGETS
    budgets (and ``fallback``: the context is the server's own, not DEFAULT_MAX_MODEL_LEN's
    guess), the longest prompt it holds (llama-server's 4096-token slots with its 2048-token
    batch: without a two-step probe a prompt's second chunk, which attends to the first, cost
    2.6x the first on a CPU and the fit saw no attention term)."""
    fitting = tuple(k * budget for k in LONG_PREFILL_BUDGETS if k * budget <= longest)
    if fitting or not fallback or longest < LONG_PREFILL_MIN_BUDGETS * budget:
        return fitting
    return (longest // LONG_PREFILL_ROUND * LONG_PREFILL_ROUND,)


def batch_sizes(assumption: SchedulerAssumption) -> tuple[int, ...]:
    """The batched-decode probe sizes a server can run at once: a batch beyond its running
    sequences (llama.cpp's 4 slots) would queue, measuring queueing instead of decode steps."""
    return tuple(b for b in BATCH_SIZES if b <= assumption.max_num_seqs) or (1,)


async def _probe_round(
    target: Target,
    assumption: SchedulerAssumption,
    rng: random.Random,
    repeats: int,
    spacing: Mapping[str, Pace],
    lengths: Sequence[int],
    prefixes: Sequence[int],
    contexts: Sequence[int],
) -> Probes:
    """One round of probes (uncached and cached TTFT, decode, batched decode), ``repeats`` of each size."""

    def shuffled(items: list) -> list:
        rng.shuffle(items)
        return items

    # Uncached TTFT: one lead-in request (a first request after an idle gap may be slow).
    plan = Plan(spacing["prefill"])
    plan.add(16, 2, lead_in=True)
    for n in shuffled([n for n in lengths for _ in range(repeats)]):
        plan.add(n, 2)
    prefill = usable(await run_plan(target, plan, "calibration-prefill"))

    # Cached TTFT: a request computes the prefix, the next one (same group) reuses it.
    plan = Plan(spacing["prefill"])
    plan.add(16, 2, lead_in=True)
    for n in shuffled([n for n in prefixes for _ in range(repeats)]):
        plan.add_pair(n, CACHED_SUFFIX_TOKENS, hit=(n // assumption.block_size) * assumption.block_size)
    cached_probes = usable(await run_plan(target, plan, "calibration-cached"))

    # Decode, one sequence, growing context.
    plan = Plan(spacing["decode"])
    plan.add(16, 2, lead_in=True)
    for n in shuffled([n for n in contexts for _ in range(repeats)]):
        plan.add(n, DECODE_TOKENS)
    single = usable(await run_plan(target, plan, "calibration-decode"))

    # Decode, many short sequences together.
    plan = Plan(spacing["batch"])
    plan.add(16, 2, lead_in=True)
    for b in shuffled([b for b in batch_sizes(assumption) for _ in range(repeats)]):
        plan.add(BATCH_PROMPT_TOKENS, DECODE_TOKENS, batch=b, size=b)
    batched = usable(await run_plan(target, plan, "calibration-batch"))
    return Probes(tuple(prefill), tuple(cached_probes), tuple(single), tuple(batched))


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
    probing: str = "",
) -> Calibration:
    """Fit the step model from probe measurements and measure the residual noise.

    ``frontend_cap_s``: the most frontend time per prompt token the server's own tokenizer
    explains (:func:`tokenize_token_s`); the rest of the cached prompts' extra time is the
    engine's (attention over the cached prefix), not the frontend's.
    """
    # Single-sequence decode: ITL = (overhead + one sequence) + context cost x context.
    pts = [(p.prompt + p.max_tokens / 2.0, _median_itl(p.result)) for p in single]
    pts = [(x, y) for x, y in pts if y is not None]
    context_fit = theil_sen([x for x, _ in pts], [y for _, y in pts])
    context_token_s = max(0.0, context_fit.slope)

    # Batched decode, per group (requests of one slot): ITL minus context cost, versus batch size.
    groups: dict[str, list[float]] = {}
    for p in batched:
        itl = _median_itl(p.result)
        if itl is not None:
            slot = p.result.request_id.split("b")[0]
            ctx = p.batch * (p.prompt + p.max_tokens / 2.0)
            groups.setdefault(f"{slot}:{p.batch}", []).append(itl - context_token_s * ctx)
    xs = [int(k.split(":")[1]) for k in groups]
    ys = [float(np.median(v)) for v in groups.values()]
    batch_fit = theil_sen(xs, ys)
    overhead_s = max(0.0, batch_fit.intercept)
    decode_seq_s = max(0.0, batch_fit.slope)

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
    if frontend_cap_s is not None:
        frontend_token_s = min(frontend_token_s, frontend_cap_s)
    prefill_token_s = max(0.0, slope - frontend_token_s)

    model = StepModel(
        overhead_s=overhead_s,
        prefill_token_s=prefill_token_s,
        decode_seq_s=decode_seq_s,
        context_token_s=context_token_s,
        request_overhead_s=request_overhead_s,
        frontend_token_s=frontend_token_s,
        prefill_pair_s=prefill_pair_s,
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
