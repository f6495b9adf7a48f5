"""The SQLite store: migrations, round-trips of executions and findings, bad databases."""

from __future__ import annotations

import sqlite3

import pytest

import fuzzer.store as store_module
from fuzzer.errors import NotFoundError, StoreError
from fuzzer.execution import ExecutionResult, MetricSample, Outcome, RequestResult
from fuzzer.store import SCHEMA_VERSION, Store


def _result(trace, *, ttft=0.05) -> ExecutionResult:
    requests = tuple(
        RequestResult(
            request_id=r.id,
            x_request_id=f"{r.id}-abc",
            scheduled_s=r.at_ms / 1000,
            sent_s=r.at_ms / 1000 + 0.0002,
            outcome=Outcome.OK if r.stream else Outcome.OK,
            ttft_s=ttft if r.stream else None,
            first_event_s=ttft if r.stream else None,
            token_times_s=(ttft, ttft + 0.004, ttft + 0.009) if r.stream else (),
            choice_gap_s=0.012 if r.stream else None,
            choice_gap_end_s=ttft + 0.02 if r.stream else None,
            e2e_s=ttft + 0.3,
            finish_reason="length",
            prompt_tokens=r.prompt_tokens,
            completion_tokens=r.max_tokens,
            http_status=200,
        )
        for r in trace.requests
    )
    return ExecutionResult(
        trace_hash=trace.content_hash(),
        target="http://127.0.0.1:9",
        started_at=1_700_000_000.0,
        duration_s=1.25,
        requests=requests,
        samples=(MetricSample(0.0, {"running": 0.0, "waiting": 0.0}), MetricSample(0.05, {"running": 6.0})),
        idle_before_s=12.0,
        idle_after=True,
        warnings=("r04: server counted 2049 prompt tokens, trace asked 2048",),
        ground_truth={"r08": ("hol-prefix-burst",)},
    )


def test_execution_round_trip(store, seed_trace):
    result = _result(seed_trace)
    execution_id = store.record_execution(result, seed_trace, purpose="fuzz")
    assert store.get_execution(execution_id) == result
    assert store.count_executions() == 1
    assert store.get_trace(result.trace_hash) == seed_trace
    assert store.execution_ids(trace_hash=result.trace_hash) == [execution_id]


def test_execution_of_another_trace_is_refused(store, seed_trace):
    other = seed_trace.with_requests(seed_trace.requests[:2])
    with pytest.raises(StoreError, match="not of the trace given"):
        store.record_execution(_result(seed_trace), other)
    assert store.count_executions() == 0


def test_a_failed_write_leaves_nothing_behind(store, seed_trace, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(store_module, "request_row", broken)
    with pytest.raises(RuntimeError):
        store.record_execution(_result(seed_trace), seed_trace)
    assert store.count_executions() == 0
    with pytest.raises(NotFoundError):
        store.get_trace(seed_trace.content_hash())


def test_findings_are_deduplicated_by_signature(store, seed_trace):
    first, created = store.add_finding(
        kind="ttft-outlier", signature="ttft:short-behind-long", trace=seed_trace,
        verdict={"p_value": 0.001}, slowdown=14.5, reproduced="3/3",
    )
    again, created_again = store.add_finding(
        kind="ttft-outlier", signature="ttft:short-behind-long", trace=seed_trace,
        verdict={"p_value": 0.002}, slowdown=15.0, reproduced="3/3",
    )
    assert created and not created_again and first == again
    finding = store.get_finding(str(first))
    assert finding.kind == "ttft-outlier" and finding.requests == 6 and not finding.minimized
    assert [f.id for f in store.list_findings()] == [first]


def test_minimized_trace_is_linked(store, seed_trace):
    fid, _ = store.add_finding(kind="ttft-outlier", signature="s", trace=seed_trace, verdict={}, slowdown=2.0, reproduced="2/3")
    small = seed_trace.with_requests(seed_trace.requests[:3])
    store.set_minimized(fid, small, repro_script="print('hi')")
    finding = store.get_finding(fid)
    assert finding.minimized and store.get_trace(finding.minimized_trace_hash) == small
    assert finding.repro_script == "print('hi')"


@pytest.mark.parametrize("bad_id", ["7", "x1", "", "-"])
def test_unknown_finding_ids(store, bad_id):
    with pytest.raises(NotFoundError, match="no finding with id"):
        store.get_finding(bad_id)


def test_calibrations_latest_wins(store):
    store.save_calibration("http://a", {"v": 1}, created_at=10.0)
    store.save_calibration("http://a", {"v": 2}, created_at=20.0)
    store.save_calibration("http://b", {"v": 3}, created_at=30.0)
    assert store.latest_calibration("http://a") == {"v": 2}
    assert store.latest_calibration("http://c") is None


def test_targets_upsert(store):
    a = store.upsert_target("http://127.0.0.1:8000", "vllm", "m", "0.11", {"chat": True})
    b = store.upsert_target("http://127.0.0.1:8000", "vllm", "m", "0.12", {"chat": False})
    c = store.upsert_target("http://127.0.0.1:8000", "vllm", "other", None, {})
    assert a == b != c
    assert store.get_target(a)["version"] == "0.12"
    assert store.get_target(a)["capabilities"] == {"chat": False}


def test_migrations_are_idempotent_on_an_existing_file(tmp_path, seed_trace):
    path = tmp_path / "c.db"
    with Store.open(path) as s:
        s.put_trace(seed_trace)
        assert s.schema_version == SCHEMA_VERSION
    with Store.open(path) as s:
        assert s.migrate() == SCHEMA_VERSION
        assert s.migrate() == SCHEMA_VERSION
        assert s.get_trace(seed_trace.content_hash()) == seed_trace
        assert s.integrity_check() == "ok"


def test_wal_mode(tmp_path):
    with Store.open(tmp_path / "w.db") as s:
        assert s._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_newer_schema_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "new.db"
    with Store.open(path):
        pass
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match="newer than this fuzzer"):
        Store.open(path)
    assert path.read_bytes() == before


def test_not_a_database(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreError, match="not a fuzzer database|cannot open"):
        Store.open(junk)
    foreign = tmp_path / "foreign.db"
    conn = sqlite3.connect(foreign)
    conn.execute("create table t (x)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="another program"):
        Store.open(foreign)


def test_missing_database_for_readers(tmp_path):
    with pytest.raises(StoreError, match="no database at"):
        Store.open(tmp_path / "absent.db", create=False)
    assert not (tmp_path / "absent.db").exists()
    with pytest.raises(StoreError, match="does not exist"):
        Store.open(tmp_path / "no" / "such" / "dir.db")


def test_campaign_checkpoint_round_trip(store, seed_trace):
    cid = store.start_campaign(seed=7, target="sim", settings={"duration_s": 60})
    digest = store.put_trace(seed_trace)
    row = {"id": 1, "trace_hash": digest, "parent": None, "operators": ["storm"], "features": ["b", "a"],
           "scores": {"ssp0": 3.5}, "found_at_exec": 4, "n_fuzz": 2, "finds": 0, "since_find": 2, "favoured": True}
    store.save_campaign(cid, state={"executions": 5}, status="running", corpus_rows=[row], new_features={"a": 1, "b": 1})
    store.save_campaign(cid, state={"executions": 9}, status="stopped", corpus_rows=[{**row, "n_fuzz": 3}],
                        new_features={"a": 2})
    latest = store.latest_campaign()
    assert latest["id"] == cid and latest["state"] == {"executions": 9} and latest["status"] == "stopped"
    assert latest["settings"] == {"duration_s": 60} and latest["seed"] == 7
    (back,) = store.corpus_rows(cid)
    assert back["n_fuzz"] == 3 and back["features"] == ["a", "b"] and back["operators"] == ["storm"]
    assert store.count_features(cid) == 2
