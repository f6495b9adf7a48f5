"""Seed traces from a production trace: write them into a corpus folder, or hand a campaign
the seeds of one file (a format-1 ``.json`` trace, or a production trace cut into windows)."""

from __future__ import annotations

import re
from pathlib import Path

from fuzzer import trace as trace_format
from fuzzer.errors import OutputError
from fuzzer.formats import read
from fuzzer.formats.mooncake import DEFAULT_BLOCK_SIZE
from fuzzer.formats.slicing import windows
from fuzzer.trace import Trace

#: Requests per seed when a campaign is handed a production trace directly: the size of the
#: project's own seeds (a few to a few dozen requests), so an execution stays short.
DEFAULT_WINDOW = 32
#: Windows a campaign takes from a production trace it is handed directly.
DEFAULT_WINDOWS = 8


def base_name(path: Path) -> str:
    """A trace name from a file name: ``conversation_trace.jsonl`` -> ``conversation_trace``."""
    stem = path.name.split(".")[0]
    name = re.sub(r"[^A-Za-z0-9_.:-]", "-", stem).strip("-._:") or "trace"
    return name[:40]


def import_file(
    path: str | Path, *, fmt: str = "auto", window: int = DEFAULT_WINDOW, start: int = 0, count: int = 1,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> tuple[str, int, list[Trace]]:
    """(the format, the requests in the file, the seed traces) of a production trace."""
    path = Path(path)
    found, records = read(path, fmt)
    traces = windows(records, window=window, start=start, count=count, block_size=block_size, name=base_name(path))
    return found, len(records), traces


def write(traces: list[Trace], out_dir: str | Path) -> list[Path]:
    """Write each trace as ``<out_dir>/<name>.json``; the paths written."""
    folder = Path(out_dir)
    written = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for t in traces:
            path = folder / f"{t.name}.json"
            trace_format.dump(t, path)
            written.append(path)
    except OSError as e:
        raise OutputError(f"cannot write seed traces into {folder}: {e.strerror or e}") from None
    return written


def seeds_of_file(path: str | Path) -> list[Trace]:
    """The seeds of one file given as a campaign's corpus: a format-1 trace, or a production trace's windows."""
    path = Path(path)
    if path.suffix == ".json":
        return [trace_format.load(path)]
    return import_file(path, count=DEFAULT_WINDOWS)[2]
