"""A pytest plugin: SIGTERM interrupts the run as Ctrl-C does, so fixtures' teardown still runs.

Python's default for SIGTERM ends the process at once: the servers the real-server fixtures
started in sessions of their own (tests/vllm_cpu/conftest.py, tests/llamacpp/conftest.py) were
left running after a `timeout` or a CI runner stopped pytest, and held the machine's cores for
the next run. As KeyboardInterrupt, pytest ends the session and tears its fixtures down.
tests/conftest.py installs it; tests/test_interrupt_on_sigterm.py checks it with and without.
"""

from __future__ import annotations

import signal
import threading


def _interrupt(signum, frame):  # noqa: ARG001 - a signal handler's signature
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):  # noqa: ARG001 - pytest's hook signature
    # Only the main thread may set a handler, and a handler someone else set is left alone.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)
