"""Helpers for the managed-target tests: a launch command for the simulator, and finding
the processes a test started (by a marker in their command line) to prove none is left."""

from __future__ import annotations

import os
import shlex
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def marker() -> str:
    """A seed nobody else's simulator uses: it marks the processes of one test."""
    return str(int(uuid.uuid4().hex[:7], 16))


def sim_command(mark: str, *extra: str, speed: float = 20.0) -> str:
    """The built-in simulator as a launch command, on 127.0.0.1 and the fuzzer's {port}."""
    return shlex.join([sys.executable, "-m", "fuzzer", "sim", "--host", "127.0.0.1", "--port", "{port}",
                       "--speed", str(speed), "--seed", mark, *extra])


def servers_with(mark: str) -> list[int]:
    """Live (not zombie) processes with ``mark`` among their arguments that are not the fuzz
    command itself: the launched server and whatever it started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z" or not any(mark in a for a in args):
            continue
        if any(a.endswith("fuzz") or "pytest" in a for a in args[:2]) or "--launch" in args:
            continue
        found.append(int(entry.name))
    return found


def wait_until(predicate, timeout_s: float = 30.0, every_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return predicate()


def dying_command(mark: str, speed: float = 20.0) -> str:
    """``tests/dying_server.py``: the simulator, killed once it finished the request $DIE_ON."""
    return shlex.join([sys.executable, str(ROOT / "tests" / "dying_server.py"), "--host", "127.0.0.1",
                       "--port", "{port}", "--speed", str(speed), "--seed", mark])
