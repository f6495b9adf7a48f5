"""SIGTERM to pytest tears its fixtures down (tests/interrupt_on_sigterm.py), so no server outlives the run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reliability_support import alive, wait_gone

HERE = Path(__file__).resolve().parent

# A test whose fixture starts a child in a session of its own (as the real-server fixtures do)
# and stops it in its teardown; the test then waits to be signalled. The test before it puts the
# default handler back, as a library's own handler would replace the plugin's (ray.init does).
INNER = '''
import os, signal, subprocess, time
from pathlib import Path
import pytest

@pytest.fixture
def child():
    proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
    Path(os.environ["CHILD_PID_FILE"]).write_text(str(proc.pid))
    yield proc
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

def test_a_library_puts_its_own_handler_in():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as ray.init puts in its own

def test_waits(child):
    time.sleep(120)
'''


def _terminate_inner_run(tmp_path: Path, plugin: bool) -> int:
    """Run INNER under pytest, SIGTERM pytest once the child runs; the child's pid."""
    (tmp_path / "test_inner.py").write_text(INNER)
    pid_file = tmp_path / "child.pid"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
            "-c", os.devnull, str(tmp_path / "test_inner.py")]
    if plugin:
        argv[3:3] = ["-p", "interrupt_on_sigterm"]
    env = dict(os.environ, CHILD_PID_FILE=str(pid_file), PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            assert proc.poll() is None, "the inner pytest ended before its fixture started the child"
            time.sleep(0.05)
        assert pid_file.exists(), "the inner test's fixture never started its child"
        time.sleep(0.3)  # into the test's sleep
        proc.terminate()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return int(pid_file.read_text())


@pytest.mark.slow
def test_sigterm_tears_the_fixtures_down_and_stops_their_children(tmp_path):
    child = _terminate_inner_run(tmp_path, plugin=True)
    assert wait_gone(child)


@pytest.mark.slow
def test_without_the_plugin_sigterm_leaves_the_child_running(tmp_path):
    """The control: what the plugin prevents does happen without it."""
    child = _terminate_inner_run(tmp_path, plugin=False)
    try:
        assert alive(child)
    finally:
        if alive(child):
            os.killpg(child, 9)


def test_this_run_has_the_plugin_installed():
    """tests/conftest.py installs it for the project's own runs (CI's included)."""
    import signal

    import interrupt_on_sigterm

    assert signal.getsignal(signal.SIGTERM) is interrupt_on_sigterm._interrupt
