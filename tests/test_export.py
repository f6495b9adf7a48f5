"""fuzz export: repro.py, report.md, timeline.png and trace.json of a finding the oracle confirmed."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from test_repro import PATHOLOGY, SEED, SMALL

from fuzzer import trace as tf
from fuzzer.cli import cli
from fuzzer.errors import NotFoundError, OutputError
from fuzzer.oracle.calibrate import calibrate
from fuzzer.oracle.confirm import examine
from fuzzer.report.export import export_finding, repro_script
from fuzzer.sim import VirtualTarget
from fuzzer.store import Store

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def confirmed():
    """The small logprobs trace examined by the oracle on virtual time: (trace, calibration, examination)."""
    trace = tf.from_dict(SMALL)

    async def run():
        target = VirtualTarget(pathologies=(PATHOLOGY,), seed=SEED)
        cal = await calibrate(target, rng=random.Random(0), clock=lambda: 0.0)
        return cal, await examine(target, trace, cal, runs=3, rng=np.random.default_rng(0))

    cal, ex = asyncio.run(run())
    return trace, cal, ex


def add_finding(store: Store, confirmed, request_id: str = "a", *, with_executions: bool = True) -> int:
    trace, cal, ex = confirmed
    verdict = next(v for v in ex.findings if v.request_id == request_id)
    target_id = store.upsert_target("http://127.0.0.1:8000", "vllm", "sim-qwen2.5-0.5b", "0.1.0+sim",
                                    {"chat": True, "n": True, "logprobs": True, "tokenize": True})
    store.save_calibration("http://127.0.0.1:8000", cal.to_dict())
    if with_executions:
        for result in ex.results:
            store.record_execution(result, trace, target_id=target_id, purpose="confirm")
    finding_id, _ = store.add_finding(kind=str(verdict.kind), signature=verdict.signature, trace=trace,
                                      verdict=verdict.to_dict(), slowdown=verdict.slowdown,
                                      reproduced=verdict.reproduction, target_id=target_id,
                                      details={"request_id": verdict.request_id})
    return finding_id


def test_export_writes_the_four_files(store, confirmed, tmp_path):
    fid = add_finding(store, confirmed)
    folder = export_finding(store, fid, tmp_path / "findings")
    assert folder == tmp_path / "findings" / str(fid)
    assert sorted(p.name for p in folder.iterdir()) == ["report.md", "repro.py", "timeline.png", "trace.json"]
    assert tf.load(folder / "trace.json").content_hash() == confirmed[0].content_hash()
    assert (folder / "timeline.png").read_bytes().startswith(PNG_MAGIC)
    assert os.access(folder / "repro.py", os.X_OK)
    report = (folder / "report.md").read_text()
    for rid in ("a", "b", "heavy"):
        assert f"| {rid} |" in report or f"| **{rid}** |" in report
    assert "| **a** |" in report  # the victim, in bold
    for needle in ("itl-stall", "`vllm` 0.1.0+sim", "`sim-qwen2.5-0.5b`", "FCFS bound", "3/3", "p-value",
                   "Effect size", "![timeline", "git bisect run python3 repro.py --base-url http://127.0.0.1:8000"):
        assert needle in report, needle


def test_exported_repro_runs_stand_alone(store, confirmed, tmp_path, unused_tcp_port):
    """The exported script starts under -I -S and says it cannot test without a server."""
    fid = add_finding(store, confirmed)
    folder = export_finding(store, fid, tmp_path)
    p = subprocess.run([sys.executable, "-I", "-S", str(folder / "repro.py"), "--base-url",
                        f"http://127.0.0.1:{unused_tcp_port}"], capture_output=True, text=True, timeout=30, check=False)
    assert p.returncode == 125 and "RESULT: CANNOT TEST" in p.stdout


def test_a_stored_repro_script_is_exported_as_stored(store, confirmed, tmp_path):
    fid = add_finding(store, confirmed)
    finding = store.get_finding(fid)
    script = repro_script(finding, confirmed[0], target=store.get_target(finding.target_id))
    store.set_minimized(fid, confirmed[0], repro_script=script + "# stored\n")
    folder = export_finding(store, fid, tmp_path)
    assert (folder / "repro.py").read_text() == script + "# stored\n"


def test_minimized_trace_is_exported_with_its_own_bound(store, confirmed, tmp_path):
    trace, _cal, _ = confirmed
    fid = add_finding(store, confirmed)
    smaller = trace.with_requests([r for r in trace.requests if r.id != "b"])

    async def run():  # what fuzz minimize leaves in the store: executions of the minimized trace
        target = VirtualTarget(pathologies=(PATHOLOGY,), seed=SEED)
        return [await target.execute(smaller) for _ in range(2)]

    for result in asyncio.run(run()):
        store.record_execution(result, smaller, purpose="minimize")
    store.set_minimized(fid, smaller, details={"minimized": {"reproduced": "9/10", "executions": 31}})
    folder = export_finding(store, fid, tmp_path)
    report = (folder / "report.md").read_text()
    assert "2 requests, minimized from 3" in report and "9/10" in report
    assert "| b |" not in report
    assert tf.load(folder / "trace.json").content_hash() == smaller.content_hash()
    script = (folder / "repro.py").read_text()
    assert "bound is the one measured on the original trace" not in script  # recomputed from the executions


def test_no_execution_no_timeline(store, confirmed, tmp_path):
    fid = add_finding(store, confirmed, with_executions=False)
    (tmp_path / str(fid)).mkdir()
    (tmp_path / str(fid) / "timeline.png").write_bytes(b"stale")
    folder = export_finding(store, fid, tmp_path)
    assert not (folder / "timeline.png").exists()
    assert "No execution of this trace is stored" in (folder / "report.md").read_text()


def test_unknown_finding(store, tmp_path):
    with pytest.raises(NotFoundError, match="no finding with id 99"):
        export_finding(store, 99, tmp_path)


def test_unwritable_output_is_one_clear_error(store, confirmed, tmp_path):
    fid = add_finding(store, confirmed)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OutputError, match="cannot create output folder"):
        export_finding(store, fid, blocker)


def test_cli_export(confirmed, tmp_path):
    db = tmp_path / "night.db"
    with Store.open(db) as store:
        fid = add_finding(store, confirmed)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["export", str(fid), "--db", str(db), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out / str(fid)}/: report.md, repro.py, timeline.png, trace.json" in result.output
    assert "repro.py --base-url" in result.output
    missing = CliRunner().invoke(cli, ["export", "42", "--db", str(db), "--out", str(out)])
    assert missing.exit_code == 2 and "error: no finding with id 42" in missing.output
    nodb = CliRunner().invoke(cli, ["export", "1", "--db", str(tmp_path / "none.db")])
    assert nodb.exit_code == 2 and "no database" in nodb.output


def test_without_matplotlib_the_report_says_so(store, confirmed, tmp_path, monkeypatch):
    from fuzzer.report import timeline

    monkeypatch.setattr(timeline, "available", lambda: False)
    fid = add_finding(store, confirmed)
    folder = export_finding(store, fid, tmp_path)
    assert not (folder / "timeline.png").exists()
    assert "matplotlib is not installed" in (folder / "report.md").read_text()


def test_repro_script_as_the_minimizer_calls_it(store, confirmed):
    """repro_script(finding, trace): the minimized trace's bound is unknown there, and the script says so."""
    trace = confirmed[0]
    fid = add_finding(store, confirmed)
    finding = store.get_finding(fid)
    same = repro_script(finding, trace)
    assert "bound is the one measured on the original trace" not in same
    smaller = trace.with_requests([r for r in trace.requests if r.id != "b"])
    noted = repro_script(finding, smaller)
    assert "bound is the one measured on the original trace" in noted
    given = repro_script(finding, smaller, {**finding.verdict, "expected_s": 0.005})
    assert "bound is the one measured on the original trace" not in given and '"expected_s": 0.005' in given


def test_an_option_slowdown_is_exported_against_the_trace_without_its_option(store, tmp_path):
    """What `fuzz minimize` leaves for an option-slowdown (runs of the minimized trace and of its
    ablation) gives report.md its medians; neither report.md nor repro.py speaks of an FCFS bound."""
    from test_reduction import SeedSlowsOthers, _seeded, confirm_option  # noqa: PLC0415

    from fuzzer.oracle.ablation import without_option  # noqa: PLC0415

    trace = _seeded()
    target_id = store.upsert_target("http://127.0.0.1:8000", "vllm", "m", "0.1.0", {"tokenize": True})
    verdict = {**confirm_option(trace), "threshold": 1.25, "detail": "with seed on carrier, the others were slow"}
    fid, _ = store.add_finding(kind="option-slowdown", signature=verdict["signature"], trace=trace, verdict=verdict,
                               slowdown=2.0, reproduced="3/3", target_id=target_id)
    # The minimizer dropped the seed of the first carrier and kept another.
    smaller = trace.with_requests([*trace.requests[:3], tf.Request(id="c2", at_ms=9.0, prompt_tokens=8, max_tokens=4,
                                                                   seed=3)])
    fake = SeedSlowsOthers(2.0)
    for t in (smaller, without_option(smaller, "seed")) * 2:
        store.record_execution(asyncio.run(fake.execute(t)), t, target_id=target_id, purpose="minimize")
    store.set_minimized(fid, smaller, details={"minimized": {"reproduced": "10/10", "executions": 40}})
    folder = export_finding(store, fid, tmp_path)
    report = (folder / "report.md").read_text()
    first_line = report.splitlines()[0]
    assert "`seed` on request c2" in first_line and "2.0x that of the same trace without it" in first_line
    assert "84.0 ms vs 42.0 ms" in first_line  # (10 ms + 32 ms) x 2 with the seed, from the stored runs
    for needle in ("option-slowdown", "removed from every request", "without `seed`", "| **c2** |",
                   "**3/3** pairs of runs", "Criterion: a run is a pair", "at least 1.25x"):
        assert needle in report, needle
    assert "FCFS bound" not in report and "calibration probes" not in report and "--threshold-ms" not in report
    namespace: dict = {"__name__": "not_main"}
    exec(compile((folder / "repro.py").read_text(), "repro.py", "exec"), namespace)  # noqa: S102 - reads DATA
    crit = namespace["DATA"]["criterion"]
    assert crit["kind"] == "option-slowdown" and crit["ablate"] == "seed" and crit["request_id"] == "c2"
    assert crit["factor"] == 1.25 and "bound" not in crit["note"]
    assert repro_script(store.get_finding(fid), smaller).count("FCFS bound is the one measured") == 0
