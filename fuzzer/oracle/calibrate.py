"""Calibration: a target's idle latencies, step-time model and noise, measured (ARCHITECTURE.md, "Oracle").

The oracle judges a request against what the *calibrated* server should have given
it. Calibration measures that, on a warmed-up server, with probe traces whose
requests run one at a time (spaced further apart than each takes):

- idle TTFT versus prompt length, uncached (a fresh salt per execution) and cached
  (a second request reusing the prefix the first one computed);
- decode step time (inter-token latency) versus context length for one sequence,
  versus batch size for many short sequences decoding together, and for a batch of
  long sequences (decode attention reads every sequence's KV: a GPU's step grows with the
  batch's total context far more than one sequence's context shows).

:mod:`fuzzer.oracle.fitting` fits the step model, the noise and the *baseline* (the ratios
observed / expected that an unremarkable request shows) to the probes; confirmation tests a
candidate's ratios against this baseline.

This module measures; :mod:`fuzzer.oracle.fitting` fits; what comes out, the
:class:`Calibration` value type and the keys it is stored under, is :mod:`fuzzer.oracle.calibration`.
:func:`reuse_or_calibrate` is the one rule every command follows to get a calibration:
the stored one while it is fresh, else a new one measured now.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from fuzzer.errors import TargetError
from fuzzer.execute import adapters
from fuzzer.execution import Target
from fuzzer.oracle.calibration import REFRESH_AFTER_S, WARMUP_RUNS, Calibration
from fuzzer.oracle.chunkcap import budget_reading, chunk_cap, prefill_step_floor, smaller_budget
from fuzzer.oracle.fitting import fit
from fuzzer.oracle.kinds import Metric
from fuzzer.oracle.model import SchedulerAssumption, assumption_for
from fuzzer.oracle.seats import SEAT_PROBE_STREAMS, seat_count
from fuzzer.oracle.probes import (
    BATCH_PROMPT_TOKENS,
    Pace,
    Plan,
    Probe,
    Probes,
    run_plan,
    usable,
)

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
#: A batch of this many sequences of LONG_BATCH_CONTEXT tokens (fewer where the KV cache, the
#: running sequences or the context do not allow: LONG_BATCH_KV_SHARE of the cache at most, at least
#: LONG_BATCH_MIN_CONTEXT tokens and 2 sequences) decoding together: its step time less the short
#: batch's line is the cost of the batch's context. One sequence's context barely shows it: on the
#: vLLM-like server written for issue 16 one 7000-token stream decoded 0.06 ms slower than a
#: 16-token one, eight of them 4.0 ms slower (8 x 7000 tokens: 72 ns a token), and with the context
#: cost read off one sequence (none) the paper schedule decoded a KV burst's sixteen 4788-token
#: streams in 7.3 ms steps where the server took 10.5 ms: the queue behind them was still there 0.7 s
#: after the paper had emptied it, a confirmed false positive of the clean server.
LONG_BATCH = 8
LONG_BATCH_CONTEXT = 4096
LONG_BATCH_MIN_CONTEXT = 1024
LONG_BATCH_KV_SHARE = 0.6
#: ... and its context is halved while the pilot's pace says the batch would take longer than this
#: (a CPU engine prefills 32k tokens in tens of seconds; its one sequence shows its attention anyway).
LONG_BATCH_MAX_S = 4.0
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
#: Of the pilot runs' two durations of a probe, the slower paces the probes up to this many times the faster.
PILOT_OUTLIER = 3.0
#: The first pilot run knows nothing yet: its largest probes are this far apart, its smallest half that.
PILOT_SPACING_S = 1.0
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
    assumption = assumption_for(info.kind, {**adapters.adapter(info.kind).scheduler_defaults, **info.scheduler}, **overrides)
    # What the server says of itself is its configuration, not a default to probe for: a probe reads
    # a planted bug's behaviour as the engine's (heldout6: a prompt that starved the decodes read as a
    # 16384-token budget), a reported value holds the engine to what it was started with.
    told = [name for key, name in (("max_num_batched_tokens", "token_budget"), ("max_num_seqs", "max_num_seqs"))
            if key in info.scheduler and overrides.get(name) is None]
    if not told:
        return assumption
    documented = assumption_for(info.kind, adapters.adapter(info.kind).scheduler_defaults).token_budget
    if "token_budget" in told and assumption.token_budget < documented:
        # Held beside the documented one, as a smaller budget calibration measures is
        # (SchedulerAssumption.low_budget): which KV-aware schedule preempts whom moves with the budget
        # (heldout6, clean, judged under its 768 alone: two preemption stalls the 2048 schedules held).
        assumption = replace(assumption, token_budget=documented, low_budget=assumption.token_budget)
    return replace(assumption, source=f"{assumption.source}; server-reported {', '.join(told)}")


def with_reported_kv(assumption: SchedulerAssumption, target: Target) -> SchedulerAssumption:
    """``assumption`` with the KV capacity (and its block size) the target reports, unless it names one."""
    kv = reported_kv(target) if assumption.kv_blocks is None else None
    return assumption if kv is None else replace(assumption, kv_blocks=kv[0], block_size=kv[1])


def longest_prompt(target: Target, max_model_len: int | None = None) -> int:
    """The longest prompt a probe of ``target`` sends: its context (``max_model_len``, else the one the server
    reported, else DEFAULT_MAX_MODEL_LEN, which every served model accepts) less two tokens of output."""
    context = max_model_len or getattr(getattr(target, "info", None), "max_model_len", None)
    return (context or DEFAULT_MAX_MODEL_LEN) - 2


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
    measure_budget: bool = True,
    measure_floor: bool = True,
    measure_seats: bool = True,
) -> Calibration:
    """Warm ``target`` up, run the probe traces and fit the model. Raises TargetError on failure.

    With ``measure_seats``, fewer sequences at once than the assumed ``max_num_seqs`` are measured
    first (:func:`fuzzer.oracle.seats.seat_count`; a user who names the count passes it in the
    assumption and is not second-guessed). With ``measure_budget``, a token budget per step larger than the assumed one is measured
    (:func:`fuzzer.oracle.chunkcap.token_budget`: vLLM's default differs by GPU, and deployments
    choose their own), else a smaller one (:func:`fuzzer.oracle.chunkcap.smaller_budget`); a user who names the budget passes False. With ``measure_floor``, what a step
    that computes prompt tokens costs beyond the fitted model is measured and moved from the request
    overhead into such steps (:func:`fuzzer.oracle.chunkcap.prefill_step_floor`). With ``measure_cap`` and no cap in
    the assumption, the long-prefill cap is measured too (:func:`fuzzer.oracle.chunkcap.chunk_cap`);
    a user who names the cap (0 included) passes False.

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
    if measure_seats and assumption.max_num_seqs > SEAT_PROBE_STREAMS and "max_num_seqs" not in assumption.source:
        # Before the batch probes, whose sizes it bounds: fewer seats than the fuzzer's traces need (a user's
        # count, or an earlier measurement's, stands).
        seats = await seat_count(target)
        if seats == SEAT_PROBE_STREAMS:  # all seated: at least that many (SchedulerAssumption.seats_seen)
            assumption = replace(assumption, seats_seen=seats)
        elif seats:
            assumption = replace(assumption, max_num_seqs=seats, source=f"{assumption.source}; max_num_seqs measured")
    budget = assumption.token_budget
    longest = longest_prompt(target, max_model_len)
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
    # Seconds by stage, reported in the calibration's `probing` note: a calibration took over 290 s on a GPU-backed
    # llama-server, and nothing said where.
    stages: dict[str, float] = {}
    began = last = clock()

    def stage(name: str) -> None:  # the seconds since the previous stage ended go to ``name``
        nonlocal last
        now = clock()
        stages[name], last = stages.get(name, 0.0) + now - last, now

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
        measured: dict[tuple[str, int], float] = {}
        for probe in await run_plan(target, pilot, "calibration-pilot"):
            key = kind_of[probe.result.request_id.split("b")[0]]
            measured[key] = max(measured.get(key, 0.0), probe.result.e2e_s or 0.0)
        # The slower run paces the probes, but not beyond PILOT_OUTLIER times the faster: one slow request is an
        # outlier, and as the slowest it set the pace of every probe of its kind. On llama-server the first request
        # of a pilot run took 5.6 s once (the other run's, 0.004 s) and 1.04 s another time (0.004 s), and every
        # prefill probe was spaced 8.4 s apart (a 12-minute calibration, other jobs sharing the cores) or 1.6 s; on
        # a GPU, 1.8 s apart for probes served in 10-120 ms.
        slowest = {key: min(max(value, slowest.get(key, 0.0)), PILOT_OUTLIER * min(value, slowest.get(key, math.inf)))
                   for key, value in measured.items()}

    stage("pilot")
    spacing = {kind: pace(kind) for kind in sizes_of}
    # A server may report its KV capacity only once its engine is up (vLLM's cache_config_info).
    assumption = with_reported_kv(assumption, target)

    long_batch = long_batch_shape(assumption, max_model_len)
    while long_batch is not None and long_batch_spacing_s(spacing, *long_batch) > LONG_BATCH_MAX_S:
        batch, context = long_batch
        long_batch = (batch, context // 2) if context // 2 >= LONG_BATCH_MIN_CONTEXT else None
    sizes = (lengths, prefixes, contexts, long_batch)
    tokenizer = await tokenize_token_s(target)
    stage("tokenizer")
    cap = None if tokenizer is None else TOKENIZE_ALLOWANCE * tokenizer

    def fitted(probes: Probes, rounds: str) -> Calibration:
        return fit(target=target.name, created_at=clock(), assumption=assumption, prefill=probes.prefill,
                   cached=probes.cached, single=probes.single, batched=probes.batched, warmup_runs=warmup_runs,
                   frontend_cap_s=cap, tokenizer_token_s=tokenizer or 0.0, probing=rounds)

    async def measured() -> Calibration:
        # Half the repeats first; the other half only when the fit is not yet settled (settled()).
        first = max(1, repeats // 2) if early_stop else repeats
        probes = await _probe_round(target, assumption, rng, first, spacing, *sizes)
        cal = fitted(probes, f"{first} of {repeats} repeats")
        if first < repeats:
            reasons = unsettled(cal, probes)
            if not reasons:
                return replace(cal, probing=f"{first} of {repeats} repeats: stopped early, the fit was settled "
                                            f"(each line within {SETTLED_SPREAD:.0%} at its largest probe, noise judged)")
            why = "; ".join(reason for _, reason in reasons)
            # Only an uncertain line's own probes run again when the noise and the baselines are settled:
            # on a slow server one round of decode or batch probes takes as long as all prefill probes twice.
            lines = {line for line, _ in reasons}
            kinds = None if None in lines else frozenset(str(line) for line in lines)
            probes += await _probe_round(target, assumption, rng, repeats - first, spacing, *sizes, kinds=kinds)
            cal = fitted(probes, f"{repeats} of {repeats} repeats ({why} after {first})" if kinds is None else
                         f"{first} of {repeats} repeats, {repeats} of the {' and '.join(sorted(kinds))} probes "
                         f"({why} after {first})")
        return cal

    cal = await measured()
    stage("probes")
    if remeasure and not cal.reliable:
        # A noisy round is often a burst of load on the host: measure once more, keep the quieter.
        again = await measured()
        stage("again (noisy)")
        cal = min((cal, again), key=lambda c: c.judged_noise()[1])
    floor = min(await prefill_step_floor(target, cal), cal.model.request_overhead_s) if measure_floor else 0.0
    stage("step floor")
    if floor > 0:  # engine time the idle probes had put in the request overhead: every TTFT stays as it was
        cal = replace(cal, model=replace(cal.model, prefill_step_s=floor,
                                         request_overhead_s=cal.model.request_overhead_s - floor))
    budget_open = measure_budget and "token budget" not in assumption.source and "token_budget" not in assumption.source
    if budget_open:
        # A user's budget (or an earlier measurement's) stands; else a larger one the server shows replaces the
        # default (a smaller one is looked for once the cap is known, below, where the steps say it may be).
        kind = getattr(getattr(target, "info", None), "kind", None)
        choices = adapters.ADAPTERS[kind].scheduler_defaults.get("max_num_batched_tokens", ()) if kind in adapters.ADAPTERS else ()
        found, budget_open = await budget_reading(target, cal, longest,
                                                  tuple(choices) if isinstance(choices, (tuple, list)) else ())
        if found:  # on the fit's assumption (it may have found no prefix caching)
            cal = replace(cal, assumption=replace(cal.assumption, token_budget=found,
                                                  source=f"{cal.assumption.source}; token budget measured"))
    if measure_cap and not assumption.long_prefill_threshold:  # a user's (or an earlier measurement's) cap stands
        found = await chunk_cap(target, cal, longest, reported=max_model_len is not None)
        if found:
            cal = replace(cal, assumption=replace(cal.assumption, long_prefill_threshold=found,
                                                  source=f"{cal.assumption.source}; long-prefill cap measured"))
        elif found is None and cal.assumption.admission_stops:
            # A cap the probe could not rule out would let a later short request pass a long one legitimately.
            cal = replace(cal, assumption=replace(cal.assumption, admission_stops=False,
                                                  source=f"{cal.assumption.source}; long-prefill cap not known"))
    # Where the budget probe counted more steps than the assumed budget takes (a cap's or a smaller budget's), with
    # prompts within the cap now known (one long prompt in partial prefill at a time is a cap's policy, no budget's).
    if budget_open and (low := await smaller_budget(target, cal)):  # the bound holds both (SchedulerAssumption.low_budget)
        cal = replace(cal, assumption=replace(cal.assumption, low_budget=low,
                                              source=f"{cal.assumption.source}; smaller token budget measured"))
    stage("budget and cap")
    spent = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in stages.items())
    return replace(cal, probing=f"{cal.probing}; {clock() - began:.0f} s in all ({spent})")


def settled(cal: Calibration, probes: Probes) -> str | None:
    """None when one round of probes has pinned the model down well enough, else what is not yet."""
    reasons = unsettled(cal, probes)
    return reasons[0][1] if reasons else None


def unsettled(cal: Calibration, probes: Probes) -> list[tuple[str | None, str]]:
    """What one round of probes has not yet pinned down: (the line's probe kind, or None for all, why).

    Settled: the noise is judged reliable, every judged metric has SETTLED_BASELINE baseline
    ratios, and each fitted line's 95% slope interval moves its value at the largest probe by
    at most SETTLED_SPREAD of that value (a bound is no more uncertain than that from the fit).
    Noise and baselines come from every kind of probe (None); a line from its own kind's.
    """
    if not cal.reliable:
        return [(None, "noisy")]
    out: list[tuple[str | None, str]] = []
    for metric in (Metric.TTFT, Metric.E2E):
        if len(cal.baseline.get(metric, ())) < SETTLED_BASELINE:
            out.append((None, f"{len(cal.baseline.get(metric, ()))} {metric.value} baseline ratios"))
    budget = cal.assumption.token_budget
    for name, line, sizes in (("prefill", cal.ttft_fit, [p.prompt for p in probes.prefill if p.prompt <= budget]),
                              ("decode", cal.context_fit, [p.prompt + p.max_tokens / 2.0 for p in probes.single]),
                              ("batch", cal.batch_fit, [p.batch for p in probes.batched])):
        if not sizes:
            continue
        largest = max(sizes)
        value = line(largest)
        spread = (line.slope_high - line.slope_low) / 2.0 * largest
        if value <= 0:
            out.append((name, f"{name} line <= 0"))
        elif spread > SETTLED_SPREAD * value:
            out.append((name, f"the {name} line uncertain ({spread / value:.0%} at {largest:g})"))
    return out


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
        # A stale calibration's budget stands (the user's, or one measured before), as its cap does.
        fresh = await calibrate(target, assumption=stale.assumption if stale else None, rng=rng(), clock=clock,
                                measure_budget=stale is None)
    except TargetError as e:
        if stale is None or on_refresh_failed is None:
            raise
        on_refresh_failed(e)
        return stale
    save(fresh)
    return fresh


async def tokenize_token_s(target: Target) -> float | None:
    """The time per prompt token the target's own tokenizer takes (/tokenize), or None.

    Timed on targets that can (``tokenize_seconds``: the HTTP executor with a server that
    tokenizes on request): the slope between a short and a long prompt, each the fastest of
    TOKENIZE_REPEATS. None on targets that cannot say (the in-process simulator). Times
    TOKENIZE_ALLOWANCE, it caps the frontend's fitted share; as it is, it is the least frontend
    time a prompt costs (StepModel.tokenizer_token_s).
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
    return max(0.0, (fastest[1] - fastest[0]) / (long - short))


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


def long_batch_shape(assumption: SchedulerAssumption, max_model_len: int | None) -> tuple[int, int] | None:
    """(sequences, context) of the long-context batch probe, or None where none fits (LONG_BATCH)."""
    batch = min(LONG_BATCH, assumption.max_num_seqs)
    context = min(LONG_BATCH_CONTEXT, (max_model_len or DEFAULT_MAX_MODEL_LEN) - DECODE_TOKENS - 2)
    if assumption.kv_blocks is not None:
        room = int(LONG_BATCH_KV_SHARE * assumption.kv_blocks * assumption.block_size)
        while batch > 2 and batch * (context + DECODE_TOKENS) > room:
            batch -= 1
        context = min(context, room // batch - DECODE_TOKENS)
    if batch < 2 or context < LONG_BATCH_MIN_CONTEXT:
        return None
    return batch, context


def long_batch_spacing_s(spacing: Mapping[str, Pace], batch: int, context: int) -> float:
    """How long the long-context batch probe is given: its prompts paced as one prompt of them all, then
    its decodes as the short batch's of its size."""
    return spacing["prefill"].spacing_s(batch * context) + spacing["batch"].spacing_s(batch)


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
    long_batch: tuple[int, int] | None = None,
    *,
    kinds: frozenset[str] | None = None,
) -> Probes:
    """One round of probes (uncached and cached TTFT, decode, batched decode), ``repeats`` of each size.

    ``kinds``: only these (of "prefill", "cached", "decode", "batch"); None: all.
    """
    prefill: list[Probe] = []
    cached_probes: list[Probe] = []
    single: list[Probe] = []
    batched: list[Probe] = []

    def shuffled(items: list) -> list:
        rng.shuffle(items)
        return items

    # Uncached TTFT: one lead-in request (a first request after an idle gap may be slow).
    if kinds is None or "prefill" in kinds:
        plan = Plan(spacing["prefill"])
        plan.add(16, 2, lead_in=True)
        for n in shuffled([n for n in lengths for _ in range(repeats)]):
            plan.add(n, 2)
        prefill = usable(await run_plan(target, plan, "calibration-prefill"))

    # Cached TTFT: a request computes the prefix, the next one (same group) reuses it.
    if kinds is None or "cached" in kinds:
        plan = Plan(spacing["prefill"])
        plan.add(16, 2, lead_in=True)
        for n in shuffled([n for n in prefixes for _ in range(repeats)]):
            plan.add_pair(n, CACHED_SUFFIX_TOKENS, hit=(n // assumption.block_size) * assumption.block_size)
        cached_probes = usable(await run_plan(target, plan, "calibration-cached"))

    # Decode, one sequence, growing context.
    if kinds is None or "decode" in kinds:
        plan = Plan(spacing["decode"])
        plan.add(16, 2, lead_in=True)
        for n in shuffled([n for n in contexts for _ in range(repeats)]):
            plan.add(n, DECODE_TOKENS)
        single = usable(await run_plan(target, plan, "calibration-decode"))

    if kinds is None or "batch" in kinds:
        # Decode, many short sequences together.
        plan = Plan(spacing["batch"])
        plan.add(16, 2, lead_in=True)
        for b in shuffled([b for b in batch_sizes(assumption) for _ in range(repeats)]):
            plan.add(BATCH_PROMPT_TOKENS, DECODE_TOKENS, batch=b, size=b)
        if long_batch is not None:
            # Long sequences together: their prompts (paced as one prompt of them all), then their decodes. One
            # batch a round: its steps give hundreds of gaps, and the calibration's time is the campaign's.
            b, context = long_batch
            for _ in range(max(1, repeats // 2)):
                plan.add(context, DECODE_TOKENS, batch=b, spacing_s=long_batch_spacing_s(spacing, b, context))
        batched = usable(await run_plan(target, plan, "calibration-batch"))
    return Probes(tuple(prefill), tuple(cached_probes), tuple(single), tuple(batched))


