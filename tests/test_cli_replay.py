"""`fuzz replay`: tables, JSON, storing executions, the API key, clear errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading

import pytest
from click.testing import CliRunner
from misbehaving_server import running
from paper_target import PaperTarget

from fuzzer.cli import cli
from fuzzer.oracle.calibrate import calibrate
from fuzzer.store import Store

TRACE = {
    "name": "mini",
    "prefixes": {"p": 16},
    "requests": [
        {"id": "ok_a", "at_ms": 0, "prompt_tokens": 40, "prefix": "p", "max_tokens": 6},
        {"id": "ok_b", "at_ms": 10, "prompt_tokens": 24, "prefix": "p", "max_tokens": 4, "stream": False},
        {"id": "e500_c", "at_ms": 12, "prompt_tokens": 8, "max_tokens": 4},
    ],
}


@pytest.fixture(scope="module")
def server():
    """The test server in its own thread and loop, since the CLI runs its own asyncio.run."""
    with _served() as served:
        yield served


@contextlib.contextmanager
def _served():
    ready = threading.Event()
    box = {}

    def serve():
        async def main():
            async with running() as (url, state):
                box["url"], box["state"], box["stop"] = url, state, asyncio.Event()
                ready.set()
                await box["stop"].wait()

        loop = asyncio.new_event_loop()
        box["loop"] = loop
        loop.run_until_complete(main())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield box["url"], box["state"]
    box["loop"].call_soon_threadsafe(box["stop"].set)
    thread.join(10)


def _calibrated(path, *urls):
    calibration = asyncio.run(calibrate(PaperTarget(), rng=random.Random(0)))
    with Store.open(path) as store:
        for url in urls:
            store.save_calibration(url, calibration.to_dict())
    return path


@pytest.fixture(scope="module")
def calibrated_db(server, tmp_path_factory):
    """A database holding a calibration for the test server, so replay does not measure one first.

    The calibration comes from the paper-timed target (virtual time, milliseconds of work); the
    test server answers within a few milliseconds, well inside its bounds.
    """
    url, _ = server
    return _calibrated(tmp_path_factory.mktemp("cal") / "cal.db", url, "sim:none")


@pytest.fixture
def db(calibrated_db, tmp_path):
    copy = tmp_path / "replay.db"
    copy.write_bytes(calibrated_db.read_bytes())
    return copy


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "mini.json"
    path.write_text(json.dumps(TRACE))
    return path


def test_replay_prints_a_table_and_a_summary_per_run(server, trace_file, db):
    url, _ = server
    result = CliRunner().invoke(cli, ["replay", str(trace_file), "--target", url, "--runs", "2", "--db", str(db)])
    assert result.exit_code == 1, result.output  # the 500s of e500_c are a confirmed error finding
    assert "FINDING error on e500_c" in result.output and "oracle verdicts" in result.output
    assert result.output.count("run 1/2") == 1 and result.output.count("run 2/2") == 1
    for column in ("TTFT ms", "max ITL ms", "E2E ms", "late ms", "outcome"):
        assert column in result.output
    assert "http-error" in result.output and "3 requests, 1 failed" in result.output


def test_replay_json_has_every_run_and_request_in_seconds(server, trace_file, db):
    url, state = server
    result = CliRunner().invoke(
        cli, ["replay", str(trace_file), "--target", url, "--runs", "2", "--json", "--seed", "5", "--db", str(db)]
    )
    assert result.exit_code == 1, result.output
    data = json.loads(result.output)
    # The 500s are an error finding. (Whether the in-process test server's few milliseconds
    # ever look slow against the paper calibration depends on the machine's load; the
    # oracle's false-positive rate is measured on virtual time, tests/test_oracle.py.)
    errors = [f for f in data["findings"] if f["kind"] != "ttft-outlier"]
    assert [(f["kind"], f["request_id"]) for f in errors] == [("error", "e500_c")], data["findings"]
    assert {v["request_id"] for v in data["verdicts"]} == {"ok_a", "ok_b", "e500_c"}
    assert data["seed"] == 5 and data["server"]["kind"] == "vllm" and len(data["runs"]) == 2
    for run in data["runs"]:
        reqs = {r["id"]: r for r in run["requests"]}
        assert reqs["ok_a"]["outcome"] == "ok" and reqs["e500_c"]["outcome"] == "http-error"
        assert 0 < reqs["ok_a"]["ttft_s"] < 1 and reqs["ok_b"]["ttft_s"] is None and reqs["ok_b"]["e2e_s"] > 0
        assert reqs["ok_a"]["prompt_tokens"] == 40
        for r in run["requests"]:
            assert r["x_request_id"].startswith(r["id"] + "-") and r["x_request_id"] in state.log


def test_replay_stores_executions_with_db(server, trace_file, db):
    url, _ = server
    result = CliRunner().invoke(cli, ["replay", str(trace_file), "--target", url, "--runs", "2", "--db", str(db)])
    assert result.exit_code == 1, result.output
    with Store.open(db) as store:
        ids = store.execution_ids()
        assert len(ids) >= 2  # the runs asked for, then the confirmation runs
        stored = store.get_execution(ids[0])
        assert {r.request_id for r in stored.requests} == {"ok_a", "ok_b", "e500_c"}


def test_the_api_key_comes_from_the_environment_and_is_never_written(server, trace_file, db):
    url, state = server
    secret = "sk-never-written-anywhere"
    result = CliRunner(env={"MY_KEY": secret}).invoke(
        cli, ["replay", str(trace_file), "--target", url, "--runs", "1", "--json", "--api-key-env", "MY_KEY", "--db", str(db)]
    )
    assert result.exit_code == 1, result.output
    assert secret not in result.output
    assert secret.encode() not in db.read_bytes()
    sent = [e.authorization for e in state.log.values() if e.x_request_id in {r["x_request_id"] for r in json.loads(result.output)["runs"][0]["requests"]}]
    assert sent and all(a == f"Bearer {secret}" for a in sent)


def test_an_unreachable_target_is_one_line_and_exit_2(trace_file, unused_tcp_port):
    result = CliRunner().invoke(cli, ["replay", str(trace_file), "--target", f"http://127.0.0.1:{unused_tcp_port}", "--runs", "1"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach http://127.0.0.1:")


def test_a_trace_that_takes_an_unmanaged_server_down_says_so_in_one_line(tmp_path):
    # vLLM 0.32's CPU engine, `fuzz replay --target` of the seeded trace that crashes it (stop 66): its first run took
    # the server down, and the replay ended with "error: POST .../tokenize failed: ..." and nothing of the crash.
    dies = {"name": "dies", "requests": [{"id": "dies_a", "at_ms": 0, "prompt_tokens": 8, "max_tokens": 4},
                                         {"id": "ok_b", "at_ms": 5, "prompt_tokens": 8, "max_tokens": 4}]}
    path = tmp_path / "dies.json"
    path.write_text(json.dumps(dies))
    with _served() as (url, _):
        db = _calibrated(tmp_path / "dies.db", url)
        result = CliRunner().invoke(cli, ["replay", str(path), "--target", url, "--runs", "3", "--db", str(db)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    assert lines[0].startswith("error: the trace took the server down in run 1 (server gone: it refused a connection")
    assert "a crash candidate, not confirmed" in lines[0] and "the 1 run(s) made are stored in --db" in lines[0]
    with Store.open(db, create=False) as store:
        assert len(store.execution_rows()) == 1  # what ran is kept


def test_without_target_replay_starts_the_simulator_in_its_own_process(db):
    from conftest import CORPUS

    result = CliRunner().invoke(cli, ["replay", str(CORPUS / "vllm-37308.json"), "--runs", "1", "--json", "--db", str(db)])
    # Exit 1 would mean a confirmed finding on the clean simulator: against a calibration of
    # the paper-timed engine that happens only on a heavily loaded machine (the oracle's
    # false-positive rate is measured on virtual time, tests/test_oracle.py); the exit code
    # must agree with the findings either way.
    assert result.exit_code in (0, 1), result.output
    data = json.loads(result.output)
    assert (result.exit_code == 1) == bool(data["findings"]), result.output
    run = data["runs"][0]
    assert data["server"]["kind"] == "vllm" and run["failed"] == 0 and run["idle_after"] is True
    assert run["client_lag_s"] is not None and run["client_lag_s"] >= 0
    assert run["target"].startswith("http://127.0.0.1:")
    assert [r["id"] for r in run["requests"]] == ["r08", "r05", "r04", "r06", "r07", "r02"]


def test_a_planted_pathology_makes_replay_exit_1(db):
    from conftest import CORPUS

    with Store.open(db) as store:
        store.save_calibration("sim:logprobs-batch-cost", store.latest_calibration("sim:none"))
    result = CliRunner().invoke(
        cli, ["replay", str(CORPUS / "n-logprobs.json"), "--runs", "3", "--db", str(db), "--seed", "1",
              "--pathologies", "logprobs-batch-cost"],
    )
    assert result.exit_code == 1, result.output
    assert "FINDING" in result.output


def test_an_interrupted_replay_keeps_the_executions_made_so_far(server, trace_file, db, monkeypatch):
    """Each execution is stored as it is made: Ctrl-C in the third leaves the first two (exit 130, not 1)."""
    from fuzzer.execute.http import HttpTarget

    url, _ = server
    real = HttpTarget.execute
    made = []

    async def execute(self, trace, *, cut_s=None):
        if len(made) == 2:
            raise KeyboardInterrupt  # what Ctrl-C raises out of asyncio.run
        made.append(await real(self, trace, cut_s=cut_s))
        return made[-1]

    monkeypatch.setattr(HttpTarget, "execute", execute)
    result = CliRunner().invoke(cli, ["replay", str(trace_file), "--target", url, "--runs", "5", "--db", str(db)])
    assert result.exit_code == 130, result.output
    assert f"interrupted; the executions made so far are stored in {db}" in result.stderr
    with Store.open(db) as store:
        ids = store.execution_ids()
        assert len(ids) == 2
        assert [store.get_execution(i).started_at for i in ids] == [r.started_at for r in made]
        assert store.get_target(1)["url"] == url


def test_replay_json_has_aiperf_metrics_and_slo_results(server, trace_file, db):
    url, _ = server
    result = CliRunner().invoke(
        cli, ["replay", str(trace_file), "--target", url, "--runs", "3", "--json", "--db", str(db),
              "--goodput", "ttft:60000 e2el:60000"],
    )
    assert result.exit_code == 1, result.output
    data = json.loads(result.output)
    ttft = data["metrics"]["time_to_first_token"]
    assert ttft["unit"] == "ms" and set(ttft) >= {"avg", "p1", "p50", "p99", "min", "max", "std"}
    assert 0 < ttft["min"] <= ttft["p50"] <= ttft["max"]
    slo = data["slo"]
    assert slo["slo_ms"] == {"ttft": 60000, "e2el": 60000}
    # Only the request the server fails misses so generous an SLO: beside the error finding, not instead.
    assert [(f["kind"], f["request_id"]) for f in slo["findings"]] == [("slo-violation", "e500_c")]
    assert any(f["kind"] == "error" for f in data["findings"])
    assert slo["attainment"] == pytest.approx(2 / 3)
    text = CliRunner().invoke(cli, ["replay", str(trace_file), "--target", url, "--runs", "3", "--db", str(db),
                                    "--goodput", "ttft:60000"])
    assert "SLO ttft:60000 (ms): attainment 67%" in text.output
    bad = CliRunner().invoke(cli, ["replay", str(trace_file), "--goodput", "ttft=5"])
    assert bad.exit_code == 2 and bad.output.startswith("error: --goodput takes")
