"""Reading a production trace file as text: plain or gzipped, UTF-8, one clear error otherwise."""

from __future__ import annotations

import gzip
from pathlib import Path

from fuzzer.errors import FormatError


def read_text(path: Path) -> str:
    """The file's text; a missing, unreadable, binary or non-UTF-8 file is one FormatError."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise FormatError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise FormatError(f"{path}: is a folder, not a trace file") from None
    except OSError as e:
        raise FormatError(f"{path}: cannot be read ({e.strerror or e})") from None
    if raw[:2] == b"\x1f\x8b":  # gzip magic: AIPerf reads gzipped Mooncake traces too
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise FormatError(f"{path}: a damaged gzip file ({e})") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: not UTF-8 text (byte {e.start}); expected Mooncake JSONL or a CSV trace") from None
