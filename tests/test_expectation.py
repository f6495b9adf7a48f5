"""The paper FCFS chunked-prefill scheduler: idle expectations and FCFS bounds."""

from __future__ import annotations

import dataclasses

import expectation_reference as reference
import pytest
from conftest import CORPUS
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from strategies import traces

from fuzzer import trace as tf
from fuzzer.errors import ConfigError
from fuzzer.execute.adapters import ADAPTERS
from fuzzer.execution import ExecutionResult, Outcome, RequestResult
from fuzzer.oracle.expectation import expect, idle_expectation, paper_schedule
from fuzzer.oracle.paper import serve as paper_serve
from fuzzer.oracle.kinds import Metric
from fuzzer.oracle.model import (
    ENVELOPE_SCALES,
    SchedulerAssumption,
    StepModel,
    assumption_for,
)
from fuzzer.trace import Request, Trace

MODEL = StepModel(overhead_s=0.004, prefill_token_s=30e-6, decode_seq_s=50e-6, context_token_s=1e-8,
                  request_overhead_s=0.002)
FCFS = SchedulerAssumption()


def _req(rid, at_ms, prompt, out=8, **kw):
    return Request(id=rid, at_ms=at_ms, prompt_tokens=prompt, max_tokens=out, **kw)


def test_a_request_alone_takes_one_prefill_step_then_decode_steps():
    trace = Trace(requests=(_req("a", 0, 1000, out=4),))
    p = paper_schedule(trace, MODEL, FCFS)["a"]
    prefill = 0.004 + 1000 * 30e-6
    assert p.ttft_s == pytest.approx(prefill + 0.002)
    # Three decode steps, each with one sequence and its growing context.
    steps = [0.004 + 50e-6 + 1e-8 * (1000 + k) for k in (1, 2, 3)]
    assert p.e2e_s == pytest.approx(prefill + sum(steps) + 0.002)
    assert p.max_itl_s == pytest.approx(max(steps))
    assert p.max_step_s == pytest.approx(prefill)  # its own prefill step was the longest
    e = expect(trace, MODEL, FCFS)["a"]
    assert e.idle_ttft_s == pytest.approx(p.ttft_s)
    assert e.idle_e2e_s == pytest.approx(p.e2e_s)


def test_scaling_a_model_scales_its_costs_and_keeps_the_rest():
    model = StepModel(0.004, 30e-6, 50e-6, 1e-8, request_overhead_s=0.002, frontend_token_s=1e-6)
    scaled = model.scaled(2.0)
    assert (scaled.overhead_s, scaled.prefill_token_s, scaled.decode_seq_s, scaled.context_token_s,
            scaled.frontend_token_s) == pytest.approx((0.008, 60e-6, 100e-6, 2e-8, 2e-6))
    assert scaled.request_overhead_s == 0.002 and scaled.frontend_slack_s == 0.0
    # The slack is an allowance, not a cost: scaling keeps it (it used to drop it; no calibrated model has one).
    assert model.with_frontend_slack().scaled(2.0).frontend_slack_s == model.with_frontend_slack().frontend_slack_s


def test_the_fcfs_bound_is_an_envelope_over_scaled_models():
    trace = Trace(requests=(_req("a", 0, 1000, out=4), _req("b", 3, 64, out=4)))
    paper = paper_schedule(trace, MODEL, FCFS)
    for rid, e in expect(trace, MODEL, FCFS).items():
        p = paper[rid]
        variants = [paper_schedule(trace, MODEL.scaled(k), FCFS)[rid] for k in ENVELOPE_SCALES]
        variants += [p, paper_schedule(trace, MODEL, FCFS, lookahead=True)[rid]]
        variants += [paper_schedule(trace, MODEL, FCFS, lookahead=True, window=0.0)[rid]]
        assert e.ttft_s == pytest.approx(max(v.ttft_s for v in variants)) and e.ttft_s >= p.ttft_s
        assert e.e2e_s == pytest.approx(max(v.e2e_s for v in variants)) and e.e2e_s >= p.e2e_s
        assert e.max_itl_s >= p.max_step_s >= p.max_itl_s


def test_a_request_that_just_missed_a_long_step_is_bounded_by_the_step_after_it():
    # a keeps the engine busy with short decode steps; b (600 tokens) starts a long step;
    # c arrives 2 ms after b. Whether c gets into b's step depends on where a real engine's
    # boundary fell: if just after b, c waits out b's step and then shares one with d's
    # 2048-token chunk. The bound covers that case (the sim met it on a random trace).
    trace = Trace(requests=(_req("a", 0, 16, out=400), _req("b", 50, 600, out=4), _req("c", 52, 16, out=4),
                            _req("d", 62, 4000, out=4)))
    def first_token_s(rid, **kw):  # from the start of the trace
        p = paper_schedule(trace, MODEL, FCFS, **kw)[rid]
        return p.arrival_s + p.ttft_s

    for kw in ({}, {"lookahead": True}):  # c shares b's step ...
        assert first_token_s("c", **kw) == pytest.approx(first_token_s("b", **kw))
    tight = paper_schedule(trace, MODEL, FCFS, lookahead=True, window=0.0)["c"].ttft_s
    assert tight > 2 * paper_schedule(trace, MODEL, FCFS)["c"].ttft_s  # ... or waits it out and shares d's chunk
    assert expect(trace, MODEL, FCFS)["c"].ttft_s >= tight


def test_lookahead_lets_a_later_arrival_share_the_victims_step():
    # b arrives while c decodes; a 2048-token request d arrives x ms after b. Whether d's
    # chunk shares b's prefill step depends on where the step boundary falls; with
    # lookahead it falls as late as one step allows, and the bound covers that case.
    shared = []
    for x in [i / 4 for i in range(1, 33)]:
        trace = Trace(requests=(_req("c", 0, 16, out=64), _req("b", 100, 64, out=2), _req("d", 100 + x, 2048, out=2)))
        plain = paper_schedule(trace, MODEL, FCFS)["b"].ttft_s
        ahead = paper_schedule(trace, MODEL, FCFS, lookahead=True)["b"].ttft_s
        bound = expect(trace, MODEL, FCFS)["b"].ttft_s
        assert bound >= max(plain, ahead) - 1e-12
        if plain < 0.015 and ahead > 0.05:
            shared.append(x)
    assert shared, "no arrival offset where only the late boundary co-schedules d with b"


def test_a_chunk_of_another_request_bounds_the_inter_token_gap():
    # b decodes while a's 2048-token prefill takes a whole step: that step is b's max ITL.
    trace = Trace(requests=(_req("b", 0, 16, out=64), _req("a", 50, 2048, out=2)))
    e = expect(trace, MODEL, FCFS)["b"]
    assert e.max_itl_s >= 0.004 + 2048 * 30e-6
    assert e.idle_max_itl_s < 0.005


def test_a_short_request_behind_long_prefills_waits_fcfs():
    longs = [_req(f"l{i}", 0, 2048, out=4) for i in range(3)]
    trace = Trace(requests=(*longs, _req("s", 1, 128, out=4)))
    e = expect(trace, MODEL, FCFS)["s"]
    # Alone it would be quick; behind three full-budget prefills it waits three steps.
    assert e.idle_ttft_s == pytest.approx(0.004 + 128 * 30e-6 + 0.002)
    assert e.ttft_s > 3 * (0.004 + 2048 * 30e-6)
    assert e.ttft_s / e.idle_ttft_s > 10


def test_the_prefix_cache_helps_a_later_request_of_the_group_only_once_computed():
    prefixes = {"p": 1000}
    first = _req("a", 0, 1100, prefix="p", out=2)
    concurrent = _req("b", 0, 1100, prefix="p", out=2)
    later = _req("c", 500, 1100, prefix="p", out=2)
    paper = paper_schedule(Trace(requests=(first, concurrent, later), prefixes=prefixes), MODEL, FCFS)
    assert paper["a"].cached_tokens == 0
    assert paper["b"].cached_tokens == 0  # admitted in the same step: blocks not computed yet
    assert paper["c"].cached_tokens == 992  # 62 full blocks of 16
    off = paper_schedule(Trace(requests=(first, later), prefixes=prefixes), MODEL,
                         SchedulerAssumption(prefix_caching=False))
    assert off["c"].cached_tokens == 0


def test_a_chat_request_shares_a_prefix_only_with_chat_requests():
    # heldout10, clean, stop 46: a chat member of a completions group (its template's tokens come first,
    # so its blocks match none of theirs) was held to the group's cache hit: a confirmed 9x ttft-outlier.
    prefixes = {"p": 1000}
    owner = _req("a", 0, 1100, prefix="p", out=2)
    chat = dataclasses.replace(_req("c", 500, 1100, prefix="p", out=2), api="chat")
    paper = paper_schedule(Trace(requests=(owner, chat), prefixes=prefixes), MODEL, FCFS)
    assert paper["c"].cached_tokens == 0
    chats = paper_schedule(Trace(requests=(dataclasses.replace(owner, api="chat"), chat), prefixes=prefixes), MODEL, FCFS)
    assert chats["c"].cached_tokens == 992


def test_a_server_over_http_may_compute_a_prompt_whole_and_hold_the_queue_until_it_fits():
    # heldout12 (chunked prefill off, an 8192-token budget): an 8160-token prompt arriving while 40
    # streams decode does not fit what a step has left (8152) and waits, and the request behind it too,
    # until a stream ends; a chunked schedule starts it at once. A false ttft-outlier on its clean server.
    streams = tuple(_req(f"s{i}", 0, 16, out=60 + i) for i in range(40))
    trace = Trace(requests=(*streams, _req("big", 100, 8160, out=4), _req("after", 110, 64, out=4)))
    http = SchedulerAssumption(token_budget=8192, frontend_fifo=True, admission_stops=False)  # cap not known
    chunked = expect(trace, MODEL, SchedulerAssumption(token_budget=8192))
    either = expect(trace, MODEL, http)
    first_end = min(paper_schedule(trace, MODEL, http)[s.id].e2e_s for s in streams)
    assert chunked["big"].ttft_s + 0.1 < first_end < either["big"].ttft_s + 0.1
    assert either["after"].ttft_s > chunked["after"].ttft_s + 0.1
    # Controls: a measured cap, or none known, means a chunking engine; prompts that fit one step
    # together never wait.
    capped = dataclasses.replace(http, long_prefill_threshold=4096)
    assert expect(trace, MODEL, capped)["big"].ttft_s < either["big"].ttft_s
    assert expect(trace, MODEL, dataclasses.replace(http, admission_stops=True))["big"].ttft_s < either["big"].ttft_s
    from fuzzer.oracle.paper import serve

    small = Trace(requests=(_req("a", 0, 100), _req("b", 1, 100)))
    assert serve(small.requests, {}, {}, MODEL, http, True, window=0.0, whole=True) == serve(
        small.requests, {}, {}, MODEL, http, True, window=0.0)
    assert serve(trace.requests, {}, {}, MODEL, http, True, window=0.0, whole=True) != serve(
        trace.requests, {}, {}, MODEL, http, True, window=0.0)


def test_a_cache_hit_never_covers_the_whole_prompt():
    prefixes = {"p": 64}
    trace = Trace(requests=(_req("a", 0, 64, prefix="p", out=1), _req("b", 500, 64, prefix="p", out=1)),
                  prefixes=prefixes)
    assert paper_schedule(trace, MODEL, FCFS)["b"].cached_tokens == 48


def test_a_streamed_choice_admitted_after_choice_0_is_a_gap_its_max_itl_bound_holds():
    # heldout7, clean (stop 50): an engine that admits each choice as a request of its own gave an n=2
    # stream's choice 1 its first token 0.5 s after choice 0's, when a seat freed; the stream's max ITL
    # counts that silence (RequestResult.max_itl_s), and the bound, 0.05 s, did not: two confirmed false
    # itl-stalls. The fan-out schedule's last choice's first token is a gap of the stream.
    trace = Trace(requests=(
        _req("long", 0, 64, out=120),
        Request(id="pair", at_ms=1, prompt_tokens=64, max_tokens=40, n=2),
    ))
    seats = SchedulerAssumption(max_num_seqs=2)
    bounds = expect(trace, MODEL, seats)
    fanned = reference._fanout(trace, MODEL, seats, None)["pair"].choice_wait_s
    assert fanned > 30 * MODEL.overhead_s  # choice 1 waits for a seat: choice 0 of its own ends first
    assert bounds["pair"].max_itl_s >= fanned
    quiet = Trace(requests=(trace.requests[0], dataclasses.replace(trace.requests[1], stream=False)))
    assert expect(quiet, MODEL, seats)["pair"].max_itl_s < fanned  # no stream: no gap seen


def test_choices_forked_after_choice_0s_first_token_queue_behind_requests_that_came_before_it():
    # heldout6, clean (stop 66): an engine that forks n after choice 0's first token queued a
    # 4-choice stream's later choices behind a 2048-token prompt sent 0.5 s after the request but before
    # choice 0's first token: 0.45 s gaps in its stream, 3x the bound that queued every choice at
    # arrival. Two confirmed false itl-stalls on a clean server.
    trace = Trace(requests=(
        _req("long", 0, 64, out=120),
        Request(id="pair", at_ms=1, prompt_tokens=64, max_tokens=40, n=2),
        _req("late", 100, 64, out=120),  # after the pair arrived, before choice 0 gets a seat
    ))
    one = SchedulerAssumption(max_num_seqs=1)
    at_arrival = reference._fanout(trace, MODEL, one, None)["pair"].choice_wait_s
    forked = reference._fanout(trace, MODEL, one, None, forks=True)["pair"].choice_wait_s
    assert forked > at_arrival + 100 * MODEL.overhead_s  # choice 1 also waits out all of `late`
    assert expect(trace, MODEL, one)["pair"].max_itl_s >= forked


def test_an_engine_that_computes_an_n_prompt_first_queues_every_choice_behind_requests_that_came_meanwhile():
    # SGLang (TokenizerManager._handle_batch_request): an n > 1 request's prompt is sent first with
    # max_new_tokens=0 and awaited, then its n copies are sent: choice 0 queues twice.
    trace = Trace(requests=(
        Request(id="pair", at_ms=0, prompt_tokens=64, max_tokens=40, n=2),
        _req("late", 1, 64, out=120),  # arrives while the pair's prompt is computed
    ))
    one = SchedulerAssumption(max_num_seqs=1)
    primed = paper_serve(trace.requests, {}, {}, MODEL, one, True, window=0.0, fanout=True, primes=True)
    assert primed["pair"].ttft_s > primed["late"].e2e_s  # the seat went to `late` before any choice
    assert primed["pair"].cached_tokens == 0 and len(primed["pair"].token_times_s) == 40  # one choice's stream
    sglang = dataclasses.replace(one, primes_choices=True)
    assert expect(trace, MODEL, sglang)["pair"].ttft_s >= primed["pair"].ttft_s
    assert expect(trace, MODEL, one)["pair"].ttft_s < primed["pair"].ttft_s / 2  # vLLM: choice 0 at arrival
    alone = idle_expectation(64, 40, MODEL, sglang, n=2)
    assert alone.idle_ttft_s >= idle_expectation(64, 40, MODEL, one, n=2).idle_ttft_s + MODEL.overhead_s  # two steps


def test_max_num_seqs_holds_later_requests_until_a_slot_frees():
    trace = Trace(requests=(_req("a", 0, 100, out=10), _req("b", 0, 100, out=10)))
    one = paper_schedule(trace, MODEL, SchedulerAssumption(max_num_seqs=1))
    assert one["b"].ttft_s > one["a"].e2e_s
    two = paper_schedule(trace, MODEL, FCFS)
    assert two["b"].ttft_s == pytest.approx(two["a"].ttft_s)


def test_arrivals_come_from_the_actual_send_times():
    trace = Trace(requests=(_req("a", 0, 2048, out=2), _req("b", 0, 16, out=2)))

    def sent(b_sent_s):
        return ExecutionResult(
            trace_hash=trace.content_hash(), target="t", started_at=0.0, duration_s=1.0,
            requests=(RequestResult("a", "a-1", 0.0, 0.0, Outcome.OK),
                      RequestResult("b", "b-1", 0.0, b_sent_s, Outcome.OK)),
        )

    queued = paper_schedule(trace, MODEL, FCFS, sent(0.0))["b"].ttft_s
    late = paper_schedule(trace, MODEL, FCFS, sent(1.0))["b"].ttft_s  # sent after a finished: no queueing
    assert queued > 0.06 and late == pytest.approx(expect(trace, MODEL, FCFS)["b"].idle_ttft_s)


def test_a_short_request_sent_just_after_a_long_one_may_wait_out_its_prefill_step():
    """Over HTTP the engine met L0 (1024 tokens) alone and started its prefill step; S1, sent
    0.2 ms later, waited out that step (38 ms). The bound must allow it even though the
    frontend model tokenizes S1 first (a clean simulator was flagged 6x before)."""
    trace = Trace(requests=(_req("L0", 0, 1024, out=4), _req("S1", 0, 1, out=4), _req("L4", 0, 1024, out=4)))
    model = StepModel(overhead_s=0.0035, prefill_token_s=30e-6, decode_seq_s=20e-6, context_token_s=1e-8,
                      frontend_token_s=2e-6)
    result = ExecutionResult(
        trace_hash=trace.content_hash(), target="t", started_at=0.0, duration_s=1.0,
        requests=tuple(RequestResult(i, f"{i}-1", 0.0, s, Outcome.OK)
                       for i, s in (("L0", 0.0), ("S1", 0.0002), ("L4", 0.0003))),
    )
    l0_step = model.step_s(1024, 0, 0)
    assert expect(trace, model, FCFS, result)["S1"].ttft_s > l0_step + model.step_s(1, 0, 0)
    # ... but a prompt whose tokenization takes far longer than the gap still comes second
    # (else a serial tokenizer queue, vLLM 25301, would hide inside the bound).
    slow = Trace(requests=(_req("L", 0, 16384, out=1), _req("S", 1, 32, out=4)))
    assert expect(slow, model, FCFS)["S"].ttft_s < model.step_s(2048, 0, 0)


def test_cancelled_requests_stop_at_their_cancel_point():
    base = _req("a", 0, 100, out=100)
    cancelled = _req("a", 0, 100, out=100, cancel_after_tokens=10)
    full = expect(Trace(requests=(base,)), MODEL, FCFS)["a"].e2e_s
    short = expect(Trace(requests=(cancelled,)), MODEL, FCFS)["a"].e2e_s
    assert short < full / 5


def test_idle_expectation_accessors():
    e = idle_expectation(512, 4, MODEL, FCFS, cached_tokens=256)
    assert e.ttft_s == pytest.approx(0.004 + 256 * 30e-6 + 0.002)
    assert e.bound(Metric.TTFT) == e.idle(Metric.TTFT) == e.ttft_s
    assert e.bound(Metric.E2E) == e.e2e_s and e.bound(Metric.MAX_ITL) == e.max_itl_s
    assert idle_expectation(10, 1, MODEL, FCFS).max_itl_s is None


@settings(max_examples=60, deadline=None)
@given(traces(max_requests=8, max_prompt_tokens=4096, max_output_tokens=64))
def test_load_never_beats_idle(trace):
    for e in expect(trace, MODEL, FCFS).values():
        assert e.ttft_s >= e.idle_ttft_s - 1e-9
        assert e.e2e_s >= e.idle_e2e_s - 1e-9
        assert e.e2e_s >= e.ttft_s - 1e-9


def test_assumption_from_adapter_defaults_and_overrides():
    vllm = assumption_for("vllm", ADAPTERS["vllm"].scheduler_defaults)
    assert (vllm.token_budget, vllm.max_num_seqs, vllm.block_size) == (2048, 256, 16)
    assert "max_num_batched_tokens=2048" in vllm.describe() and "vllm default" in vllm.describe()
    sglang = assumption_for("sglang", ADAPTERS["sglang"].scheduler_defaults)
    assert sglang.token_budget == 8192 and sglang.block_size == 1
    generic = assumption_for("openai", ADAPTERS["openai"].scheduler_defaults, token_budget=4096)
    assert generic.token_budget == 4096 and "user override of token_budget" in generic.describe()
    assert SchedulerAssumption.from_dict(vllm.to_dict()) == vllm


def test_bad_assumption_is_a_config_error():
    with pytest.raises(ConfigError, match="token_budget must be a positive integer"):
        SchedulerAssumption(token_budget=0)


def test_step_model_round_trips():
    assert StepModel.from_dict(MODEL.to_dict()) == MODEL


# --- the fast scheduler gives exactly what the step-by-step reference gives ----------------

_models = st.builds(
    StepModel,
    overhead_s=st.sampled_from([0.0, 0.001, 0.004, 0.02]),
    prefill_token_s=st.sampled_from([0.0, 5e-6, 30e-6, 2e-4]),
    decode_seq_s=st.sampled_from([0.0, 50e-6, 1e-3]),
    context_token_s=st.sampled_from([0.0, 1e-8, 3e-7]),
    request_overhead_s=st.sampled_from([0.0, 0.002]),
    frontend_token_s=st.sampled_from([0.0, 1e-6, 2e-5]),
)
_assumptions = st.builds(
    SchedulerAssumption,
    token_budget=st.sampled_from([16, 256, 512, 2048, 8192]),
    max_num_seqs=st.sampled_from([1, 2, 4, 8, 256]),
    block_size=st.sampled_from([1, 16, 32]),
    prefix_caching=st.booleans(),
)


@st.composite
def _sent_times(draw, trace):
    """None, or an execution whose requests left late by random amounts (some not at all)."""
    if draw(st.booleans()):
        return None
    late = st.sampled_from([0.0, 0.0, 1e-4, 0.003, 0.05, 0.5])
    requests = tuple(
        RequestResult(r.id, f"{r.id}-1", r.at_ms / 1000, r.at_ms / 1000 + draw(late), Outcome.OK)
        for r in trace.requests
    )
    return ExecutionResult(trace_hash="", target="t", started_at=0.0, duration_s=1.0, requests=requests)


def _admissible(trace, assumption):
    # A request with more sequences than max_num_seqs is never admitted: both schedulers spin
    # to MAX_MODEL_STEPS and raise (a test of its own below; a million reference steps are slow).
    return all(r.n <= assumption.max_num_seqs for r in trace.requests)


def _assert_same(fast, slow):
    assert fast.keys() == slow.keys()
    for rid in slow:
        assert fast[rid] == slow[rid], rid  # dataclass equality: every float identical


@settings(max_examples=150, deadline=None)
@given(
    traces(max_requests=10, max_prompt_tokens=4096, max_output_tokens=256),
    _models,
    _assumptions,
    st.booleans(),
    st.data(),
)
def test_fast_schedule_equals_the_step_by_step_reference(trace, model, assumption, lookahead, data):
    assume(_admissible(trace, assumption))
    result = data.draw(_sent_times(trace))
    fast = paper_schedule(trace, model, assumption, result, lookahead=lookahead)
    _assert_same(fast, reference.paper_schedule(trace, model, assumption, result, lookahead=lookahead))
    if lookahead:
        fast = paper_schedule(trace, model, assumption, result, lookahead=True, window=0.0)
        _assert_same(fast, reference.paper_schedule(trace, model, assumption, result, lookahead=True, window=0.0))


@settings(max_examples=100, deadline=None)
@given(traces(max_requests=12, max_prompt_tokens=8192, max_output_tokens=512), _models, _assumptions, st.data())
def test_fast_expect_equals_the_step_by_step_reference(trace, model, assumption, data):
    assume(_admissible(trace, assumption))
    result = data.draw(_sent_times(trace))
    _assert_same(expect(trace, model, assumption, result), reference.expect(trace, model, assumption, result))
    # a second call is answered from the cache, with the same values in a fresh dict
    again = expect(trace, model, assumption, result)
    _assert_same(again, reference.expect(trace, model, assumption, result))
    again.clear()
    assert expect(trace, model, assumption, result).keys() == {r.id for r in trace.requests}


def test_fast_schedule_equals_the_reference_on_the_committed_corpus():
    for path in sorted(CORPUS.glob("*.json")):
        trace = tf.load(path)
        for lookahead in (False, True):
            fast = paper_schedule(trace, MODEL, FCFS, lookahead=lookahead)
            _assert_same(fast, reference.paper_schedule(trace, MODEL, FCFS, lookahead=lookahead))


def test_a_model_with_a_negative_fitted_cost_is_scheduled_as_the_reference_does():
    # A least-squares fit can give a slightly negative per-context cost: steps then shrink.
    model = StepModel(overhead_s=0.004, prefill_token_s=30e-6, decode_seq_s=50e-6, context_token_s=-3e-6)
    trace = Trace(requests=(_req("a", 0, 100, out=300), _req("b", 40, 50, out=20), _req("c", 41, 50, out=5)))
    for lookahead in (False, True):
        fast = paper_schedule(trace, model, FCFS, lookahead=lookahead)
        _assert_same(fast, reference.paper_schedule(trace, model, FCFS, lookahead=lookahead))


def test_a_trace_longer_than_the_step_cap_ends_in_a_config_error(monkeypatch):
    # (n above max_num_seqs is served in waves, tests/test_n_above_slots.py: every request
    # is admitted once the engine is empty, so only a trace this long reaches the cap.)
    monkeypatch.setattr("fuzzer.oracle.paper.MAX_MODEL_STEPS", 50)
    trace = Trace(requests=(_req("a", 0, 100, out=200, n=8),))
    with pytest.raises(ConfigError, match="scheduler steps"):
        paper_schedule(trace, MODEL, SchedulerAssumption(max_num_seqs=4))
    monkeypatch.setattr("fuzzer.oracle.paper.MAX_MODEL_STEPS", 1_000)
    assert paper_schedule(trace, MODEL, SchedulerAssumption(max_num_seqs=4))["a"].e2e_s > 0


def test_an_arrival_during_a_decode_run_is_exposed_to_the_step_it_arrived_in():
    # a decodes with a long context (44 ms steps); b arrives during a's last step and then
    # runs alone with short steps: only its exposure makes its max-step bound 44 ms.
    model = StepModel(overhead_s=0.004, prefill_token_s=30e-6, decode_seq_s=0.0, context_token_s=1e-5)
    trace = Trace(requests=(_req("a", 0, 4000, out=3), _req("b", 190, 1, out=2)))
    for lookahead in (False, True):
        fast = paper_schedule(trace, model, FCFS, lookahead=lookahead)
        _assert_same(fast, reference.paper_schedule(trace, model, FCFS, lookahead=lookahead))
    alone = paper_schedule(trace, model, FCFS)["b"]
    assert alone.max_step_s == pytest.approx(0.004 + 1e-5 * 4002)  # a's last step, context 4000 + 2
    assert alone.max_itl_s < 0.01


def test_a_short_prompt_sent_just_after_long_ones_is_bounded_by_their_prefill():
    """vLLM's frontend tokenizes in arrival order: four 4096-token prompts and four 64-token ones
    sent within 1 ms reached its engine in that order, and the short ones' first tokens came with
    the last long one's (stock vLLM's CPU build, 16 s). A bound that let them overtake on their
    way to the engine (1.8 us of tokenization per token) held them to 68 ms."""
    from fuzzer.oracle.model import SchedulerAssumption, StepModel
    from fuzzer.trace import Request, Trace

    model = StepModel(overhead_s=0.0034, prefill_token_s=0.00065, decode_seq_s=0.00076, context_token_s=2e-7,
                      frontend_token_s=1.8e-6)
    trace = Trace(requests=(*(Request(id=f"L{i}", at_ms=0, prompt_tokens=4096, max_tokens=64) for i in range(4)),
                            *(Request(id=f"s{i}", at_ms=0, prompt_tokens=64, max_tokens=16) for i in range(4))))
    bounds = expect(trace, model, SchedulerAssumption(frontend_fifo=True))
    long_prefill = 4 * 4096 * model.prefill_token_s
    assert all(bounds[f"s{i}"].ttft_s >= 0.9 * long_prefill for i in range(4))
    assert all(bounds[f"s{i}"].idle_ttft_s < 0.1 for i in range(4))
    # Every server met over HTTP is assumed to; the in-process simulator tokenizes each request on its own.
    assert assumption_for("vllm", ADAPTERS["vllm"].scheduler_defaults).frontend_fifo
    assert not SchedulerAssumption().frontend_fifo
    parallel = expect(trace, model, SchedulerAssumption())
    assert all(parallel[f"s{i}"].ttft_s < 0.2 for i in range(4))


def test_a_request_with_n_choices_is_bounded_as_if_each_choice_computed_the_prompt():
    # The held-out vLLM-like server splits n into child requests that share only prefix blocks
    # already computed: an n=8 request's 256-token prompt was prefilled eight times in one step,
    # and it and a request behind it were confirmed 2.3-3.5x "slow" against a shared prefill.
    trace = Trace(requests=(
        Request(id="heavy", at_ms=0, prompt_tokens=256, max_tokens=64, n=8, logprobs=20),
        Request(id="after", at_ms=7, prompt_tokens=128, max_tokens=32),
    ))
    eight_prompts = 8 * 256 * MODEL.prefill_token_s
    shared = paper_schedule(trace, MODEL, FCFS)  # the control: one prefill for all choices
    assert shared["heavy"].ttft_s < eight_prompts / 2
    bounds = expect(trace, MODEL, FCFS)
    assert bounds["heavy"].ttft_s >= eight_prompts
    assert bounds["after"].ttft_s >= eight_prompts - 0.007
    # its idle expectation (the slowdown a user feels) still assumes the shared prefill
    assert bounds["heavy"].idle_ttft_s == pytest.approx(shared["heavy"].ttft_s, rel=0.2)
    # a trace without n > 1 has no such schedule: its bounds are the shared ones
    single = Trace(requests=(Request(id="a", at_ms=0, prompt_tokens=256, max_tokens=64),))
    assert expect(single, MODEL, FCFS)["a"].ttft_s < eight_prompts / 2


def test_the_fan_out_schedule_drifts_like_the_others():
    """A confirmed false positive on the held-out vLLM-like server (no planted bug involved): it
    prefills each choice of an n=8 request, a 2048-token step; b0_retry, sent during it, met the
    next step with a burst's long chunks and its first token came at 99-110 ms in six runs. Only the
    fan-out schedule had that step, and only unscaled, where b0_retry caught an earlier boundary:
    bound 33 ms, a ttft-outlier at 3x. With the envelope's drift (and shared frontend) on the fan-out
    schedule too, the bound holds what the server did."""
    import json
    from pathlib import Path

    from fuzzer.oracle.policy import DEFAULT_POLICY

    data = json.loads((Path(__file__).parent / "data" / "fp-fanout-step-drift.json").read_text())
    trace = tf.from_dict(data["trace"])
    model, a = StepModel.from_dict(data["model"]), SchedulerAssumption.from_dict(data["assumption"])
    result = ExecutionResult("h", "http://127.0.0.1:1", 0.0, 2.0, tuple(
        RequestResult(rid, rid, sent, sent, Outcome.OK) for rid, sent in data["sent_s"].items()))
    bound = expect(trace, model, a, result)["b0_retry"].ttft_s
    assert DEFAULT_POLICY.factor * bound > max(data["observed_ttft_s"]["b0_retry"])
    # The control: without its fan-out (n = 1), nothing made a step that long, and the bound stays short.
    single = trace.with_requests([r if r.n == 1 else Request(**{**r.__dict__, "n": 1}) for r in trace.requests])
    assert DEFAULT_POLICY.factor * expect(single, model, a, result)["b0_retry"].ttft_s < 0.099


def test_a_request_whose_client_left_frees_its_seat_on_paper_where_the_engine_aborts_it():
    from dataclasses import replace

    from fuzzer.execute import adapters
    from fuzzer.oracle.model import assumption_for

    one_seat = SchedulerAssumption(max_num_seqs=1)
    gone = Request(id="a", at_ms=0, prompt_tokens=64, max_tokens=2000, disconnect_after_ms=100)
    trace = Trace(requests=(gone, Request(id="b", at_ms=10, prompt_tokens=64, max_tokens=4)))
    bounds = expect(trace, MODEL, one_seat)
    # a's client left at 100 ms: the engine drops it at the next step after 150 ms and b takes the seat.
    assert bounds["b"].ttft_s < 0.25
    served = expect(trace, MODEL, replace(one_seat, aborts_on_disconnect=False))
    assert served["b"].ttft_s > 1000 * MODEL.overhead_s  # behind a's 2000 tokens
    # A client that leaves after its request ended changes nothing.
    late = trace.with_requests((replace(gone, max_tokens=8, disconnect_after_ms=60_000), trace.requests[1]))
    assert expect(late, MODEL, one_seat)["b"].ttft_s == expect(late, MODEL, replace(one_seat, aborts_on_disconnect=False))["b"].ttft_s
    # Which engines abort: vLLM's adapter says so; llama.cpp's, SGLang's and a calibration stored before do not.
    assert assumption_for("vllm", adapters.adapter("vllm").scheduler_defaults).aborts_on_disconnect
    assert not assumption_for("llamacpp", adapters.adapter("llamacpp").scheduler_defaults).aborts_on_disconnect
    # SGLang's tokenizer manager polls a waiting request's client every 4 s: no prompt abort is assumed.
    assert not assumption_for("sglang", adapters.adapter("sglang").scheduler_defaults).aborts_on_disconnect
    stored = one_seat.to_dict()
    del stored["aborts_on_disconnect"]
    assert not SchedulerAssumption.from_dict(stored).aborts_on_disconnect


def test_the_bound_holds_the_schedules_under_a_smaller_budget_the_server_showed():
    # heldout10 (issue 16), clean: a 96-token prompt sent 5 ms after two 4096-token ones waited for their
    # prefill at 1536 tokens a step (its cap 768 each): 2.2x the bound under the assumed 2048, which
    # left it 512 tokens beside them.
    trace = Trace(requests=(_req("l0", 0, 4096, out=2), _req("l1", 1, 4096, out=2), _req("s", 6, 96, out=2)))
    capped = SchedulerAssumption(long_prefill_threshold=768)
    plain = expect(trace, MODEL, capped)
    both = expect(trace, MODEL, dataclasses.replace(capped, low_budget=1536))
    alone = expect(trace, MODEL, dataclasses.replace(capped, token_budget=1536))
    assert plain["s"].ttft_s < 0.5 * alone["s"].ttft_s
    # The envelope takes the larger of the two budgets' schedules, request by request.
    assert both["s"].ttft_s > 1.5 * plain["s"].ttft_s
    assert all(both[rid].ttft_s >= plain[rid].ttft_s and both[rid].e2e_s >= plain[rid].e2e_s for rid in ("l0", "l1", "s"))


def test_the_lookahead_schedules_drift_like_the_others():
    """The simulator, clean as far as this trace goes (a campaign's child of cached_prefix_burst, one tail grown to
    2064 uncached tokens): short tails sent 1 ms apart shared a step with that chunk, sent 5 ms after the first of
    them; on paper the boundary fell before it, and three of them were a confirmed ttft-outlier of 5x. With the
    lookahead schedules under the envelope's scalings, the later ones are within their bounds in every run; the
    first (warm24) is still flagged in some runs (LOOKAHEAD_WINDOW says why), and is the only one."""
    import asyncio
    import json
    import random
    from pathlib import Path

    from fuzzer.oracle.calibrate import calibrate
    from fuzzer.oracle.judge import candidates
    from fuzzer.sim import VirtualTarget

    trace = tf.from_dict(json.loads((Path(__file__).parent / "data" / "fp-unlucky-boundary-burst.json").read_text()))
    cal = asyncio.run(calibrate(VirtualTarget(seed=0), rng=random.Random(0)))
    flagged = []
    for seed in range(10):
        flagged += [c.request_id for c in candidates(trace, VirtualTarget(seed=seed).run(trace), cal)]
    assert set(flagged) <= {"warm24"} and len(flagged) <= 3, flagged


def test_a_choice_of_a_request_whose_choices_alone_fill_the_kv_cache_may_wait_for_its_siblings():
    """heldout7 (held out), clean: 8 choices of 2048 tokens on 512 blocks of 32; one choice was silent 0.64 s near
    the end in every run (vLLM v1 schedules choices as requests: the newest, preempted, waits for blocks for its
    whole recompute, i.e. for its siblings to end); its bound was its recompute alone, 0.09 s."""
    from dataclasses import replace

    fan = Trace(requests=(Request(id="fan", at_ms=0, prompt_tokens=64, max_tokens=2048, n=8),))
    full = SchedulerAssumption(kv_blocks=512, block_size=32)
    bound = expect(fan, MODEL, full)["fan"]
    # Each choice holds 64 blocks (2048 tokens, 1984 of output) when the cache is full: 64 tokens of 2048 are left.
    decode = bound.e2e_s - bound.ttft_s
    assert bound.preempted and bound.max_itl_s >= decode * 64 / 2048
    # The control: a cache that holds every choice whole preempts nobody, and the bound is a step's.
    roomy = expect(fan, MODEL, replace(full, kv_blocks=1024))["fan"]
    assert not roomy.preempted and roomy.max_itl_s < decode * 64 / 2048 / 4
