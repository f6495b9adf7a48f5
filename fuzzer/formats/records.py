"""One request of a production trace, whatever file it came from (ARCHITECTURE.md, "Formats").

Mooncake JSONL, Azure and BurstGPT CSV all reduce to the same four facts per request: when
it arrived, how long its prompt and its output were, and (Mooncake only) which blocks of its
prompt it shares with others, named by hash ids.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProductionRequest:
    """A request as a production trace records it. ``at_ms`` is absolute in the file's own clock."""

    at_ms: float
    input_length: int
    output_length: int
    #: Mooncake's block hashes: equal leading ids mean a shared prompt prefix; () when unknown.
    hash_ids: tuple[int, ...] = ()
