"""Harness warnings on an execution's results: client-side trouble, not server latency."""

from __future__ import annotations

from fuzzer.execution import RequestResult
from fuzzer.trace import Trace

# A request sent later than this after its schedule gets a harness warning.
LATENESS_WARN_S = 0.005


def result_warnings(trace: Trace, results: list[RequestResult]) -> list[str]:
    """Client-side trouble: late dispatches, and prompts the server counted differently."""
    warnings = []
    late = [r for r in results if r.dispatch_lateness_s > LATENESS_WARN_S]
    if late:
        worst = max(r.dispatch_lateness_s for r in late)
        warnings.append(
            f"{len(late)} request(s) left more than {LATENESS_WARN_S * 1000:g} ms late "
            f"(worst {worst * 1000:.1f} ms): client lag, not server latency"
        )
    asked = {r.id: r.prompt_tokens for r in trace.requests}  # trace.request() scans: O(n^2) at 4096 requests
    for r in results:
        want = asked[r.request_id]
        if r.prompt_tokens is not None and r.prompt_tokens != want:
            warnings.append(f"{r.request_id}: the server counted {r.prompt_tokens} prompt tokens, the trace asked {want}")
    return warnings
