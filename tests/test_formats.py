"""Production trace formats (fuzzer/formats): Mooncake JSONL, Azure and BurstGPT CSV in, Mooncake out."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from click.testing import CliRunner
from conftest import ROOT

from fuzzer import trace as trace_format
from fuzzer.cli import cli
from fuzzer.cli import campaign as campaign_cli
from fuzzer.errors import FormatError
from fuzzer.formats import detect, mooncake, read
from fuzzer.formats.seeds import import_file
from fuzzer.store import Store
from fuzzer.trace import Request, Trace

DATA = ROOT / "tests" / "data" / "formats"
BAD = ["bad-json.jsonl", "bad-timestamp.jsonl", "bad-azure.csv", "bad-burstgpt.csv", "unknown.csv", "empty.jsonl"]


@pytest.mark.parametrize(("name", "fmt"), [("mooncake.jsonl", "mooncake"), ("azure.csv", "azure"),
                                           ("burstgpt.csv", "burstgpt")])
def test_each_sample_is_detected_and_read(name, fmt):
    assert detect(DATA / name) == fmt
    found, records = read(DATA / name)
    assert found == fmt and len(records) >= 5
    assert all(r.input_length >= 0 and r.output_length >= 0 for r in records)


def test_mooncake_window_keeps_gaps_lengths_and_shared_blocks():
    _, total, traces = import_file(DATA / "mooncake.jsonl", window=4, count=2, block_size=512)
    assert total == 8 and [t.name for t in traces] == ["mooncake-0-3", "mooncake-4-7"]
    first = traces[0]
    assert [r.at_ms for r in first.requests] == [0, 105, 230, 274]
    assert [(r.prompt_tokens, r.max_tokens) for r in first.requests] == [(655, 52), (1672, 26), (300, 12), (655, 52)]
    # r0, r1, r3 start with blocks 46, 47: two shared blocks, capped by the shortest prompt (655).
    assert first.prefixes == {"p0": 655}
    assert [r.prefix for r in first.requests] == ["p0", "p0", None, "p0"]
    second = traces[1]
    assert second.requests[0].at_ms == 0 and second.requests[1].at_ms == 8  # gaps kept, rebased
    assert second.prefixes == {"p0": 1024}  # blocks 200, 201 of 512 tokens


def test_azure_and_burstgpt_timestamps_become_gaps():
    _, _, (azure,) = import_file(DATA / "azure.csv", window=3, block_size=512)
    assert [r.at_ms for r in azure.requests] == [0, pytest.approx(4314.579), pytest.approx(4523.922)]
    assert azure.prefixes == {}
    _, _, (burst,) = import_file(DATA / "burstgpt.csv", window=5, block_size=512)
    assert [r.at_ms for r in burst.requests] == [0, 40_000, 113_000, 113_500, 125_000]
    assert burst.requests[1].max_tokens == 1  # a failed request (0 response tokens) asks for the least


def test_windows_start_and_stop_at_the_end():
    _, _, traces = import_file(DATA / "mooncake.jsonl", window=3, start=2, count=10, block_size=512)
    assert [len(t.requests) for t in traces] == [3, 3]
    assert traces[0].requests[0].id == "r2"


def _trace_shape(trace: Trace):
    groups = {}
    shape = []
    for r in trace.requests:
        group = groups.setdefault(r.prefix, len(groups)) if r.prefix else None
        shape.append((r.at_ms, r.prompt_tokens, r.max_tokens, group, trace.prefixes.get(r.prefix)))
    return shape


@pytest.mark.parametrize("block_size", [16, 512])
def test_round_trip_import_export_import(tmp_path, block_size):
    _, _, traces = import_file(DATA / "mooncake.jsonl", window=8, block_size=block_size)
    before = traces[0]
    out = tmp_path / "again.jsonl"
    out.write_text(mooncake.dumps(before, block_size=block_size))
    _, _, (after,) = import_file(out, window=8, block_size=block_size)
    assert _trace_shape(after) == _trace_shape(before)


def test_export_shape_is_what_aiperf_reads():
    trace = Trace(requests=(Request("a", 0, 40, 8, prefix="g"), Request("b", 12.5, 20, 4, prefix="g"),
                            Request("c", 30, 5, 2)), prefixes={"g": 20})
    rows = [json.loads(line) for line in mooncake.dumps(trace, block_size=16).splitlines()]
    assert [set(r) for r in rows] == [{"timestamp", "input_length", "output_length", "hash_ids"}] * 3
    assert [r["timestamp"] for r in rows] == [0, 12.5, 30]
    assert rows[0]["hash_ids"][:2] == rows[1]["hash_ids"] == [0, 1]  # the group's two blocks
    assert len(rows[0]["hash_ids"]) == 3 and len(rows[2]["hash_ids"]) == 1
    assert len({h for r in rows for h in r["hash_ids"]}) == 4


@pytest.mark.parametrize("name", BAD)
def test_bad_files_fail_with_one_line(name):
    result = CliRunner().invoke(cli, ["import", str(DATA / name), "--out", "unused"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_wrong_format_forced_is_one_line():
    with pytest.raises(FormatError, match="azure.csv:1: not a JSON object"):
        read(DATA / "azure.csv", "mooncake")
    with pytest.raises(FormatError, match="not a burstgpt CSV"):
        read(DATA / "azure.csv", "burstgpt")


def test_binary_file_is_refused(tmp_path):
    junk = tmp_path / "junk.jsonl"
    junk.write_bytes(b"\xff\xfe\x00\x81" * 10)
    with pytest.raises(FormatError, match="not UTF-8"):
        read(junk)


def test_import_command_writes_seeds_the_campaign_loads(tmp_path):
    out = tmp_path / "seeds"
    result = CliRunner().invoke(cli, ["import", str(DATA / "mooncake.jsonl"), "--window", "4", "--windows", "2",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    seeds = campaign_cli._load_seeds(campaign_cli._seed_folder(str(out)))
    assert sorted(t.name for t in seeds) == ["mooncake-0-3", "mooncake-4-7"]
    assert trace_format.load(out / "mooncake-0-3.json").prefixes == {"p0": 655}


def test_campaign_corpus_may_be_a_production_file_or_one_trace():
    seeds = campaign_cli._load_seeds(campaign_cli._seed_folder(str(DATA / "burstgpt.csv")))
    assert len(seeds) == 1 and len(seeds[0].requests) == 5
    one = campaign_cli._load_seeds(campaign_cli._seed_folder(str(ROOT / "corpus" / "vllm-37308.json")))
    assert [t.name for t in one] == ["vllm-37308"]


def test_export_mooncake_of_a_finding(tmp_path, seed_trace):
    db = tmp_path / "f.db"
    with Store.open(db) as s:
        fid, _ = s.add_finding(kind="ttft-outlier", signature="sig", trace=seed_trace, verdict={},
                               slowdown=3.0, reproduced="3/3")
    result = CliRunner().invoke(cli, ["export", str(fid), "--db", str(db), "--format", "mooncake",
                                      "--out", str(tmp_path / "out"), "--block-size", "16"])
    assert result.exit_code == 0, result.output
    written = tmp_path / "out" / str(fid) / "trace.mooncake.jsonl"
    assert "aiperf profile" in result.output and "--custom-dataset-type mooncake_trace" in result.output
    assert "--dataset-name timed_trace" in result.output and "--timed-trace-chunk-hash-size 16" in result.output
    _, _, (back,) = import_file(written, window=len(seed_trace.requests), block_size=16)
    assert [(r.prompt_tokens, r.max_tokens) for r in back.requests] == [
        (r.prompt_tokens, r.max_tokens) for r in seed_trace.requests]


_roots = st.sampled_from([1, 2, 3, None])


@st.composite
def _mooncake_rows(draw):
    rows, at = [], 0
    tails = iter(range(1000, 100000))
    for _ in range(draw(st.integers(1, 12))):
        at += draw(st.integers(0, 5000))
        length = draw(st.integers(0, 3000))
        blocks = max(1, -(-length // 16))
        root = draw(_roots)
        shared = [root * 100 + i for i in range(draw(st.integers(1, blocks)))] if root is not None else []
        ids = (shared + [next(tails) for _ in range(blocks)])[:blocks]
        rows.append({"timestamp": at, "input_length": length, "output_length": draw(st.integers(0, 500)),
                     "hash_ids": ids})
    return rows


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=_mooncake_rows())
def test_property_export_of_an_imported_window_imports_to_the_same_trace(tmp_path, rows):
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, _, (first,) = import_file(src, window=len(rows), block_size=16)
    again = tmp_path / "again.jsonl"
    again.write_text(mooncake.dumps(first, block_size=16))
    _, _, (second,) = import_file(again, window=len(rows), block_size=16)
    assert _trace_shape(second) == _trace_shape(first)
