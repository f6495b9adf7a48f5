"""The exception tree of the fuzzer.

Every error the tool raises on purpose derives from :class:`FuzzError`. Only the
CLI turns these into one-line messages and exit codes; library code raises them
and never prints.

    FuzzError
    ├── TraceError          an invalid trace (JSON path, bad value, rule)
    ├── StoreError          the database cannot be opened, is too new, or is locked
    │   └── NotFoundError   an unknown finding, trace or execution id
    ├── TargetError         the target server is unreachable or misbehaves
    ├── OutputError         an output folder or file cannot be written
    └── ConfigError         a bad option value (unknown pathology, bad duration, ...)

A request the target rejects is not an error but data: its outcome is
``unsupported`` or ``rejected`` (:class:`fuzzer.execution.Outcome`).
"""

from __future__ import annotations

import json


class FuzzError(Exception):
    """Root of every error the fuzzer raises on purpose."""


class TraceError(FuzzError):
    """A trace does not follow the format of ARCHITECTURE.md, "Traces".

    ``path`` is the JSON path of the offending value (``requests[3].max_tokens``),
    ``rule`` what it must satisfy and ``value`` what was found.
    """

    def __init__(self, path: str, rule: str, value: object = None, *, source: str | None = None):
        self.path = path
        self.rule = rule
        self.value = value
        self.source = source
        where = f"{source}: " if source else ""
        shown = "" if value is NO_VALUE else f", got {_show(value)}"
        super().__init__(f"{where}{path}: {rule}{shown}")


class StoreError(FuzzError):
    """The campaign database cannot be used as asked."""


class NotFoundError(StoreError):
    """An id given by the user names nothing in the database."""


class TargetError(FuzzError):
    """The target server cannot be reached or does not behave like an inference server."""


class OutputError(FuzzError):
    """An output path cannot be written."""


class ConfigError(FuzzError):
    """An option or setting has a value the fuzzer cannot use."""


class _NoValue:
    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return "<no value>"


#: Marker for a TraceError that has no offending value to show (a missing field).
NO_VALUE = _NoValue()


def _show(value: object) -> str:
    """A short, JSON-like rendering of a bad value for an error message."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class FormatError(FuzzError):
    """A production trace (Mooncake JSONL, Azure or BurstGPT CSV) cannot be read or written."""
