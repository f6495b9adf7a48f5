"""Slices of a production trace become seed traces (format 1) for a campaign.

A window is N consecutive requests (by arrival); its first request is sent at 0 ms and the
gaps of the production trace are kept. Requests whose Mooncake ``hash_ids`` start with the
same block form a prefix group sharing the leading blocks all of them have in common
(``block_size`` tokens each, never more than the group's shortest prompt). Lengths of 0
(BurstGPT's failed requests) become 1, the least a trace can ask for.
"""

from __future__ import annotations

from collections.abc import Sequence

from fuzzer.errors import FormatError, TraceError
from fuzzer.formats.records import ProductionRequest
from fuzzer.trace import MAX_AT_MS, MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS, MAX_REQUESTS, Request, Trace, validate


def windows(
    records: Sequence[ProductionRequest], *, window: int, start: int = 0, count: int = 1, block_size: int, name: str,
) -> list[Trace]:
    """Up to ``count`` consecutive windows of ``window`` requests, the first at request ``start``."""
    if not 1 <= window <= MAX_REQUESTS:
        raise FormatError(f"--window must be 1 to {MAX_REQUESTS} requests, got {window}")
    if count < 1 or start < 0 or block_size < 1:
        raise FormatError(f"--windows and --block-size must be >= 1 and --start >= 0, got {count}, {block_size}, {start}")
    ordered = sorted(records, key=lambda r: r.at_ms)
    if start >= len(ordered):
        raise FormatError(f"--start {start} is past the end of the trace ({len(ordered)} requests)")
    traces = []
    for w in range(count):
        first = start + w * window
        chunk = ordered[first:first + window]
        if not chunk:
            break
        traces.append(to_trace(chunk, first=first, block_size=block_size, name=f"{name}-{first}-{first + len(chunk) - 1}"))
    return traces


def to_trace(chunk: Sequence[ProductionRequest], *, first: int, block_size: int, name: str) -> Trace:
    """One window as a trace; request ids ``r<index>`` give each request's place in the production trace."""
    t0 = chunk[0].at_ms
    span = chunk[-1].at_ms - t0
    if span > MAX_AT_MS:
        raise FormatError(f"window {name} spans {span / 1000:.0f} s; a trace holds at most {MAX_AT_MS // 1000} s: "
                          "use a smaller --window")
    prefixes, member_of = _prefix_groups(chunk, block_size)
    requests = []
    for i, rec in enumerate(chunk):
        prompt = max(1, rec.input_length)
        if prompt > MAX_PROMPT_TOKENS:
            raise FormatError(f"request {first + i} of the trace has {prompt} input tokens, more than {MAX_PROMPT_TOKENS}")
        requests.append(Request(id=f"r{first + i}", at_ms=round(rec.at_ms - t0, 3), prompt_tokens=prompt,
                                max_tokens=min(max(1, rec.output_length), MAX_OUTPUT_TOKENS), prefix=member_of.get(i)))
    try:
        return validate(Trace(requests=tuple(requests), prefixes=prefixes, name=name))
    except TraceError as e:
        raise FormatError(f"window {name} makes no valid trace: {e}") from None


def _prefix_groups(chunk: Sequence[ProductionRequest], block_size: int) -> tuple[dict[str, int], dict[int, str]]:
    """Groups by first hash id, each with the tokens of the leading blocks all its members share."""
    by_root: dict[int, list[int]] = {}
    for i, rec in enumerate(chunk):
        if rec.hash_ids:
            by_root.setdefault(rec.hash_ids[0], []).append(i)
    prefixes: dict[str, int] = {}
    member_of: dict[int, str] = {}
    for members in by_root.values():
        if len(members) < 2:
            continue
        ids = [chunk[i].hash_ids for i in members]
        common = 0
        while all(len(h) > common and h[common] == ids[0][common] for h in ids):
            common += 1
        tokens = min(common * block_size, min(max(1, chunk[i].input_length) for i in members))
        group = f"p{len(prefixes)}"
        prefixes[group] = tokens
        member_of.update((i, group) for i in members)
    return prefixes, member_of
