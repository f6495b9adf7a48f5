"""Variants (issue 17): one trace, or one finding, on several configurations of a launched server."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner
from conftest import CORPUS
from launch_support import marker, servers_with
from test_launch import FUZZ

from fuzzer.cli import cli
from fuzzer.cli._variants import parse_variants
from fuzzer.errors import ConfigError


def _sim(mark: str, pathologies: str) -> str:
    return shlex.join([sys.executable, "-m", "fuzzer", "sim", "--host", "127.0.0.1", "--port", "{port}",
                       "--speed", "10", "--seed", mark, "--pathologies", pathologies])


def test_variants_are_name_equals_args():
    assert parse_variants(['np1="-np 1"'.replace('"', ""), "off=--no-enable-prefix-caching"], {"f": "-x"}) == {
        "f": "-x", "np1": "-np 1", "off": "--no-enable-prefix-caching"}
    with pytest.raises(ConfigError, match='--variant must look like NAME="extra args"'):
        parse_variants(["-np 1"])
    with pytest.raises(ConfigError, match="'base' names the launch command itself"):
        parse_variants(["base=-np 1"])


def test_a_variant_without_a_launch_command_is_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["replay", str(CORPUS / "n-logprobs.json"), "--variant", "a=-np 1"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: --variant and --compare need --launch or --target-file: they are run beside the launch command"]


def _effect(text: str) -> float:
    return float(text.rstrip("x")) if text != "-" else 1.0


def test_replay_runs_the_trace_on_every_configuration(tmp_path):
    mark = marker()
    proc = subprocess.run(
        [FUZZ, "replay", str(CORPUS / "n-logprobs.json"), "--launch", _sim(mark, "logprobs-batch-cost"),
         "--variant", "fixed=--pathologies none", "--variant", "broken=--no-such-flag",
         "--runs", "3", "--seed", "1", "--db", str(tmp_path / "v.db"), "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr  # the planted bug is confirmed on the base configuration
    data = json.loads(proc.stdout)
    assert [c["name"] for c in data["configurations"]] == ["base", "fixed", "broken"]
    assert data["configurations"][2]["error"].startswith("the launched server exited with status 2 before it was ready")
    heavy = {r["configuration"]: r for r in data["table"] if r["finding"] == "e2e-outlier on heavy"}
    assert heavy["base"]["reproduces"] and int(heavy["base"]["reproduced"].split("/")[0]) >= 2
    # Without the planted pathology the same request is far less slow (the outcome differs).
    assert _effect(heavy["base"]["effect"]) > 3 * _effect(heavy["fixed"]["effect"])
    assert heavy["broken"]["effect"].startswith("did not run:")
    assert not servers_with(mark)


def test_export_adds_the_configuration_table_to_the_report(tmp_path):
    mark = marker()
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    shutil.copy(CORPUS / "n-logprobs.json", seeds)
    db = str(tmp_path / "e.db")
    # Calibrated first, so that the campaign's 30 s go to the seed and its confirmation on a loaded machine.
    proc = subprocess.run([FUZZ, "calibrate", "--launch", _sim(mark, "logprobs-batch-cost"), "--db", db],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([FUZZ, "campaign", "--launch", _sim(mark, "logprobs-batch-cost"), "--corpus", str(seeds),
                           "--db", db, "--duration", "30s", "--seed", "3"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "new finding 1" in proc.stdout, proc.stdout

    plain = subprocess.run([FUZZ, "export", "1", "--db", db, "--out", str(tmp_path / "plain")],
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    report = (tmp_path / "plain" / "1" / "report.md").read_text()
    assert "## Configurations" in report and "--no-enable-prefix-caching" in report  # vLLM's knobs, suggested

    proc = subprocess.run([FUZZ, "export", "1", "--db", db, "--out", str(tmp_path / "out"), "--runs", "3",
                           "--variant", "fixed=--pathologies none"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "out" / "1" / "report.md").read_text()
    table = report.split("## Configurations")[1]
    assert "| configuration | extra args | reproduced | effect |" in table
    base = next(ln for ln in table.splitlines() if ln.startswith("| base |"))
    fixed = next(ln for ln in table.splitlines() if ln.startswith("| fixed | `--pathologies none` |"))
    assert int(base.split("|")[3].split("/")[0]) >= 2
    assert _effect(base.split("|")[4].strip()) > 3 * _effect(fixed.split("|")[4].strip())
    assert not servers_with(mark)

    # fuzz minimize starts the command the finding was found on again (no --target, no --launch).
    proc = subprocess.run([FUZZ, "minimize", "1", "--db", db, "--max-execs", "3"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "next: fuzz export 1" in proc.stdout
    assert not servers_with(mark)


def test_compare_runs_the_trace_on_two_launch_commands_and_says_where_it_reproduces(tmp_path):
    mark = marker()
    proc = subprocess.run(
        [FUZZ, "replay", str(CORPUS / "n-logprobs.json"), "--launch", _sim(mark, "logprobs-batch-cost"),
         "--compare", _sim(mark, "none"), "--runs", "3", "--seed", "1", "--db", str(tmp_path / "c.db")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert "configuration compare: " in proc.stderr
    where = dict(ln.split(": reproduces on ") for ln in proc.stdout.splitlines() if ": reproduces on " in ln)
    # The planted cost shows as a latency finding on some request (which one, and its kind, vary with the
    # machine's load); it reproduces on the base command and not on the command without the pathology.
    assert any(places == "base" for places in where.values()), proc.stdout
    assert all("base" in places for places in where.values()), proc.stdout
    assert not servers_with(mark)


def test_replay_of_configurations_that_all_fail_to_start_is_an_error(tmp_path):
    mark = marker()
    broken = _sim(mark, "none") + " --no-such-flag"
    proc = subprocess.run([FUZZ, "replay", str(CORPUS / "n-logprobs.json"), "--launch", broken, "--compare", broken,
                           "--runs", "3", "--seed", "1", "--db", str(tmp_path / "f.db")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout
    assert "configuration base did not run: the launched server exited with status 2" in proc.stdout
    assert "Traceback" not in proc.stderr
    assert not servers_with(mark)
