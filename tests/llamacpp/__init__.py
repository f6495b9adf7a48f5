"""Tests against a real llama.cpp llama-server (pytest -m llamacpp).

A package, so that this folder's conftest.py is imported as `llamacpp.conftest` and does not
shadow tests/conftest.py, which the other test modules import as `conftest`.
"""
