"""The step probes: a long prompt beside a decoding stream shows how many prompt tokens a step computes.

Two limits set that. The token budget (vLLM's ``--max-num-batched-tokens``: 2048 on smaller GPUs,
8192 on large ones, or what the deployment chose) is measured by :func:`token_budget`: the stream's
longest gap while the prompt prefills is a step computing a full chunk, and a larger budget makes
that step longer. The long-prefill cap, by :func:`chunk_cap`:

vLLM's ``--long-prefill-token-threshold`` (off by default; the knob its maintainers answer
head-of-line reports with) caps the prompt tokens one request computes in a step while other
requests are running or waiting, so a long prompt takes more steps than the token budget
implies. Calibration's idle probes run one request at a time and never see it; this probe runs
a long prompt beside a decoding stream (ARCHITECTURE.md, "Oracle"). A cap it measures goes into
the scheduler assumption (``SchedulerAssumption.long_prefill_threshold``), which the paper
schedule then follows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from fuzzer.execution import Target
from fuzzer.oracle.calibration import Calibration
from fuzzer.oracle.expectation import idle_expectation
from fuzzer.oracle.kinds import Metric
from fuzzer.oracle.model import SchedulerAssumption, StepModel
from fuzzer.oracle.paper import serve
from fuzzer.oracle.policy import CANDIDATE_FACTOR, NOISE_MARGINS
from fuzzer.trace import Request, Trace

#: The probe: a prompt of this many token budgets (where the model length allows) sent while a short
#: stream decodes, CAP_REPEATS times. Two, the fewest that tell a cap from none: heldout8 (issue 16's
#: eighth held-out server) with its bugs on computes a prompt over two budgets before the decodes,
#: without its 1024-token cap, and a probe of three budgets read that as no cap. A cap read from fewer
#: steps is a little lower (768 there, clean, against 1023): a longer bound for long prompts.
CAP_PROBE_BUDGETS = 2
CAP_REPEATS = 2
#: ... or, where the server reports a shorter context, the longest prompt it holds from this many
#: budgets (two steps uncapped; until stop 43 two budgets, and heldout9's 4096-token context left its
#: cap unknown; until stop 47 1.5, and heldout9's reported 3072-token budget left it unknown again: a
#: 1056-token prompt then took two steps of its 1024-token cap, a confirmed 2.3x ttft-outlier); a context
#: not reported (4096 guessed) needs two.
CAP_PROBE_MIN_BUDGETS = 1.25
#: A cap is measured only when every run counts at least this many times the steps an uncapped
#: engine needs (and a short prompt passed the long one: WITNESS_STEPS) ...
CAP_EVIDENCE = 2.0
#: No cap: at most this many steps more than an uncapped engine's (one at an edge of the window).
NO_CAP_EXTRA_STEPS = 1
#: ... and the prompt's TTFT is the oracle's candidate factor times what the uncapped schedule
#: gives it, and the noise margin more: a cap that costs less than that makes no candidate either.
#: Caps below this many tokens a step are not looked for (the stream would be long).
MIN_CAP_TOKENS = 64
#: ... and a cap is what lets other requests in beside a long prompt: a short prompt of WITNESS_TOKENS
#: (sent one stream step after the long one reached the engine) must get its first token at least
#: WITNESS_STEPS of the stream's steps before the long prompt does, in every run. On heldout3 with
#: every bug on, a prefill in twice an uncapped engine's steps was measured as a cap of 3072 tokens
#: while short prompts still waited for the whole prefill (as the server does clean): the bound
#: then let them in beside it, and two ttft-outliers (8.5x, 48x) were false. Nor fewer than the steps an
#: uncapped engine takes: a cap's prefill takes twice those (CAP_EVIDENCE), the witness in its second, where a
#: long prompt that reached the engine late shared its first step with a witness admitted ahead of it and left
#: only its last steps after it (the built-in simulator at a load of 0.9, stop 54: a cap of 585 read that way).
WITNESS_TOKENS = 32
WITNESS_STEPS = 2
#: ... and it passed beside the long prompt's chunks only if its TTFT is at least this share of its own step on
#: paper, one computing a chunk of the cap beside it (and its frontend): a short prompt served quicker than that
#: passed the long one in the frontend, in a step of decodes (a busy host hands a long prompt to the engine later
#: than calibrated). The built-in simulator, clean, at a load of 2.5 on two cores (stop 54): witnesses done
#: 6-15 ms after their send, two whole 68 ms prefill steps before the long prompt's first token, were read as caps
#: of 512 and 585 tokens in two of three calibrations; one such cap let a short request in beside two 15k-token
#: prompts in the bound, a false 2.7x ttft-outlier of a 30-minute campaign.
WITNESS_STEP_SHARE = 0.5
#: The token budget probe: a prompt of at most this many tokens (and at least two assumed budgets;
#: halved while the calibrated model says its prefill would take longer than BUDGET_PROBE_MAX_S)
#: beside a decoding stream, BUDGET_REPEATS times ...
BUDGET_PROBE_TOKENS = 16384
BUDGET_PROBE_MAX_S = 3.0
BUDGET_REPEATS = 2
#: ... and a larger budget is measured only when the stream's longest gap during the prefill (the
#: quicker run's) is this many times the longest step the assumed budget gives the prompt, and the
#: noise margin more; it is then the smallest of BUDGET_CHOICES (and the documented ones) whose
#: longest step explains that gap. On the vLLM-like server of issue 16's third held-out deployment
#: (a budget of 8192 tokens where vLLM's smaller-GPU default of 2048 was assumed) the stream's gaps
#: were 120 ms against 40 ms steps on paper: four confirmed itl-stall false positives in 4 minutes.
BUDGET_EVIDENCE = 1.5
#: A larger budget computes the burst in fewer steps: a run whose stream counts at least this share
#: of the steps the assumed budget needs, and BUDGET_EXTRA_STEPS more, shows the assumed budget
#: however long its gaps were (a step computed prompt tokens when its gap is BUDGET_STEP_GAP of
#: the longest or more; the stream's own decode steps at the window's ends are far shorter). In CI, llama-server at its 2048-token n_batch was
#: measured at 8192 while other jobs shared the two cores: every gap was long, the steps as many.
BUDGET_STEPS_SHARE = 0.5
BUDGET_EXTRA_STEPS = 2
BUDGET_STEP_GAP = 0.25
BUDGET_CHOICES = (2048, 4096, 8192, 16384, 32768)
#: Where a step costs mostly its overhead (a GPU's, for a small model), a larger budget's step is hardly longer
#: (heldout11, issue 16's eleventh held-out server: 18 ms at its 4096 tokens against 15 ms on paper at 2048)
#: but there are fewer of them: a run also shows a larger budget when its stream counted at least
#: BUDGET_FEWER_STEPS fewer full steps than the assumed budget's paper schedule makes, and the burst's last
#: first token came BUDGET_TOLERANCE sooner than that schedule's and the noise margin more (one long stall of a
#: busy host leaves the other steps short of full, and makes the burst later); it is then the smallest budget
#: whose schedule makes no more full steps.
BUDGET_FEWER_STEPS = 2
#: The burst is at least this many prompts (of the total's share, or the longest the context holds), so that
#: their first tokens can say whether the stream was in every step. An engine that computes a step without
#: its running decodes (a long prompt prefilled whole, or its chunks before the decodes: vLLM PR #10235,
#: llama.cpp #4216; heldout8's prompts over two budgets) gives a prompt its first token inside the stream's
#: long gap; every step of a larger budget gives the stream its token with theirs. A stream left out of steps
#: was read as a larger budget (16384 on the simulator's unchunked-prefill and on heldout8 before it reported
#: its budget), and the stalls it was left out for were then inside the bound.
BUDGET_PROBE_PROMPTS = 2
#: ... inside: this share of the gap (and the noise margin) from both its ends: the step a prompt's first token
#: ends is one the stream decoded in, whose token comes a delivery's jitter and the request's own overhead apart.
STARVED_SHARE = 0.25
#: A budget explains the gap when its longest step on paper, this much longer, reaches it (the
#: bound's envelope scales the model as much).
BUDGET_TOLERANCE = 0.15


async def token_budget(target: Target, cal: Calibration, longest: int, documented: tuple[int, ...] = ()) -> int:
    """The target's token budget per step where it is clearly larger than the assumed one, else 0
    (:func:`budget_reading`'s first half)."""
    return (await budget_reading(target, cal, longest, documented))[0]


async def budget_reading(target: Target, cal: Calibration, longest: int,
                         documented: tuple[int, ...] = ()) -> tuple[int, bool]:
    """(The target's token budget per step where it is clearly larger than the assumed one, else 0;
    whether the probe's first run counted more full steps than the assumed budget takes, or could not
    tell: only then may the budget be smaller, or a cap make the steps more, and :func:`smaller_budget`
    has something to look for.)

    A short stream decodes; a burst of long prompts (BUDGET_PROBE_PROMPTS sharing BUDGET_PROBE_TOKENS where
    the context holds them, else up to four of the longest it holds: a budget counts a step's tokens,
    whoever's) arrives beside it, BUDGET_REPEATS times. Each step gives the stream a token, so its longest gap
    while the prompts prefill is the longest step, one computing a full budget of prompt tokens.
    See BUDGET_EVIDENCE for when it is measured, and BUDGET_PROBE_PROMPTS for a stream left out of steps,
    which is no budget.
    """
    model, assumption = cal.model, cal.assumption
    budget = assumption.token_budget
    total = BUDGET_PROBE_TOKENS
    while total >= 4 * budget and idle_expectation(total, 2, model, assumption).ttft_s > BUDGET_PROBE_MAX_S:
        total //= 2
    each = min(total // BUDGET_PROBE_PROMPTS, max(1, longest))
    prompts = (each,) * max(BUDGET_PROBE_PROMPTS, min(4, total // each))
    if sum(prompts) < 2 * budget:
        return 0, True  # no burst of several assumed chunks fits (or none the probe can afford): nothing to tell
    margin_s = NOISE_MARGINS * cal.noise_s.get(Metric.MAX_ITL, 0.0)
    gaps, more_steps = [], True
    for run in range(BUDGET_REPEATS):
        trace, sent, got = await _beside_a_stream(target, model, assumption, prompts, f"calibration-budget-{run}")
        if got is None:
            return 0, more_steps
        s, burst, _ = got
        during, paper_steps = _during(s, burst, model, each), _prompt_steps(trace, sent, model, assumption, budget)
        full = _full(during, model)
        if run == 0:
            more_steps = full > paper_steps
        if not during:
            return 0, more_steps  # no step of the stream to tell by
        # As many steps as the assumed budget takes: long gaps are a busy host's, not larger chunks.
        steps_as_assumed = sum(gap >= BUDGET_STEP_GAP * max(during) for gap in during) >= (
            BUDGET_STEPS_SHARE * math.ceil(sum(prompts) / budget) + BUDGET_EXTRA_STEPS)
        if not steps_as_assumed and max(during) >= BUDGET_EVIDENCE * _longest_step(
                trace, sent, model, assumption, budget) + margin_s:
            if _left_out(s, burst, margin_s):
                return 0, more_steps  # steps that computed prompts without the stream: no budget makes those
            gaps.append((max(during), None, sent, trace))  # longer steps: larger chunks
            continue
        span_s = max(p.sent_s + p.ttft_s for p in burst) - min(p.sent_s for p in burst)
        if (full <= paper_steps - BUDGET_FEWER_STEPS
                and span_s <= (1 - BUDGET_TOLERANCE) * _burst_span(trace, sent, model, assumption, budget) - margin_s):
            gaps.append((max(during), full, sent, trace))  # fewer steps, and sooner done: steps that cost their overhead
        else:
            return 0, more_steps  # the assumed budget explains this run (a server at its default costs one run)
    # Budgets beyond the burst all compute it in one step: the smallest of them is all the probe can tell; each
    # run's smallest budget that explains it, the smaller of the runs'.
    choices = sorted({c for c in (*BUDGET_CHOICES, *documented) if c > budget})

    def explains(choice: int, gap: float, count: int | None, sent, trace) -> bool:
        if choice > sum(prompts):
            return True
        if count is not None:
            return _prompt_steps(trace, sent, model, assumption, choice) <= count
        return (1 + BUDGET_TOLERANCE) * _longest_step(trace, sent, model, assumption, choice) >= gap - margin_s

    read = [next((c for c in choices if explains(c, *run)), choices[-1] if choices else 0) for run in gaps]
    return (min(read), False) if min(read) else (0, more_steps)


#: The smaller budget probe: SMALL_PROBE_BUDGETS assumed budgets of prompt tokens in prompts of a quarter
#: of the budget each, or SMALL_PROBE_CAP_SHARE of a long-prefill cap the calibration measured where that is
#: less (a prompt over the cap is a long one, and an engine may prefill one long prompt at a time: the
#: simulator's max_long_partial_prefills, vLLM v0's), sent together beside a decoding stream (at most
#: SMALL_PROBE_KV_SHARE of the KV cache's tokens, where the server reports them, so that no admission
#: waits for blocks, and no more than its sequences beside the stream), BUDGET_REPEATS times ...
SMALL_PROBE_BUDGETS = 4
SMALL_PROBE_CAP_SHARE = 0.8
SMALL_PROBE_KV_SHARE = 0.6
#: ... and a smaller budget is measured only when every run's stream counts more full steps (a gap at least
#: FULL_STEP_SHARE of the way from the stream's own decode step to the longest, while the burst prefills: where
#: a step costs mostly its overhead a decode step is most of a full one, and 0.75 of the longest counted the
#: burst's edges; with the jitter of heldout11-like steps, 0.75 of the way split the full steps themselves)
#: than the paper schedule makes under
#: the assumed budget (its slots and arrival order too): a budget B computes a burst in at most
#: total / B full steps, and a step boundary that splits the burst's arrival or a busy host makes none
#: more. It is then the smallest budget under which the paper schedule makes no more full steps than
#: the run with the fewest (of the budgets that explain the count, the one that gives the longest
#: bounds). heldout10 (issue 16's tenth held-out server) computes 1536 tokens a step where 2048 was
#: assumed: a short prompt sent just after two long ones waited for their prefill, 2.2x its bound, and
#: two of its clean campaign's findings were that.
FULL_STEP_SHARE = 0.5


async def smaller_budget(target: Target, cal: Calibration) -> int:
    """The target's token budget per step where it is clearly smaller than the assumed one, else 0.

    The stream gets a token in every step, so its gaps between the burst's arrival and the burst's last
    first token count the steps the burst's prefill took; prompts within the cap fill every step's budget.
    See FULL_STEP_SHARE for when it is measured.
    """
    model, assumption = cal.model, cal.assumption
    budget = assumption.token_budget
    each = budget // 4
    if assumption.long_prefill_threshold:
        each = min(each, int(SMALL_PROBE_CAP_SHARE * assumption.long_prefill_threshold))
    count = min(math.ceil(SMALL_PROBE_BUDGETS * budget / max(each, 1)), assumption.max_num_seqs - 1)
    if assumption.kv_blocks is not None:
        count = min(count, int(SMALL_PROBE_KV_SHARE * assumption.kv_blocks * assumption.block_size)
                    // (each + assumption.block_size))
    if count < 8 or each < MIN_CAP_TOKENS:
        return 0  # too few prompts to count the steps apart
    prompts = (each,) * count
    counted = []
    for run in range(BUDGET_REPEATS):
        trace, sent, got = await _beside_a_stream(target, model, assumption, prompts, f"calibration-small-budget-{run}")
        if got is None:
            return 0
        s, burst, _ = got
        steps = _full(_during(s, burst, model, each), model)
        if steps <= _prompt_steps(trace, sent, model, assumption, budget):
            return 0  # the assumed budget explains this run
        counted.append((steps, trace, sent))
    steps, trace, sent = min(counted, key=lambda c: c[0])
    lo, hi = MIN_CAP_TOKENS, budget  # the paper needs more steps than counted under lo's budget, no more under hi's
    if _prompt_steps(trace, sent, model, assumption, lo) <= steps:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _prompt_steps(trace, sent, model, assumption, mid) <= steps else (mid, hi)
    return hi if hi < budget else 0


def _during(s, burst, model: StepModel, each: int) -> list[float]:
    """The stream's gaps from the burst's arrival at the engine to its last first token."""
    arrived = min(p.sent_s for p in burst) + model.frontend_s(each)
    first = max(p.sent_s + p.ttft_s for p in burst)
    times = [s.sent_s + t for t in s.token_times_s]
    return [b - a for a, b in zip(times, times[1:]) if b > arrived and a < first]


def _left_out(s, burst, margin_s: float) -> bool:
    """Whether a prompt of the burst got its first token inside the stream's longest gap while it prefilled
    (STARVED_SHARE): a step that computed prompts and gave the stream no token."""
    times = [s.sent_s + t for t in s.token_times_s]
    first = max(p.sent_s + p.ttft_s for p in burst)
    gaps = [(a, b) for a, b in zip(times, times[1:]) if a < first]
    if not gaps:
        return False
    a, b = max(gaps, key=lambda g: g[1] - g[0])
    edge = STARVED_SHARE * (b - a) + margin_s
    return any(a + edge < p.sent_s + p.ttft_s < b - edge for p in burst)


def _full(steps: Sequence[float], model: StepModel) -> int:
    """How many of ``steps`` are full: FULL_STEP_SHARE of the way from the stream's own decode step to the
    longest, or more (the burst's edges and the stream's own steps are shorter; where a step costs mostly its
    overhead, a decode step is most of a full one's length)."""
    if not steps:
        return 0
    decode_s = model.step_s(0, 1, 16)
    line = decode_s + FULL_STEP_SHARE * (max(steps) - decode_s)
    return sum(d >= line for d in steps)


def _on_paper(trace: Trace, sent: Mapping[str, float], model: StepModel, assumption: SchedulerAssumption,
              budget: int) -> dict:
    """The probe's paper schedule under ``budget`` (no cap, no KV limit)."""
    under = replace(assumption, token_budget=budget, long_prefill_threshold=0, kv_blocks=None)
    return serve(trace.requests, {}, sent, model, under, False)


def _burst_span(trace: Trace, sent: Mapping[str, float], model: StepModel, assumption: SchedulerAssumption,
                budget: int) -> float:
    """From the probe's first prompt sent to its prompts' last first token, in the paper schedule under ``budget``."""
    paper = _on_paper(trace, sent, model, assumption, budget)
    burst = [r.id for r in trace.requests if r.id != "cs"]
    return max(sent[i] + paper[i].ttft_s for i in burst) - min(sent[i] for i in burst)


def _prompt_steps(trace: Trace, sent: Mapping[str, float], model: StepModel, assumption: SchedulerAssumption,
                  budget: int) -> int:
    """The full steps (:func:`_full`) computing the probe's prompts in the paper schedule under ``budget``."""
    paper = _on_paper(trace, sent, model, assumption, budget)
    return _full([d for _, d in {step for r in trace.requests if r.id != "cs" for step in paper[r.id].chunk_steps}],
                 model)


#: The prefill step probe: this many prompts of FLOOR_PROMPT_TOKENS, each sent while the stream
#: decodes alone (FLOOR_SPACING_STEPS of its steps apart) ...
FLOOR_PROMPTS = 5
FLOOR_PROMPT_TOKENS = 128
FLOOR_SPACING_STEPS = 12
#: ... and a floor is kept only when the median excess of the stream's gap over the model's step is
#: this many noise margins and this share of the step (a dense model's is within its noise).
FLOOR_EVIDENCE = 0.5


async def prefill_step_floor(target: Target, cal: Calibration) -> float:
    """What a step that computes a few prompt tokens costs beyond the calibrated model's step, or 0.

    A stream decodes; FLOOR_PROMPTS short prompts come one at a time beside it. The stream's gap
    that ends with each prompt's first token is the step that computed it (and the stream's
    token); its median excess over ``model.step_s`` of that step is the floor, kept only beyond
    the noise and FLOOR_EVIDENCE of the step: calibration then moves it from the request overhead
    (idle probes see both in every TTFT) into every step that computes a prompt.
    """
    model, assumption = cal.model, cal.assumption
    step = model.step_s(0, 1, 16)
    if step <= 0.0:  # a fit with no decode step (a fast server under load) places no stream's gaps
        return 0.0
    lead_s = idle_expectation(16, 2, model, assumption).ttft_s + 8 * step
    spacing_s = FLOOR_SPACING_STEPS * max(step, model.step_s(FLOOR_PROMPT_TOKENS, 1, 16))
    prompts = [Request(id=f"cp{i}", at_ms=round((lead_s + i * spacing_s) * 1000.0, 3),
                       prompt_tokens=FLOOR_PROMPT_TOKENS, max_tokens=2) for i in range(FLOOR_PROMPTS)]
    stream_tokens = math.ceil((lead_s + FLOOR_PROMPTS * spacing_s) / step) + 32
    trace = Trace(requests=(Request(id="cs", at_ms=0.0, prompt_tokens=16, max_tokens=stream_tokens), *prompts),
                  name="calibration-prefill-step")
    result = await target.execute(trace)
    got = {r.request_id: r for r in result.requests}
    s = got.get("cs")
    if s is None or s.outcome.failed or len(s.token_times_s) < 2:
        return 0.0
    times = [s.sent_s + t for t in s.token_times_s]
    excess = []
    for p in prompts:
        r = got.get(p.id)
        if r is None or r.outcome.failed or r.ttft_s is None:
            continue
        first = r.sent_s + r.ttft_s
        # The stream's gap whose end is nearest the prompt's first token: the step that computed the prompt.
        k = min(range(1, len(times)), key=lambda i: abs(times[i] - first))
        context = 16 + k
        excess.append(times[k] - times[k - 1] - model.step_s(FLOOR_PROMPT_TOKENS, 1, context,
                                                             FLOOR_PROMPT_TOKENS * FLOOR_PROMPT_TOKENS / 2))
    if len(excess) < (FLOOR_PROMPTS + 1) // 2:
        return 0.0
    floor = float(sorted(excess)[len(excess) // 2])
    margin_s = NOISE_MARGINS * cal.noise_s.get(Metric.MAX_ITL, 0.0)
    if floor < margin_s or floor < FLOOR_EVIDENCE * model.step_s(FLOOR_PROMPT_TOKENS, 1, 16):
        return 0.0
    return floor


async def _beside_a_stream(target: Target, model: StepModel, assumption: SchedulerAssumption,
                           prompts: tuple[int, ...], name: str, witness: bool = False):
    """Run a short stream ("cs") and, once it decodes, prompts of ``prompts`` tokens sent together ("cl",
    "cl1", ...), and with ``witness`` a short prompt ("cw") sent one stream step after they reach the
    engine; returns the trace, the send times and (stream, [prompt results], the witness's result or
    None), the latter None when any failed or had no token."""
    step = model.step_s(0, 1, 16)
    lead_s = idle_expectation(16, 2, model, assumption).ttft_s + 8 * step
    longs = [Request(id="cl" if i == 0 else f"cl{i}", at_ms=round(lead_s * 1000.0, 3), prompt_tokens=n, max_tokens=2)
             for i, n in enumerate(prompts)]
    witnesses = [Request(id="cw", at_ms=round((lead_s + model.frontend_s(max(prompts)) + step) * 1000.0, 3),
                         prompt_tokens=WITNESS_TOKENS, max_tokens=2)] if witness else []
    trace = Trace(requests=(
        Request(id="cs", at_ms=0.0, prompt_tokens=16, max_tokens=math.ceil(sum(prompts) / MIN_CAP_TOKENS) + 32),
        *longs, *witnesses,
    ), name=name)
    result = await target.execute(trace)
    got = {r.request_id: r for r in result.requests}
    s, burst, w = got.get("cs"), [got.get(r.id) for r in longs], got.get("cw")
    if s is None or s.outcome.failed or not s.token_times_s or any(
            p is None or p.outcome.failed or p.ttft_s is None for p in [*burst, *([w] if witness else [])]):
        return trace, {}, None
    return trace, {r.request_id: r.sent_s for r in result.requests}, (s, burst, w)


def _longest_step(trace: Trace, sent: Mapping[str, float], model: StepModel, assumption: SchedulerAssumption,
                  budget: int) -> float:
    """The longest step computing the probe's prompts in the paper schedule under ``budget``."""
    paper = _on_paper(trace, sent, model, assumption, budget)
    return max((d for r in trace.requests if r.id != "cs" for _, d in paper[r.id].chunk_steps), default=0.0)


async def chunk_cap(target: Target, cal: Calibration, longest: int, *, reported: bool = True,
                    prompt_tokens: int | None = None) -> int | None:
    """The long-prefill cap the target applies: prompt tokens per request per step beside others; 0 when
    the probe showed none, None when it could not tell.

    A short stream decodes, then a prompt of CAP_PROBE_BUDGETS token budgets (or the longest the context
    holds: CAP_PROBE_MIN_BUDGETS; ``reported``: the context is the server's, not a guess) arrives, CAP_REPEATS
    times. A cap shows twice: every step gives the stream a token, so its tokens between the
    prompt's arrival at the engine (its send plus the modelled frontend time) and the prompt's
    first token count the prefill's steps, and the prompt's TTFT exceeds what the calibrated
    model gives it beside the stream. A cap is measured only when every run counts CAP_EVIDENCE
    times the steps an uncapped engine needs, and its TTFT is the
    candidate factor times the uncapped schedule's and the noise margin more, it is then the largest
    cap under which the schedule explains the quicker run's TTFT (no larger than the prompt
    over the steps counted), and a short prompt sent beside it got its first token well before it (see
    WITNESS_STEPS: more steps alone may be a server's own, and a cap's bound lets later requests in
    beside a long prompt). Where a cap costs the prompt little (prefill time dominated by tokens,
    not steps) it is the prompt over the fewest steps counted: it changes a TTFT little, but not
    how many prompts prefill at once, each holding KV blocks, nor so the preemptions.

    No cap (0) needs a run whose stream counted the steps an uncapped engine needs, and at most
    NO_CAP_EXTRA_STEPS more, and whose short prompt did not pass the long one: a stream that got
    fewer was starved (a server that leaves decodes out while a long prompt prefills, or one that
    computes it in fewer steps than the budget says), one that got more without a cap's evidence
    shows something else, and a short prompt that passed shows a cap the steps could not measure
    (heldout8: a 1024-token cap and a 3072-token budget took 6 steps where the assumed budget
    takes 4; read as no cap, short requests passing long ones were two false ttft-outliers). Then (and when
    the model is too short for the probe, or a probe failed) the cap is not known: None, and the
    order check does not assume that a later request of any size waits (``admission_stops``).

    ``prompt_tokens``: probe with a prompt of this many tokens instead (at least MIN_CAP_TOKENS twice): whether
    prompts of a trace's size are capped, where the calibration's longer probe found no cap (see
    :func:`fuzzer.oracle.order.cap_dependent`).
    """
    model, assumption = cal.model, cal.assumption
    budget = assumption.token_budget
    prompt = min(prompt_tokens or CAP_PROBE_BUDGETS * budget, longest)
    if prompt_tokens is not None and prompt < 2 * MIN_CAP_TOKENS:
        return None  # too short for two chunks of the smallest cap looked for
    if prompt_tokens is None and prompt < (CAP_PROBE_MIN_BUDGETS if reported else 2) * budget:
        return None  # the model is too short for a prompt of several chunks
    uncapped = math.ceil(prompt / max(1, budget - 1))
    step = model.step_s(0, 1, 16)
    margin_s = NOISE_MARGINS * cal.noise_s.get(Metric.TTFT, 0.0)
    runs: list[tuple[float, int, dict[str, float], Trace]] = []
    witnessed: list[float] = []  # the short prompt's TTFT in each run
    slow = True
    for run in range(CAP_REPEATS):
        trace, sent, got = await _beside_a_stream(target, model, assumption, (prompt,), f"calibration-cap-{run}",
                                                  witness=True)
        if got is None:
            return None
        s, (p,), w = got
        arrived = p.sent_s + model.frontend_s(prompt)
        first = p.sent_s + p.ttft_s + step / 2.0
        steps = sum(1 for t in s.token_times_s if arrived < s.sent_s + t <= first)
        if s.sent_s + s.token_times_s[-1] < first:
            return None  # the stream ended first: no count
        # The stream's token of the witness's own step is read with it (a little later under load): not a step after.
        after = sum(1 for t in s.token_times_s if w.sent_s + w.ttft_s + step / 2.0 < s.sent_s + t <= first)
        if uncapped <= steps <= uncapped + NO_CAP_EXTRA_STEPS and after < WITNESS_STEPS:
            return 0  # the steps an uncapped engine takes, the stream decoding in each, and no one passed
        if steps < CAP_EVIDENCE * uncapped or after < max(WITNESS_STEPS, uncapped):
            # Fewer (a starved stream), or more (or a short prompt passed) without a cap's evidence; or the
            # short prompt waited for the long one's prefill: its steps are not a cap's. Steps of the stream
            # may fall between the prompt's send and its arrival (a busy API server hands it over late), so
            # more steps alone are no cap: until stop 43 they needed 3 more too, and heldout9's 1024-token
            # cap under a 4096-token context (a probe of 2 budgets: 4 steps where 2 are uncapped, the
            # short prompt passing) was not known.
            return None
        slow = slow and p.ttft_s >= CANDIDATE_FACTOR * _probe_ttft(trace, sent, model, assumption, 0) + margin_s
        runs.append((p.ttft_s, steps, sent, trace))
        witnessed.append(w.ttft_s)
    cap = _cap_of(runs, slow, prompt, budget, model, assumption, margin_s)
    if cap and min(witnessed) < WITNESS_STEP_SHARE * (model.frontend_s(WITNESS_TOKENS)
                                                      + model.step_s(WITNESS_TOKENS + cap, 1, 16)):
        return None  # the short prompt passed in the frontend, not beside a chunk of the cap
    return cap


def _cap_of(runs: list[tuple[float, int, dict[str, float], Trace]], slow: bool, prompt: int, budget: int,
            model: StepModel, assumption: SchedulerAssumption, margin_s: float) -> int | None:
    """The cap the probe's runs (TTFT, steps counted, send times, trace) show: see chunk_cap."""
    if not slow:
        # No slower than an uncapped engine serves it, yet in more steps: a cap that costs little time still
        # lets several prompts prefill at once, each holding its KV (a clean vLLM-like server capped at 512
        # preempted 2-2.7 times per request more than the uncapped model, and a thrash that is not was
        # judged against the bound that never runs out of KV). Counted steps are at most the prefill's.
        return min(budget - 1, max(MIN_CAP_TOKENS, prompt // min(r[1] for r in runs)))
    ttft, _, sent, trace = min(runs, key=lambda run: run[0])  # the quicker run (tuples of dicts do not compare)
    # Counted steps are at most the prefill's (one may precede its arrival): the cap is at least prompt / fewest.
    lo, hi = max(MIN_CAP_TOKENS, prompt // min(r[1] for r in runs)), min(budget, prompt) - 1
    if (1 + BUDGET_TOLERANCE) * _probe_ttft(trace, sent, model, assumption, lo) < ttft - margin_s:
        # Even the smallest cap the steps allow does not explain it, by more than the envelope's drift: not
        # a cap (without the drift a cap of 64 tokens, the smallest looked for, was measured or not by the noise).
        return None
    while hi - lo > 1:  # the schedule's TTFT falls as the cap grows
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _probe_ttft(trace, sent, model, assumption, mid) >= ttft - margin_s else (lo, mid)
    return lo


def _probe_ttft(trace: Trace, sent: Mapping[str, float], model: StepModel, assumption: SchedulerAssumption,
                cap: int) -> float:
    """The cap probe's long prompt's TTFT in the paper schedule under a cap (0: none)."""
    capped = replace(assumption, long_prefill_threshold=cap, kv_blocks=None)
    return serve(trace.requests, {}, sent, model, capped, False)["cl"].ttft_s
