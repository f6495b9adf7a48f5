"""Fixtures shared by the test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from fuzzer import trace as tf
from fuzzer.store import Store

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "corpus"


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
