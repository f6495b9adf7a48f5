"""CSV production traces: Azure's LLM inference traces and BurstGPT.

- Azure (AzurePublicDataset, ``AzureLLMInferenceTrace_{code,conv}.csv``, 2023 and 2024):
  ``TIMESTAMP,ContextTokens,GeneratedTokens``, timestamps as ``2023-11-16 18:15:46.6805900``.
- BurstGPT (``BurstGPT_*.csv``): ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``,
  timestamps in seconds from the trace's start; a failed request has 0 response tokens.

Neither records shared prefixes, so their requests get no hash ids.
"""

from __future__ import annotations

import csv
import io
import math
import re
from datetime import datetime, timezone
from pathlib import Path

from fuzzer.errors import FormatError
from fuzzer.formats._text import read_text
from fuzzer.formats.records import ProductionRequest

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")

#: Azure writes 7 fractional digits; datetime takes at most 6.
_FRACTION = re.compile(r"(\.\d{1,6})\d*")


def header(text: str) -> list[str]:
    """The first row of a CSV text, stripped."""
    first = next(csv.reader(io.StringIO(text)), [])
    return [c.strip() for c in first]


def read_azure(path: Path) -> list[ProductionRequest]:
    return _read(path, AZURE_COLUMNS, "azure", _azure_ms)


def read_burstgpt(path: Path) -> list[ProductionRequest]:
    return _read(path, BURSTGPT_COLUMNS, "burstgpt", _seconds_ms)


def _read(path: Path, columns: tuple[str, str, str], name: str, to_ms) -> list[ProductionRequest]:
    text = read_text(path)
    reader = csv.reader(io.StringIO(text))
    head = [c.strip() for c in next(reader, [])]
    missing = [c for c in columns if c not in head]
    if missing:
        raise FormatError(f"{path}: not a {name} CSV: no column {', '.join(missing)} "
                          f"(expected {', '.join(columns)}; found {', '.join(head) or 'nothing'})")
    at, inp, outp = (head.index(c) for c in columns)
    out = []
    try:
        for row in reader:
            if not any(cell.strip() for cell in row):
                continue
            where = f"{path}:{reader.line_num}"
            if len(row) < len(head):
                raise FormatError(f"{where}: {len(row)} fields, the header has {len(head)}")
            out.append(ProductionRequest(to_ms(row[at].strip(), where), _count(row[inp], columns[1], where),
                                         _count(row[outp], columns[2], where)))
    except csv.Error as e:
        raise FormatError(f"{path}:{reader.line_num}: not valid CSV ({e})") from None
    if not out:
        raise FormatError(f"{path}: holds no request")
    return out


def _count(cell: str, column: str, where: str) -> int:
    try:
        value = float(cell.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or not value.is_integer():
        raise FormatError(f"{where}: {column} must be a token count >= 0, got {cell.strip()!r}")
    return int(value)


def _azure_ms(cell: str, where: str) -> float:
    try:
        moment = datetime.fromisoformat(_FRACTION.sub(r"\1", cell))
    except ValueError:
        raise FormatError(f"{where}: TIMESTAMP must be a date and time like 2023-11-16 18:15:46.680, got {cell!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp() * 1000.0


def _seconds_ms(cell: str, where: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise FormatError(f"{where}: Timestamp must be seconds >= 0, got {cell!r}")
    return value * 1000.0
