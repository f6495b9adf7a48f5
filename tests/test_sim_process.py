"""``fuzz sim`` and SimProcess: the simulator as a command and as a child process."""

from __future__ import annotations

import json
import urllib.request

import aiohttp
import pytest
from click.testing import CliRunner

from fuzzer.cli import cli
from fuzzer.errors import ConfigError, TargetError
from fuzzer.sim.pathologies import NAMES
from fuzzer.sim.process import SimProcess


def test_list_describes_every_pathology():
    result = CliRunner().invoke(cli, ["sim", "--list"])
    assert result.exit_code == 0
    for name in NAMES:
        assert name in result.output
    assert "vLLM #37308" in result.output and "SGLang #22831" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--pathologies", "cold-start,warp"], "error: unknown pathology 'warp': choose from hol-prefix-burst"),
        (["--speed", "0"], "error: --speed must be > 0"),
    ],
)
def test_bad_options_are_one_line_errors(args, message):
    result = CliRunner().invoke(cli, ["sim", "--port", "0", *args])
    assert result.exit_code == 2
    assert result.output.startswith(message) and len(result.output.strip().splitlines()) == 1


def test_sim_process_serves_and_stops(tmp_path):
    truth = tmp_path / "gt.jsonl"
    with SimProcess(pathologies=("cold-start",), seed=3, speed=20.0, extra_args=("--ground-truth", str(truth))) as sim:
        assert sim.url.startswith("http://127.0.0.1:")
        body = json.dumps({"prompt": "a b c", "max_tokens": 4, "ignore_eos": True}).encode()
        request = urllib.request.Request(
            sim.url + "/v1/completions", data=body, headers={"Content-Type": "application/json", "X-Request-Id": "p1"}
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 4
        pid = sim.pid
    assert sim.pid is None
    with pytest.raises(OSError):
        urllib.request.urlopen(sim.url + "/health", timeout=2)
    (line,) = truth.read_text().splitlines()
    record = json.loads(line)
    assert record["request_id"] == "p1" and record["pathologies"] == ["cold-start"]
    assert pid > 0


async def test_sim_process_async_with():
    async with SimProcess(speed=10.0) as sim:
        async with aiohttp.ClientSession() as session:
            async with session.get(sim.url + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "sim-qwen2.5-0.5b"


def test_a_child_that_cannot_start_is_a_target_error():
    with pytest.raises(TargetError) as e:
        SimProcess(extra_args=("--no-such-option",)).start()
    assert "exited with status 2" in str(e.value) and "no-such-option" in str(e.value)


def test_bad_pathology_name_is_refused_before_starting():
    with pytest.raises(ConfigError):
        SimProcess(pathologies=("nope",))
