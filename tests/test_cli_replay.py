"""`fuzz replay`: tables, JSON, storing executions, the API key, clear errors."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from click.testing import CliRunner

from fuzzer.cli import cli
from fuzzer.store import Store

from misbehaving_server import running

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


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "mini.json"
    path.write_text(json.dumps(TRACE))
    return path


def test_replay_prints_a_table_and_a_summary_per_run(server, trace_file):
    url, _ = server
    result = CliRunner().invoke(cli, ["replay", str(trace_file), "--target", url, "--runs", "2"])
    assert result.exit_code == 0, result.output
    assert result.output.count("run 1/2") == 1 and result.output.count("run 2/2") == 1
    for column in ("TTFT ms", "max ITL ms", "E2E ms", "late ms", "outcome"):
        assert column in result.output
    assert "http-error" in result.output and "3 requests, 1 failed" in result.output


def test_replay_json_has_every_run_and_request_in_seconds(server, trace_file):
    url, state = server
    result = CliRunner().invoke(cli, ["replay", str(trace_file), "--target", url, "--runs", "2", "--json", "--seed", "5"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["seed"] == 5 and data["server"]["kind"] == "vllm" and len(data["runs"]) == 2
    for run in data["runs"]:
        reqs = {r["id"]: r for r in run["requests"]}
        assert reqs["ok_a"]["outcome"] == "ok" and reqs["e500_c"]["outcome"] == "http-error"
        assert 0 < reqs["ok_a"]["ttft_s"] < 1 and reqs["ok_b"]["ttft_s"] is None and reqs["ok_b"]["e2e_s"] > 0
        assert reqs["ok_a"]["prompt_tokens"] == 40
        for r in run["requests"]:
            assert r["x_request_id"].startswith(r["id"] + "-") and r["x_request_id"] in state.log


def test_replay_stores_executions_with_db(server, trace_file, tmp_path):
    url, _ = server
    db = tmp_path / "replay.db"
    result = CliRunner().invoke(cli, ["replay", str(trace_file), "--target", url, "--runs", "2", "--db", str(db)])
    assert result.exit_code == 0, result.output
    with Store.open(db) as store:
        ids = store.execution_ids()
        assert len(ids) == 2
        stored = store.get_execution(ids[0])
        assert {r.request_id for r in stored.requests} == {"ok_a", "ok_b", "e500_c"}


def test_the_api_key_comes_from_the_environment_and_is_never_written(server, trace_file, tmp_path):
    url, state = server
    secret = "sk-never-written-anywhere"
    db = tmp_path / "key.db"
    result = CliRunner(env={"MY_KEY": secret}).invoke(
        cli, ["replay", str(trace_file), "--target", url, "--runs", "1", "--json", "--api-key-env", "MY_KEY", "--db", str(db)]
    )
    assert result.exit_code == 0, result.output
    assert secret not in result.output
    assert secret.encode() not in db.read_bytes()
    sent = [e.authorization for e in state.log.values() if e.x_request_id in {r["x_request_id"] for r in json.loads(result.output)["runs"][0]["requests"]}]
    assert sent and all(a == f"Bearer {secret}" for a in sent)


def test_an_unreachable_target_is_one_line_and_exit_2(trace_file, unused_tcp_port):
    result = CliRunner().invoke(cli, ["replay", str(trace_file), "--target", f"http://127.0.0.1:{unused_tcp_port}", "--runs", "1"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach http://127.0.0.1:")


def test_without_target_replay_starts_the_simulator_in_its_own_process():
    from conftest import CORPUS

    result = CliRunner().invoke(cli, ["replay", str(CORPUS / "vllm-37308.json"), "--runs", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    run = data["runs"][0]
    assert data["server"]["kind"] == "vllm" and run["failed"] == 0 and run["idle_after"] is True
    assert run["target"].startswith("http://127.0.0.1:")
    assert [r["id"] for r in run["requests"]] == ["r08", "r05", "r04", "r06", "r07", "r02"]
