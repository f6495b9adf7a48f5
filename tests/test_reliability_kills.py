"""Kill safety (issue 8): SIGKILL a running campaign / minimization at random points, resume, lose nothing.

After every kill the database passes ``PRAGMA integrity_check``, every finding that was
in it is still there, execution counts never go down, and the killed process's simulator
child exits on its own. Kill points are drawn from a seeded RNG and bounded in count.
"""

from __future__ import annotations

import json
import random
import subprocess
import time

import pytest
from reliability_support import (
    calibrated_template,
    campaign_args,
    children,
    copy_db,
    db_facts,
    env,
    fuzz_command,
    kill9,
    run_fuzz,
    start_campaign,
    wait_gone,
)

#: Kills per test, and where they fall: seconds after the campaign's simulator child is up
#: (start-up takes 1-5 s on a loaded machine). Kills land mid-calibration-lookup, mid-fuzzing,
#: mid-confirmation or mid-recovery from a crash fault.
KILLS = 3
KILL_WINDOW_S = (0.2, 6.0)
#: How long a campaign may take to start its simulator.
STARTUP_S = 30.0

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return calibrated_template(tmp_path_factory.mktemp("calibrated"))


def _wait_for_child(proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_S
    while not children(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)


def _assert_nothing_lost(before: dict, after: dict) -> None:
    assert after["integrity"] == "ok"
    assert after["executions"] >= before["executions"]
    for finding_id, signature in before["findings"].items():
        assert after["findings"].get(finding_id) == signature


def test_campaign_survives_sigkill_and_resumes(template, tmp_path):
    db = copy_db(template, tmp_path / "kills.db")
    rng = random.Random(2024)
    facts = db_facts(db)
    first = facts
    for _ in range(KILLS):
        proc = start_campaign(db, "--duration", "60s", cwd=tmp_path)
        _wait_for_child(proc)
        time.sleep(rng.uniform(*KILL_WINDOW_S))
        assert proc.poll() is None, "the campaign ended before it could be killed"
        simulators = kill9(proc)
        assert simulators, "the campaign had no simulator child"
        for pid in simulators:
            assert wait_gone(pid), f"simulator {pid} outlived its SIGKILLed campaign"
        now = db_facts(db)
        _assert_nothing_lost(facts, now)
        facts = now
    # Resume once more and finish normally: the campaign takes up where the last kill left it.
    done = run_fuzz(*campaign_args(db, "--max-execs", str(facts["executions"] + 8)), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "resumed" in done.stdout
    final = db_facts(db)
    _assert_nothing_lost(facts, final)
    assert final["executions"] >= facts["executions"] + 1
    assert final["executions"] > first["executions"]


def test_minimization_survives_sigkill_and_resumes(template, tmp_path):
    db = copy_db(template, tmp_path / "minimize.db")
    found = run_fuzz(*campaign_args(db, "--max-execs", "30"), cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    facts = db_facts(db)
    assert facts["findings"], "the faulty simulator gave the campaign nothing to minimize"
    finding = max(facts["findings"])  # a fault finding (the template's first one is a latency one)
    rng = random.Random(7)
    for _ in range(2):
        proc = subprocess.Popen(
            fuzz_command("minimize", str(finding), "--db", str(db), "--timeout", "1.0"), cwd=tmp_path, env=env(),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        _wait_for_child(proc)
        time.sleep(rng.uniform(0.5, 3.0))
        if proc.poll() is not None:
            break  # it finished before the kill: nothing left to interrupt
        for pid in kill9(proc):
            assert wait_gone(pid)
        now = db_facts(db)
        _assert_nothing_lost(facts, now)
        facts = now
    # The resumed search runs to its end: ~30 s on a quiet machine, over 120 s once in CI beside two truth
    # campaigns (stop 41: 61 executions into its third pass, still accepting), so its bound is wider.
    done = run_fuzz("minimize", str(finding), "--db", str(db), "--timeout", "1.0", cwd=tmp_path, timeout_s=360.0)
    assert done.returncode == 0, done.stderr
    assert "minimized" in done.stdout
    _assert_nothing_lost(facts, db_facts(db))
    shown = run_fuzz("findings", "--db", str(db), "--json", cwd=tmp_path)
    minimized = {f["id"]: f["minimized"] for f in json.loads(shown.stdout)}
    assert minimized[finding] is True
