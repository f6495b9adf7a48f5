"""Fault modes of the simulator (issue 8), what the executor sees of each, and a campaign that goes through all."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import pytest
from reliability_support import (
    calibrated_template,
    campaign_args,
    copy_db,
    db_facts,
    run_fuzz,
)

from fuzzer.errors import ConfigError
from fuzzer.execute.http import HttpTarget
from fuzzer.execution import FAILURE_KIND, Outcome
from fuzzer.sim import faults
from fuzzer.sim.config import SimConfig
from fuzzer.sim.server import SimServer
from fuzzer.trace import Request, Trace

CAPS = {"tokenize": True, "chat": True, "n": True, "logprobs": True}
TRACE = Trace(requests=(
    Request(id="s", at_ms=0, prompt_tokens=40, max_tokens=8, stream=True),
    Request(id="w", at_ms=5, prompt_tokens=50, max_tokens=8, stream=False),
))


def test_parse_all_none_and_unknown():
    assert faults.parse("all") == faults.NAMES
    assert faults.parse("none") == () == faults.parse("")
    assert faults.parse("crash, http-500") == ("crash", "http-500")
    with pytest.raises(ConfigError, match="unknown fault 'boom'.*choose from"):
        faults.parse("boom")
    with pytest.raises(ConfigError, match="between 0 and 1"):
        faults.FaultPlan(("reset",), rate=1.5)


def test_every_fault_documented_with_a_finding_kind():
    kinds = {info.name: info.kind for info in faults.describe()}
    assert set(kinds) == set(faults.NAMES)
    assert set(kinds.values()) == {"error", "hang", "protocol", "crash"}
    assert all(info.summary and info.client_sees for info in faults.describe())


def test_choice_is_deterministic_per_seed_and_shape_and_follows_the_rate():
    plan = faults.FaultPlan(faults.NAMES, rate=0.05, seed=3)
    shapes = [(p, m) for p in range(1, 200) for m in (1, 16, 128)]
    first = [plan.choose(p, m) for p, m in shapes]
    assert first == [plan.choose(p, m) for p, m in shapes]  # the same request gets the same fault
    other = [faults.FaultPlan(faults.NAMES, rate=0.05, seed=4).choose(p, m) for p, m in shapes]
    assert first != other  # the seed decides which shapes
    hit = sum(f is not None for f in first) / len(shapes)
    expected = 1 - (1 - 0.05) ** len(faults.NAMES)
    assert abs(hit - expected) < 0.06
    assert faults.FaultPlan(faults.NAMES, rate=0.0).choose(40, 8) is None


def test_grace_period_then_faults():
    plan = faults.FaultPlan(("http-500",), rate=1.0, grace_requests=3)
    assert [plan.choose(10, 10, served) for served in range(5)] == [None, None, None, "http-500", "http-500"]


async def _run_with(fault: str):
    server = SimServer(SimConfig(speed=20), faults=faults.FaultPlan((fault,), rate=1.0))
    url = await server.start()
    try:
        async with HttpTarget(url, timeout_s=0.5, idle_timeout_s=3, idle_after_timeout_s=3, capabilities=CAPS) as t:
            result = await t.execute(TRACE)
        return result, server.fault_counts[fault]
    finally:
        await server.stop()


@pytest.mark.parametrize(
    ("fault", "outcomes"),
    [
        ("http-500", {Outcome.HTTP_ERROR}),
        ("reset", {Outcome.CONNECTION_ERROR}),
        ("hang", {Outcome.TIMEOUT}),
        ("malformed-sse", {Outcome.MALFORMED}),
        ("truncated-sse", {Outcome.MISSING_DONE, Outcome.MALFORMED}),
        ("crash", {Outcome.CONNECTION_ERROR}),
    ],
)
async def test_each_fault_is_the_failure_of_its_kind_and_no_latency(fault, outcomes):
    result, injected = await _run_with(fault)
    assert injected >= 1
    assert {r.outcome for r in result.requests} <= outcomes
    # Per request a crash looks like resets and refusals; the oracle's crashed() makes it a crash.
    expected = "error" if fault == "crash" else faults.KIND[fault]
    assert {FAILURE_KIND[r.outcome] for r in result.requests} == {expected}
    for r in result.requests:
        if r.outcome is Outcome.TIMEOUT:
            assert r.e2e_s is None and r.ttft_s is None  # the client giving up is no server latency


async def test_crash_refuses_connections_then_restarts_cold():
    server = SimServer(SimConfig(speed=1))
    url = await server.start()
    try:
        async with HttpTarget(url, timeout_s=1, idle_timeout_s=3, idle_after_timeout_s=1, capabilities=CAPS) as t:
            ok = await t.execute(TRACE)
            assert not ok.failures
            old_engine = server.engine
            crash = asyncio.create_task(server.crash(down_s=0.6))
            await asyncio.sleep(0.1)
            assert server.down
            with pytest.raises(Exception):  # noqa: B017,PT011 - refused: aiohttp's or the fuzzer's error
                await t.execute(TRACE)
            await crash
            assert not server.down and server.engine is not old_engine
            again = await t.execute(TRACE)
            assert not again.failures
    finally:
        await server.stop()


@pytest.mark.slow
def test_campaign_goes_through_every_fault(tmp_path_factory, tmp_path):
    db = copy_db(calibrated_template(tmp_path_factory.mktemp("calibrated")), tmp_path / "faults.db")
    before = db_facts(db)
    done = run_fuzz(*campaign_args(db, "--max-execs", str(before["executions"] + 20)), cwd=tmp_path, timeout_s=300)
    assert done.returncode == 0, done.stderr
    assert "error:" not in done.stderr and "Traceback" not in done.stderr
    conn = sqlite3.connect(db)
    outcomes = dict(conn.execute("select outcome, count(*) from request_results group by outcome"))
    kinds = {row[0] for row in conn.execute("select kind from findings")}
    # The client giving up (a hang past --timeout) is never recorded as a server latency.
    assert conn.execute("select count(*) from request_results where outcome = 'timeout' "
                        "and e2e_s is not null").fetchone()[0] == 0
    conn.close()
    # Which faults a short campaign meets depends on the shapes it tries (a seed trace whose
    # shape crashes the server crashes it every time); each kind's mapping is tested above.
    assert db_facts(db)["executions"] >= before["executions"] + 20  # a step may overshoot --max-execs
    assert sum(n for o, n in outcomes.items() if o not in ("ok", "cancelled")) > 0, outcomes
    assert kinds & {"error", "crash", "protocol", "hang"}, kinds
    assert kinds <= {"error", "crash", "protocol", "hang", "ttft-outlier", "itl-stall", "e2e-outlier", "cold-start",
                     "leak", "option-slowdown"}
    shown = json.loads(run_fuzz("findings", "--db", str(db), "--json", cwd=tmp_path).stdout)
    assert {f["kind"] for f in shown} == kinds
