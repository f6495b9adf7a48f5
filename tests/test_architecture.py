"""The architecture rules of ARCHITECTURE.md ("Layering"), checked on the source.

One rule: each package of ``fuzzer`` may import only the packages listed for it in
``MAY_IMPORT`` (and itself), every import counted (top level, inside functions, under
TYPE_CHECKING), and no two modules import each other, directly or round a cycle. Beside it
the two house rules: only ``cli`` prints, only ``store`` touches SQLite.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import fuzzer

from conftest import ROOT

PACKAGE = ROOT / "fuzzer"
# A smell detector, not a reason to split: a module past this is worth a second look.
MAX_MODULE_LINES = 600

#: The seam: the value types every stage speaks (a trace in, an execution out, the errors).
SEAM = {"errors", "trace", "execution"}
#: Which top-level part of ``fuzzer`` may import which. Value types flow one way: a trace is
#: executed (execute), judged (oracle), searched (search), shrunk (shrink), reported (report),
#: and only the command line sees every stage.
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),
    "trace": {"errors"},
    "execution": {"errors", "trace"},
    "__init__": SEAM,
    "sim": SEAM,
    "store": SEAM,
    "execute": SEAM,
    "formats": SEAM,
    "oracle": SEAM | {"execute"},
    "search": SEAM | {"execute", "oracle", "store"},
    "shrink": SEAM | {"execute", "oracle", "store"},
    "report": SEAM | {"execute", "oracle", "store"},
    # One campaign across many servers: workers (execute, oracle) and a coordinator (search, store).
    "fleet": SEAM | {"execute", "oracle", "search", "store"},
    "cli": SEAM | {"sim", "store", "execute", "formats", "oracle", "search", "shrink", "report", "fleet"},
    "__main__": {"cli"},
}
#: Leaf modules of a stage: they import nothing of the fuzzer's but the seam.
LEAVES = {"fuzzer.oracle.model", "fuzzer.oracle.kinds"}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _fuzzer_imports(path: Path) -> set[str]:
    """Every ``fuzzer...`` module this file imports, wherever the import statement stands."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "fuzzer"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "fuzzer":
                continue
            for alias in node.names:
                # ``from fuzzer.oracle import judge`` imports the module fuzzer.oracle.judge.
                candidate = f"{node.module}.{alias.name}"
                sub = PACKAGE.parent / Path(*candidate.split("."))
                found.add(candidate if sub.with_suffix(".py").exists() or sub.is_dir() else node.module)
    return found


def _part(module: str) -> str:
    """The top-level part of fuzzer a module belongs to: ``fuzzer.oracle.judge`` -> ``oracle``."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _graph() -> dict[str, set[str]]:
    return {_name(p): _fuzzer_imports(p) for p in _modules()}


def _top_level_imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module.split(".")[0]


def test_every_part_of_the_package_has_a_layering_rule():
    parts = {_part(m) for m in _graph()}
    assert parts <= set(MAY_IMPORT), sorted(parts - set(MAY_IMPORT))


def test_packages_import_only_what_the_layering_allows():
    offenders = []
    for module, imports in _graph().items():
        own = _part(module)
        for imported in imports:
            other = _part(imported)
            # The package root holds only the version and the seam's names: anyone may read it.
            if other not in (own, "__init__") and other not in MAY_IMPORT[own]:
                offenders.append(f"{module} -> {imported}")
    assert offenders == []


def test_leaf_modules_import_only_the_seam():
    graph = _graph()
    offenders = [f"{m} -> {i}" for m in LEAVES for i in graph[m] if _part(i) not in SEAM]
    assert offenders == []


def test_no_import_cycles():
    graph = _graph()
    # The package's own __init__ imports of its submodules are how Python loads them, not a
    # dependency of the stage; count module -> module edges only.
    edges = {m: {i for i in imps if i in graph and i != m and not m.startswith(i + ".")} for m, imps in graph.items()}
    state: dict[str, int] = defaultdict(int)  # 0 new, 1 on the stack, 2 done
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state[nxt] == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif state[nxt] == 0:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if state[node] == 0:
            visit(node, [])
    assert cycles == []


def test_the_rule_catches_a_violation(tmp_path):
    """Positive control: the import reader sees a lazy import inside a function."""
    source = tmp_path / "bad.py"
    source.write_text("def f():\n    from fuzzer.cli import main\n    return main\n")
    assert "fuzzer.cli" in _fuzzer_imports(source)
    assert _part("fuzzer.cli") not in MAY_IMPORT["execute"]


def test_only_the_store_touches_sqlite():
    offenders = [
        str(p.relative_to(ROOT)) for p in _modules()
        if "store" not in p.relative_to(PACKAGE).parts and {"sqlite3", "sqlite_utils"} & set(_top_level_imports(p))
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


def test_hypothesis_is_a_test_dependency_only():
    users = [str(p.relative_to(ROOT)) for p in _modules() if "hypothesis" in set(_top_level_imports(p))]
    assert users == []


def test_modules_stay_small():
    big = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert big == {}


def test_public_names():
    for name in fuzzer.__all__:
        assert hasattr(fuzzer, name), name
    assert "FuzzError" in fuzzer.__all__ and "Trace" in fuzzer.__all__
