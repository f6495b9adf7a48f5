"""Shared by the tests/test_reliability_*.py files: the fuzz CLI as a subprocess, on a calibrated database.

A campaign calibrates its target first (~400 probe requests, tens of seconds). The
reliability tests want many short campaigns, so one campaign calibrates once per test
session into a template database (``calibrated_template``) and every test starts from a
copy of it. All campaigns here run the built-in simulator (a child process on
127.0.0.1) with every fault mode on, faster than real time.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "corpus"
#: The simulator settings of every campaign here (part of the stored target key, so a copy
#: of the template resumes with its calibration). Speed 20: a calibration in ~15 s.
SEED = 11
SIM_ARGS = ("--speed", "20", "--faults", "all", "--fault-rate", "0.1", "--seed", str(SEED))
#: The client timeout of the campaigns here: a hang fault costs this much per request.
TIMEOUT = "1.0"
#: The calibrating campaign's: non-streaming probes say nothing until they end, and a
#: loaded 2-core machine may take seconds (a probe that times out fails the calibration).
CALIBRATION_TIMEOUT = "10"
#: Any one fuzz command here must end within this (a hung command fails the test, not CI).
COMMAND_TIMEOUT_S = 120.0

_template: dict[str, Path] = {}


def fuzz_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "fuzzer", *args]


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    out.update(extra)
    out["PYTHONUNBUFFERED"] = "1"
    return out


def run_fuzz(*args: str, cwd: Path, timeout_s: float = COMMAND_TIMEOUT_S, extra_env: dict | None = None):
    return subprocess.run(
        fuzz_command(*args), cwd=cwd, env=env(**(extra_env or {})), capture_output=True, text=True, timeout=timeout_s,
        check=False,
    )


def campaign_args(db: Path, *more: str, timeout: str = TIMEOUT) -> list[str]:
    return ["campaign", "--db", str(db), "--corpus", str(CORPUS), *SIM_ARGS, "--timeout", timeout, *more]


def start_campaign(db: Path, *more: str, cwd: Path, extra_env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        fuzz_command(*campaign_args(db, *more)), cwd=cwd, env=env(**(extra_env or {})),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def calibrated_template(root: Path) -> Path:
    """A database with a stored calibration of the faulty simulator and a short campaign that met some faults (made once)."""
    if "db" not in _template:
        db = root / "template.db"
        # First run: calibrates (the simulator holds its faults back for it), one execution.
        done = run_fuzz(*campaign_args(db, "--max-execs", "1", timeout=CALIBRATION_TIMEOUT), cwd=root, timeout_s=300)
        assert done.returncode == 0, done.stderr + done.stdout
        # Resumed with a stored calibration: the faults are on from the first request. 24 executions: the first
        # seed's option test (logprobs) took 15 of them, undecided, in one CI run on a loaded machine (10 when quiet),
        # and the template met no fault in the 12 it had then.
        done = run_fuzz(*campaign_args(db, "--max-execs", "24"), cwd=root, timeout_s=300)
        assert done.returncode == 0, done.stderr + done.stdout
        assert db_facts(db)["findings"], "the faulty simulator gave the template campaign nothing"
        _template["db"] = db
    return _template["db"]


def copy_db(template: Path, dest: Path) -> Path:
    shutil.copy(template, dest)
    for suffix in ("-wal", "-shm"):
        side = Path(str(template) + suffix)
        if side.exists():
            shutil.copy(side, Path(str(dest) + suffix))
    return dest


def children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        kids = task / "children"
        if kids.exists():
            out += [int(p) for p in kids.read_text().split()]
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return not alive(pid)


def kill9(proc: subprocess.Popen) -> list[int]:
    """SIGKILL a fuzz process; returns the pids of its children (the simulator) at that moment."""
    kids = children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)
    return kids


def db_facts(db: Path) -> dict:
    """What a SIGKILL must never lose, read with plain sqlite3 (not the fuzzer's store)."""
    conn = sqlite3.connect(db)
    try:
        return {
            "integrity": conn.execute("PRAGMA integrity_check").fetchone()[0],
            "executions": conn.execute("select count(*) from executions").fetchone()[0],
            "findings": {row[0]: row[1] for row in conn.execute("select id, signature from findings")},
        }
    finally:
        conn.close()


@contextlib.contextmanager
def lock_holder(acquire: str, db: Path) -> Iterator[subprocess.Popen]:
    """Another process holding a lock on ``db`` (``acquire``: a Python expression on ``db``,
    e.g. ``CampaignLock(db)``, from fuzzer.store); SIGKILLed at the end, as a crash would."""
    holder = subprocess.Popen(
        [sys.executable, "-c",
         f"import sys, time; from fuzzer.store import *; db = sys.argv[1]; ({acquire}).acquire(); "
         "print('locked', flush=True); time.sleep(60)", str(db)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
