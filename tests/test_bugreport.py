"""report.md text: titles, environment, tables and reproduction instructions."""

from __future__ import annotations

from fuzzer import trace as tf
from fuzzer.report.markdown import Exhibit, markdown, title

TRACE = tf.from_dict({"prefixes": {"p0": 32}, "requests": [
    {"id": "long", "at_ms": 0, "prompt_tokens": 2048, "prefix": "p0", "max_tokens": 64},
    {"id": "short", "at_ms": 8, "prompt_tokens": 128, "prefix": "p0", "max_tokens": 16, "stream": False}]})


def test_failure_finding_without_target():
    x = Exhibit(finding_id=4, kind="error", signature="error:abc", trace=TRACE,
                verdict={"kind": "error", "request_id": "short", "detail": "http-error", "reproduced": "3/3",
                         "method": "reproduction count over re-executions"})
    text = markdown(x)
    assert title(x) == "error: request short ends http-error (3/3 runs)"
    assert text.startswith("# error: request short ends http-error")
    assert "Server: unknown" in text and "http://127.0.0.1:8000" in text  # a placeholder URL to fill in
    assert "| **short** | 8 | 128 | p0 | 16 | no |" in text
    assert "`p0` = 32 tokens" in text
    assert "Method: reproduction count over re-executions" in text
    assert "_No timeline._" in text


def test_latency_finding_title_and_numbers():
    verdict = {"kind": "ttft-outlier", "request_id": "short", "metric": "ttft", "observed_s": 1.4, "expected_s": 0.1,
               "idle_s": 0.01, "slowdown": 140.0, "excess_s": 1.3, "threshold": 2.0, "reproduced": "5/5",
               "p_value": 0.0004, "effect": 12.0, "effect_ci": [10.0, 14.0, 0.95], "n_sample": 5, "n_baseline": 40,
               "assumption": "max_num_batched_tokens=2048"}
    x = Exhibit(finding_id=1, kind="ttft-outlier", signature="s", trace=TRACE, verdict=verdict,
                target={"kind": "vllm", "version": "0.17.1", "model": "Qwen/Qwen2.5-0.5B", "url": "http://gpu:8000",
                        "capabilities": {"n": False, "chat": True}},
                original_requests=6, minimized={"reproduced": "10/10", "executions": 40}, repro_threshold_s=0.2)
    text = markdown(x)
    assert title(x).startswith("ttft-outlier: TTFT of request short is 1400.0 ms, 14.0x its FCFS bound (100.0 ms), 140x idle")
    for needle in ("`vllm` 0.17.1", "`Qwen/Qwen2.5-0.5B`", "rejected by the server: n", "2 requests, minimized from 6",
                   "| observed (median over the confirmation runs) | 1400.0 |", "**140.0x**", "**14.0x**",
                   "p-value: 0.0004", "95% CI 10.00-14.00", "10/10", ">= 200.0 ms",
                   "git bisect run python3 repro.py --base-url http://gpu:8000"):
        assert needle in text, needle
    assert "a finding needs 2.0x." in text


def test_a_long_excess_finding_says_the_excess_it_needed():
    verdict = {"kind": "ttft-outlier", "request_id": "short", "metric": "ttft", "observed_s": 12.4, "expected_s": 7.9,
               "idle_s": 1.1, "threshold": 1.5, "min_excess_s": 1.35, "reproduced": "3/3"}
    text = markdown(Exhibit(finding_id=2, kind="ttft-outlier", signature="s", trace=TRACE, verdict=verdict))
    assert "**1.6x**; a finding needs 1.5x and 1350.0 ms above it (far beyond its own work)." in text


def test_an_option_slowdown_names_what_of_the_others_it_compared():
    trace = tf.from_dict({"requests": [*({"id": f"r{i}", "at_ms": i, "prompt_tokens": 8, "max_tokens": 8} for i in range(3)),
                                       {"id": "carrier", "at_ms": 3, "prompt_tokens": 8, "max_tokens": 8, "logprobs": 20}]})
    verdict = {"kind": "option-slowdown", "request_id": "carrier", "ablated": "logprobs", "threshold": 8.8,
               "metric": "e2e", "observed_s": 0.36, "expected_s": 0.012, "reproduced": "3/3", "effect": 30.0}
    gaps = Exhibit(finding_id=3, kind="option-slowdown", signature="s", trace=trace,
                   verdict={**verdict, "compared": "itl"})
    assert "requests' median inter-token latency (each one's mean gap between tokens) 30.0x" in title(gaps)
    text = markdown(gaps)
    assert "| median inter-token latency (each one's mean gap between tokens) of the 3 requests" in text
    assert "other requests' median inter-token latency (each one's mean gap between tokens) with `logprobs`" in text
    assert "reproduces when the median inter-token latency (each one's mean gap between tokens) of the" in text
    # A verdict stored before the test compared token gaps compared the others' e2e.
    e2e = Exhibit(finding_id=3, kind="option-slowdown", signature="s", trace=trace, verdict=verdict)
    assert "median end-to-end latency 30.0x" in title(e2e) and "| median end-to-end latency of the 3" in markdown(e2e)


def test_a_stall_only_in_later_choices_says_so():
    # A maintainer looking at choice 0's tokens sees no stall: the report says where the silence was.
    verdict = {"kind": "itl-stall", "request_id": "short", "metric": "max_itl", "observed_s": 2.6, "expected_s": 0.05,
               "idle_s": 0.01, "threshold": 2.0, "reproduced": "3/3"}
    plain = Exhibit(finding_id=5, kind="itl-stall", signature="s", trace=TRACE, verdict=verdict)
    held = Exhibit(finding_id=5, kind="itl-stall", signature="s", trace=TRACE, verdict=verdict, held_choice=True)
    assert "choice after the first" not in markdown(plain)
    assert "The silence was in a choice after the first of request short's `n` choices" in markdown(held)
