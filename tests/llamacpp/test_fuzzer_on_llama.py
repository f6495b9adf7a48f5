"""The fuzzer against a real llama-server (issue 9): detection, exact prompts, metrics, campaign, repro.

The session's server (tests/llamacpp/conftest.py: -np 4 -c 16384 --metrics, random-weight
model) is driven through the fuzzer's own HttpTarget, the library's calibration, the CLI's
campaign and a generated repro.py run with `python -I -S`.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fuzzer import servers
from fuzzer import trace as trace_format
from fuzzer.calibration import calibrate
from fuzzer.cli import cli as cli_main
from fuzzer.execution import Outcome
from fuzzer.executor import HttpTarget
from fuzzer.expectation import assumption_for
from fuzzer.store import Store

pytestmark = pytest.mark.llamacpp

ROOT = Path(__file__).resolve().parents[2]
SLOTS = 4  # -np 4 in conftest.SERVER_ARGS
SLOT_CONTEXT = 16384 // SLOTS
# Finding kinds of SPEC §7: whatever a campaign finds must be one of them.
KINDS = {"ttft-outlier", "itl-stall", "e2e-outlier", "cold-start", "leak", "error", "hang", "protocol", "crash"}
# Bounds of the short campaign: enough executions to seed the corpus and fuzz a few children.
CAMPAIGN_MAX_EXECS = 12
CAMPAIGN_DURATION = "150s"
REPRO_TIMEOUT_S = 180


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
    # Six requests on four slots: two are deferred (waiting) until a slot frees.
    trace = trace_format.from_dict({"requests": [
        {"id": f"r{i}", "at_ms": i, "prompt_tokens": 400, "max_tokens": 48} for i in range(SLOTS + 2)
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
    assert all(b.t_s > a.t_s for a, b in zip(samples, samples[1:]))


async def _store_calibration(url: str, db: Path) -> None:
    """A cheap calibration (one repeat per probe) stored under the key `fuzz campaign` reads."""
    async with HttpTarget(url, server="llamacpp", rng=random.Random(3)) as target:
        info = target.info
        assert info is not None
        assumption = assumption_for("llamacpp", {**servers.adapter("llamacpp").scheduler_defaults, **info.scheduler})
        cal = await calibrate(target, assumption=assumption, rng=random.Random(3), repeats=1, warmup_runs=1,
                              max_model_len=info.max_model_len)
    assert cal.assumption.max_num_seqs == SLOTS and cal.assumption.token_budget == 2048
    with Store.open(db) as store:
        store.save_calibration(url, cal.to_dict(), created_at=cal.created_at)


@pytest.mark.slow
async def test_a_short_campaign_runs_cleanly_and_classifies_what_it_finds(llama_server, tmp_path):
    db = tmp_path / "campaign.db"
    await _store_calibration(llama_server.base_url, db)
    # A subprocess: the campaign runs its own event loop and signal handlers.
    done = subprocess.run(
        [sys.executable, "-m", "fuzzer", "campaign", "--target", llama_server.base_url, "--server", "llamacpp",
         "--max-execs", str(CAMPAIGN_MAX_EXECS), "--duration", CAMPAIGN_DURATION, "--db", str(db), "--seed", "7"],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
    )
    assert done.returncode in (0, 1), done.stdout[-2000:] + done.stderr[-2000:]
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
