"""The campaign loop on the simulator's virtual time: finds, records, checkpoints, resumes."""

from __future__ import annotations

import asyncio

import pytest
from conftest import CORPUS

from fuzzer import trace as tf
from fuzzer.search.campaign import Campaign, ExitReason, Settings
from fuzzer.sim import VirtualTarget
from fuzzer.store import Store


def _campaign(store, target, seeds, **settings):
    return Campaign(target, store, Settings(**{"seed": 5, **settings}), seeds=seeds, target_key="sim:test")


async def test_finds_the_planted_logprobs_stall_in_the_seed_phase():
    store = Store.memory()
    target = VirtualTarget(pathologies=("logprobs-batch-cost",), seed=2)
    seeds = [tf.load(CORPUS / "n-logprobs.json")]
    summary = await _campaign(store, target, seeds, max_execs=6).run()
    assert summary.reason is ExitReason.MAX_EXECS
    findings = store.list_findings()
    assert findings, "the planted pathology was not found"
    finding = findings[0]
    assert finding.kind in ("e2e-outlier", "itl-stall", "ttft-outlier")
    k, n = map(int, finding.reproduced.split("/"))
    assert n >= 3 and k >= 2
    assert finding.slowdown > 5
    assert (finding.id, finding.kind) in summary.new_findings
    # every confirmation run is stored with the campaign, under its purpose
    assert store.purposes(campaign_id=summary.campaign_id)["confirm"] >= 3


async def test_resume_keeps_corpus_findings_and_counts(seed_trace):
    store = Store.memory()
    target = VirtualTarget(pathologies=("hol-prefix-burst",), seed=2)
    first = _campaign(store, target, [seed_trace], max_execs=14)
    s1 = await first.run()
    corpus_before = {e.hash for e in first.corpus.entries.values()}
    findings_before = [(f.id, f.signature) for f in store.list_findings()]
    executions_before = store.count_executions()

    second = _campaign(store, target, [seed_trace], max_execs=executions_before + 8)
    s2 = await second.run()
    assert s2.resumed and s2.campaign_id == s1.campaign_id
    assert corpus_before <= {e.hash for e in second.corpus.entries.values()}
    assert store.count_executions() >= executions_before + 8
    # nothing found twice: the seed is not re-seeded and known signatures are not re-recorded
    signatures = [f.signature for f in store.list_findings()]
    assert len(signatures) == len(set(signatures))
    assert findings_before == [(f.id, f.signature) for f in store.list_findings()][: len(findings_before)]
    second.corpus._check_invariants()


async def test_interrupt_stops_after_the_current_execution(seed_trace):
    store = Store.memory()
    target = VirtualTarget(seed=4)
    stop = asyncio.Event()
    seen = []

    def on_stats(stats):
        seen.append(stats.executions)
        if stats.executions >= 5:
            stop.set()

    campaign = Campaign(target, store, Settings(seed=1, max_execs=500), seeds=[seed_trace],
                        target_key="sim:test", on_stats=on_stats, stop=stop)
    summary = await campaign.run()
    assert summary.reason is ExitReason.INTERRUPTED
    assert 5 <= store.count_executions() < 40
    latest = store.latest_campaign()
    assert latest["status"] == "stopped" and latest["state"]["rng"]


@pytest.mark.parametrize("mutator", ["guided", "null"])
async def test_every_child_is_recorded_with_its_purpose(seed_trace, mutator):
    store = Store.memory()
    campaign = _campaign(store, VirtualTarget(seed=1), [seed_trace], max_execs=10, mutator=mutator)
    await campaign.run()
    purposes = store.purposes(campaign_id=campaign.campaign_id)
    assert purposes.get("seed", 0) == 1  # seeds run once; their stability runs come when first fuzzed
    assert purposes.get("fuzz", 0) >= 1
    # the guided campaign re-ran the seed before mutating it; the null baseline never reads the corpus
    assert (purposes.get("stability", 0) >= 1) == (mutator == "guided")
    assert sum(purposes.values()) == store.count_executions()
