"""The model-free order check (fuzzer/oracle/order.py): a request FCFS serves first, served after
a later one with no less work (or any later one, where admissions stop at the first request that
cannot be scheduled), is a finding whatever the step model says; and nothing else is.

Executions are written by hand (times in seconds from t0), so each rule is seen alone.
"""

from __future__ import annotations

import asyncio
import functools
import random
from dataclasses import replace

import numpy as np
from paper_target import PaperTarget

from fuzzer.execute.adapters import adapter
from fuzzer.execution import ExecutionResult, MetricSample, Outcome, RequestResult
from fuzzer.oracle.calibrate import calibrate
from fuzzer.oracle.judge import candidates, judge, observe
from fuzzer.oracle.kinds import Decision, FindingKind, Metric
from fuzzer.oracle.model import assumption_for
from fuzzer.oracle.order import CHAT_TEMPLATE_TOKENS, cap_dependent, inversions
from fuzzer.report.markdown import Exhibit, markdown
from fuzzer.report.repro import criterion_from_verdict
from fuzzer.trace import Request, Trace


@functools.cache
def _calibrated():
    return asyncio.run(calibrate(PaperTarget(seed=99), rng=random.Random(0), clock=lambda: 0.0))


def _stopping():
    """The calibration of an engine whose admissions stop at the first request they cannot schedule
    (vLLM v1's, its long-prefill cap known)."""
    cal = _calibrated()
    return cal.with_assumption(replace(cal.assumption, admission_stops=True))


def _calibration():
    """The calibration of an FCFS engine not known to stop its admissions at a blocked request
    (SGLang's): a later request passes only with no less work."""
    cal = _calibrated()
    return cal.with_assumption(replace(cal.assumption, admission_stops=False))


#: A (128 tokens) is sent 50 ms before B (1024 tokens), a blocker long before both.
TRACE = Trace(
    requests=(
        Request(id="blocker", at_ms=0, prompt_tokens=2048, max_tokens=4),
        Request(id="A", at_ms=100, prompt_tokens=128, max_tokens=8),
        Request(id="B", at_ms=150, prompt_tokens=1024, max_tokens=8),
    ),
)


def _request(rid: str, sent: float, first: float | None, outcome: Outcome = Outcome.OK) -> RequestResult:
    ttft = None if first is None else first - sent
    return RequestResult(rid, f"{rid}-x", sent, sent, outcome, ttft_s=ttft, first_event_s=ttft,
                         token_times_s=() if ttft is None else (ttft, ttft + 0.01), e2e_s=(ttft or 0.0) + 0.02)


def _execution(a_first: float, b_first: float = 1.0, *, b_sent: float = 0.15, samples=(), trace=TRACE,
               blocker_first: float = 0.9) -> ExecutionResult:
    requests = (_request("blocker", 0.0, blocker_first), _request("A", 0.1, a_first), _request("B", b_sent, b_first))
    return ExecutionResult(trace.content_hash(), "test://", 0.0, 3.0, requests, samples=samples, idle_before_s=0.0)


def test_a_request_served_after_a_later_bigger_one_is_overtaken():
    found = inversions(TRACE, _execution(a_first=1.5), _calibration(), preempted=False)
    assert set(found) == {"A"}
    inv = found["A"]
    assert inv.overtakers == ("B",) and abs(inv.lead_s - 0.5) < 1e-9 and abs(inv.bound_s - 0.9) < 1e-9
    assert abs(inv.gap_s - 0.05) < 1e-9


def test_only_the_earliest_overtaken_request_is_a_victim():
    # LIFO: A3, A2, A1 served in that order. A2 lost nothing (FCFS serves A1 first anyway): only A1 is a victim.
    lifo = Trace(requests=(TRACE.requests[0], *(Request(id=f"A{i}", at_ms=100 * i, prompt_tokens=1024, max_tokens=8)
                                                 for i in (1, 2, 3))))
    requests = (_request("blocker", 0.0, 0.9), _request("A1", 0.1, 3.0), _request("A2", 0.2, 2.0),
                _request("A3", 0.3, 1.0))
    result = ExecutionResult(lifo.content_hash(), "test://", 0.0, 3.0, requests, idle_before_s=0.0)
    found = inversions(lifo, result, _calibration(), preempted=False)
    assert set(found) == {"A1"}
    assert found["A1"].overtakers == ("A3", "A2") and abs(found["A1"].bound_s - 0.9) < 1e-9
    assert "after that of A3 (and after A2)" in found["A1"].describe()


def test_a_stalled_client_widens_the_lead_an_inversion_needs_but_not_the_send_gap():
    # A loaded 2-core machine: the client's loop stalled 100 ms (over the 50 ms between A and B's sends).
    # The sends still left in order (one event loop stamps and writes them); of two first tokens that
    # were ready together, the loop may stamp one late by the stall: a lead within it is no evidence.
    stalled = lambda a_first: replace(_execution(a_first=a_first), client_lag_s=0.1)  # noqa: E731
    assert set(inversions(TRACE, stalled(1.5), _calibration(), preempted=False)) == {"A"}
    assert set(inversions(TRACE, stalled(1.13), _calibration(), preempted=False)) == {"A"}
    assert inversions(TRACE, stalled(1.11), _calibration(), preempted=False) == {}


def test_fcfs_order_and_near_ties_are_not_inversions():
    cal = _calibration()
    assert inversions(TRACE, _execution(a_first=0.95), cal, preempted=False) == {}  # served first
    assert inversions(TRACE, _execution(a_first=1.01), cal, preempted=False) == {}  # same step: 10 ms apart


def test_a_request_sent_within_the_reach_margin_may_reach_the_engine_second():
    assert inversions(TRACE, _execution(a_first=1.5, b_sent=0.11), _calibration(), preempted=False) == {}


def test_a_shared_prefix_is_not_counted_as_the_overtakers_work():
    # B's 1024 tokens share 960 with another group member: 64 uncached tokens can overtake A's 128.
    shared = Trace(requests=(TRACE.requests[0], TRACE.requests[1], replace(TRACE.requests[2], prefix="p")),
                   prefixes={"p": 960})
    assert inversions(shared, _execution(a_first=1.5, trace=shared), _calibration(), preempted=False) == {}


def test_more_output_work_or_preemption_or_a_full_kv_cache_excuses_the_order():
    cal = _calibration()
    longer = Trace(requests=(TRACE.requests[0], replace(TRACE.requests[1], max_tokens=64), TRACE.requests[2]))
    assert inversions(longer, _execution(a_first=1.5, trace=longer), cal, preempted=False) == {}
    # A chat prompt as long as a completion's is longer on the server (its template).
    chat = Trace(requests=(TRACE.requests[0], replace(TRACE.requests[1], prompt_tokens=1000, api="chat"),
                           TRACE.requests[2]))
    assert inversions(chat, _execution(a_first=1.5, trace=chat), cal, preempted=False) == {}
    assert set(inversions(replace(chat, requests=(chat.requests[0], replace(chat.requests[1], prompt_tokens=900),
                                                  chat.requests[2])),
                          _execution(a_first=1.5, trace=chat), cal, preempted=False)) == {"A"}
    assert inversions(TRACE, _execution(a_first=1.5), cal, preempted=True) == {}
    full = (MetricSample(0.5, {"kv_usage": 0.97}),)
    assert inversions(TRACE, _execution(a_first=1.5, samples=full), cal, preempted=False) == {}


def _smaller_later(a_tokens: int = 1024, b_tokens: int = 128, **a_fields) -> Trace:
    return Trace(requests=(TRACE.requests[0],
                           replace(TRACE.requests[1], prompt_tokens=a_tokens, max_tokens=64, **a_fields),
                           replace(TRACE.requests[2], prompt_tokens=b_tokens)))


def test_where_admissions_stop_at_a_blocked_request_no_later_request_may_pass():
    # A (1024 tokens, 64 out) sent 50 ms before B (128 tokens, 8 out): B has less work, so only an engine
    # whose admissions stop at the first request they cannot schedule (vLLM v1) is held to serving A first.
    stopping, trace = _stopping(), _smaller_later()
    assert stopping.assumption.admission_stops
    found = inversions(trace, _execution(a_first=1.5, trace=trace), stopping, preempted=False)
    assert set(found) == {"A"} and found["A"].overtakers == ("B",)
    assert inversions(trace, _execution(a_first=1.5, trace=trace), _calibration(), preempted=False) == {}
    # Same step (10 ms apart) or served first: not an inversion either way.
    assert inversions(trace, _execution(a_first=1.01, trace=trace), stopping, preempted=False) == {}
    # Preemptions still excuse it.
    assert inversions(trace, _execution(a_first=1.5, trace=trace), stopping, preempted=True) == {}


def test_a_capped_prefill_or_more_sequences_lets_a_smaller_later_request_pass():
    stopping = _stopping()
    capped = stopping.with_assumption(replace(stopping.assumption, long_prefill_threshold=512))
    longer, within = _smaller_later(1024), _smaller_later(400)
    assert inversions(longer, _execution(a_first=1.5, trace=longer), capped, preempted=False) == {}
    assert set(inversions(within, _execution(a_first=1.5, trace=within), capped, preempted=False)) == {"A"}
    # A chat prompt within the cap may not be once its template is added.
    chat = _smaller_later(480, api="chat")
    assert inversions(chat, _execution(a_first=1.5, trace=chat), capped, preempted=False) == {}
    fan = _smaller_later(n=2)
    assert inversions(fan, _execution(a_first=1.5, trace=fan), stopping, preempted=False) == {}


def test_an_inversion_by_smaller_requests_alone_depends_on_the_cap_and_one_by_a_bigger_one_does_not():
    stopping = _stopping()
    smaller = _smaller_later(1024)
    (by_smaller,) = inversions(smaller, _execution(a_first=1.5, trace=smaller), stopping, preempted=False).values()
    assert cap_dependent(smaller, by_smaller) == 1024  # the size to probe the cap at
    chat = _smaller_later(1024, api="chat")
    (by_chat,) = inversions(chat, _execution(a_first=1.5, trace=chat), stopping, preempted=False).values()
    assert cap_dependent(chat, by_chat) == 1024 + CHAT_TEMPLATE_TOKENS
    # B has more work than A: no cap lets it pass, whatever A's size.
    (by_bigger,) = inversions(TRACE, _execution(a_first=1.5), stopping, preempted=False).values()
    assert cap_dependent(TRACE, by_bigger) is None


def test_a_smaller_later_request_must_be_sent_after_the_earlier_ones_extra_tokenization():
    # 1 ms a token in the frontend: A's 896 extra tokens take 0.9 s more than B's to reach the engine (the blocker's
    # 64 tokens are tokenized before A is sent).
    stopping, trace = _stopping(), _smaller_later()
    trace = trace.with_requests([replace(trace.requests[0], prompt_tokens=64), *trace.requests[1:]])
    slow = stopping.with_model(replace(stopping.model, frontend_token_s=1e-3, frontend_slack_s=0.0))
    assert inversions(trace, _execution(a_first=1.5, trace=trace), slow, preempted=False) == {}
    late = _execution(a_first=2.5, b_first=2.0, b_sent=1.05, trace=trace)
    assert set(inversions(trace, late, slow, preempted=False)) == {"A"}


def test_admission_stops_is_vllms_and_an_old_calibration_does_not_assume_it():
    assert assumption_for("vllm", adapter("vllm").scheduler_defaults).admission_stops
    assert not assumption_for("sglang", adapter("sglang").scheduler_defaults).admission_stops
    assert not assumption_for("llamacpp", adapter("llamacpp").scheduler_defaults).admission_stops
    stored = _stopping().assumption.to_dict()
    assert stored["admission_stops"] is True
    del stored["admission_stops"]
    assert not type(_stopping().assumption).from_dict(stored).admission_stops


def test_engines_not_documented_as_fcfs_are_not_held_to_arrival_order():
    cal = _calibration()
    for kind, held in (("vllm", True), ("sglang", True), ("llamacpp", False), ("tgi", False)):
        assumption = assumption_for(kind, adapter(kind).scheduler_defaults)
        assert assumption.arrival_order is held
        found = inversions(TRACE, _execution(a_first=1.5), cal.with_assumption(assumption), preempted=False)
        assert bool(found) is held


def test_an_inversion_is_a_candidate_and_recurring_is_a_finding_with_its_evidence():
    cal = _calibration()
    # A's first token 1.2x its FCFS bound (no candidate by the bound), 100 ms after B's.
    (probe,) = [r for r in observe(TRACE, _execution(a_first=1.5), cal) if r.request_id == "A"]
    a_first = 0.1 + 1.2 * probe.observations[Metric.TTFT].expected_s
    result = _execution(a_first=a_first, b_first=a_first - 0.1, blocker_first=0.05)
    (report,) = [r for r in observe(TRACE, result, cal) if r.request_id == "A"]
    assert report.observations[Metric.TTFT].flagged and not report.observations[Metric.TTFT].candidate
    assert any(c.request_id == "A" and c.kind is FindingKind.TTFT_OUTLIER for c in candidates(TRACE, result, cal))
    rng = np.random.default_rng(0)
    three = [v for v in judge(TRACE, [result] * 3, cal, rng=rng) if v.request_id == "A"][0]
    assert three.is_finding and three.overtakers == ("B",) and three.reproduction == "3/3"
    assert "order of first tokens" in three.evidence and three.effect and three.effect > 1.0
    # The repro script's criterion is the inversion, not a threshold.
    criterion = criterion_from_verdict("ttft-outlier", three.to_dict())
    assert criterion.overtakers == ("B",)
    # The report says what the order showed, not an effect over a model's bound.
    report = markdown(Exhibit(finding_id=1, kind="ttft-outlier", signature=three.signature or "", trace=TRACE,
                              verdict=three.to_dict()))
    assert "served after B, sent later with no less work" in report.splitlines()[0]
    assert "had it been served no later than B" in report and "the order itself is the evidence" in report
    assert "FCFS bound (a reasonable" not in report
    # Once in three runs: not a finding yet.
    clean = _execution(a_first=a_first, b_first=a_first + 0.1, blocker_first=0.05)
    once = [v for v in judge(TRACE, [result, clean, clean], cal, rng=rng) if v.request_id == "A"][0]
    assert not once.is_finding and once.decision is Decision.UNKNOWN and once.reproduction == "1/3"


def test_the_repro_script_judges_the_inversion():
    from dataclasses import asdict

    from fuzzer.report.repro import Criterion, _script_main

    crit = asdict(Criterion(kind="ttft-outlier", request_id="A", metric="ttft", expected_s=0.9, overtakers=("B",)))

    def res(rid, sent, ttft):
        return {"id": rid, "sent_s": sent, "ttft_s": ttft, "outcome": "ok", "status": 200, "detail": ""}

    victim = res("A", 0.1, 1.4)
    hit, words = _script_main.judge_order(crit, victim, {"A": victim, "B": res("B", 0.15, 0.85)})
    assert hit is True and "after that of B" in words
    assert _script_main.judge_order(crit, victim, {"A": victim, "B": res("B", 0.15, 1.4)})[0] is False
    # An overtaker sent too soon after the victim may have reached the server first: not tested.
    assert _script_main.judge_order(crit, victim, {"A": victim, "B": res("B", 0.11, 0.5)})[0] is None
    # A victim that ended ok with no text in its stream (a random model's invisible tokens) tests nothing;
    # one that failed before its first token does not reproduce the inversion.
    silent = res("A", 0.1, None)
    assert _script_main.judge_order(crit, silent, {"A": silent, "B": res("B", 0.15, 0.85)})[0] is None
    hung = dict(silent, outcome="hang")
    assert _script_main.judge_order(crit, hung, {"A": hung, "B": res("B", 0.15, 0.85)})[0] is False


def test_the_repro_script_does_not_count_a_victim_with_no_text_as_not_reproduced():
    """llama-server with a random model sent `short` 16 tokens and no text (CI, stop 63): the run tests nothing."""
    from dataclasses import asdict

    from fuzzer.report.repro import Criterion, _script_main

    crit = asdict(Criterion(kind="ttft-outlier", request_id="A", metric="ttft", expected_s=0.01))
    base = {"id": "A", "sent_s": 0.0, "ttft_s": None, "token_times_s": [], "e2e_s": 1.0, "outcome": "ok",
            "status": 200, "detail": ""}
    verdict, words = _script_main.judge_run(crit, [base], None, 0.05, 0.0)
    assert verdict is None and "no text" in words
    assert _script_main.judge_run(crit, [dict(base, outcome="http-error")], None, 0.05, 0.0)[0] is False
    assert _script_main.judge_run(crit, [dict(base, ttft_s=0.2, token_times_s=[0.2])], None, 0.05, 0.0)[0] is True


def test_a_timeout_that_fcfs_queueing_explains_is_not_a_hang():
    from fuzzer.oracle.kinds import FindingKind as Kind

    cal = _calibration()
    # Twenty long prompts at once: the last waits for nineteen prefills before its first byte.
    crowd = Trace(requests=tuple(Request(id=f"f{i:02d}", at_ms=i, prompt_tokens=3000, max_tokens=8) for i in range(20)))
    bound = expect_of(crowd, cal)["f19"].ttft_s
    quick = Trace(requests=(Request(id="q", at_ms=0, prompt_tokens=16, max_tokens=8),))

    def timed_out(trace, rid, silence):
        rows = tuple(_request(r.id, r.at_ms / 1000.0, r.at_ms / 1000.0 + 0.01) if r.id != rid else
                     RequestResult(rid, f"{rid}-x", r.at_ms / 1000.0, r.at_ms / 1000.0, Outcome.TIMEOUT)
                     for r in trace.requests)
        return ExecutionResult(trace.content_hash(), "test://", 0.0, silence, rows, idle_before_s=0.0)

    (crowded,) = [r for r in observe(crowd, timed_out(crowd, "f19", 1.5 * bound), cal) if r.request_id == "f19"]
    assert crowded.failure is None  # FCFS says it would wait that long: queueing
    (stuck,) = [r for r in observe(quick, timed_out(quick, "q", 60.0), cal) if r.request_id == "q"]
    assert stuck.failure is Kind.HANG  # alone on the server, silent for a minute


def expect_of(trace, cal):
    from fuzzer.oracle.expectation import expect

    return expect(trace, cal.model, cal.assumption)


def test_a_smaller_later_request_may_pass_while_the_frontend_works_off_what_came_before():
    # The built-in simulator (stop 54): six 8192-token prompts sent just before A held its HTTP frontend, and a
    # 96-token B sent 48 ms after A's 4096 tokens reached the engine first: confirmed 4/5 as an inversion.
    stopping = _stopping()
    tokenizing = stopping.with_model(replace(stopping.model, frontend_token_s=2.4e-6, frontend_slack_s=0.0))
    a, b = Request(id="A", at_ms=36, prompt_tokens=4096, max_tokens=16), Request(id="B", at_ms=84, prompt_tokens=96,
                                                                                 max_tokens=16)
    burst = tuple(Request(id=f"left{i}", at_ms=3 + i, prompt_tokens=8192, max_tokens=64) for i in range(6))

    def run(before):
        trace = Trace(requests=(*before, a, b))
        requests = (*(_request(r.id, r.at_ms / 1000, None, Outcome.CANCELLED) for r in before),
                    _request("A", 0.036, 0.571), _request("B", 0.084, 0.448))
        return trace, ExecutionResult(trace.content_hash(), "test://", 0.0, 1.0, requests, idle_before_s=0.0)

    assert inversions(*run(burst), tokenizing, preempted=False) == {}
    # The control: nothing before A, and B is held to FCFS 48 ms after it (A's 10 ms more tokenization and the reach).
    assert set(inversions(*run(()), tokenizing, preempted=False)) == {"A"}
