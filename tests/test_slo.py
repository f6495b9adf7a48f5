"""SLO findings and AIPerf-shaped summaries (fuzzer.oracle.slo, fuzzer.oracle.summary)."""

from __future__ import annotations

import asyncio

import pytest

from fuzzer.errors import ConfigError
from fuzzer.execution import ExecutionResult, Outcome, RequestResult
from fuzzer.oracle import slo as slo_oracle
from fuzzer.oracle.kinds import Decision, FindingKind
from fuzzer.oracle.slo import Slo, goodput, verdicts
from fuzzer.oracle.summary import PERCENTILES, summarize
from fuzzer.trace import Request, Trace

TRACE = Trace(requests=(Request("a", 0, 100, 5), Request("b", 10, 100, 5)))


def _req(rid: str, ttft: float, gap: float = 0.01, tokens: int = 5, outcome: Outcome = Outcome.OK) -> RequestResult:
    times = tuple(ttft + gap * i for i in range(tokens))
    return RequestResult(request_id=rid, x_request_id=rid, scheduled_s=0.0, sent_s=0.0, outcome=outcome,
                         ttft_s=ttft, token_times_s=times, e2e_s=times[-1], completion_tokens=tokens,
                         prompt_tokens=100)


def _run(a_ttft: float, b_ttft: float = 0.05) -> ExecutionResult:
    return ExecutionResult(trace_hash=TRACE.content_hash(), target="t", started_at=0.0, duration_s=1.0,
                           requests=(_req("a", a_ttft), _req("b", b_ttft)))


def test_parse_takes_vllm_words():
    slo = Slo.parse(["ttft:500 tpot:50", "e2el:2000"])
    assert (slo.ttft_ms, slo.tpot_ms, slo.e2el_ms) == (500, 50, 2000)
    assert Slo.parse(["ttft:1,tpot:2"]).tpot_ms == 2
    assert Slo.parse([]) is None
    for bad in ("ttft=5", "itl:4", "ttft:0", "ttft:-1"):
        with pytest.raises(ConfigError, match="--goodput takes"):
            Slo.parse([bad])


def test_violation_needs_three_misses_and_sixty_percent():
    slo = Slo(ttft_ms=100)
    three = verdicts(TRACE, [_run(0.3), _run(0.3), _run(0.3)], slo)
    assert [v.request_id for v in three] == ["a"]
    v = three[0]
    assert v.kind is FindingKind.SLO_VIOLATION and v.is_finding and v.reproduction == "3/3"
    assert v.effect == pytest.approx(3.0) and v.p_value == pytest.approx(0.125)
    two = verdicts(TRACE, [_run(0.3), _run(0.3), _run(0.05)], slo)[0]
    assert two.decision is Decision.UNKNOWN and slo_oracle.undecided(two)
    rare = verdicts(TRACE, [_run(0.3)] + [_run(0.05)] * 5, slo)[0]
    assert rare.decision is Decision.UNSTABLE and not rare.is_finding
    assert verdicts(TRACE, [_run(0.05)] * 3, slo) == []


def test_failed_request_misses_and_tpot_is_judged():
    failed = ExecutionResult(trace_hash="x", target="t", started_at=0, duration_s=1,
                             requests=(_req("a", 0.05, outcome=Outcome.HTTP_ERROR), _req("b", 0.05)))
    assert goodput(failed, Slo(ttft_ms=100))["good"] == 1
    slow_decode = _run(0.05)
    assert Slo(tpot_ms=5).worst(slow_decode.requests[0]) == ("tpot", pytest.approx(2.0))


def test_goodput_and_attainment():
    g = goodput(_run(0.3), Slo(ttft_ms=100))
    assert g["good"] == 1 and g["requests"] == 2 and g["attainment"] == 0.5
    assert g["goodput_rps"] == pytest.approx(1 / 0.34)  # one good request over the run (last end at 0.34 s)


def test_examine_reruns_an_undecided_request_a_bounded_number_of_times():
    class Slow:
        name = "slow"
        runs = 0

        async def execute(self, trace):
            self.runs += 1
            return _run(0.3)

    target = Slow()
    found, extra = asyncio.run(slo_oracle.examine(target, TRACE, [_run(0.3), _run(0.05)], Slo(ttft_ms=100)))
    assert found[0].is_finding and len(extra) == target.runs == 2  # 3/4 misses: a violation

    class Fast(Slow):
        async def execute(self, trace):
            self.runs += 1
            return _run(0.05)

    fast = Fast()
    found, extra = asyncio.run(slo_oracle.examine(fast, TRACE, [_run(0.3), _run(0.3)], Slo(ttft_ms=100)))
    assert not found[0].is_finding and len(extra) <= slo_oracle.MAX_SLO_RUNS - 2


def test_summary_has_aiperf_shape():
    m = summarize([_run(0.1), _run(0.2)])
    keys = {"unit", "avg", *(f"p{q}" for q in PERCENTILES), "min", "max", "std"}
    for name in ("time_to_first_token", "inter_token_latency", "request_latency", "output_token_throughput",
                 "output_token_throughput_per_user", "output_sequence_length", "request_throughput"):
        assert set(m[name]) == keys, name
    ttft = m["time_to_first_token"]
    assert ttft["unit"] == "ms" and ttft["min"] == pytest.approx(50) and ttft["max"] == pytest.approx(200)
    assert ttft["p50"] == pytest.approx(75)
    assert m["inter_token_latency"]["avg"] == pytest.approx(10)
    assert m["output_token_throughput_per_user"]["avg"] == pytest.approx(100)
    empty = summarize([])
    assert empty["time_to_first_token"]["avg"] is None and empty["time_to_first_token"]["unit"] == "ms"


def test_show_json_summarizes_the_findings_executions(tmp_path):
    import json  # noqa: PLC0415

    from click.testing import CliRunner  # noqa: PLC0415

    from fuzzer.cli import cli  # noqa: PLC0415
    from fuzzer.store import Store  # noqa: PLC0415

    db = tmp_path / "s.db"
    with Store.open(db) as store:
        for ttft in (0.1, 0.2):
            store.record_execution(_run(ttft), TRACE)
        fid, _ = store.add_finding(kind="slo-violation", signature="s", trace=TRACE, verdict={}, slowdown=None,
                                   reproduced="3/3")
    result = CliRunner().invoke(cli, ["show", str(fid), "--db", str(db), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["executions"] == 2 and data["metrics"]["time_to_first_token"]["max"] == pytest.approx(200)
    assert data["kind"] == "slo-violation"


def test_report_goodput_section(tmp_path):
    from click.testing import CliRunner  # noqa: PLC0415

    from fuzzer.cli import cli  # noqa: PLC0415
    from fuzzer.store import Store  # noqa: PLC0415

    db = tmp_path / "r.db"
    with Store.open(db) as store:
        for ttft in (0.3, 0.05):
            store.record_execution(_run(ttft), TRACE)
    page = tmp_path / "r.html"
    result = CliRunner().invoke(cli, ["report", "--db", str(db), "--out", str(page), "--goodput", "ttft:100"])
    assert result.exit_code == 0, result.output
    assert "SLO ttft:100 (ms): attainment 75%" in result.output  # 3 of 4 requests met it
    assert "<h2>SLO (ttft:100 ms)</h2>" in page.read_text() and "75.0%" in page.read_text()


async def test_campaign_records_slo_violations_beside_the_scheduler_kinds():
    from conftest import CORPUS  # noqa: PLC0415

    from fuzzer import trace as tf  # noqa: PLC0415
    from fuzzer.search.campaign import Campaign  # noqa: PLC0415
    from fuzzer.search.settings import Settings  # noqa: PLC0415
    from fuzzer.sim import VirtualTarget  # noqa: PLC0415
    from fuzzer.store import Store  # noqa: PLC0415

    store = Store.memory()
    settings = Settings(seed=5, max_execs=12, slo_ms={"ttft": 1.0})  # 1 ms: every request misses
    summary = await Campaign(VirtualTarget(seed=2), store, settings, seeds=[tf.load(CORPUS / "vllm-37308.json")],
                             target_key="sim:test").run()
    slo_findings = [f for f in store.list_findings() if f.kind == "slo-violation"]
    assert slo_findings, store.list_findings()
    f = slo_findings[0]
    assert f.reproduced in ("3/3", "3/4", "4/5", "4/6", "5/6", "6/6", "5/5", "4/4")
    assert f.verdict["p_value"] is not None and f.verdict["effect"] > 1
    assert (f.id, "slo-violation") in summary.new_findings
    assert Settings.from_dict(store.latest_campaign()["settings"]).slo_ms == {"ttft": 1.0}


def test_minimize_and_bundle_export_refuse_an_slo_finding_in_one_line(tmp_path):
    from click.testing import CliRunner  # noqa: PLC0415

    from fuzzer.cli import cli  # noqa: PLC0415
    from fuzzer.store import Store  # noqa: PLC0415

    db = tmp_path / "f.db"
    with Store.open(db) as store:
        fid, _ = store.add_finding(kind="slo-violation", signature="s", trace=TRACE, verdict={}, slowdown=None,
                                   reproduced="3/3")
    for args in (["minimize", str(fid)], ["export", str(fid), "--out", str(tmp_path / "o")]):
        result = CliRunner().invoke(cli, [*args, "--db", str(db)])
        assert result.exit_code == 2
        assert result.output.strip().splitlines() == [
            f"error: finding {fid} is an slo-violation: " + ("minimize" if args[0] == "minimize" else
                                                           "a repro.py/report.md bundle")
            + f" is not supported for SLO findings; `fuzz show {fid}` and `fuzz export {fid} --format mooncake` are"]


def test_goodput_takes_vllms_unquoted_words():
    import click  # noqa: PLC0415
    from click.testing import CliRunner  # noqa: PLC0415

    from fuzzer.cli._slo import goodput_option, parse_slo  # noqa: PLC0415

    @click.command()
    @click.argument("path")
    @goodput_option
    def probe(path, goodput_specs):
        click.echo(f"{path}|{parse_slo(goodput_specs).describe()}")

    for args in (["t.json", "--goodput", "ttft:500", "tpot:50", "e2el:2000"],
                 ["--goodput", "ttft:500", "tpot:50", "e2el:2000", "t.json"],
                 ["t.json", "--goodput", "ttft:500 tpot:50", "--goodput", "e2el:2000"]):
        result = CliRunner().invoke(probe, args)
        assert result.output.strip() == "t.json|ttft:500 tpot:50 e2el:2000", (args, result.output)


def test_verdict_carries_the_median_observed_time_of_the_metric_over():
    v = verdicts(TRACE, [_run(0.3), _run(0.2), _run(0.4)], Slo(ttft_ms=100))[0]
    assert v.observed_s == pytest.approx(0.3) and v.to_dict()["observed_s"] == pytest.approx(0.3)
