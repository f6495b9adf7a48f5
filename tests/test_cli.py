"""The CLI contract of ARCHITECTURE.md, "Store and CLI": every command present, helped, exemplified and documented."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from conftest import ROOT

from fuzzer import __version__
from fuzzer.cli import campaign as campaign_cli
from fuzzer.cli import cli
from fuzzer.errors import ConfigError
from fuzzer.store import Store

SPEC_COMMANDS = [
    "campaign", "status", "findings", "show", "minimize", "export", "import", "replay", "calibrate", "sim", "report",
]


@pytest.fixture
def runner():
    return CliRunner()


def test_every_spec_command_is_listed(runner):
    result = runner.invoke(cli, ["--help"])
    assert result.exit_code == 0
    listed = re.findall(r"^  (\w+)\s", result.output.split("Commands:")[1], flags=re.M)
    assert sorted(listed) == sorted(SPEC_COMMANDS)


@pytest.mark.parametrize("name", SPEC_COMMANDS)
def test_every_command_has_help_with_an_example(runner, name):
    for flag in ("--help", "-h"):
        result = runner.invoke(cli, [name, flag])
        assert result.exit_code == 0, result.output
        assert "Example:" in result.output
        assert f"fuzz {name}" in result.output.split("Example:")[1]


@pytest.mark.parametrize("name", SPEC_COMMANDS)
def test_every_command_is_in_the_readme(name):
    readme = (ROOT / "README.md").read_text()
    assert f"fuzz {name}" in readme


def test_version(runner):
    result = runner.invoke(cli, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_replay_reports_a_bad_field_in_one_line(runner, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"requests": [{"id": "a", "at_ms": 0, "prompt_tokens": 5, "max_tokens": 0}]}))
    result = runner.invoke(cli, ["replay", str(bad)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert lines == [f"error: {bad}: requests[0].max_tokens: must be >= 1, got 0"]


def test_findings_and_show_on_a_missing_database(runner, tmp_path):
    missing = tmp_path / "none.db"
    for args in (["findings"], ["show", "1"], ["status"]):
        result = runner.invoke(cli, [*args, "--db", str(missing)])
        assert result.exit_code == 2
        assert result.output.startswith("error: no database at")
        assert len(result.output.strip().splitlines()) == 1
    assert not missing.exists()


def test_findings_json_fields_and_unknown_id(runner, tmp_path, seed_trace):
    path = tmp_path / "f.db"
    with Store.open(path) as s:
        s.add_finding(kind="ttft-outlier", signature="sig", trace=seed_trace, verdict={"p_value": 0.001},
                      slowdown=14.5, reproduced="3/3")
    result = runner.invoke(cli, ["findings", "--db", str(path), "--json"])
    assert result.exit_code == 0
    (row,) = json.loads(result.output)
    assert {k: row[k] for k in ("id", "kind", "slowdown", "reproduced", "requests", "minimized")} == {
        "id": 1, "kind": "ttft-outlier", "slowdown": 14.5, "reproduced": "3/3", "requests": 6, "minimized": False,
    }
    shown = runner.invoke(cli, ["show", "1", "--db", str(path), "--json"])
    assert shown.exit_code == 0 and json.loads(shown.output)["trace"]["name"] == "vllm-37308"
    table = runner.invoke(cli, ["show", "1", "--db", str(path)])
    assert table.exit_code == 0 and "r08" in table.output and "ttft-outlier" in table.output
    unknown = runner.invoke(cli, ["show", "42", "--db", str(path)])
    assert unknown.exit_code == 2
    assert unknown.output.strip() == "error: no finding with id 42 (see `fuzz findings` for the ids)"


def test_campaign_seeds_come_from_the_corpus_folder_wherever_fuzz_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # No ./corpus: the project's own seeds (the README's main job run from anywhere).
    assert campaign_cli._seed_folder(None) == ROOT / "corpus"
    names = {t.name for t in campaign_cli._load_seeds(campaign_cli._seed_folder(None))}
    assert len(names) == len(list((ROOT / "corpus").glob("*.json"))) and "vllm-37308" in names
    # A ./corpus folder wins over them.
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "one.json").write_text((ROOT / "corpus" / "kv-fill.json").read_text())
    assert campaign_cli._seed_folder(None).resolve() == (tmp_path / "corpus").resolve()
    assert len(campaign_cli._load_seeds(campaign_cli._seed_folder(None))) == 1
    # A named folder must exist; with no seeds anywhere the campaign generates its own.
    with pytest.raises(ConfigError, match="does not exist"):
        campaign_cli._seed_folder(str(tmp_path / "missing"))
    (tmp_path / "corpus" / "one.json").unlink()
    (tmp_path / "corpus").rmdir()
    monkeypatch.setattr(campaign_cli, "BUNDLED_CORPUS", tmp_path / "nowhere")
    assert campaign_cli._seed_folder(None) is None and campaign_cli._load_seeds(None) == []


def test_a_campaign_whose_server_stayed_down_prints_its_summary_then_one_error_line(monkeypatch, tmp_path):
    from fuzzer.search.settings import ExitReason, Stats, Summary

    stats = Stats(campaign_id=1, phase="done", executions=8, execs_per_min=0.6, corpus=5, favoured=4, features=187,
                  stability=0.5, findings=0, candidates=1, confirmations=1, elapsed_s=751.0, since_last_find_s=None,
                  server="down", time_s={"recover": 724.0, "fuzz": 15.0})

    async def stopped(*args, **kwargs):
        return Summary(1, ExitReason.SERVER_DOWN, stats, (), False, "cannot connect to 127.0.0.1:8101")

    monkeypatch.setattr(campaign_cli, "_run", stopped)
    result = CliRunner().invoke(cli, ["campaign", "--target", "http://127.0.0.1:8101", "--db", str(tmp_path / "c.db")])
    assert result.exit_code == 2, result.output
    assert "the server stopped answering; everything is saved" in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot connect to 127.0.0.1:8101" in errors[0] and "resume" in errors[0]


def test_a_new_findings_line_says_what_its_slowdown_is_over():
    from fuzzer.cli._render import slowdown_words

    # An option-slowdown is over the same trace without the option, not over an idle server.
    assert slowdown_words(1.48, "logprobs") == ", 1.5x slower with logprobs than without"
    assert slowdown_words(21.5, None) == ", 21.5x slower than idle"
    # A request that also waited by design: the figure beyond its FCFS bound is said beside the idle one.
    assert slowdown_words(1829.0, None, 1.66) == ", 1829.0x slower than idle, 1.7x its FCFS bound"
    assert slowdown_words(1.48, "logprobs", None) == ", 1.5x slower with logprobs than without"
    assert slowdown_words(None, None) == ""


def test_findings_list_and_show_give_the_figure_over_the_fcfs_bound(runner, tmp_path, seed_trace):
    """`fuzz findings` headlines a KV stall 1829x idle that is 1.65x its FCFS bound with both figures."""
    from fuzzer.oracle.verdict import Verdict

    path = tmp_path / "b.db"
    verdict = {"kind": "itl-stall", "decision": "different", "request_id": "r08", "metric": "e2e",
               "observed_s": 18.29, "expected_s": 18.29 / 1.65, "idle_s": 0.01, "threshold": 1.5}
    assert Verdict.from_dict(verdict).over_bound == pytest.approx(1.65)
    assert Verdict.from_dict({**verdict, "ablated": "seed"}).over_bound is None
    with Store.open(path) as s:
        s.add_finding(kind="itl-stall", signature="sig", trace=seed_trace, verdict=verdict, slowdown=1829.0,
                      reproduced="3/3")
        # Stored before the key was kept, or with no bound at all.
        s.add_finding(kind="leak", signature="sig2", trace=seed_trace, verdict={"decision": "different"},
                      slowdown=None, reproduced="3/3")
    rows = json.loads(runner.invoke(cli, ["findings", "--db", str(path), "--json"]).output)
    assert [round(r["over_bound"], 2) if r["over_bound"] else None for r in rows] == [1.65, None]
    table = runner.invoke(cli, ["findings", "--db", str(path)])
    assert table.exit_code == 0 and "over bound" in table.output and "1.7x" in table.output
    shown = runner.invoke(cli, ["show", "1", "--db", str(path)])
    assert "slowdown: 1829.0x over idle, 1.7x its FCFS bound, reproduced 3/3" in shown.output
