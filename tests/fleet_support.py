"""Shared by the fleet tests: Ray or a skip (a failure with FUZZ_REQUIRE_RAY=1), the targets file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def require_ray():
    """The ray module; skips when it is not installed, unless FUZZ_REQUIRE_RAY=1 (CI), which fails instead."""
    try:
        import ray
    except ImportError:
        reason = "ray is not installed (pip install -e '.[ray]')"
        if os.environ.get("FUZZ_REQUIRE_RAY") == "1":
            pytest.fail(f"FUZZ_REQUIRE_RAY=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    return ray


def write_targets(path: Path, targets: dict[str, tuple[str, str]]) -> Path:
    """A targets file: name -> (url, kind)."""
    path.write_text("".join(f'[[target]]\nname = "{n}"\nurl = "{url}"\nkind = "{kind}"\n\n'
                            for n, (url, kind) in targets.items()))
    return path
