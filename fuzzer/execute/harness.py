"""What the client makes of one request's answer (its RequestResult), and harness warnings on an
execution's results: client-side trouble, not server latency."""

from __future__ import annotations

from typing import Any

from fuzzer.execute.adapters import ServerInfo
from fuzzer.execute.sse import StreamAccount, usage_counts
from fuzzer.execution import Outcome, RequestResult
from fuzzer.trace import Request, Trace

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


def status_outcome(status: int, r: Request, info: ServerInfo | None) -> Outcome:
    """The outcome of an HTTP error status for ``r`` on a server that ``info`` describes."""
    if status >= 500:
        return Outcome.HTTP_ERROR
    if info is not None and status != 429:
        uses = {"chat": r.api == "chat", "logprobs": r.logprobs is not None, "ignore_eos": r.ignore_eos}
        if any(used and not info.accepts(feature) for feature, used in uses.items()):
            return Outcome.UNSUPPORTED
        if info.max_n is not None and r.n > info.max_n:
            return Outcome.UNSUPPORTED  # more choices than the probe saw accepted (1: n refused)
        if info.max_logprobs is not None and r.logprobs is not None and r.logprobs > info.max_logprobs:
            return Outcome.UNSUPPORTED  # more logprobs than the probe saw accepted
    return Outcome.REJECTED


def request_result(r: Request, x_request_id: str, scheduled_s: float, t0: float, sent: float, status: int | None,
                   end: float | None, outcome: Outcome, detail: str | None, account: StreamAccount | None, body: Any,
                   info: ServerInfo | None) -> RequestResult:
    """What the client measured for ``r`` (sent at ``sent``, answered until ``end``, on the client's clock)."""
    ttft = first_event = finish = None
    token_times: tuple[float, ...] = ()
    usage = choice_gap = choice_gap_end = None
    if account is not None:
        ttft = None if account.first_token_t is None else account.first_token_t - sent
        first_event = None if account.first_event_t is None else account.first_event_t - sent
        token_times = tuple(t - sent for t in account.token_times)
        choice_gap = account.choice_gap
        choice_gap_end = None if account.choice_gap_end is None else account.choice_gap_end - sent
        finish = account.finish_reason
        usage = account.usage
        if account.fault is not None and detail is None:
            detail = account.detail
    elif isinstance(body, dict):
        usage = body.get("usage")
        choices = body.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            finish = choices[0].get("finish_reason")
    prompt_tokens, completion_tokens, cached = usage_counts(usage)
    if (
        outcome is Outcome.OK
        and r.ignore_eos
        and info is not None
        and info.accepts("ignore_eos")
        and completion_tokens is not None
        and completion_tokens not in (r.max_tokens * r.n, r.max_tokens)
    ):
        # usage counts every choice (OpenAI, vLLM) or, with n > 1, one choice (llama-server 11434
        # streams n choices of max_tokens each but reports max_tokens): either is the whole output.
        outcome = Outcome.TOKEN_MISMATCH
        detail = f"{completion_tokens} completion tokens with ignore_eos, expected {r.max_tokens * r.n}"
    return RequestResult(
        request_id=r.id, x_request_id=x_request_id, scheduled_s=scheduled_s, sent_s=sent - t0, outcome=outcome,
        ttft_s=ttft, first_event_s=first_event, token_times_s=token_times, choice_gap_s=choice_gap,
        choice_gap_end_s=choice_gap_end,
        e2e_s=None if end is None or outcome is Outcome.TIMEOUT else end - sent,
        finish_reason=finish if isinstance(finish, str) else None, prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens, cached_tokens=cached, http_status=status, detail=detail,
    )
