"""The stand-alone repro.py: generated from a real verdict, run with `python -I -S` against servers."""

from __future__ import annotations

import ast
import asyncio
import json
import random
import subprocess
import sys

import numpy as np
import pytest
from misbehaving_server import ServerState
from misbehaving_server import running as misbehaving

from fuzzer import trace as tf
from fuzzer.errors import ConfigError
from fuzzer.oracle.calibrate import calibrate
from fuzzer.oracle.confirm import examine
from fuzzer.report import repro
from fuzzer.report.repro import (
    _script_net,
    _script_run,
    criterion_from_verdict,
    script_data,
    script_source,
)
from fuzzer.sim import VirtualTarget
from fuzzer.sim.process import SimProcess

# A short trace on which the simulator's logprobs-batch-cost pathology (vLLM 37343) stalls
# request a's stream for ~100 ms against an FCFS bound of ~13 ms; each run lasts < 1 s.
SMALL = {"format": 1, "name": "logprobs-small", "requests": [
    {"id": "a", "at_ms": 0, "prompt_tokens": 128, "max_tokens": 24},
    {"id": "b", "at_ms": 2, "prompt_tokens": 128, "max_tokens": 24},
    {"id": "heavy", "at_ms": 5, "prompt_tokens": 128, "max_tokens": 8, "n": 8, "logprobs": 20, "temperature": 1.0},
]}
PATHOLOGY = "logprobs-batch-cost"
# The simulator's step times are noisy by seed; the verdict is computed on the same seed.
SEED = 3
# Python start-up, three runs of < 1 s and tokenize calls: well under this on a loaded machine.
SCRIPT_TIMEOUT_S = 90
PYTHON = sys.executable


def oracle_verdict(trace: tf.Trace, request_id: str) -> dict:
    """The oracle's own verdict for request_id, on virtual time with the pathology planted."""

    async def run():
        target = VirtualTarget(pathologies=(PATHOLOGY,), seed=SEED)
        cal = await calibrate(target, rng=random.Random(0), clock=lambda: 0.0)
        return await examine(target, trace, cal, runs=3, rng=np.random.default_rng(0))

    found = [v for v in asyncio.run(run()).findings if v.request_id == request_id]
    assert found, "the oracle no longer flags the planted pathology on this trace"
    return found[0].to_dict()


@pytest.fixture(scope="module")
def small_trace():
    return tf.from_dict(SMALL)


@pytest.fixture(scope="module")
def script(small_trace, tmp_path_factory):
    verdict = oracle_verdict(small_trace, "a")
    assert verdict["kind"] == "itl-stall" and verdict["metric"] == "max_itl"
    crit = criterion_from_verdict(verdict["kind"], verdict)
    data = script_data(finding={"id": 7, "kind": verdict["kind"], "signature": verdict["signature"],
                                "reproduced": verdict["reproduction"]},
                       criterion=crit, trace=small_trace, server={"kind": "vllm"})
    path = tmp_path_factory.mktemp("repro") / "repro.py"
    path.write_text(script_source(data))
    return path


def run_script(path, *args, timeout=SCRIPT_TIMEOUT_S):
    return subprocess.run([PYTHON, "-I", "-S", str(path), *args], capture_output=True, text=True, timeout=timeout, check=False)


async def run_script_async(path, *args, timeout=SCRIPT_TIMEOUT_S):
    """The script as a child process while this event loop keeps serving a test server."""
    proc = await asyncio.create_subprocess_exec(PYTHON, "-I", "-S", str(path), *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out.decode(), err.decode()


def result_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("RESULT:")]


# --- the script as a program ------------------------------------------------------------------


def test_reproduces_with_the_pathology_on(script):
    with SimProcess(pathologies=(PATHOLOGY,), seed=SEED) as sim:
        p = run_script(script, "--base-url", sim.url, "--runs", "3")
    assert p.returncode == 1, p.stdout + p.stderr
    assert result_lines(p.stdout) == ["RESULT: REPRODUCED"]
    assert "reproduced in 3/3 runs" in p.stdout or "reproduced in 2/3 runs" in p.stdout
    for rid in ("a", "b", "heavy"):
        assert f"\n  {rid} " in p.stdout  # a row per request per run
    assert "exact lengths via /tokenize" in p.stdout


def test_does_not_reproduce_with_the_pathology_off(script):
    with SimProcess(pathologies=(), seed=SEED) as sim:
        p = run_script(script, "--base-url", sim.url, "--runs", "3")
    assert p.returncode == 0, p.stdout + p.stderr
    assert result_lines(p.stdout) == ["RESULT: NOT REPRODUCED"]
    assert "reproduced in 0/3 runs" in p.stdout


def test_cannot_test_without_a_server(script, unused_tcp_port):
    p = run_script(script, "--base-url", f"http://127.0.0.1:{unused_tcp_port}", timeout=30)
    assert p.returncode == 125, p.stdout + p.stderr
    assert result_lines(p.stdout) == ["RESULT: CANNOT TEST"]
    assert "unreachable" in p.stdout


def test_cannot_test_a_model_the_server_does_not_serve(script):
    with SimProcess(seed=SEED) as sim:
        p = run_script(script, "--base-url", sim.url, "--model", "no-such-model", timeout=30)
    assert p.returncode == 125
    assert "not served" in p.stdout


def test_bad_options_do_not_read_as_a_bad_commit(script):
    p = run_script(script, "--runs", "zero", timeout=30)
    assert p.returncode == 125  # argparse would say 2, which git bisect takes for "bad"


def test_threshold_override_decides(script):
    """--threshold-ms replaces the embedded bound: an unreachable threshold means not reproduced."""
    with SimProcess(pathologies=(PATHOLOGY,), seed=SEED) as sim:
        p = run_script(script, "--base-url", sim.url, "--runs", "1", "--threshold-ms", "60000")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "60000.0 ms" in p.stdout


async def test_error_finding_reproduces_on_a_failing_server(tmp_path):
    trace = tf.from_dict({"requests": [{"id": "ok1", "at_ms": 0, "prompt_tokens": 8, "max_tokens": 4},
                                       {"id": "e500", "at_ms": 1, "prompt_tokens": 8, "max_tokens": 4}]})
    path = tmp_path / "repro.py"
    crit = criterion_from_verdict("error", {"request_id": "e500", "detail": "http-error"})
    path.write_text(script_source(script_data(finding={"id": 1, "kind": "error"}, criterion=crit, trace=trace)))
    async with misbehaving() as (url, _state):
        rc, out, err = await run_script_async(path, "--base-url", url, "--runs", "2")
    assert rc == 1, out + err
    assert "e500 ended http-error as the finding says" in out


async def test_hang_finding_is_a_client_timeout(tmp_path):
    trace = tf.from_dict({"requests": [{"id": "hang", "at_ms": 0, "prompt_tokens": 8, "max_tokens": 4}]})
    path = tmp_path / "repro.py"
    crit = criterion_from_verdict("hang", {"request_id": "hang", "detail": "timeout"})
    path.write_text(script_source(script_data(finding={"id": 4, "kind": "hang"}, criterion=crit, trace=trace)))
    async with misbehaving() as (url, _state):
        rc, out, err = await run_script_async(path, "--base-url", url, "--runs", "1", "--timeout-s", "0.5")
    assert rc == 1, out + err
    assert "hang ended timeout as the finding says" in out


async def test_protocol_finding_not_reproduced_when_the_stream_is_fine(tmp_path):
    trace = tf.from_dict({"requests": [{"id": "ok1", "at_ms": 0, "prompt_tokens": 8, "max_tokens": 4}]})
    path = tmp_path / "repro.py"
    crit = criterion_from_verdict("protocol", {"request_id": "ok1", "detail": "missing-done"})
    path.write_text(script_source(script_data(finding={"id": 2, "kind": "protocol"}, criterion=crit, trace=trace)))
    async with misbehaving() as (url, _state):
        rc, out, err = await run_script_async(path, "--base-url", url, "--runs", "2")
    assert rc == 0, out + err
    assert "ok1 ended ok" in out


async def test_leak_finding_reads_running_and_waiting(tmp_path):
    trace = tf.from_dict({"requests": [{"id": "ok1", "at_ms": 0, "prompt_tokens": 8, "max_tokens": 4}]})
    path = tmp_path / "repro.py"
    crit = criterion_from_verdict("leak", {})
    path.write_text(script_source(script_data(finding={"id": 3, "kind": "leak"}, criterion=crit, trace=trace)))
    async with misbehaving() as (url, state):
        state.stuck = 1  # running never returns to 0
        rc, out, err = await run_script_async(path, "--base-url", url, "--runs", "1", "--leak-wait-s", "0.3")
        assert rc == 1, out + err
        state.stuck = 0
        rc, out, err = await run_script_async(path, "--base-url", url, "--runs", "1", "--leak-wait-s", "0.3")
        assert rc == 0, out + err


async def test_a_leak_finding_reads_kv_still_in_use_with_nothing_running(tmp_path):
    # Blocks of ended requests never given back (vllm-ascend #16662): running + waiting return to 0, and the
    # KV cache in use stays above its level before the run; given back within the wait, no leak.
    trace = tf.from_dict({"requests": [{"id": "ok1", "at_ms": 0, "prompt_tokens": 8, "max_tokens": 4}]})
    path = tmp_path / "repro.py"
    crit = criterion_from_verdict("leak", {})
    path.write_text(script_source(script_data(finding={"id": 3, "kind": "leak"}, criterion=crit, trace=trace)))
    async with misbehaving() as (url, state):
        state.kv_usage, state.kv_left_by_request = 0.2, 0.05  # 20% in use before: the level it compares with
        rc, out, err = await run_script_async(path, "--base-url", url, "--runs", "1", "--leak-wait-s", "0.3")
        assert rc == 1 and "of the KV cache was still in use" in out, out + err
        state.kv_left_s = 0.1
        rc, out, err = await run_script_async(path, "--base-url", url, "--runs", "1", "--leak-wait-s", "0.5")
        assert rc == 0 and "the KV cache in use with them" in out, out + err


async def test_the_script_leaves_after_the_traces_time_and_sends_its_seed(tmp_path):
    # A client with a timeout (disconnect_after_ms) before its first token: the script drops its
    # socket then, the server sees the abort, and an aborting server shows no leak.
    trace = tf.from_dict({"requests": [{"id": "ok1", "at_ms": 0, "prompt_tokens": 8, "max_tokens": 40,
                                        "disconnect_after_ms": 50, "seed": 11},
                                       {"id": "ok2", "at_ms": 0, "prompt_tokens": 8, "max_tokens": 4}]})
    path = tmp_path / "repro.py"
    crit = criterion_from_verdict("leak", {})
    path.write_text(script_source(script_data(finding={"id": 3, "kind": "leak"}, criterion=crit, trace=trace)))
    async with misbehaving() as (url, state):
        state.ttft_s = 0.3
        rc, out, err = await run_script_async(path, "--base-url", url, "--runs", "1", "--leak-wait-s", "0.5")
        gone = [e for xid, e in state.log.items() if xid.startswith("ok1-")]
        stayed = [e for xid, e in state.log.items() if xid.startswith("ok2-")]
    assert rc == 0, out + err
    assert gone and all(e.aborted and e.first_token_t is None and e.body["seed"] == 11 for e in gone)
    assert stayed and not any(e.aborted for e in stayed) and all("seed" not in e.body for e in stayed)
    assert "cancelled" in out


# --- the generator ------------------------------------------------------------------------------


def test_script_is_python_3_9_and_standard_library_only(script):
    source = script.read_text()
    tree = ast.parse(source, feature_version=(3, 9))  # no match, no parenthesized with, ...
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported and imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
    assert "fuzzer" not in imported


def test_script_embeds_the_trace_and_the_criterion(script, small_trace):
    namespace: dict = {"__name__": "not_main"}
    exec(compile(script.read_text(), str(script), "exec"), namespace)  # noqa: S102 - defines, does not run
    data = namespace["DATA"]
    assert tf.from_dict(data["trace"]).content_hash() == small_trace.content_hash()
    assert data["criterion"]["request_id"] == "a" and data["criterion"]["metric"] == "max_itl"
    assert data["words"] == list(repro.WORDS)


def test_quotes_in_data_survive_embedding():
    trace = tf.from_dict({"name": "it's '''odd''' \\ name", "requests": [{"id": "r", "at_ms": 0, "prompt_tokens": 4,
                                                                           "max_tokens": 2}]})
    crit = criterion_from_verdict("ttft-outlier", {"request_id": "r", "metric": "ttft", "expected_s": 0.01})
    source = script_source(script_data(finding={"id": 1, "kind": "ttft-outlier"}, criterion=crit, trace=trace))
    namespace: dict = {"__name__": "not_main"}
    exec(compile(source, "repro.py", "exec"), namespace)  # noqa: S102 - the generated script, to read DATA
    assert namespace["DATA"]["trace"]["name"] == "it's '''odd''' \\ name"


def test_criterion_per_kind():
    latency = criterion_from_verdict("ttft-outlier", {"request_id": "r", "metric": "ttft", "threshold": 2.0,
                                                      "expected_s": 0.040})
    assert latency.threshold_s == pytest.approx(0.080)
    small = criterion_from_verdict("ttft-outlier", {"request_id": "r", "metric": "ttft", "expected_s": 0.005})
    assert small.threshold_s == pytest.approx(0.025)  # bound + 20 ms beats 2 x 5 ms
    assert criterion_from_verdict("cold-start", {"request_id": "r", "metric": "ttft"}).idle_before_s > 0
    assert criterion_from_verdict("hang", {"request_id": "r", "detail": "timeout"}).outcome == "timeout"
    assert criterion_from_verdict("error", {"request_id": "r", "detail": "weird"}).outcome is None
    assert criterion_from_verdict("crash", {}).request_id is None
    with pytest.raises(ConfigError, match="metric"):
        criterion_from_verdict("itl-stall", {"request_id": "r"})
    with pytest.raises(ConfigError, match="no repro criterion"):
        criterion_from_verdict("mystery", {})


def test_victim_must_be_in_the_trace(small_trace):
    crit = criterion_from_verdict("ttft-outlier", {"request_id": "gone", "metric": "ttft", "expected_s": 0.01})
    with pytest.raises(ConfigError, match="gone"):
        script_data(finding={"id": 1}, criterion=crit, trace=small_trace)


# --- pieces of the script, in process --------------------------------------------------------------


def test_sse_reader_counts_text_events_only():
    s = _script_run.Stream()
    lines = [b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}', b"",
             b": keep-alive", b"",
             b'data: {"choices":[{"index":0,"text":"hi"}]}', b"",
             b'data: {"choices":[{"index":1,"text":"x"}]}', b"",
             b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}', b"",
             b"data: [DONE]", b""]
    for t, line in enumerate(lines):
        if not s.line(line, float(t)):
            break
    assert s.ttft == 5.0 and s.token_times == [5.0]  # the role-only chunk is no token; choice 1 is not counted
    assert s.usage["completion_tokens"] == 2 and s.done and s.fault is None


def test_sse_reader_reports_malformed_events():
    s = _script_run.Stream()
    assert s.line(b"data: {not json", 0.0)
    assert not s.line(b"", 0.0)
    assert s.fault[0] == "malformed"
    s = _script_run.Stream()
    assert not s.line(b"garbage line", 0.0)
    assert s.fault[0] == "malformed"


def test_prompts_share_prefix_text_and_fit_lengths():
    class Words:  # one token per word, like the simulator's tokenizer
        exact = True

        def count(self, text, chat=False):
            return len(text.split())

    trace = tf.from_dict({"prefixes": {"p": 8}, "requests": [
        {"id": "x", "at_ms": 0, "prompt_tokens": 20, "prefix": "p", "max_tokens": 1},
        {"id": "y", "at_ms": 1, "prompt_tokens": 8, "prefix": "p", "max_tokens": 1},
        {"id": "z", "at_ms": 2, "prompt_tokens": 5, "max_tokens": 1}]}).to_dict()
    words = list(repro.WORDS)
    first = _script_net.build_prompts(trace, Words(), random.Random(1), words)
    assert {k: n for k, (_, n) in first.items()} == {"x": 20, "y": 8, "z": 5}
    assert first["x"][0].split()[:8] == first["y"][0].split()
    second = _script_net.build_prompts(trace, Words(), random.Random(2), words)
    assert second["y"][0] != first["y"][0]  # fresh text per run: no prefix-cache hit across runs


def test_data_json_reads_back(small_trace):
    crit = criterion_from_verdict("leak", {})
    data = script_data(finding={"id": 1, "kind": "leak"}, criterion=crit, trace=small_trace)
    text = script_source(data)
    start = text.index("r'''\n") + 5
    assert json.loads(text[start:text.index("\n'''", start)]) == json.loads(json.dumps(data))


def test_a_long_excess_verdicts_script_holds_runs_to_its_factor_and_its_excess():
    # A verdict at the long-excess factor (1.5x) needed 0.6 s above the bound in every run as well:
    # the script's threshold is the larger of the two, not 1.5x alone.
    verdict = {"request_id": "v", "metric": "ttft", "threshold": 1.5, "expected_s": 1.0, "min_excess_s": 0.6}
    crit = criterion_from_verdict("ttft-outlier", verdict)
    assert crit.factor == 1.5 and crit.threshold_s == pytest.approx(1.6)
    # A verdict of the usual factor, or one stored before the field: the margin as before.
    assert criterion_from_verdict("ttft-outlier", {**verdict, "threshold": 2.0, "min_excess_s": None}).threshold_s == 2.0
    assert criterion_from_verdict("ttft-outlier", {k: v for k, v in verdict.items() if k != "min_excess_s"}).threshold_s \
        == pytest.approx(1.5)


# --- option-slowdown: a run is a pair, the trace with and without the option -----------------------

# The carrier's seed is in flight while the others stream: the others' median E2E with it is
# judged against the same trace with the seed removed from every request.
OPTION_TRACE = {"requests": [
    {"id": "carrier", "at_ms": 0, "prompt_tokens": 8, "max_tokens": 24, "seed": 7, "temperature": 1.0},
    {"id": "ok1", "at_ms": 1, "prompt_tokens": 8, "max_tokens": 10},
    {"id": "ok2", "at_ms": 1, "prompt_tokens": 8, "max_tokens": 10},
    {"id": "ok3", "at_ms": 2, "prompt_tokens": 8, "max_tokens": 10},
]}
OPTION_VERDICT = {"kind": "option-slowdown", "ablated": "seed", "request_id": "carrier", "metric": "e2e",
                  "threshold": 1.25, "observed_s": 0.2, "expected_s": 0.1, "effect": 2.0}


class SeedSlowsEveryone(ServerState):
    """The misbehaving server's state, with every token gap ``slowdown`` times longer while a
    request with a seed is being answered (vllm-omni#6178: one seeded row, the whole batch slow)."""

    def __init__(self, slowdown: float):
        super().__init__()
        self.slowdown = slowdown

    @property
    def token_delay_s(self) -> float:
        seeded = any(e.body.get("seed") is not None and e.end_t is None and not e.aborted for e in self.log.values())
        return 0.006 * (self.slowdown if seeded else 1.0)

    @token_delay_s.setter
    def token_delay_s(self, value: float) -> None:
        pass  # the dataclass default: the property decides


def _option_script(tmp_path, verdict=OPTION_VERDICT, trace=OPTION_TRACE):
    trace = tf.from_dict(trace)
    crit = criterion_from_verdict("option-slowdown", verdict)
    path = tmp_path / "repro.py"
    path.write_text(script_source(script_data(finding={"id": 9, "kind": "option-slowdown"}, criterion=crit,
                                              trace=trace)))
    return path


def test_option_slowdown_criterion_names_the_option_and_has_no_fixed_threshold():
    crit = criterion_from_verdict("option-slowdown", OPTION_VERDICT)
    assert crit.ablate == "seed" and crit.request_id == "carrier" and crit.factor == 1.25
    assert crit.expected_s == 0.1 and crit.threshold_s is None  # each run measures its own baseline
    with pytest.raises(ConfigError, match="option"):
        criterion_from_verdict("option-slowdown", {**OPTION_VERDICT, "ablated": None})
    # A trace whose named request lost the option (minimized): the script names one that has it.
    other = dict(OPTION_TRACE, requests=[{**OPTION_TRACE["requests"][0], "seed": None, "id": "plain"},
                                         *OPTION_TRACE["requests"][1:], {**OPTION_TRACE["requests"][0], "id": "c2"}])
    data = script_data(finding={"id": 1}, criterion=crit, trace=tf.from_dict(other))
    assert data["criterion"]["request_id"] == "c2" and data["criterion"]["ablate"] == "seed"
    with pytest.raises(ConfigError, match="seed"):
        script_data(finding={"id": 1}, criterion=crit, trace=tf.from_dict({"requests": OPTION_TRACE["requests"][1:]}))


def test_option_slowdown_script_parses_and_judges_a_pair(tmp_path):
    source = _option_script(tmp_path).read_text()
    ast.parse(source, feature_version=(3, 9))
    namespace: dict = {"__name__": "not_main"}
    exec(compile(source, "repro.py", "exec"), namespace)  # noqa: S102 - defines, does not run
    crit, trace = namespace["DATA"]["criterion"], namespace["DATA"]["trace"]
    assert namespace["without_option"](trace, "seed")["requests"][0].get("seed") is None
    assert trace["requests"][0]["seed"] == 7  # the original is left alone

    def results(carrier_e2e, others_e2e, outcome="ok"):
        return [{"id": "carrier", "outcome": "ok", "e2e_s": carrier_e2e}] + [
            {"id": f"ok{i}", "outcome": outcome, "e2e_s": others_e2e} for i in (1, 2, 3)]

    hit, words, medians = namespace["judge_option"](crit, trace, results(0.9, 0.2), results(0.9, 0.1))
    assert hit is True and medians == (0.2, 0.1) and "2.00x >= 1.25x" in words  # the carrier's own e2e not counted
    hit, words, _ = namespace["judge_option"](crit, trace, results(0.1, 0.1), results(0.1, 0.1))
    assert hit is False and "1.00x < 1.25x" in words
    hit, _, medians = namespace["judge_option"](crit, trace, results(0.1, 0.1, "http-error"), results(0.1, 0.1))
    assert hit is None and medians is None  # too few others completed: the run tests nothing
    assert "without seed" in namespace["describe"](crit, None) and "1.25 x" in namespace["describe"](crit, None)


def test_an_option_slowdown_decided_on_token_gaps_is_judged_on_them_by_its_script(tmp_path):
    """A verdict that compared the others' ITL (fuzzer.oracle.ablation.statistic_of) gives a script that
    compares their mean token gaps, not their e2e, which prefill dilutes."""
    verdict = {**OPTION_VERDICT, "compared": "itl"}
    assert criterion_from_verdict("option-slowdown", verdict).metric == "itl"
    assert criterion_from_verdict("option-slowdown", OPTION_VERDICT).metric == "e2e"  # stored before the field
    source = _option_script(tmp_path, verdict=verdict).read_text()
    namespace: dict = {"__name__": "not_main"}
    exec(compile(source, "repro.py", "exec"), namespace)  # noqa: S102 - defines, does not run
    crit, trace = namespace["DATA"]["criterion"], namespace["DATA"]["trace"]

    def results(gap_s, e2e_s=1.0):  # ten tokens after a 0.5 s prefill
        times = [0.5 + i * gap_s for i in range(10)]
        return [{"id": "carrier", "outcome": "ok", "e2e_s": 9.0, "token_times_s": [0.1, 9.0]}] + [
            {"id": f"ok{i}", "outcome": "ok", "e2e_s": e2e_s, "token_times_s": times} for i in (1, 2, 3)]

    hit, words, medians = namespace["judge_option"](crit, trace, results(0.02), results(0.01))
    assert hit is True and medians == (pytest.approx(0.02), pytest.approx(0.01)) and "ITL" in words
    assert "2.00x >= 1.25x" in words  # the same e2e both times: an e2e criterion would not see it
    assert "median ITL" in namespace["describe"](crit, None)


@pytest.mark.parametrize(("slowdown", "expected_rc"), [(3.0, 1), (1.0, 0)])
async def test_option_slowdown_script_runs_pairs_against_a_server(tmp_path, slowdown, expected_rc):
    path = _option_script(tmp_path)
    async with misbehaving(SeedSlowsEveryone(slowdown)) as (url, state):
        rc, out, err = await run_script_async(path, "--base-url", url, "--runs", "3")
        seeded = [e for e in state.log.values() if e.body.get("seed") is not None]
    assert rc == expected_rc, out + err
    assert result_lines(out) == ["RESULT: REPRODUCED" if expected_rc else "RESULT: NOT REPRODUCED"]
    assert len(seeded) == 3 and all(e.x_request_id.startswith("carrier-") for e in seeded)  # once per pair
    assert out.count("with seed (the trace as found):") == 3
    assert out.count("without seed (removed from every request):") == 3
    # With a slowdown at least 2/3, without one at most 1/3: on a loaded machine (CI, 2 cores shared) one pair
    # without a slowdown measured 3.9x (stop 42), and one pair of three with it fell below 1.25x (stop 50, load 1.8).
    counts = ("2/3", "3/3") if expected_rc else ("0/3", "1/3")
    assert any(f"reproduced in {k} runs" in out for k in counts), out
    assert "median E2E of the others, median over runs" in out and "<- has seed" in out


def test_the_repro_measures_a_held_back_choice_as_the_executor_does():
    """The stand-alone script's stream reader and metric: with n > 1, the longest silence of any choice is
    the request's max ITL (fuzzer.execute.sse.StreamAccount.choice_gap), else a held-back choice's finding
    could not reproduce."""
    from fuzzer.report.repro import _script_main, _script_run

    stream = _script_run.Stream()
    for t, index in ((1.0, 0), (1.01, 0), (1.02, 0), (1.5, 1), (1.5, 1)):
        stream.line(b"data: " + json.dumps({"choices": [{"index": index, "text": "x"}]}).encode(), t)
        stream.line(b"", t)
    assert stream.token_times == [1.0, 1.01, 1.02] and stream.choice_gap == pytest.approx(0.5)
    result = {"token_times_s": [0.1, 0.11, 0.12], "choice_gap_s": stream.choice_gap, "outcome": "ok"}
    assert _script_main.metric_value(result, "max_itl") == pytest.approx(0.5)
    assert _script_main.metric_value({**result, "choice_gap_s": None}, "max_itl") == pytest.approx(0.01)
