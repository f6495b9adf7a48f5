"""Fixtures shared by the test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from fuzzer import trace as tf
from fuzzer.store import Store
from interrupt_on_sigterm import pytest_configure, pytest_runtest_setup  # noqa: F401 - SIGTERM tears fixtures down

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "corpus"


def pytest_report_header(config):
    """The machine, for reading timings in a CI log: CPUs, model and load at the start."""
    import os
    import platform

    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    one, five, _ = os.getloadavg()
    return (f"machine: {usable} usable CPUs of {os.cpu_count()} ({model}), {platform.machine()}; "
            f"load {one:.2f} / {five:.2f} (1 / 5 min)")


@pytest.fixture
def store():
    """A private in-memory campaign database."""
    s = Store.memory()
    yield s
    s.close()


@pytest.fixture
def seed_trace():
    """The trace of the public vLLM 37308 report."""
    return tf.load(CORPUS / "vllm-37308.json")
