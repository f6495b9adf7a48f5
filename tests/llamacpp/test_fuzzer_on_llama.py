"""The fuzzer against a real llama-server (issue 9): detection, exact prompts, metrics, campaign, repro.

The session's server (tests/llamacpp/conftest.py: -np 4 -c 16384 --metrics, random-weight
model) is driven through the fuzzer's own HttpTarget, the library's calibration, the CLI's
campaign and a generated repro.py run with `python -I -S`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from fuzzer import trace as trace_format
from fuzzer.cli import cli as cli_main
from fuzzer.execute import adapters
from fuzzer.execute.http import HttpTarget
from fuzzer.execution import Outcome
from fuzzer.oracle.calibrate import Calibration, calibrate
from fuzzer.oracle.model import assumption_for
from fuzzer.store import Store

from . import conftest

pytestmark = pytest.mark.llamacpp

ROOT = Path(__file__).resolve().parents[2]
SLOTS = 4  # -np 4 in conftest.SERVER_ARGS
SLOT_CONTEXT = 16384 // SLOTS
# Finding kinds of ARCHITECTURE.md, "Oracle": whatever a campaign finds must be one of them.
KINDS = {"ttft-outlier", "itl-stall", "e2e-outlier", "cold-start", "leak", "error", "hang", "protocol", "crash"}
# Bounds of the short campaign: enough executions to seed the corpus and fuzz a few children.
CAMPAIGN_MAX_EXECS = 10
CAMPAIGN_DURATION = "75s"
REPRO_TIMEOUT_S = 600


def _scaled(trace: trace_format.Trace, factor: float, name: str) -> trace_format.Trace:
    """The trace with prompt and output lengths divided by ``factor`` (prefixes too), for a fast CPU run."""
    data = json.loads(trace_format.dumps(trace))
    data["name"] = name
    data["prefixes"] = {k: max(1, int(v / factor)) for k, v in (data.get("prefixes") or {}).items()}
    for r in data["requests"]:
        r["prompt_tokens"] = max(r["prompt_tokens"] // int(factor), data["prefixes"].get(r.get("prefix"), 0) + 1)
        r["max_tokens"] = max(1, r["max_tokens"] // int(factor))
    return trace_format.from_dict(data)


async def test_the_adapter_is_detected_with_its_slots_context_and_features(llama_server):
    async with HttpTarget(llama_server.base_url, rng=random.Random(0)) as target:
        info = target.info
    assert info is not None and info.kind == "llamacpp"
    assert info.max_model_len == SLOT_CONTEXT
    assert info.scheduler == {"max_num_seqs": SLOTS}
    assert info.model and info.model.endswith(".gguf")
    for feature in ("completions", "chat", "stream_options", "ignore_eos", "tokenize"):
        assert info.capabilities[feature], feature


@pytest.mark.parametrize("corpus_file, factor", [("stream-mix.json", 2), ("vllm-37308.json", 4)])
async def test_replay_of_corpus_traces_builds_prompts_of_the_exact_length_the_server_counts(
    llama_server, corpus_file, factor
):
    trace = _scaled(trace_format.load(ROOT / "corpus" / corpus_file), factor, f"{corpus_file}/{factor}")
    async with HttpTarget(llama_server.base_url, server="auto", rng=random.Random(1)) as target:
        result = await target.execute(trace)
    assert result.idle_after is True
    assert not [w for w in result.warnings if "prompt" in w], result.warnings
    for r in result.requests:
        req = trace.request(r.request_id)
        assert r.outcome is Outcome.OK, (r.request_id, r.detail)
        assert r.prompt_tokens == req.prompt_tokens, r.request_id  # chat included (template counted)
        assert r.completion_tokens == req.max_tokens, r.request_id  # ignore_eos honoured
        if req.stream:
            assert r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s
        else:
            assert r.ttft_s is None and r.e2e_s > 0


async def test_metrics_are_sampled_with_slots_queueing_and_kv_usage(llama_server):
    # Six requests on four slots: two are deferred (waiting) until a slot frees. Outputs long enough
    # that the four overlap for many 20 ms scrapes on a loaded machine (at 48 tokens a CI run under
    # load sampled at most 2 running).
    trace = trace_format.from_dict({"requests": [
        {"id": f"r{i}", "at_ms": i, "prompt_tokens": 400, "max_tokens": 160} for i in range(SLOTS + 2)
    ]})
    async with HttpTarget(llama_server.base_url, metrics_interval_s=0.02, rng=random.Random(2)) as target:
        result = await target.execute(trace)
    assert all(r.outcome is Outcome.OK for r in result.requests)
    samples = result.samples
    assert len(samples) >= 5
    assert all(set(s.values) >= {"running", "waiting", "kv_usage", "prompt_tokens", "generation_tokens"} for s in samples)
    assert max(s.values["running"] for s in samples) == SLOTS
    assert max(s.values["waiting"] for s in samples) >= 1
    # Busy slots hold up to 4 x (400 + 48) tokens of 16384; a slot just handed a new request
    # may still show its previous request's counts for one scrape, so only a loose upper bound.
    assert 0.05 < max(s.values["kv_usage"] for s in samples) <= 1.0
    assert samples[-1].values["kv_usage"] < max(s.values["kv_usage"] for s in samples)
    generated = [s.values["generation_tokens"] for s in samples]
    assert generated == sorted(generated) and generated[-1] > generated[0]
    assert all(b.t_s > a.t_s for a, b in itertools.pairwise(samples))


# Fewer probe points than a real calibration (each fit still gets MIN_FIT_POINTS), so the
# stored calibration costs well under a minute on 2 cores instead of over three (measured: 200 s).
# Five sizes where a fit needs four points: one probe that a loaded host spoils (seen after a
# long test session) must not fail the calibration.
_QUICK_PROBES = {
    "PREFILL_LENGTHS": (16, 64, 128, 256, 512),
    "CACHED_PREFIXES": (128, 512),
    "DECODE_CONTEXTS": (16, 64, 128, 256, 512),
    "BATCH_SIZES": (1, 2, 3, 4),
}
# The campaign's mutators ask n up to 8; the FCFS model cannot place a request with n above
# max_num_seqs (it stops the campaign with "more than 1000000 scheduler steps", reported to
# the lead), so this test assumes 8 sequences rather than the server's 4 slots.
_TEST_MAX_NUM_SEQS = 8


_CALIBRATIONS: dict[str, dict] = {}  # url -> calibration, measured once per server and session


async def _store_calibration(url: str, db: Path, monkeypatch) -> None:
    """A cheap calibration (one repeat, fewer probes) stored under the key `fuzz campaign` reads."""
    if url not in _CALIBRATIONS:
        _CALIBRATIONS[url] = await _quick_calibration(url, monkeypatch)
    with Store.open(db) as store:
        store.save_calibration(url, _CALIBRATIONS[url])


async def _quick_calibration(url: str, monkeypatch) -> dict:
    from fuzzer.oracle import calibrate as calibration

    for name, value in _QUICK_PROBES.items():
        monkeypatch.setattr(calibration, name, value)
    async with HttpTarget(url, server="llamacpp", rng=random.Random(3)) as target:
        info = target.info
        assert info is not None
        assumption = assumption_for("llamacpp", {**adapters.adapter("llamacpp").scheduler_defaults, **info.scheduler},
                                    max_num_seqs=_TEST_MAX_NUM_SEQS)
        cal = await calibrate(target, assumption=assumption, rng=random.Random(3), repeats=1, warmup_runs=1,
                              max_model_len=info.max_model_len)
    assert cal.assumption.token_budget == 2048 and cal.assumption.block_size == 1
    return cal.to_dict()


@pytest.mark.timeout(900)
@pytest.mark.slow
async def test_a_short_campaign_runs_cleanly_and_classifies_what_it_finds(llama_server, tmp_path, monkeypatch):
    db = tmp_path / "campaign.db"
    started = time.perf_counter()
    await _store_calibration(llama_server.base_url, db, monkeypatch)
    calibration_s = time.perf_counter() - started
    # Two small seeds (scaled-down corpus traces), so most executions are mutated children.
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, factor in (("vllm-37308.json", 8), ("stream-mix.json", 4)):
        trace_format.dump(_scaled(trace_format.load(ROOT / "corpus" / name), factor, f"{name}/{factor}"), corpus / name)
    # A subprocess: the campaign runs its own event loop and signal handlers.
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "fuzzer", "campaign", "--target", llama_server.base_url, "--server", "llamacpp",
         "--max-execs", str(CAMPAIGN_MAX_EXECS), "--duration", CAMPAIGN_DURATION, "--db", str(db), "--seed", "7",
         "--corpus", str(corpus)],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
    )
    assert done.returncode in (0, 1), f"calibrated in {calibration_s:.0f} s\n" + done.stdout[-2000:] + done.stderr[-2000:]
    assert "error:" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    with Store.open(db, create=False) as store:
        executions = store.count_executions()
        campaign = store.latest_campaign()
        findings = store.list_findings()
        rows = store.execution_rows(campaign_id=campaign["id"])
    assert executions >= CAMPAIGN_MAX_EXECS
    assert len(rows) == executions  # every execution belongs to this campaign
    assert all(f.kind in KINDS for f in findings)
    listed = json.loads(CliRunner().invoke(cli_main, ["findings", "--db", str(db), "--json"]).output)
    assert [f["kind"] for f in listed] == [f.kind for f in findings]
    for f in findings:  # a latency finding states its bound and idle expectation
        if f.kind in ("ttft-outlier", "itl-stall", "e2e-outlier"):
            assert f.verdict["expected_s"] > 0 and f.verdict["observed_s"] > f.verdict["expected_s"]


# The short request's 16 tokens: the random-weight model's tokens can decode to no text (a byte of a
# character held back), and a CI run's repro measured no TTFT when all four of its tokens did; at stop 63
# all 16 did once. The repro now counts such a run as testing nothing, and runs three times.
SHORT_BEHIND_LONG = trace_format.from_dict({"name": "short-behind-long", "requests": [
    *({"id": f"L{i}", "at_ms": i, "prompt_tokens": 1500, "max_tokens": 4} for i in range(SLOTS)),
    {"id": "short", "at_ms": 30, "prompt_tokens": 32, "max_tokens": 16},
]})


def _repro(tmp_path: Path, expected_s: float) -> Path:
    """A repro.py whose criterion is the short request's TTFT over ``expected_s`` (as a ttft-outlier verdict)."""
    from fuzzer.report.repro import criterion_from_verdict, script_data, script_source

    criterion = criterion_from_verdict("ttft-outlier", {"request_id": "short", "metric": "ttft", "expected_s": expected_s})
    data = script_data(finding={"id": 1, "kind": "ttft-outlier"}, criterion=criterion, trace=SHORT_BEHIND_LONG,
                       server={"kind": "llamacpp"})
    path = tmp_path / f"repro-{expected_s:g}.py"
    path.write_text(script_source(data))
    return path


@pytest.mark.slow
async def test_an_exported_repro_measures_the_short_request_as_the_executor_does(llama_server, tmp_path):
    async with HttpTarget(llama_server.base_url, rng=random.Random(4)) as target:
        result = await target.execute(SHORT_BEHIND_LONG)
    short = next(r for r in result.requests if r.request_id == "short")
    assert short.outcome is Outcome.OK and short.prompt_tokens == 32
    # The short request queues behind the long prefills (run order is llama.cpp's slot order).
    assert short.ttft_s > 0.05

    # A bound far below that TTFT: reproduced (exit 1); far above it: not reproduced (exit 0). Three runs: the random
    # model's stream for `short` can carry no text at all, a run that tests nothing (CI, stop 63).
    for expected_s, code, verdict in ((0.001, 1, "RESULT: REPRODUCED"), (600.0, 0, "RESULT: NOT REPRODUCED")):
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-I", "-S", str(_repro(tmp_path, expected_s)), "--base-url", llama_server.base_url,
             "--runs", "3"],
            capture_output=True, text=True, timeout=REPRO_TIMEOUT_S, check=False,
        )
        assert done.returncode == code, done.stdout[-1500:] + done.stderr[-1500:]
        assert verdict in done.stdout


# A request whose prompt plus max_tokens exceed its slot's context: llama-server accepts it
# and stops generating when the slot is full (finish_reason "length", fewer tokens than
# max_tokens despite ignore_eos). Deterministic, so a finding the minimizer can shrink. It
# runs on a server of its own with small slots, so every execution is a short prefill.
SMALL_SERVER_ARGS = ("-np", "2", "-c", "2048", "--metrics", "-t", conftest.THREADS)
SMALL_SLOT_CONTEXT = 1024
OVER_CONTEXT = trace_format.from_dict({"name": "over-context", "requests": [
    {"id": "a", "at_ms": 0, "prompt_tokens": 64, "max_tokens": 8},
    {"id": "big", "at_ms": 1, "prompt_tokens": SMALL_SLOT_CONTEXT - 64, "max_tokens": 200},
    {"id": "b", "at_ms": 2, "prompt_tokens": 64, "max_tokens": 8},
]})
# Enough for delta debugging to drop both bystanders (a few tests of up to 3 runs); the
# binary search on lengths is cut short by it.
MINIMIZE_MAX_EXECS = 24


@pytest.fixture
def small_llama_server(llama_server_binary, llama_model, tmp_path, monkeypatch):
    """A second llama-server with two 1024-token slots, stopped by PID at the end of the test."""
    monkeypatch.setattr(conftest, "SERVER_ARGS", SMALL_SERVER_ARGS)
    server = conftest.start_llama_server(llama_server_binary, llama_model, tmp_path / "small-server.log")
    try:
        yield server
    finally:
        conftest.stop_llama_server(server)


# ~20 s here; a CI host shared with other jobs has been seen to run llama-server >10x slower.
@pytest.mark.timeout(900)
@pytest.mark.slow
async def test_a_real_finding_is_minimized_and_its_exported_repro_reproduces_it(
    small_llama_server, tmp_path, monkeypatch
):
    import numpy as np

    from fuzzer.oracle.confirm import examine

    url = small_llama_server.base_url
    db = tmp_path / "min.db"
    await _store_calibration(url, db, monkeypatch)
    with Store.open(db) as store:
        cal = Calibration.from_dict(store.latest_calibration(url))
    async with HttpTarget(url, rng=random.Random(5)) as target:
        exam = await examine(target, OVER_CONTEXT, cal, runs=3, rng=np.random.default_rng(5))
        info = target.info
    findings = [v for v in exam.findings if v.request_id == "big"]
    assert findings, [v.to_dict() for v in exam.verdicts]
    verdict = findings[0]
    assert verdict.kind.value == "protocol" and verdict.reproduction == "3/3"
    with Store.open(db) as store:
        target_id = store.upsert_target(url, info.kind, info.model, info.version, dict(info.capabilities))
        finding_id, _ = store.add_finding(
            kind=verdict.kind.value, signature=verdict.signature or "over-context", trace=OVER_CONTEXT,
            verdict=verdict.to_dict(), slowdown=verdict.slowdown, reproduced=verdict.reproduction, target_id=target_id,
        )

    # Subprocesses: the commands run their own event loops (this test is inside one).
    done = _fuzz("minimize", str(finding_id), "--db", str(db), "--target", url, "--max-execs", str(MINIMIZE_MAX_EXECS))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with Store.open(db, create=False) as store:
        stored = store.get_finding(finding_id)
        minimized = store.get_trace(stored.minimized_trace_hash)
    # The two bystanders go; the victim stays, and still overflows its slot.
    assert [r.id for r in minimized.requests] == ["big"]
    big = minimized.requests[0]
    assert big.prompt_tokens + big.max_tokens > SMALL_SLOT_CONTEXT
    assert big.prompt_tokens <= OVER_CONTEXT.request("big").prompt_tokens

    out = tmp_path / "findings"
    done = _fuzz("export", str(finding_id), "--db", str(db), "--out", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    script = next(out.rglob("repro.py"))
    ran = await asyncio.to_thread(subprocess.run, [sys.executable, "-I", "-S", str(script), "--base-url", url, "--runs", "3"],
                         capture_output=True, text=True, timeout=REPRO_TIMEOUT_S, check=False)
    assert ran.returncode == 1, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert "RESULT: REPRODUCED" in ran.stdout


def _fuzz(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fuzzer", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=REPRO_TIMEOUT_S, check=False)
