"""A whole campaign is a function of its seed: on virtual time the same seed gives the same
executions, corpus and findings, byte for byte (as trio tests its scheduler's determinism).

Everything random draws from the campaign's seeded generators and every clock is injected, so
two runs write identical databases. A hidden ``random.random()``, ``time.time()`` or set-order
dependence anywhere in search, oracle or store shows up here as a differing row.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CORPUS, ROOT

from fuzzer import trace as tf
from fuzzer.oracle.calibrate import calibrate
from fuzzer.search.campaign import Campaign, Settings
from fuzzer.sim import VirtualTarget
from fuzzer.store import Store

SEED = 3
PATHOLOGIES = ("hol-prefix-burst", "logprobs-batch-cost")


def _ticks(step: float = 0.001):
    """A clock that advances by ``step`` at every reading: deterministic, and never stands still."""
    counter = itertools.count()
    return lambda: 1_000_000.0 + step * next(counter)


async def _campaign(path, seed: int) -> list[str]:
    target = VirtualTarget(pathologies=PATHOLOGIES, seed=seed)
    calibration = await calibrate(target, rng=random.Random(seed))
    seeds = [tf.load(CORPUS / name) for name in ("stream-mix.json", "vllm-37308.json", "spread-arrivals.json")]
    with Store.open(path, clock=_ticks()) as store:
        campaign = Campaign(target, store, Settings(seed=seed, max_execs=40), seeds=seeds, target_key="sim:det",
                            calibration=calibration, clock=_ticks())
        await campaign.run()
    connection = sqlite3.connect(path)
    try:
        return list(connection.iterdump())
    finally:
        connection.close()


def _campaign_in_a_process(path: Path, seed: int, hash_seed: int) -> list[str]:
    """The same campaign in a fresh interpreter with its own string-hash seed: nothing may
    depend on a set's iteration order (a resumed campaign runs in another process too)."""
    code = ("import asyncio, sys; sys.path.insert(0, 'tests'); import test_determinism as t; "
            f"asyncio.run(t._campaign({str(path)!r}, {seed}))")
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed)}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=600)
    connection = sqlite3.connect(path)
    try:
        return list(connection.iterdump())
    finally:
        connection.close()


@pytest.mark.slow
def test_the_same_seed_writes_the_same_database(tmp_path):
    first = _campaign_in_a_process(tmp_path / "a.db", SEED, hash_seed=1)
    second = _campaign_in_a_process(tmp_path / "b.db", SEED, hash_seed=2)
    for table in ("executions", "corpus", "findings"):  # the comparison covers all three
        assert any(line.startswith(f'INSERT INTO "{table}"') for line in first), table
    assert first == second


@pytest.mark.slow
def test_another_seed_writes_another_database(tmp_path):
    """Positive control: the comparison above can fail."""
    first = asyncio.run(_campaign(tmp_path / "a.db", SEED))
    assert first != asyncio.run(_campaign(tmp_path / "c.db", SEED + 1))
