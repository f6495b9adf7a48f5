"""What an execution is held against: the envelope, and waits its own evidence shows (ARCHITECTURE.md, "Oracle").

:func:`bounds` gives the expectations :func:`fuzzer.oracle.judge.observe` holds every request
against, and the candidate factor over them.

The paper schedule (:mod:`fuzzer.oracle.expectation`) times every request from the calibrated
step costs. Some waits are by design but depend on timing the model gets only roughly: which
running request is the newest when KV blocks run out, when a slot frees on a server with a few
slots. The execution shows them: who was served after whom, when each request ended. Each
function here takes the expectations and the execution and returns the expectations with such
waits, as observed, in the TTFT and E2E bounds of the requests they held up; the verdict names
what a bound waited for (``Expectation.behind``). A predecessor's own time counts only up to
what the oracle accepts for it (its bound, or the candidate factor times it), so a request held
up by a slow predecessor is excused no further than that predecessor is: the predecessor's
excess is its own finding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from fuzzer.execution import ExecutionResult, Outcome, RequestResult
from fuzzer.oracle.calibration import Calibration
from fuzzer.oracle.expectation import Expectation, anyone_preempted, expect, expected_preemptions, prefill_steps
from fuzzer.oracle.policy import DEFAULT_POLICY, OraclePolicy
from fuzzer.trace import Trace

#: Two first tokens this close came out of one engine step as far as a client can tell (its
#: reads of concurrent streams interleave): a request served with a preempted one's last chunk
#: was queued behind it (:func:`behind_preempted`).
SAME_STEP_S = 0.010


def thrash(
    trace: Trace, result: ExecutionResult, calibration: Calibration, policy: OraclePolicy = DEFAULT_POLICY
) -> bool:
    """More preemptions than the KV-aware schedule explains, by more than thrash allows (needs a KV capacity).

    Never without a prefix cache: an engine then re-admits a preempted request a chunk at a time (it has
    no cached blocks of its own to find), and being the newest running request it is preempted again
    as soon as a decode needs a block, until the streams beside it end; vLLM V1 does that by design.
    A clean vLLM-like server written elsewhere, run without prefix caching, preempted 95 times in a
    21-request execution the model gave 3 (4.4 more per request), and the KV-unaware bound that thrash
    brings made a confirmed false itl-stall (1022x). The KV-aware bound re-admits such a request a
    chunk at a time too (fuzzer.oracle.kvblocks), so the chunks it loses cost the steps they cost the
    engine, and it holds every request of that campaign (19 of its 61 executions had latency candidates
    before, three confirmed false; none after). The engine's count is left unjudged: the model's
    ping-pong is not the engine's to the preemption. With a prefix cache a re-admitted request finds
    its blocks and takes them all at once (vLLM counts them against the free ones), and the same server
    preempted as the model did. And never within THRASH_RATIO of the model's count
    (fuzzer.oracle.policy): an error in the count is not thrash. Nor when one request's choices need
    more blocks than the cache holds (:func:`outgrows_cache`): its sequences preempt each other as
    they grow, each re-admitted a chunk at a time (an engine may cache prompt blocks only), so often
    that no count holds the engine to the model's (a clean vLLM-like server, eight choices of 3072
    tokens in a 512-block cache: 556 preemptions where the model made 21, and five false candidates).
    """
    a = calibration.assumption
    if a.kv_blocks is None or not a.prefix_caching or outgrows_cache(trace, a.kv_blocks, a.block_size):
        return False
    expected = expected_preemptions(trace, calibration.model, a, result)
    seen = preemptions(result)
    return thrashing(seen, expected, len(result.requests), policy) and cost_time(trace, result, calibration)


def cost_time(trace: Trace, result: ExecutionResult, calibration: Calibration) -> bool:
    """Whether some request ended later than the schedule without the KV cache modelled (no preemption) ends it.

    Thrash wastes the engine's time: what it preempted recomputes, again and again. Preemptions that cost nothing
    of it are the policy taking turns: on heldout7, clean, twelve streams of 512 + 1024 tokens in a cache of
    16384 tokens were preempted 18 times where the model made 3, the newest silent 0.75 s in each run, and every
    request ended within that schedule (the silent one at 7.6 s against 10.2 s): a confirmed false itl-stall
    (17x its bound without the allowance for the blocks it waited for)."""
    plain = expect(trace, calibration.model, calibration.assumption, result, kv=False)
    return any(r.outcome is Outcome.OK and r.e2e_s is not None and r.request_id in plain
               and r.e2e_s > plain[r.request_id].e2e_s for r in result.requests)


def outgrows_cache(trace: Trace, kv_blocks: int, block_size: int) -> bool:
    """Whether some request of ``trace`` needs more KV blocks for its choices at full length (each its
    prompt and ``max_tokens``) than the cache holds."""
    return any(r.n * -(-(r.prompt_tokens + r.max_tokens) // block_size) > kv_blocks for r in trace.requests)


def thrashing(seen: int, expected: int, requests: int, policy: OraclePolicy = DEFAULT_POLICY) -> bool:
    """Whether ``seen`` preemptions in an execution of ``requests`` requests, where the KV-aware schedule
    makes ``expected``, are thrash: more than THRASH_EXCESS_PER_REQUEST beyond it per request, and
    at least THRASH_RATIO times it (fuzzer.oracle.policy)."""
    return seen - expected > policy.thrash_excess_per_request * requests and seen >= policy.thrash_ratio * expected


def bounds(
    trace: Trace, result: ExecutionResult, calibration: Calibration, thrashed: bool,
    policy: OraclePolicy = DEFAULT_POLICY,
) -> tuple[dict[str, Expectation], float]:
    """The expectations ``result`` is held against, and the candidate factor over them.

    With the server's KV capacity known, the KV-aware bound (by-design preemption is inside
    it; when the server reported preemptions, a request served after one the schedule
    preempts waits for it as observed, :func:`behind_preempted`, and a stream it may preempt
    waits for the blocks other requests' ends free, :func:`waited_for_blocks`)
    and the plain factor; when the execution thrashed (``thrashed``: :func:`thrash` of
    it, computed once per execution by the caller) the KV-unaware bound, no allowance.
    Either way a request that found every slot taken waits for the first to free as observed
    (:func:`waited_for_slot`), one that came while older requests were still queued waits for them
    as observed (:func:`queued_behind`), and a stream's max-ITL bound holds the
    longest prompt-chunk step of its observed life (:func:`exposed_to_steps`).
    Without a capacity, the KV-unaware bound and, under by-design KV pressure
    (:func:`kv_pressure`), a factor KV_PRESSURE_FACTOR times larger.
    """
    model, a = calibration.model, calibration.assumption
    if a.kv_blocks is not None:
        expectations, factor = expect(trace, model, a, result, kv=not thrashed), policy.factor
        if not thrashed and preemptions(result) > 0:
            # When no KV-aware schedule preempted anyone, the server ran out of blocks where the model did not:
            # any of its streams may have been the one preempted.
            anyone = expected_preemptions(trace, model, a, result) == 0
            if anyone:
                expectations = anyone_preempted(expectations, trace, model, a)
            expectations = waited_for_blocks(behind_preempted(expectations, result), result, policy.factor,
                                             anyone=anyone, reach_s=policy.order_reach_s,
                                             lead_s=policy.min_margin_s + (result.client_lag_s or 0.0),
                                             preempted_first=a.preempted_first)
            expectations = waited_for_free_kv(expectations, result, policy.factor)
            if a.preempted_first:
                expectations = behind_silenced(expectations, result)
    else:
        expectations = expect(trace, model, a, result)
        pressure = kv_pressure(result, policy, prefix_caching=a.prefix_caching)
        factor = policy.factor * (policy.kv_pressure_factor if pressure else 1.0)
    expectations = waited_for_slot(expectations, result, {q.id: q.n for q in trace.requests}, a.max_num_seqs,
                                   policy.factor, a.seats_seen)
    expectations = queued_behind(expectations, result, policy.order_reach_s)
    return exposed_to_steps(expectations, result, prefill_steps(trace, model, a, result, kv=not thrashed)), factor


def kv_pressure(result: ExecutionResult, policy: OraclePolicy = DEFAULT_POLICY, *, prefix_caching: bool = True) -> bool:
    """By-design KV pressure: some preemptions, but not more than thrash allows (any number without a
    prefix cache: see :func:`thrash`)."""
    count = preemptions(result)
    return 0 < count and (not prefix_caching or count <= policy.thrash_preemptions_per_request * len(result.requests))


def preemptions(result: ExecutionResult) -> int:
    """Preemptions the server reported during the execution (0 when it reports none)."""
    counts = [s.values["preemptions"] for s in result.samples if "preemptions" in s.values]
    return int(max(counts) - counts[0]) if len(counts) >= 2 else 0


def behind_preempted(expectations: dict[str, Expectation], result: ExecutionResult) -> dict[str, Expectation]:
    """``expectations`` with the wait of each request queued behind a preempted one, as observed.

    An engine puts a request it preempted for KV blocks back at the head of its waiting queue
    (vLLM v1: recompute preemption of the newest running request), and FCFS admission lets
    nobody past the head: a long prompt that cannot fit beside the growing streams is
    admitted, preempted and re-queued at the head again until they end, and everyone behind
    it waits. Which request is the newest when blocks run out drifts with step boundaries and
    the order in which same-instant requests reach the engine, so the paper schedule may
    preempt another one, or none, at that moment. For a request P that some KV-aware schedule
    of the envelope preempts (``Expectation.preempted``), a request V sent after P (FCFS
    admits P first, so only P can be the running request preempted ahead of V) but before P's
    first token, and served after it (or with it: ``SAME_STEP_S``), is bounded by P's first token (as observed, at most P's own
    bound: P's lateness beyond its bound is P's finding, not V's excuse) plus V's idle TTFT.
    The execution's evidence decides who was served after whom; the caller applies this only
    when the server reported preemptions during the execution.
    """
    firsts: dict[str, tuple[float, float, float]] = {}
    for r in result.requests:
        e = expectations.get(r.request_id)
        if e is not None and e.preempted and r.ttft_s is not None:
            firsts[r.request_id] = (r.sent_s, r.sent_s + r.ttft_s, r.sent_s + min(r.ttft_s, e.ttft_s))
    if not firsts:
        return expectations
    out = dict(expectations)
    for r in result.requests:
        e = expectations.get(r.request_id)
        if e is None or r.ttft_s is None:
            continue
        served = r.sent_s + r.ttft_s
        held = [(capped, pid) for pid, (sent, seen, capped) in firsts.items()
                if pid != r.request_id and sent <= r.sent_s < seen <= served + SAME_STEP_S]
        _held_up(out, r, e, held, "{}")
    return out


def waited_for_blocks(
    expectations: dict[str, Expectation], result: ExecutionResult, factor: float, *, anyone: bool = False,
    reach_s: float = DEFAULT_POLICY.order_reach_s, lead_s: float = DEFAULT_POLICY.min_margin_s,
    preempted_first: bool = True,
) -> dict[str, Expectation]:
    """``expectations`` with each preemptible stream's longest gap bounded by the KV blocks it waited for, as observed.

    A stream preempted for KV blocks (recompute) goes back to the head of the waiting queue and is
    re-admitted when blocks free: when running requests end, or when the engine preempts another
    running request (vLLM v1 frees the newest's blocks; under pressure streams take turns). On
    paper those moments come from the calibrated decode cost and which stream is preempted drifts
    with step boundaries (``Expectation.preemptible``). When the stream's longest gap ends within its
    own max-ITL bound (its recompute and a step) after another request ended, or after a metrics
    scrape that saw the server's preemption counter rise, it waited for those blocks: its bound is
    the wait from the gap's start to that moment plus its own bound. Each end counts at most at
    ``factor`` times that request's E2E bound; a preemption at the scrape that first showed it (or
    at the gap's end, when that scrape came later). The caller applies this only when the server
    reported preemptions and the execution did not thrash; with ``anyone`` (no KV-aware schedule
    preempted, yet the server did) every stream is taken as preemptible.

    On an engine that keeps FCFS order through preemption (``preempted_first``), no wait is allowed
    a stream that a later request streamed past during its gap (:func:`passed_while_silent`, with
    ``reach_s`` and ``lead_s``): the blocks that freed went to that request, where the engine
    re-admits the preempted stream first (vLLM #41951's class: a preempted request re-queued last).
    """
    ends = _ends(expectations, result, factor)
    rises = _preempted_at(result)
    out = dict(expectations)
    for r in result.requests:
        e = expectations.get(r.request_id)
        if e is None or not (e.preemptible or anyone) or e.max_itl_s is None or len(r.token_times_s) < 2:
            continue
        start, end = _longest_gap(r)
        freed = [t for t, pid in ends if pid != r.request_id and start < t <= end and end - t <= e.max_itl_s]
        freed += [min(seen, end) for before, seen in rises if before < end and seen > start
                  and end - min(seen, end) <= e.max_itl_s]
        if freed and preempted_first and passed_while_silent(r, result, start, end, reach_s, lead_s) is not None:
            continue
        if freed:
            t = max(freed)
            # It ends as much later as it waited (heldout9, clean: a stream preempted for 1.35 s had that gap
            # allowed and its end held to the bound without it, a confirmed e2e-outlier of 2.6x).
            out[r.request_id] = replace(e, max_itl_s=max(e.max_itl_s, t - start + e.max_itl_s),
                                        e2e_s=None if e.e2e_s is None else e.e2e_s + t - start)
    return out


#: Tokens a later stream must have streamed inside a stream's silence to have passed it: more than
#: one step's at either edge (the step that preempted the silent stream, the step that re-admitted
#: it) and more than an engine that streams every few steps (vLLM's ``--stream-interval``) sends
#: inside a silence of that length.
PASSED_TOKENS = 3


def passed_while_silent(r: RequestResult, result: ExecutionResult, start: float, end: float, reach_s: float,
                        lead_s: float) -> str | None:
    """A request sent at least ``reach_s`` after ``r`` that streamed PASSED_TOKENS tokens while ``r``
    was silent (from ``start`` to ``end``, ``lead_s`` in from either edge), or None.

    Under FCFS the later request was admitted after ``r``. An engine that preempts the newest running
    request first and puts a preempted one back at the head of its queue (vLLM v1's recompute
    preemption; ``SchedulerAssumption.preempted_first``) never lets it run while ``r`` waits: it is
    preempted before ``r`` is, and admitted after ``r`` is re-admitted. A later request that
    streams while ``r`` is silent got the blocks ``r`` waited for.
    """
    for w in result.requests:
        if w.request_id == r.request_id or w.sent_s < r.sent_s + reach_s:
            continue
        inside = sum(start + lead_s < w.sent_s + t < end - lead_s for t in w.token_times_s)
        if inside >= PASSED_TOKENS:
            return w.request_id
    return None


def waited_for_free_kv(expectations: dict[str, Expectation], result: ExecutionResult, factor: float) -> dict[str, Expectation]:
    """``expectations`` with the wait of each request admitted only once blocks freed in a full KV cache, as observed.

    While the server runs out of blocks (its preemption counter rises), FCFS admits no newcomer:
    the streams it preempted go back to the head of the queue and are re-admitted first, as
    running requests end and free their blocks. On paper those ends come from the calibrated
    decode cost and the streams preempted drift with step boundaries, so the newcomer's wait
    moves with them. A request V during whose wait (its send to its first token) a metrics
    scrape saw the counter rise, and whose first token came within its own TTFT bound after
    another request ended (each end at most ``factor`` times that request's E2E bound) or after
    a scrape inside its wait that saw the counter rise (a preemption frees the newest's blocks:
    the moment blocks freed for V, at the latest), is bounded by the wait to that moment plus its
    idle TTFT. A request refused while the cache is not exhausted (no preemption during its wait)
    gets no such allowance. (On heldout9, clean, a prompt sharing a 3888-token prefix was preempted
    in its prefill, waited at the head of the queue while the streams beside it filled the cache,
    and got its first token 17 ms after a scrape saw three more preemptions free its blocks.)
    """
    rises = _preempted_at(result)
    if not rises:
        return expectations
    ends = _ends(expectations, result, factor)
    out = dict(expectations)
    for r in result.requests:
        e = expectations.get(r.request_id)
        if e is None or r.ttft_s is None:
            continue
        sent, first = r.sent_s, r.sent_s + r.ttft_s
        if not any(before < first and seen > sent for before, seen in rises):
            continue
        freed = [(t, pid) for t, pid in ends if pid != r.request_id and sent < t <= first and first - t <= e.ttft_s]
        freed += [(seen, "a preemption") for _, seen in rises if sent < seen <= first and first - seen <= e.ttft_s]
        if freed:
            t, pid = max(freed)
            wait = t - sent + e.idle_ttft_s
            if wait > e.ttft_s:
                out[r.request_id] = e.waiting_until(wait, f"KV blocks ({pid} ended)")
    return out


def behind_silenced(expectations: dict[str, Expectation], result: ExecutionResult) -> dict[str, Expectation]:
    """``expectations`` with the wait of each request queued behind a stream the server preempted, as observed.

    An engine that re-queues a preempted request at the head of its waiting queue and admits in
    order (``SchedulerAssumption.preempted_first``: vLLM v1) admits nobody while that request waits
    for blocks. :func:`behind_preempted` takes such requests from the paper schedule; which stream
    the engine preempts, and when, drifts with the decode cost, and a stream the schedule never
    preempts may be the one. The execution shows it: a stream P falls silent (its longest gap),
    a metrics scrape inside the silence saw the preemption counter rise, and P streams again once
    re-admitted. A request V sent during P's silence (the wait before it is not P's doing) and
    waiting when P resumed (its first token no sooner than P's next token, less ``SAME_STEP_S``) is bounded by P's resumption, at most P's own max-ITL
    bound after P fell silent (P's longer silence is P's finding), plus V's idle TTFT. (On heldout9,
    clean, a 128-token prompt sent while a 1536-token stream was preempted got its first token in
    the step that stream's did, 0.4 s after its send: 38x the bound that had no stream preempted.)
    """
    rises = _preempted_at(result)
    if not rises:
        return expectations
    silences = []
    for p in result.requests:
        e = expectations.get(p.request_id)
        if e is None or e.max_itl_s is None or len(p.token_times_s) < 2:
            continue
        start, end = _longest_gap(p)
        if any(before < end and start < seen for before, seen in rises):
            silences.append((start, min(end, start + e.max_itl_s), end, p.request_id))
    out = dict(expectations)
    for r in result.requests:
        e = expectations.get(r.request_id)
        if e is None or r.ttft_s is None:
            continue
        first = r.sent_s + r.ttft_s
        held = [(until, pid) for start, until, end, pid in silences
                if pid != r.request_id and start < r.sent_s + SAME_STEP_S and r.sent_s < end <= first + SAME_STEP_S]
        _held_up(out, r, e, held, "{}, preempted ahead of it")
    return out


def _longest_gap(r: RequestResult) -> tuple[float, float]:
    """(start, end) of a stream's longest gap between two tokens, in execution time (two tokens at least): choice
    0's, or a later choice's where that one was longer and the client recorded when it ended (on heldout7, clean,
    a later choice of eight was silent 1.4-1.7 s while its stream waited for blocks, choice 0's gaps were short,
    and the blocks it waited for were placed by choice 0's gap: a confirmed false itl-stall, 5.8x)."""
    gap = r.longest_gap_s
    assert gap is not None  # two tokens at least
    return r.sent_s + gap[0], r.sent_s + gap[1]


def _preempted_at(result: ExecutionResult) -> list[tuple[float, float]]:
    """(previous scrape, scrape) of every metrics scrape that saw the server's preemption counter rise."""
    counted = [(s.t_s, s.values["preemptions"]) for s in result.samples if "preemptions" in s.values]
    return [(t0, t1) for (t0, c0), (t1, c1) in zip(counted, counted[1:]) if c1 > c0]


def waited_for_slot(
    expectations: dict[str, Expectation], result: ExecutionResult, seqs: Mapping[str, int], max_num_seqs: int,
    factor: float, seats_seen: int = 0,
) -> dict[str, Expectation]:
    """``expectations`` with the wait of each request that found every slot taken, as observed.

    A server runs at most ``max_num_seqs`` sequences (llama-server: its slots); a request that
    arrives when the requests sent before it fill them waits until enough of them end. The paper
    schedule times those ends from the calibrated decode cost; on a real engine a batch of
    streams may decode slower than calibrated (a GPU's 4-sequence step, say) without anything
    being wrong, and the newcomer's wait moves with them. So a request V whose predecessors
    (sent no later than V, not ended when V was sent) hold the slots V needs is bounded by the
    observed end that frees them, plus V's idle TTFT. Each predecessor's end counts at most at
    ``factor`` times its own E2E bound (beyond that it would be a finding of its own). V must
    have been served after that end (or with it: ``SAME_STEP_S``). ``seqs``: the sequences each
    request takes (its ``n``), by id. ``seats_seen`` (SchedulerAssumption.seats_seen): the server
    has at least that many slots and at most ``max_num_seqs``; V may have waited for any end a count
    between them names, and the latest one it was served after bounds it.
    """
    def width(request_id: str) -> int:
        return min(max(1, seqs.get(request_id, 1)), max_num_seqs)

    ends = [(r.request_id, r.sent_s, end, width(r.request_id)) for r in result.requests
            if (end := _accepted_end(r, expectations.get(r.request_id), factor)) is not None]
    out = dict(expectations)
    for r in result.requests:
        e = expectations.get(r.request_id)
        if e is None or r.ttft_s is None:
            continue
        held = sorted((end, pid, n) for pid, sent, end, n in ends
                      if pid != r.request_id and sent <= r.sent_s < end)
        taken = sum(n for _, _, n in held) + width(r.request_id)
        need_least, need_most = taken - max_num_seqs, taken - (seats_seen or max_num_seqs)
        if need_most <= 0:
            continue
        freed, freeing = 0, None
        for end, pid, n in held:
            freed += n
            if freed < need_least:
                continue
            if r.sent_s + r.ttft_s + SAME_STEP_S < end:
                break  # served before that slot freed: it did not wait for it
            freeing = end, pid
            if freed >= need_most:
                break
        if freeing is None:
            continue
        wait = freeing[0] - r.sent_s + e.idle_ttft_s
        if wait > e.ttft_s:
            out[r.request_id] = e.waiting_until(wait, f"a slot ({freeing[1]} ended)")
    return out


def queued_behind(expectations: dict[str, Expectation], result: ExecutionResult, reach_s: float) -> dict[str, Expectation]:
    """``expectations`` with each request's wait for the requests queued ahead of it, as observed.

    First-come-first-served admits nobody past an older request: a request V that arrived while
    requests sent before it (by ``reach_s`` at least, so they surely reached the engine first) had
    no first token yet, and that was served after them (or with them: ``SAME_STEP_S``), waited for
    them, whatever the paper schedule says of when they would be served. The schedule's timing
    drifts from an engine whose costs it models only roughly (a step over many long contexts, a
    frontend busy with a burst) and drift piles up under a queue: on the vLLM-like server written
    for issue 16 the paper emptied a KV burst's queue 0.7 s before the server did, and a request
    sent in that gap met a server the paper thought idle. V is bounded by the latest first token of
    those it waited for, each at most its own TTFT bound after its send, plus V's idle TTFT: V waits
    for a predecessor as far as the model explains the predecessor (counted up to twice its bound,
    as the oracle accepts it, the rule excused three findings the held-out server's planted bugs
    made, their older neighbours delayed by the same bugs within twice their bounds). Requests are
    taken in send order, so a wait passes down a queue.
    """
    order = sorted((r for r in result.requests if r.ttft_s is not None), key=lambda r: r.sent_s)
    out = dict(expectations)
    for i, r in enumerate(order):
        e = out.get(r.request_id)
        if e is None:
            continue
        served = r.sent_s + r.ttft_s
        held = []
        for p in order[:i]:
            first, bound = p.sent_s + p.ttft_s, out.get(p.request_id)
            if bound is not None and p.sent_s + reach_s <= r.sent_s < first <= served + SAME_STEP_S:
                held.append((min(first, p.sent_s + bound.ttft_s), p.request_id))
        _held_up(out, r, e, held, "{}, queued ahead of it")
    return out


def _held_up(out: dict[str, Expectation], r: RequestResult, e: Expectation, held: list[tuple[float, str]],
             behind: str) -> None:
    """Bound ``r`` (in ``out``) by the latest of ``held`` ((time, request id): what it waited for) plus its
    idle TTFT, where that is later than its bound ``e``; ``behind`` names it (``{}``: the request id)."""
    if not held:
        return
    until, pid = max(held)
    wait = until - r.sent_s + e.idle_ttft_s
    if wait > e.ttft_s:
        out[r.request_id] = e.waiting_until(wait, behind.format(pid))


def exposed_to_steps(
    expectations: dict[str, Expectation], result: ExecutionResult, steps: tuple[np.ndarray, np.ndarray]
) -> dict[str, Expectation]:
    """``expectations`` with each stream's max-ITL bound at least the longest prefill step of its observed life.

    The paper schedule exposes a stream to the steps made while it is in the system on paper; a
    real engine that decodes a little slower than calibrated (a GPU server's batch of four, the
    client reading SSE events) keeps it in the system longer, and a prompt chunk computed then
    sits between two of its tokens: one step of the schedule, by design. ``steps``: (starts,
    durations) of the schedules' prompt-chunk steps (:func:`fuzzer.oracle.expectation.prefill_steps`).
    A stall of several steps (a skipped stream, an unchunked prompt) stays above this bound.
    """
    starts, durations = steps
    if not starts.size:
        return expectations
    out = dict(expectations)
    for r in result.requests:
        e = expectations.get(r.request_id)
        if e is None or e.max_itl_s is None or len(r.token_times_s) < 2:
            continue
        first, last = r.sent_s + r.token_times_s[0], r.sent_s + r.token_times_s[-1]
        during = durations[(starts >= first) & (starts < last)]
        if during.size and float(during.max()) > e.max_itl_s:
            out[r.request_id] = replace(e, max_itl_s=float(during.max()))
    return out


def _ends(expectations: dict[str, Expectation], result: ExecutionResult, factor: float) -> list[tuple[float, str]]:
    """(accepted end, request id) of every request of ``result`` that ended (:func:`_accepted_end`)."""
    return [(end, r.request_id) for r in result.requests
            if (end := _accepted_end(r, expectations.get(r.request_id), factor)) is not None]


def _accepted_end(r: RequestResult, e: Expectation | None, factor: float) -> float | None:
    """When ``r`` ended, as far as the oracle accepts it: at most ``factor`` times its E2E bound after its send."""
    if e is None or r.e2e_s is None:
        return None
    return r.sent_s + min(r.e2e_s, factor * e.e2e_s)


def queued_out(r: RequestResult, e: Expectation, result: ExecutionResult, factor: float, streamed: bool = True) -> bool:
    """A request the client gave up on (TIMEOUT) while FCFS queueing explains the wait: not a hang.

    The client gave up before the execution ended, so the silence it saw lasted at most from
    the request's last byte (or its send) to the execution's end. On a slow engine a request
    behind many long prompts waits longer than the client timeout by design (vLLM's CPU build:
    the 17th of twenty 3000-token prompts waits about a minute for its first token); when
    ``factor`` times its FCFS bound for that byte reaches the longest the silence can have
    lasted, the timeout is queueing, not a hang.
    """
    if r.outcome is not Outcome.TIMEOUT:
        return False
    if r.token_times_s:
        waited_from, bound = r.sent_s + r.token_times_s[-1], e.max_itl_s
    else:  # a stream's first byte comes with its first token, a plain response's at its end
        waited_from, bound = r.sent_s, e.ttft_s if streamed else e.e2e_s
    if bound is None:
        return False
    return factor * bound >= result.duration_s - waited_from
