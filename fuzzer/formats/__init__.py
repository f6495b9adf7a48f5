"""Production trace formats in and out (ARCHITECTURE.md, "Formats").

``read(path, fmt)`` reads Mooncake JSONL, Azure or BurstGPT CSV into
:class:`~fuzzer.formats.records.ProductionRequest` values (``fmt="auto"`` looks at the file);
:mod:`fuzzer.formats.slicing` cuts them into seed traces; :mod:`fuzzer.formats.mooncake`
writes a trace back as Mooncake JSONL. Imports only the seam.
"""

from __future__ import annotations

from pathlib import Path

from fuzzer.errors import FormatError
from fuzzer.formats import mooncake, tables
from fuzzer.formats._text import read_text
from fuzzer.formats.records import ProductionRequest

FORMATS = ("auto", "mooncake", "azure", "burstgpt")


def detect(path: Path) -> str:
    """Which format a file is in: JSON lines are Mooncake, a CSV header names Azure or BurstGPT."""
    text = read_text(path)
    stripped = text.lstrip()
    if stripped.startswith("{"):
        return "mooncake"
    head = tables.header(stripped)
    if all(c in head for c in tables.AZURE_COLUMNS):
        return "azure"
    if all(c in head for c in tables.BURSTGPT_COLUMNS):
        return "burstgpt"
    shown = ", ".join(head[:6]) or "nothing"
    raise FormatError(f"{path}: not a trace this fuzzer reads (Mooncake JSONL, Azure CSV "
                      f"{'/'.join(tables.AZURE_COLUMNS)}, BurstGPT CSV); its first line holds {shown}")


def read(path: str | Path, fmt: str = "auto") -> tuple[str, list[ProductionRequest]]:
    """(the format, every request) of a production trace file."""
    path = Path(path)
    if fmt == "auto":
        fmt = detect(path)
    readers = {"mooncake": mooncake.read, "azure": tables.read_azure, "burstgpt": tables.read_burstgpt}
    if fmt not in readers:
        raise FormatError(f"unknown trace format {fmt!r} (one of {', '.join(FORMATS)})")
    return fmt, readers[fmt](path)
