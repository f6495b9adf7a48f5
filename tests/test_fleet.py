"""Fleet campaigns on a local Ray (issue 18): findings from the right target, a lost worker, a
killed coordinator.

One local Ray (2 CPUs) and three built-in simulators on 127.0.0.1 for the module: two plant a
different pathology each, one plants none. Their calibrations are measured once into a
template database that every test copies. Skipped without ray, unless FUZZ_REQUIRE_RAY=1.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fleet_support import require_ray, write_targets

from conftest import CORPUS, ROOT
from fuzzer import trace as tf
from fuzzer.fleet.coordinator import Coordinator
from fuzzer.fleet.pool import RayPool
from fuzzer.fleet.targets import FleetTarget
from fuzzer.fleet.worker import Worker
from fuzzer.search.mutators import Limits
from fuzzer.search.settings import ExitReason, Settings
from fuzzer.sim.process import SimProcess
from fuzzer.store import Store

pytestmark = pytest.mark.slow

SPEED = 10
#: name -> (pathologies planted, kind). The clean simulator is of the logprobs one's kind: a
#: finding on one is re-checked on the other.
SIMS = {"hol": ("hol-prefix-burst", "hol"), "logprobs": ("logprobs-batch-cost", "lp"), "clean": ("none", "lp")}
SEEDS = ("vllm-37308.json", "n-logprobs.json")
#: Small mutants: three simulators, Ray and the tests share 2 cores, and a simulator starved of
#: CPU by a 47-request mutant is really slower than its calibration (a true finding, of the machine).
LIMITS = Limits(max_requests=10, max_output_tokens=128)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """(ray address, {name: FleetTarget}, calibrated template database)."""
    ray = require_ray()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    sims = {name: SimProcess(pathologies=() if p == "none" else (p,), speed=SPEED, seed=i)
            for i, (name, (p, _)) in enumerate(SIMS.items())}
    try:
        for sim in sims.values():
            sim.start()
        targets = {name: FleetTarget(name, url=sims[name].url, kind=kind) for name, (_, kind) in SIMS.items()}
        template = tmp_path_factory.mktemp("fleet") / "template.db"
        # One at a time, as on a quiet machine: three at once on the two cores gave calibrations of 50 % noise.
        with Store.open(template) as store:
            for t in targets.values():
                worker = Worker(t, seed=1)
                store.save_calibration(t.identity, worker.start()["measured"])
                worker.stop()
        yield ray.get_runtime_context().gcs_address, targets, template
    finally:
        for sim in sims.values():
            sim.stop()
        ray.shutdown()


def _db(template: Path, tmp_path: Path) -> Path:
    db = tmp_path / "fleet.db"
    shutil.copy(template, db)
    return db


def _seeds():
    return [tf.load(CORPUS / name) for name in SEEDS]


def _target_ids(db: Path) -> dict[int, str]:
    with Store.open(db) as store:
        state = store.latest_campaign()["state"]
    return {row["target_id"]: name for name, row in state["targets"].items()}


def _executions(db: Path) -> list[tuple[int, int]]:
    """(number, target_id) of every execution, in order."""
    with sqlite3.connect(db) as c:
        return list(c.execute("select number, target_id from executions order by id"))


#: Fleet campaigns tried for the planted target's finding: three simulators, Ray and the tests share two cores,
#: and an option test whose carrier's own cost is measured on a starved simulator can come back undecided (the
#: fleet test of stop 49's CI: no finding in 50 executions). As tests/timing.py's attempts, for the host.
CAMPAIGN_ATTEMPTS = 3


def test_findings_come_from_the_target_that_plants_them_and_are_rechecked_on_its_kind(fleet, tmp_path):
    _, targets, template = fleet
    tried = []
    for attempt in range(CAMPAIGN_ATTEMPTS):
        (tmp_path / str(attempt)).mkdir()
        db = _db(template, tmp_path / str(attempt))
        pool = RayPool("auto")
        with Store.open(db) as store:
            try:
                summary = Coordinator(pool, list(targets.values()), store,
                                      Settings(max_execs=50, seed=3 + attempt, limits=LIMITS), seeds=_seeds()).run()
            finally:
                pool.close()
            findings = store.list_findings()
        assert summary.reason is ExitReason.MAX_EXECS and summary.executions >= 50
        # The requests batched with a logprobs request are many times slower on the server that plants
        # logprobs-batch-cost: a finding is there, confirmed in every run. (Not necessarily the
        # campaign's worst: a request queued behind a held prefix burst on the hol server may be
        # slower still.)
        on_logprobs = [f for f in findings if f.details["target"] == "logprobs"]
        worst = max(on_logprobs, key=lambda f: f.slowdown or 0.0) if on_logprobs else None
        k, n = map(int, worst.reproduced.split("/")) if worst else (0, 0)
        if worst and k == n >= Settings().policy.min_runs:
            break
        tried.append([(f.details, f.slowdown, f.reproduced) for f in findings])
    else:
        raise AssertionError(f"no planted finding in {CAMPAIGN_ATTEMPTS} fleet campaigns: {tried}")
    # A finding is re-checked on the other target of its kind (logprobs and clean), never elsewhere;
    # the outcome there is recorded ("k/n" or "not reproduced ...").
    rechecked = [f for f in findings if len(f.details["targets"]) > 1]
    assert rechecked, [f.details for f in findings]
    for f in findings:
        kind = {"hol"} if f.details["target"] == "hol" else {"logprobs", "clean"}
        assert set(f.details["targets"]) <= kind and f.details["target"] in f.details["targets"]
    # Every execution is stored with the target it ran on, and each target ran some.
    ids = _target_ids(db)
    assert {ids[t] for _, t in _executions(db)} == set(targets)


def test_a_killed_worker_marks_its_target_down_and_the_campaign_goes_on(fleet, tmp_path):
    _, targets, template = fleet
    db = _db(template, tmp_path)
    pool = RayPool("auto")
    killed_at: list[int] = []

    def kill_logprobs(name: str, number: int) -> None:
        if number >= 8 and not killed_at:
            killed_at.append(number)
            pool.kill("logprobs")  # ray.kill: the actor's process dies, as on a lost node

    chosen = [targets["hol"], targets["logprobs"]]
    with Store.open(db) as store:
        try:
            summary = Coordinator(pool, chosen, store, Settings(max_execs=24, seed=5, limits=LIMITS), seeds=_seeds(),
                                  on_execution=kill_logprobs).run()
        finally:
            pool.close()
    assert killed_at
    assert summary.reason is ExitReason.MAX_EXECS and summary.executions >= 24
    assert summary.targets["logprobs"]["status"] == "down"
    assert "worker lost" in summary.targets["logprobs"]["reason"]
    assert summary.targets["hol"]["status"] == "up"
    ids = _target_ids(db)
    after = [ids[t] for number, t in _executions(db) if number > killed_at[0]]
    # The campaign went on on the target still up (a task of the killed worker that had already
    # finished when it was killed may still be stored first).
    assert len(after) >= 5 and after[-5:] == ["hol"] * 5, after


def _campaign_command(address: str, targets_file: Path, db: Path, corpus: Path) -> list[str]:
    return [sys.executable, "-m", "fuzzer", "campaign", "--ray", address, "--targets", str(targets_file),
            "--db", str(db), "--max-execs", "60", "--seed", "7", "--corpus", str(corpus)]


def test_a_killed_coordinator_resumes_with_the_same_command_and_loses_nothing_confirmed(fleet, tmp_path):
    address, targets, template = fleet
    db = _db(template, tmp_path)
    corpus = tmp_path / "seeds"
    corpus.mkdir()
    for name in SEEDS:
        shutil.copy(CORPUS / name, corpus / name)
    targets_file = write_targets(tmp_path / "targets.toml",
                                 {n: (targets[n].url, targets[n].kind) for n in ("hol", "logprobs")})
    command = _campaign_command(address, targets_file, db, corpus)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        before: set[str] = set()
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            with Store.open(db) as store:
                before = {f.signature for f in store.list_findings()}
            if before:
                break
        assert before, "no finding before the kill: " + (proc.stdout.read().decode() if proc.poll() is not None else "")
        assert proc.poll() is None, "the campaign ended before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    with Store.open(db) as store:
        executions_before = store.count_executions()
        assert store.latest_campaign()["status"] == "running"  # it had no chance to say it stopped
    resumed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed" in resumed.stdout
    with Store.open(db) as store:
        assert store.integrity_check() == "ok"
        assert len(store.campaigns()) == 1
        assert before <= {f.signature for f in store.list_findings()}
        assert store.count_executions() >= max(executions_before, 60)
        assert store.latest_campaign()["status"] == "stopped"
