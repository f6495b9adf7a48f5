"""The fuzzer against a real vLLM server (CPU build): detection, exact prompts, metrics, KV capacity, calibration, replay.

The session's stock server (tests/vllm_cpu/conftest.py, random-weight Llama) is driven through the
CLI in subprocesses (`python -m fuzzer ...`), as a user would; results are read from the CLI's
--json output and from the campaign database (plain SQLite). Only that the target works end to
end is checked here, not what the oracle concludes about it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from fuzzer import trace as trace_format

from . import schedules
from .conftest import MAX_MODEL_LEN, SERVED_MODEL_NAME, group_members, post_json, server_cpus

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
# vLLM's CPU defaults for the API server, and the KV cache of 64 MiB (conftest.SERVER_ARGS):
# 32768 tokens in blocks of 128 for this model.
TOKEN_BUDGET = 2048
KV_BLOCK_SIZE = 128
KV_BLOCKS = 256
# `fuzz calibrate --repeats 1` took 4 min here on 2 cores shared with other test runs, and over
# 15 min once under heavier load (a noisy round is measured twice); an idle machine is faster.
CLI_TIMEOUT_S = 1800

SMALL = trace_format.from_dict({"name": "vllm-small", "requests": [
    {"id": "plain", "at_ms": 0, "prompt_tokens": 40, "max_tokens": 8},
    {"id": "chat", "at_ms": 5, "prompt_tokens": 300, "max_tokens": 8, "api": "chat"},
    {"id": "long", "at_ms": 10, "prompt_tokens": 1000, "max_tokens": 4},
]})


def _fuzz(*args: str, timeout_s: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fuzzer", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout_s, check=False)


def _json_of(done: subprocess.CompletedProcess, *ok: int) -> dict:
    assert done.returncode in ok, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def calibrated(vllm_server, tmp_path_factory) -> tuple[Path, dict]:
    """`fuzz calibrate` once against the session's server (one repeat per probe: minutes on 2 cores)."""
    db = tmp_path_factory.mktemp("vllm-cal") / "vllm.db"
    done = _fuzz("calibrate", "--target", vllm_server.base_url, "--db", str(db), "--repeats", "1", "--json")
    return db, _json_of(done, 0)


def _replay(url: str, db: Path, trace_path: Path) -> dict:
    # Exit 1 is a confirmed finding: a verdict, which is not what these tests look at.
    return _json_of(_fuzz("replay", str(trace_path), "--target", url, "--db", str(db), "--runs", "1", "--json"), 0, 1)


def _timeline(out: dict) -> str:
    """Each verdict, and each run's requests (sent, first token), its client lag and warnings: why a
    verdict went as it did. A string, which pytest prints whole (a tuple's repr it cuts short)."""
    lines = [f"verdict {v.get('decision')} {v.get('kind')} on {v.get('request_id')} by {v.get('method')}, "
             f"reproduced {v.get('reproduction')}: {v.get('evidence') or v.get('detail')}"
             for v in out.get("verdicts", [])]
    for run in out.get("runs", []):
        lines.append(f"client lag {run.get('client_lag_s')}, warnings {run.get('warnings')}")
        lines += [f"  {r['id']}: sent {r.get('sent_s')} ttft {r.get('ttft_s')} outcome {r.get('outcome')}"
                  for r in run.get("requests", [])]
    return "\n".join(lines)


def test_the_server_runs_as_three_processes_in_a_group_of_its_own(vllm_server):
    members = group_members(vllm_server.pid)
    assert vllm_server.pid in members and len(members) >= 3, members  # API server, engine core, worker
    print(f"\nvLLM ready in {vllm_server.ready_s:.1f} s")


def test_the_engine_leaves_a_cpu_to_the_client_and_the_api_server(vllm_server):
    cpus = server_cpus()
    if cpus is None:
        pytest.skip("one CPU (or FUZZ_VLLM_SERVER_CPUS=all): nothing to leave to the client")
    engine = [pid for pid in group_members(vllm_server.pid) if pid != vllm_server.pid]
    assert len(engine) >= 2, engine  # engine core and worker
    for pid in engine:
        for task in Path(f"/proc/{pid}/task").iterdir():  # every thread, the worker's compute thread included
            try:
                assert os.sched_getaffinity(int(task.name)) <= cpus, (pid, task.name)
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
    free = set(os.sched_getaffinity(0)) - cpus
    assert free, "the test process has a CPU the engine does not use"
    assert free <= os.sched_getaffinity(vllm_server.pid), "the API server may use it too"


def test_tokenize_counts_the_prompt_the_completion_reports(vllm_server):
    words = " ".join(["the", "world", "of", "school"] * 25)
    counted = post_json(vllm_server.base_url + "/tokenize", {"model": SERVED_MODEL_NAME, "prompt": words})
    assert counted["count"] == 101  # one token a word, and <s>
    answer = post_json(vllm_server.base_url + "/v1/completions",
                       {"model": SERVED_MODEL_NAME, "prompt": words, "max_tokens": 3, "ignore_eos": True})
    assert (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]) == (101, 3), answer["usage"]


@pytest.mark.slow
@pytest.mark.timeout(CLI_TIMEOUT_S + 60)
def test_calibration_fits_the_server_and_reads_its_kv_capacity(calibrated):
    _, cal = calibrated
    assumption = cal["assumption"]
    # The KV capacity comes from /metrics' vllm:cache_config_info (num_gpu_blocks, block_size).
    assert assumption["kv_blocks"] == KV_BLOCKS and assumption["block_size"] == KV_BLOCK_SIZE, assumption
    assert assumption["token_budget"] == TOKEN_BUDGET
    # Stock vLLM has no long-prefill cap (--long-prefill-token-threshold 0): the cap probe must not invent one.
    assert assumption["long_prefill_threshold"] == 0, assumption
    assert cal["ttft_fit"]["slope"] > 0 and cal["ttft_fit"]["n"] >= 5
    # Attention makes a long prompt's prefill grow faster than its length (2048 tokens ~0.12 s, 8000
    # ~1.5 s on one machine): the chunked probes show it and the model carries it. (Per decode
    # sequence the tiny model costs next to nothing: that fit may be 0 on a fast machine.)
    assert cal["model"]["prefill_token_s"] > 0 and cal["model"]["prefill_pair_s"] > 0, cal["model"]
    assert cal["model"]["decode_seq_s"] >= 0
    print(f"\ncalibration: ttft {cal['ttft_fit']['intercept'] * 1e3:.0f} ms + {cal['ttft_fit']['slope'] * 1e3:.3f} ms/token,"
          f" decode {cal['model']['decode_seq_s'] * 1e3:.2f} ms/seq, noise {cal['noise']}")


@pytest.mark.slow
@pytest.mark.timeout(2 * CLI_TIMEOUT_S)
def test_replay_detects_vllm_builds_exact_prompts_and_samples_its_metrics(vllm_server, calibrated, tmp_path):
    db, _ = calibrated
    path = tmp_path / "small.json"
    trace_format.dump(SMALL, path)
    out = _replay(vllm_server.base_url, db, path)

    server = out["server"]
    assert server["kind"] == "vllm" and server["version"] == "0.32.0", server
    assert server["model"] == SERVED_MODEL_NAME and server["max_model_len"] == MAX_MODEL_LEN
    for feature in ("completions", "chat", "stream_options", "ignore_eos", "tokenize"):
        assert server["capabilities"][feature], feature
    assert out["runs"]
    for run in out["runs"]:
        assert run["failed"] == 0 and run["idle_after"] is True, run
        assert not [w for w in run["warnings"] if "prompt" in w], run["warnings"]
        for r in run["requests"]:
            assert r["outcome"] == "ok", r
            # usage.prompt_tokens as the server counted it (the chat template included).
            assert r["prompt_tokens"] == SMALL.request(r["id"]).prompt_tokens, r
            assert r["completion_tokens"] == SMALL.request(r["id"]).max_tokens, r

    # /metrics was sampled through every execution: the vLLM gauges, KV usage a fraction.
    with sqlite3.connect(db) as con:
        samples = [json.loads(m) for (m,) in con.execute("SELECT metrics FROM metric_samples")]
    assert samples
    kv = [s["kv_usage"] for s in samples if "kv_usage" in s]
    assert kv and all(0.0 <= u <= 1.0 for u in kv), kv[:20]
    assert max(kv) > 0.0
    assert max(s.get("running", 0) for s in samples) >= 1


# Clients that leave: one while its prompt (three step budgets) is being computed, one after a few tokens.
GONE = trace_format.from_dict({"name": "vllm-gone", "requests": [
    {"id": "mid_prefill", "at_ms": 0, "prompt_tokens": 6000, "max_tokens": 64, "disconnect_after_ms": 150},
    {"id": "mid_stream", "at_ms": 5, "prompt_tokens": 500, "max_tokens": 400, "cancel_after_tokens": 4},
    {"id": "after", "at_ms": 400, "prompt_tokens": 200, "max_tokens": 8},
]})


def test_stock_vllm_gives_back_the_kv_of_requests_left_mid_prefill_and_mid_stream(vllm_server, calibrated, tmp_path):
    # Once nothing runs or waits, the leak check reads vLLM's KV usage against its level before the execution
    # (fuzzer.execution.KV_HELD_MARGIN): vLLM v1 runs a step for finished and aborted requests, so the gauge is
    # current, and the blocks of requests whose clients left are given back.
    db, _ = calibrated
    path = tmp_path / "gone.json"
    trace_format.dump(GONE, path)
    out = _replay(vllm_server.base_url, db, path)
    assert out["runs"]
    for run in out["runs"]:
        assert run["idle_after"] is True, run
        assert not [w for w in run["warnings"] if "KV cache in use" in w], run["warnings"]
        outcomes = {r["id"]: r["outcome"] for r in run["requests"]}
        assert outcomes == {"mid_prefill": "cancelled", "mid_stream": "cancelled", "after": "ok"}, run
    assert "leak" not in {v["kind"] for v in out["findings"]}, _timeline(out)


@pytest.mark.slow
@pytest.mark.timeout(2 * CLI_TIMEOUT_S)
def test_a_corpus_trace_replays_end_to_end(vllm_server, calibrated):
    db, _ = calibrated
    corpus_file = ROOT / "corpus" / "stream-mix.json"  # completions and chat, streamed and not
    trace = trace_format.load(corpus_file)
    assert any(r.stream for r in trace.requests) and not all(r.stream for r in trace.requests)
    out = _replay(vllm_server.base_url, db, corpus_file)
    assert out["server"]["kind"] == "vllm"
    for run in out["runs"]:
        assert run["failed"] == 0, run
        for r in run["requests"]:
            request = trace.request(r["id"])
            assert r["outcome"] == "ok" and r["prompt_tokens"] == request.prompt_tokens, r
            # A first token is measured on a stream only; a non-streamed answer has its end.
            first = r["ttft_s"]
            assert (first is not None and first > 0) if request.stream else (first is None and r["e2e_s"] > 0), (
                r, _timeline(out))


@pytest.mark.slow
@pytest.mark.timeout(2 * CLI_TIMEOUT_S)
@pytest.mark.parametrize(("cls", "schedule", "victim"), [
    ("planted.LifoAdmission", schedules.lifo, "A1"),
    ("planted.HolLongestFirst", schedules.hol, "S"),
])
def test_the_oracle_finds_a_planted_ordering_bug_with_its_victim_and_nothing_on_stock_vllm(
        cls, schedule, victim, vllm_server, vllm_server_factory, vllm_speed, calibrated, tmp_path):
    """The planted-bug schedules (schedules.py, as benchmarks/vllm's planted-*.json traces, timed for
    this machine): the victim is found on the planted scheduler by the order of first tokens (the
    step model puts both victims under 2x their FCFS bounds) or by its bound at the long-excess
    factor, and stock vLLM serving the same trace
    in FCFS order gives no finding. Both are judged by the stock server's calibration: the planted
    class changes which request a step serves, not what a step costs."""
    db, _ = calibrated
    trace_path = tmp_path / f"{cls}.json"
    trace_path.write_text(json.dumps(schedules.as_trace(cls.replace(".", "-"), schedule(vllm_speed, 0))))
    stock = _replay(vllm_server.base_url, db, trace_path)
    assert stock["findings"] == [], _timeline(stock)
    planted = vllm_server_factory(scheduler_cls=cls)
    mine = tmp_path / "planted.db"
    with sqlite3.connect(db) as source, sqlite3.connect(mine) as copy:
        source.backup(copy)
    with sqlite3.connect(mine) as con:  # the stock calibration, under the planted server's key
        (data,) = con.execute("SELECT data FROM calibrations ORDER BY id DESC LIMIT 1").fetchone()
        con.execute("INSERT INTO calibrations (target_key, data, created_at) SELECT ?, data, created_at FROM calibrations "
                    "WHERE data = ? LIMIT 1", (f"{planted.base_url}#{SERVED_MODEL_NAME}", data))
    out = _replay(planted.base_url, mine, trace_path)
    if not out["findings"]:
        # Once more: CI (stop 42) saw one replay of LifoAdmission on a busy 2-core machine without a
        # finding, where 7 runs here, 6 beside busy loops, found it. Shown, not hidden: a warning in
        # pytest's summary carries the first try's verdicts and timeline, and a second miss fails.
        warnings.warn(f"{cls}: no finding on the first replay; replayed once more.\n{_timeline(out)}", stacklevel=1)
        out = _replay(planted.base_url, mine, trace_path)
    findings = out["findings"]
    assert [(f["request_id"], f["kind"]) for f in findings] == [(victim, "ttft-outlier")], _timeline(out)
    # Decided by the order of first tokens, or, where the victim was also far above its bound (1.5x,
    # and its own work and 40 steps over: the long-excess factor; HolLongestFirst's S in CI, stop 33),
    # by the bound at that factor.
    by_order = bool(findings[0]["overtakers"]) and "order of first tokens" in findings[0]["evidence"]
    assert by_order or (findings[0]["threshold"] == 1.5 and findings[0]["min_excess_s"]), findings[0]
