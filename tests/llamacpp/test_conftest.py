"""How the llama-server fixture finds its binary, and says why when it cannot."""

from __future__ import annotations

import os
import stat

from .conftest import find_llama_server


def test_env_var_names_the_binary(tmp_path, monkeypatch):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FUZZ_LLAMA_SERVER", str(binary))
    assert find_llama_server() == (binary, f"FUZZ_LLAMA_SERVER={binary}")


def test_env_var_that_names_nothing_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("FUZZ_LLAMA_SERVER", str(tmp_path / "missing"))
    binary, reason = find_llama_server()
    assert binary is None
    assert "is not an executable file" in reason


def test_empty_cache_says_how_to_build(tmp_path, monkeypatch):
    monkeypatch.delenv("FUZZ_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("FUZZ_LLAMA_CACHE", str(tmp_path))
    binary, reason = find_llama_server()
    assert binary is None
    assert ".ci/llama-server.sh" in reason and str(tmp_path) in reason


def test_cache_entry_for_another_cpu_is_not_used(tmp_path, monkeypatch):
    monkeypatch.delenv("FUZZ_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("FUZZ_LLAMA_CACHE", str(tmp_path))
    foreign = tmp_path / "11434.0.0-000000000000" / "bin" / "llama-server"
    foreign.parent.mkdir(parents=True)
    foreign.write_text("#!/bin/sh\n")
    os.chmod(foreign, 0o755)
    assert find_llama_server()[0] is None
