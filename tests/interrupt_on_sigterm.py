"""A pytest plugin: SIGTERM interrupts the run as Ctrl-C does, so fixtures' teardown still runs.

Python's default for SIGTERM ends the process at once: the servers the real-server fixtures
started in sessions of their own (tests/vllm_cpu/conftest.py, tests/llamacpp/conftest.py) were
left running after a `timeout` or a CI runner stopped pytest, and held the machine's cores for
the next run. As KeyboardInterrupt, pytest ends the session and tears its fixtures down.
tests/conftest.py installs it, again before each test where a test replaced it (ray.init does);
tests/test_interrupt_on_sigterm.py checks it with and without.
"""

from __future__ import annotations

import signal
import threading


def _interrupt(signum, frame):  # noqa: ARG001 - a signal handler's signature
    raise KeyboardInterrupt(f"signal {signum}")


_installed = False


def _install() -> None:
    signal.signal(signal.SIGTERM, _interrupt)


def pytest_configure(config):  # noqa: ARG001 - pytest's hook signature
    global _installed
    # Only the main thread may set a handler, and a handler someone set before pytest started is left alone.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        _install()
        _installed = True


def pytest_runtest_setup(item):  # noqa: ARG001 - pytest's hook signature
    # Code under test may set its own: ray.init's handler calls sys.exit, which pytest counts as one test's
    # failure and runs on. Put ours back before each test.
    if _installed and signal.getsignal(signal.SIGTERM) is not _interrupt:  # tests run in the main thread
        _install()
