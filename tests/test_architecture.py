"""The architecture rules of ARCHITECTURE.md, "Layering", checked on the source."""

from __future__ import annotations

import ast

from conftest import ROOT

import fuzzer

PACKAGE = ROOT / "fuzzer"
# "About <= 500 lines a module"; past this a module is doing two jobs and should be split.
MAX_MODULE_LINES = 600


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module.split(".")[0]


def test_only_the_store_touches_sqlite():
    offenders = [
        str(p.relative_to(ROOT)) for p in _modules()
        if "store" not in p.relative_to(PACKAGE).parts and {"sqlite3", "sqlite_utils"} & set(_imports(p))
    ]
    assert offenders == []


def test_only_the_cli_prints():
    offenders = []
    for path in _modules():
        if "cli" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_modules_stay_small():
    big = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert big == {}


def test_public_names():
    for name in fuzzer.__all__:
        assert hasattr(fuzzer, name), name
    assert "FuzzError" in fuzzer.__all__ and "Trace" in fuzzer.__all__
