"""Option-slowdowns: one request's sampling option slows everyone, against the same trace without it.

The FCFS bound judges a request against a model of the engine's costs, with room (the 2x
candidate factor) for what the model does not know. A sampling option of one request (a
``seed``, ``logprobs``) changes no token work: FCFS with the engine's real costs charges it
to that request's own sampler row. When the *other* requests of the trace take 1.5-2x longer
because one of them carries it (vllm-omni#6178: one seeded request kept the whole batch on the
per-row sampling path, ~2x time per token), no request is 2x over its bound, yet the engine
decided something about everyone's batch. The baseline that shows it is the server itself: the
same trace with the option removed from every request, run alternately with the original.

The test (:func:`confirm_option`) runs pairs (ablated, original first; the order alternates, so a
drifting server favours neither; a run with the option closes at CAP_FACTOR x the end of the other
requests in the runs without it, a lower bound past that) and takes, per run, the median ITL (mean token
gap) of the requests without the option, or their median e2e when most of them do not stream
(:func:`statistic_of`). Per pair it has the ratio of the two; on the log ratios a one-sided t interval at the
policy's alpha decides: DIFFERENT when the slowdown is significant, the geometric mean ratio
reaches ``policy.option_factor`` and most pairs do, SAME when the interval lies below that factor, and one pair
far below it stops at once (sequential futility). The factor is over what the option costs its own
rows: one carrier row alone, with and without it, runs twice each once a pair shows a slowdown, and
each of the carriers' rows may add to a step what the option added to that row's
(:func:`own_of`, in seconds over the others' token gap without it): every step the others share with
them is that much longer under FCFS with the engine's real costs (on a held-out server whose sampler charges each logprob to its row, eight rows
of 20 logprobs made the others' e2e 1.95x without any batch-wide cost: a confirmed false finding).
The factor is ``policy.option_factor`` times that ratio where it is above 1. No model is involved: a
campaign tests a trace when enough requests, and most of those without the option, ran beside a carrier for half their
span or more (:func:`suspects`), a few times per option, each test larger than the last (:func:`option_size`: more
requests beside more of the carriers' sampling work; fuzzer.search.confirming). On two held-out servers the tests of traces whose carriers were short
(64 tokens beside 1024-token streams) came back SAME at 1.12x and 1.18x on planted 2x and 1.5x
per-row samplers; that is what the "most of them" asks to avoid.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace

from scipy import stats

from fuzzer.execution import ExecutionResult, Outcome, RequestResult, Target
from fuzzer.oracle.kinds import Decision, FindingKind, Metric
from fuzzer.oracle.policy import DEFAULT_POLICY, OraclePolicy
from fuzzer.oracle.signature import option_signature
from fuzzer.oracle.verdict import Verdict
from fuzzer.trace import Request, Trace

#: The options whose removal changes no token work (request fields of fuzzer.trace.Request).
OPTIONS = ("seed", "logprobs")
#: Fewer requests without the option than this say nothing about "everyone".
MIN_OTHERS = 3
#: A request ran beside a carrier when this share of its span overlaps a carrier's (:func:`beside`).
COVER_SHARE = 0.5
#: Pairs of runs of one carrier row alone, with and without the option, that measure its own cost, each
#: of at most this many tokens (its steps' gaps are what they measure).
OWN_PAIRS = 2
OWN_TOKENS = 64
#: One pair whose ratio is below 1 plus this share of the factor's excess stops the test (sequential
#: futility: 1.125x for a 1.25x factor; the clean servers' pairs were 1.00-1.06x).
FUTILITY_SHARE = 0.5

#: A run with the option closes this many times after the other requests had all ended in a run without
#: it (and at least CAP_MIN_S after), once one such run is known: each of them then ran at least this
#: many times its e2e without the option, a lower bound that decides a slowdown (the factor is 1.25x).
#: The README's main job: the option test's runs with `logprobs` took 8.5 s against 0.3 s without it.
CAP_FACTOR = 4.0
CAP_MIN_S = 1.0

METHOD = ("paired runs of the trace with and without the option, alternating; one-sided t interval "
          "of the log ratios of the other requests' median ITL (or e2e)")
EVIDENCE = "the same trace with the option removed from every request, run alternately with it"


def options_of(trace: Trace) -> tuple[str, ...]:
    """The options of :data:`OPTIONS` some request of ``trace`` sets and some other does not."""
    return tuple(o for o in OPTIONS
                 if any(getattr(r, o) is not None for r in trace.requests)
                 and sum(getattr(r, o) is None for r in trace.requests) >= MIN_OTHERS)


def carriers(trace: Trace, option: str) -> tuple[str, ...]:
    """Ids of the requests of ``trace`` that set ``option``."""
    return tuple(r.id for r in trace.requests if getattr(r, option) is not None)


def without_option(trace: Trace, option: str) -> Trace:
    """``trace`` with ``option`` removed from every request (the test's baseline)."""
    if option not in OPTIONS:
        raise ValueError(f"not an ablatable option: {option!r}")
    return trace.with_requests([replace(r, **{option: None}) for r in trace.requests])


def others_e2e(trace: Trace, result: ExecutionResult, option: str, *, at_least: bool = False) -> float | None:
    """The median e2e of the requests of ``trace`` that do not set ``option`` and completed;
    None with fewer than MIN_OTHERS of them.

    A request the run's time cap closed (Outcome.CUT) ran at least to the cap: with ``at_least``
    its e2e so far counts, and the median is a lower bound (the slow side of a pair: the ratio can
    only come out smaller); without, any such request makes the median unknown (None)."""
    mine = set(carriers(trace, option))
    others = [r for r in result.requests if r.request_id not in mine]
    if not at_least and any(r.outcome is Outcome.CUT for r in others):
        return None
    values = [r.e2e_s for r in others if r.outcome in (Outcome.OK, Outcome.CUT) and r.e2e_s is not None]
    return statistics.median(values) if len(values) >= MIN_OTHERS else None


def streamed(request: Request) -> bool:
    """Whether ``request`` streams tokens whose gaps can be measured."""
    return request.stream and request.max_tokens >= 2


def statistic_of(trace: Trace, option: str) -> str:
    """What a test of ``option`` on ``trace`` compares: the other requests' ITL ("itl", the median of their
    mean token gaps) when at least MIN_OTHERS of them, and most, stream tokens; their e2e ("e2e") otherwise.

    A sampling option costs per step: its rows' sampler work lengthens each step they share. The others'
    token gaps are those steps; their e2e also holds their prefill and queueing, which the cost touches less,
    so it dilutes it (heldout12's batch-wide logprobs cost: the others' token gaps 30x, their e2e 7x, under
    a bar of 12x)."""
    mine = set(carriers(trace, option))
    others = [r for r in trace.requests if r.id not in mine]
    gapped = sum(streamed(r) for r in others)
    return "itl" if gapped >= MIN_OTHERS and 2 * gapped > len(others) else "e2e"


def others_itl(trace: Trace, result: ExecutionResult, option: str, *, at_least: bool = False) -> float | None:
    """The median, over the streamed requests of ``trace`` that do not set ``option``, of their mean token
    gap (first token to last); None with fewer than MIN_OTHERS of them.

    A request the run's time cap closed (Outcome.CUT): with ``at_least`` its gaps so far count, the open
    one up to the cap included (a lower bound of its mean); without, any such request makes it unknown."""
    mine = set(carriers(trace, option))
    gapped = {r.id for r in trace.requests if r.id not in mine and streamed(r)}
    others = [r for r in result.requests if r.request_id in gapped]
    if not at_least and any(r.outcome is Outcome.CUT for r in others):
        return None
    values = []
    for r in others:
        times = r.token_times_s
        if r.outcome is Outcome.CUT and times and r.e2e_s is not None:
            values.append(max(0.0, r.e2e_s - times[0]) / len(times))
        elif r.outcome in (Outcome.OK, Outcome.CANCELLED) and len(times) >= 2:
            values.append((times[-1] - times[0]) / (len(times) - 1))
    return statistics.median(values) if len(values) >= MIN_OTHERS else None


def others_value(statistic: str, trace: Trace, result: ExecutionResult, option: str, *,
                 at_least: bool = False) -> float | None:
    """The others' :func:`others_itl` or :func:`others_e2e`, by ``statistic`` (:func:`statistic_of`)."""
    measure = others_itl if statistic == "itl" else others_e2e
    return measure(trace, result, option, at_least=at_least)


def ended_s(trace: Trace, result: ExecutionResult, option: str) -> float | None:
    """When the last request of ``result`` without ``option`` ended, from its start; None when one did
    not complete."""
    mine = set(carriers(trace, option))
    others = [r for r in result.requests if r.request_id not in mine]
    if not others or any(r.outcome is not Outcome.OK or r.e2e_s is None or r.sent_s is None for r in others):
        return None
    return max(r.sent_s + r.e2e_s for r in others)  # type: ignore[operator]


def later_end(ended: float | None, trace: Trace, result: ExecutionResult, option: str) -> float | None:
    """``ended``, or the run's :func:`ended_s` when later (the cap's reference: the slowest run without it)."""
    end = ended_s(trace, result, option)
    return ended if end is None or (ended is not None and ended >= end) else end


def option_cap_s(ended: float | None, cut_s: float | None) -> float | None:
    """The cap of a run with the option: ``cut_s``, tightened to CAP_FACTOR x ``ended`` (when the other
    requests had all ended in a run without it)."""
    if ended is None:
        return cut_s
    cap = max(CAP_FACTOR * ended, ended + CAP_MIN_S)
    return cap if cut_s is None else min(cut_s, cap)


def capped(trace: Trace, result: ExecutionResult, option: str) -> bool:
    """Whether the run's cap closed a request without ``option`` (its median is then a lower bound)."""
    mine = set(carriers(trace, option))
    return any(r.outcome is Outcome.CUT for r in result.requests if r.request_id not in mine)


def others_end_s(trace: Trace, result: ExecutionResult, option: str) -> float | None:
    """When the last request of ``result`` without ``option`` ended, from its start, if a carrier
    ended later (a run of the test may then close there, see :func:`confirm_option`); None when
    some request without it did not complete, or no carrier outlasted them."""
    last = ended_s(trace, result, option)
    if last is None:
        return None
    ends = {r.request_id: r.sent_s + r.e2e_s for r in result.requests
            if r.outcome is Outcome.OK and r.e2e_s is not None}
    carried = [ends.get(rid) for rid in carriers(trace, option)]
    return last if any(end is None or end > last for end in carried) else None


def beside(trace: Trace, result: ExecutionResult, option: str) -> tuple[int, int]:
    """(requests that ran beside one with ``option``, completed requests without it) in ``result``: a
    request ran beside when at least COVER_SHARE of its sampling (first token to last byte, or to the cap for one
    the run's time cap closed; its whole span without a first token) overlaps a carrier's."""
    mine = set(carriers(trace, option))
    done = [r for r in result.requests
            if r.outcome in (Outcome.OK, Outcome.CUT) and r.sent_s is not None and r.e2e_s is not None]
    # A carrier costs the batch while it samples, and the others pay it while they do: from their first tokens on.
    # The built-in simulator's seeded-sampling-path went unfound in a 30-minute campaign (stop 54) whose three
    # tests of the seed had carriers of 32 tokens that waited and prefilled beside the others, or sampled while
    # 42 others were still waiting for their first tokens: their token gaps moved by nothing.
    def sampling(r: RequestResult) -> tuple[float, float]:
        return r.sent_s + (r.ttft_s or 0.0), r.sent_s + r.e2e_s

    theirs = [sampling(r) for r in done if r.request_id in mine]
    others = [sampling(r) for r in done if r.request_id not in mine]
    near = 0
    for start, end in others:
        shared = sum(max(0.0, min(end, b) - max(start, a)) for a, b in theirs)
        near += shared >= COVER_SHARE * (end - start)
    return near, len(others)


def suspects(trace: Trace, result: ExecutionResult, policy: OraclePolicy = DEFAULT_POLICY) -> dict[str, int]:
    """The options of ``trace`` worth a test after ``result``, with how many requests ran beside a
    carrier: at least ``policy.option_overlap``, and most of those without it (the test's statistic
    is all of their median: a short seeded request among long streams moves it little, and a test
    of it is a try spent). Whether to test is the campaign's call (fuzzer.search.confirming)."""
    out = {}
    for option in options_of(trace):
        near, others = beside(trace, result, option)
        if near >= policy.option_overlap and 2 * near > others:
            out[option] = near
    return out


def option_work(trace: Trace, option: str) -> int:
    """The sampling work of the carriers of ``option`` in ``trace``: the token rows they ask for (output tokens,
    to a cancellation, times choices), each times the logprobs it returns plus one for ``logprobs``."""
    return sum((r.cancel_after_tokens or r.max_tokens) * r.n * ((1 + r.logprobs) if option == "logprobs" else 1)
               for r in trace.requests if getattr(r, option) is not None)


def option_size(trace: Trace, option: str, overlap: int) -> int:
    """How large a test of ``option`` on ``trace`` is: the requests that ran beside a carrier (``overlap``,
    :func:`suspects`) times the carriers' work (:func:`option_work`). A per-row sampler path costs every row
    of each step a carrier samples; a frontend that redoes a carrier's logprobs over its output so far costs
    everyone's delivery more the longer the carrier decodes (a tuning server's frontend bug of that kind: six
    carriers of 512 tokens with 20 logprobs made the others' token gaps 2-3x, where its campaigns' three tests,
    on carriers of fewer tokens, had 1.03x). A test is worth repeating on a larger one
    (fuzzer.search.confirming.option_due)."""
    return overlap * max(1, option_work(trace, option))


def option_bar(policy: OraclePolicy, own: float) -> float:
    """The slowdown an option-slowdown needs: ``policy.option_factor`` over the option's own cost ``own``
    (:func:`own_ratio`; below 1, none)."""
    return policy.option_factor * max(1.0, own)


def decide(ratios: Sequence[float], policy: OraclePolicy = DEFAULT_POLICY, *,
           futility: bool = True, own: float = 1.0) -> tuple[Decision, float | None, float]:
    """(decision, one-sided p of no slowdown, geometric mean ratio) of the pairs' ratios so far; one
    pair far below the factor is SAME only under ``futility``. ``own``: the option's cost to its
    carriers alone (:func:`own_ratio`); the factor is ``policy.option_factor`` over it."""
    if not ratios:
        return Decision.INSUFFICIENT_DATA, None, math.nan
    factor = option_bar(policy, own)
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    effect = math.exp(mean)
    limit = math.log(factor)
    if len(logs) == 1:
        far_below = futility and effect < 1.0 + FUTILITY_SHARE * (factor - 1.0)
        return (Decision.SAME if far_below else Decision.UNKNOWN), None, effect
    sd = statistics.stdev(logs)
    if sd == 0.0:
        p = 0.0 if mean > 0 else 1.0
        low = high = mean
    else:
        se = sd / math.sqrt(len(logs))
        p = float(stats.t.sf(mean / se, len(logs) - 1))
        q = float(stats.t.ppf(1.0 - policy.alpha, len(logs) - 1))
        low, high = mean - q * se, mean + q * se
    # ... and most pairs each at the factor: on vLLM's CPU build a few wild pairs (one run of a pair
    # slowed by the host) gave geometric means of 1.3-1.6x with 1-2 of 5 pairs at 1.25x.
    most = 2 * sum(r >= factor for r in ratios) > len(ratios)
    if len(logs) >= policy.min_runs and low > 0.0 and mean >= limit and most:
        return Decision.DIFFERENT, p, effect
    if len(logs) >= policy.min_runs and high < limit:
        return Decision.SAME, p, effect
    return Decision.UNKNOWN, p, effect


def one_row(trace: Trace, option: str) -> Trace:
    """The first request of ``trace`` that sets ``option``, alone, with one choice of at most OWN_TOKENS
    tokens, streamed, sent at once."""
    first = next(r for r in trace.requests if getattr(r, option) is not None)
    return trace.with_requests([replace(first, n=1, at_ms=0.0, stream=True,
                                        max_tokens=min(first.max_tokens, OWN_TOKENS),
                                        cancel_after_tokens=None, disconnect_after_ms=None)])


def _step_s(result: ExecutionResult) -> float | None:
    """The mean gap between the tokens of the one request of ``result`` (its e2e with fewer than two), None
    when it did not complete."""
    r = next((r for r in result.requests if r.outcome is Outcome.OK and r.e2e_s), None)
    if r is None:
        return None
    times = r.token_times_s
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) >= 2 and times[-1] > times[0] else r.e2e_s


async def own_steps(target: Target, trace: Trace, option: str) -> list[tuple[float, float]]:
    """One carrier row's mean token gap (:func:`_step_s`) with ``option`` and without it, alone
    (:func:`one_row`), in OWN_PAIRS pairs of runs; a pair that did not complete is left out."""
    probe = one_row(trace, option)
    steps = []
    for _ in range(OWN_PAIRS):
        with_s, without_s = [_step_s(await target.execute(t)) for t in (probe, without_option(probe, option))]
        if with_s is not None and without_s:
            steps.append((with_s, without_s))
    return steps


def own_of(steps: Sequence[tuple[float, float]], rows: int, base_s: float | None = None) -> float:
    """The slowdown the carriers' ``rows`` explain in a step that one row alone took ``steps`` (with and
    without the option, :func:`own_steps`) for: each row adds to a step what the option added to that
    row's, the larger of the pairs' (a noisy pair understates it as often as not); 1.0 without a pair.

    Over ``base_s`` (the others' mean token gap without the option, when the test compares token gaps):
    1 + rows x the added seconds / base_s, what FCFS with the engine's real costs gives a step of theirs.
    Without: 1 + rows x (the row's ratio - 1), a bound from above for a batch whose steps are no shorter
    than one row's alone."""
    if not steps:
        return 1.0
    if base_s:
        return 1.0 + rows * max(0.0, max(a - b for a, b in steps)) / base_s
    return 1.0 + rows * max(0.0, max(a / b for a, b in steps) - 1.0)


def rows_of(trace: Trace, option: str) -> int:
    """The carriers' rows of ``option``: their choices, in all."""
    return sum(r.n for r in trace.requests if getattr(r, option) is not None)


async def own_ratio(target: Target, trace: Trace, option: str) -> float:
    """The slowdown the carriers' own rows of ``option`` explain in a step (:func:`own_of` over one row's
    ratio, :func:`own_steps`).

    One row, not the carriers as they are: a cost that grows with the rows beside it (the
    batch-wide bug the test looks for) would show among a carrier's own choices too. Its gaps, not its
    e2e, whose prefill and frontend pay none of a sampler's cost: on heldout7's clean configuration one
    row's e2e was 1.08-1.09x with 20 logprobs, and left the others' 1.91x against a bar of 2.05x."""
    return own_of(await own_steps(target, trace, option), rows_of(trace, option))


async def run_pair(target: Target, trace: Trace, option: str, *, trace_first: bool = True,
                   ablated: Trace | None = None, record: Callable[[Trace, ExecutionResult], None] | None = None,
                   cut_s: float | None = None, ended: float | None = None, statistic: str | None = None,
                   ) -> tuple[float | None, float | None, list[tuple[Trace, ExecutionResult]]]:
    """One pair: ``trace`` and its ablation of ``option`` (``ablated``, made when not given), in that order or
    the other, each capped at ``cut_s`` when given; ``record`` hears of each run as it ends. ``ended``: when
    the other requests had all ended in an earlier run without the option; that, or this pair's own run
    without it when it comes first, caps the run with it (:func:`option_cap_s`). Returns the other requests'
    ``statistic`` (:func:`statistic_of` by default) with (at least, when cut) and without the option (None:
    too few completed, or cut before they ended) and the runs, in the order they ran."""
    ablated = without_option(trace, option) if ablated is None else ablated
    statistic = statistic_of(trace, option) if statistic is None else statistic
    runs = []
    for t in (trace, ablated) if trace_first else (ablated, trace):
        runs.append((t, await target.execute(t, cut_s=option_cap_s(ended, cut_s) if t is trace else cut_s)))
        if record is not None:
            record(*runs[-1])
        if t is ablated and not trace_first:  # the run with it comes next
            ended = later_end(ended, trace, runs[-1][1], option)
    return (*pair_values(statistic, trace, option, runs), runs)


def pair_values(statistic: str, trace: Trace, option: str,
                runs: Sequence[tuple[Trace, ExecutionResult]]) -> tuple[float | None, float | None]:
    """The others' ``statistic`` in a pair's runs of ``trace`` (with the option, at least when cut) and of
    its ablation (:func:`others_value`)."""
    # The carriers' ids are the original's in both runs.
    values = {t is trace: others_value(statistic, trace, result, option, at_least=t is trace) for t, result in runs}
    return values[True], values[False]


async def confirm_option(
    target: Target,
    trace: Trace,
    option: str,
    *,
    policy: OraclePolicy = DEFAULT_POLICY,
    futility: bool = True,
    cut_s: float | None = None,
) -> Verdict:
    """Run ``trace`` and its ablation of ``option`` in alternating pairs until decided (see the module doc).

    ``cut_s``: each run's time cap, for a test whose carriers outlast the other requests (the statistic
    is theirs). A run with the option that the cap closed before all of them ended counts what they ran
    so far (a lower bound of its slowdown); one without it is then no pair, and the test runs whole."""
    ablated = without_option(trace, option)
    statistic = statistic_of(trace, option)
    steps: list[tuple[float, float]] | None = None  # measured once a pair shows a slowdown (SAME under 1.0 is SAME over any)
    own = 1.0
    pairs: list[tuple[float, float]] = []
    decision, p, effect = Decision.INSUFFICIENT_DATA, None, math.nan
    ended: float | None = None
    bounds = 0  # pairs whose run with the option a cap closed before the others ended
    for done in range(0, policy.max_runs, 2):
        with_s, without_s, runs = await run_pair(target, trace, option, trace_first=done % 4 == 2,
                                                 ablated=ablated, cut_s=cut_s, ended=ended, statistic=statistic)
        for t, result in runs:
            if t is ablated:
                ended = later_end(ended, trace, result, option)
        if statistic == "itl" and with_s is None and without_s is not None:
            # The cap closed the run with it before enough of the others had two tokens (vllm#37343: 76-423x
            # their TTFT): their e2e so far is the lower bound there is, for this test's pairs from here on.
            statistic, pairs, bounds = "e2e", [], 0
            with_s, without_s = pair_values(statistic, trace, option, runs)
        if without_s is None:
            cut_s = None
        if with_s is not None and without_s is not None and without_s > 0:
            pairs.append((with_s, without_s))
            bounds += any(t is trace and capped(trace, result, option) for t, result in runs)
        ratios = [a / b for a, b in pairs]
        decision, p, effect = decide(ratios, policy, futility=futility, own=own)
        if steps is None and ratios and decision is not Decision.SAME:
            steps = await own_steps(target, trace, option)
        if steps is not None and pairs:
            base = statistics.median(b for _, b in pairs) if statistic == "itl" else None
            own = own_of(steps, rows_of(trace, option), base)
            decision, p, effect = decide(ratios, policy, futility=futility, own=own)
        if decision in (Decision.DIFFERENT, Decision.SAME):
            break
    if len(pairs) < 2 and decision is not Decision.SAME:
        decision = Decision.INSUFFICIENT_DATA
    return _verdict(trace, option, pairs, decision, p, effect, policy, bounds, own, statistic)


def _verdict(trace: Trace, option: str, pairs: list[tuple[float, float]], decision: Decision, p: float | None,
             effect: float, policy: OraclePolicy, bounds: int = 0, own: float = 1.0,
             statistic: str = "e2e") -> Verdict:
    mine = carriers(trace, option)
    others = len(trace.requests) - len(mine)
    with_s = statistics.median(a for a, _ in pairs) if pairs else None
    without_s = statistics.median(b for _, b in pairs) if pairs else None
    factor = option_bar(policy, own)
    reproduced = sum(a >= factor * b for a, b in pairs)
    if with_s is not None and without_s is not None:
        what = "median ITL (mean token gap)" if statistic == "itl" else "median e2e"
        detail = (f"with {option} on {', '.join(mine)}, the other {others} requests' {what} was "
                  f"{effect:.2f}x that of the same trace without it ({with_s * 1000:.0f} ms vs "
                  f"{without_s * 1000:.0f} ms; {len(pairs)} alternating pair(s), {reproduced} at least "
                  f"{factor:.3g}x); the option changes no token work, and the carriers' own rows explain "
                  f"{own:.2f}x of a step (one row alone, with and without it)")
        if bounds:
            detail += (f"; in {bounds} pair(s) the run with it was closed before the others ended (a lower "
                       f"bound: the slowdown is at least this)")
    else:
        detail = f"no pair of runs had {MIN_OTHERS} or more completed requests without {option}"
    return Verdict(
        kind=FindingKind.OPTION_SLOWDOWN if decision is not Decision.SAME else None,
        decision=decision, method=METHOD, request_id=mine[0] if mine else None, metric=Metric.E2E,
        p_value=p, effect=None if math.isnan(effect) else effect, threshold=factor,
        n_sample=len(pairs), n_baseline=len(pairs), reproduced=reproduced, runs=len(pairs),
        observed_s=with_s, expected_s=without_s, idle_s=without_s,
        assumption=f"{option} changes no token work: the baseline is the server without it",
        signature=option_signature(option), detail=detail, evidence=EVIDENCE, ablated=option,
        compared=statistic,
    )
