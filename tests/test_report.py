"""fuzz report: a self-contained HTML page of a real (virtual-time) campaign."""

from __future__ import annotations

import asyncio
import base64
import json
import re

import pytest
from click.testing import CliRunner
from conftest import CORPUS

from fuzzer import trace as tf
from fuzzer.cli import cli
from fuzzer.report import html as report
from fuzzer.search.campaign import Campaign
from fuzzer.search.settings import Settings
from fuzzer.sim import VirtualTarget
from fuzzer.store import Store

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def campaign_db(tmp_path_factory):
    """A short campaign that finds the planted logprobs stall (as in test_campaign)."""
    path = tmp_path_factory.mktemp("report") / "night.db"
    store = Store.open(path)
    target = VirtualTarget(pathologies=("logprobs-batch-cost",), seed=2)
    seeds = [tf.load(CORPUS / "n-logprobs.json"), tf.load(CORPUS / "vllm-37308.json")]
    campaign = Campaign(target, store, Settings(seed=5, max_execs=12), seeds=seeds, target_key="sim:test")
    asyncio.run(campaign.run())
    store.close()
    return path


def test_gather_reads_the_campaign(campaign_db):
    with Store.open(campaign_db, create=False) as store:
        data = report.gather(store)
        assert data.campaign is not None
        assert len(data.executions) == store.count_executions(campaign_id=data.campaign["id"])
        assert data.findings and all(f.campaign_id == data.campaign["id"] for f in data.findings)
    assert data.corpus and data.features > 0
    cov = report.coverage_series(data)
    assert [n for _, n in cov] == sorted({n for _, n in cov})  # coverage only grows
    assert cov[-1][1] <= data.features
    assert [n for _, n in report.corpus_series(data)] == list(range(1, len(data.corpus) + 1))
    assert len(report.findings_series(data)) == len(data.findings)  # each placed at its confirmation
    # Where the time went: the campaign's phases, as its last checkpoint saw them.
    assert data.time_s["calibrate"] > 0 and data.time_s["seed"] > 0 and set(data.time_s) >= {"fuzz", "confirm", "other"}
    _starts, per_min, width = report.rate_series(data)
    total = sum(sum(v) for v in per_min.values()) * width
    assert total == pytest.approx(len(data.executions))


def test_html_is_self_contained_with_plots_and_findings(campaign_db):
    with Store.open(campaign_db, create=False) as store:
        data = report.gather(store)
    page = report.render_html(data, generated_at=0.0)
    assert page.startswith("<!doctype html>") and page.rstrip().endswith("</html>")
    # no external asset: every src is inline data, no link/script tags
    assert re.findall(r"src='([^']*)'", page) and all(s.startswith("data:image/png;base64,")
                                                       for s in re.findall(r"src='([^']*)'", page))
    assert "<link" not in page and "<script" not in page and "http://" not in page.split("<h2>Findings")[0]
    images = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    assert len(images) == 4 and all(base64.b64decode(i).startswith(PNG_MAGIC) for i in images)
    for caption in ("Coverage and findings over time", "Executions per minute, by purpose", "Time by phase",
                    "Corpus growth"):
        assert caption in page
    for f in data.findings:
        assert f"<td>{f.signature}</td>" in page and f"<td>{f.kind}</td>" in page


def test_html_without_matplotlib_says_so(campaign_db):
    with Store.open(campaign_db, create=False) as store:
        data = report.gather(store)
    page = report.render_html(data, images={}, generated_at=0.0)
    assert "matplotlib is not installed" in page and "<img" not in page


def test_empty_database(tmp_path):
    with Store.open(tmp_path / "empty.db") as store:
        data = report.gather(store)
    page = report.render_html(data, generated_at=0.0)
    assert "No campaign in this database" in page and "No findings." in page


def test_cli_report(campaign_db, tmp_path):
    out = tmp_path / "night.html"
    result = CliRunner().invoke(cli, ["report", "--db", str(campaign_db), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output
    assert out.read_text().count("data:image/png;base64,") == 4
    bad = CliRunner().invoke(cli, ["report", "--db", str(campaign_db), "--out", str(tmp_path / "no" / "x.html")])
    assert bad.exit_code == 2 and "error: cannot write" in bad.output


def test_status_shows_the_time_by_phase(campaign_db):
    result = CliRunner().invoke(cli, ["status", "--db", str(campaign_db), "--json"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output)
    assert stats["time_by_phase_s"]["seed"] >= 0 and "fuzz" in stats["time_by_phase_s"]
    assert 0.0 <= stats["fuzz_share"] <= 1.0
    plain = CliRunner().invoke(cli, ["status", "--db", str(campaign_db)])
    assert "time_by_phase_s" in plain.output and "%" in plain.output.split("time_by_phase_s")[1].splitlines()[0]


def test_an_option_slowdown_names_the_others_as_its_victims(tmp_path):
    """The request an option-slowdown names carries the option: the page and `fuzz show` say the others were slowed."""
    db = tmp_path / "option.db"
    trace = tf.from_dict({"requests": [*({"id": f"r{i}", "at_ms": i, "prompt_tokens": 8, "max_tokens": 8} for i in range(3)),
                                       {"id": "carrier", "at_ms": 3, "prompt_tokens": 8, "max_tokens": 8, "seed": 7}]})
    verdict = {"kind": "option-slowdown", "decision": "different", "request_id": "carrier", "metric": "e2e",
               "ablated": "seed", "threshold": 1.25, "observed_s": 0.2, "expected_s": 0.1, "idle_s": 0.1}
    with Store.open(db) as store:
        fid, _ = store.add_finding(kind="option-slowdown", signature="option-slowdown:x", trace=trace, verdict=verdict,
                                   slowdown=2.0, reproduced="3/3")
        page = report.render_html(report.gather(store), images={}, generated_at=0.0)
    assert "<td>the others (seed on carrier)</td>" in page
    shown = CliRunner().invoke(cli, ["show", str(fid), "--db", str(db)])
    assert shown.exit_code == 0, shown.output
    assert "slowdown: 2.0x (the other requests' median e2e with seed over without it)" in shown.output
    with Store.open(db) as store:  # a test that compared the others' token gaps (fuzzer.oracle.ablation.statistic_of)
        fid, _ = store.add_finding(kind="option-slowdown", signature="option-slowdown:y", trace=trace,
                                   verdict={**verdict, "compared": "itl"}, slowdown=2.0, reproduced="3/3")
    shown = CliRunner().invoke(cli, ["show", str(fid), "--db", str(db)])
    assert "slowdown: 2.0x (the other requests' median ITL with seed over without it)" in shown.output
