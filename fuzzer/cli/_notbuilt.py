"""The one honest answer of a command whose capability does not exist yet."""

from __future__ import annotations

from fuzzer.errors import NotBuiltError


def not_built(command: str, what: str) -> NotBuiltError:
    return NotBuiltError(f"`fuzz {command}` is not built yet: {what} does not exist in this version")
