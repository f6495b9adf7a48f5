"""What one execution of a trace produced: the value types of the target seam (ARCHITECTURE.md, "Layering").

The HTTP executor (a live server) and the simulator's virtual-time runner both
return an :class:`ExecutionResult`, so the oracle, the campaign and the
minimizer never know which one they drive.

Times are in seconds. ``*_s`` fields of a request are measured from the moment
that request was sent, except ``scheduled_s`` and ``sent_s``, which are offsets
from the start of the execution (t0, when the first request was due).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence, runtime_checkable

from fuzzer.trace import Trace


class Outcome(enum.StrEnum):
    """How a request ended. A failure is data, never an exception."""

    OK = "ok"
    #: Closed by the client after ``cancel_after_tokens`` tokens, as the trace asked.
    CANCELLED = "cancelled"
    #: The server answered 5xx.
    HTTP_ERROR = "http-error"
    #: The server answered 4xx for a request the trace describes correctly.
    REJECTED = "rejected"
    #: The server answered 4xx because it does not support a feature the request uses.
    UNSUPPORTED = "unsupported"
    #: Connection refused or reset before the response ended.
    CONNECTION_ERROR = "connection-error"
    #: No complete answer within the client timeout.
    TIMEOUT = "timeout"
    #: A stream event that is not valid SSE/JSON, or a body that is not valid JSON.
    MALFORMED = "malformed"
    #: The stream ended without ``data: [DONE]``.
    MISSING_DONE = "missing-done"
    #: The number of generated tokens contradicts ``max_tokens`` with ``ignore_eos``.
    TOKEN_MISMATCH = "token-mismatch"
    #: Still running when the execution reached its time cap (``Target.execute``'s ``cut_s``), and
    #: closed by the client (or never sent, when scheduled after it): its latencies are lower bounds.
    CUT = "cut"

    @property
    def failed(self) -> bool:
        return self not in (Outcome.OK, Outcome.CANCELLED)


#: Which finding kind (ARCHITECTURE.md, "Oracle") a failed outcome is evidence of.
FAILURE_KIND: Mapping[Outcome, str] = {
    Outcome.HTTP_ERROR: "error",
    Outcome.CONNECTION_ERROR: "error",
    Outcome.TIMEOUT: "hang",
    Outcome.MALFORMED: "protocol",
    Outcome.MISSING_DONE: "protocol",
    Outcome.TOKEN_MISMATCH: "protocol",
}


@dataclass(frozen=True)
class RequestResult:
    """What the client measured for one request of a trace."""

    request_id: str
    #: The X-Request-Id header sent (trace request id + execution-unique suffix).
    x_request_id: str
    #: Planned send time, offset from t0 (``at_ms / 1000``).
    scheduled_s: float
    #: Actual send time, offset from t0.
    sent_s: float
    outcome: Outcome
    #: First event carrying non-empty text; None for non-streaming requests or no token.
    ttft_s: float | None = None
    #: First event of any kind (a role-only chunk counts here, not in ttft_s).
    first_event_s: float | None = None
    #: Arrival of every content-bearing event of choice 0, from send.
    token_times_s: tuple[float, ...] = ()
    #: With n > 1 streamed: the longest any other choice went without text once the first token came (from
    #: it to the choice's first, or between two of its events); None otherwise. A choice held back is a stall.
    choice_gap_s: float | None = None
    #: When that longest gap ended, from send (where the client recorded it; None otherwise).
    choice_gap_end_s: float | None = None
    #: Send to the end of the response (or to the cancel); None when it never ended.
    e2e_s: float | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    http_status: int | None = None
    #: A short human-readable detail for failures (the server's error message, say).
    detail: str | None = None

    @property
    def dispatch_lateness_s(self) -> float:
        """Client-side lag: how late the request left compared with its schedule."""
        return self.sent_s - self.scheduled_s

    @property
    def itl_s(self) -> tuple[float, ...]:
        """Gaps between consecutive content-bearing events (one event may carry several tokens)."""
        t = self.token_times_s
        return tuple(b - a for a, b in zip(t, t[1:]))

    @property
    def max_itl_s(self) -> float | None:
        """The longest silence of any choice once the stream's first token came (choice 0's gaps, ``choice_gap_s``)."""
        gaps = self.itl_s
        longest = max(gaps) if gaps else None
        if self.choice_gap_s is None or (longest is not None and longest >= self.choice_gap_s):
            return longest
        return self.choice_gap_s

    @property
    def longest_gap_s(self) -> tuple[float, float] | None:
        """(start, end), from send, of the stream's longest silence: choice 0's longest gap, or a later choice's
        where that was longer and the client recorded when it ended (``choice_gap_end_s``); None when neither is
        known. Where in the run a stall fell, for the evidence and the confirmation that place it."""
        t = self.token_times_s
        gaps = self.itl_s
        start = end = None
        if gaps:
            k = max(range(len(gaps)), key=gaps.__getitem__)
            start, end = t[k], t[k + 1]
        if self.choice_gap_s is not None and self.choice_gap_end_s is not None and (
                end is None or self.choice_gap_s > end - start):
            return self.choice_gap_end_s - self.choice_gap_s, self.choice_gap_end_s
        return None if end is None else (start, end)


@dataclass(frozen=True)
class MetricSample:
    """One scrape of the server's metrics, mapped onto common names by the server adapter.

    Common names: running, waiting, kv_usage (0-1), preemptions, prefix_cache_hits,
    prefix_cache_queries, prompt_tokens, generation_tokens (counters are cumulative).
    """

    t_s: float
    values: Mapping[str, float]


@dataclass(frozen=True)
class ExecutionResult:
    """One run of one trace against one target."""

    trace_hash: str
    #: Where it ran: a base URL, or ``sim+virtual://...`` for the in-process simulator.
    target: str
    #: Wall-clock start (epoch seconds) from the injected clock; virtual targets use virtual time.
    started_at: float
    duration_s: float
    requests: tuple[RequestResult, ...]
    samples: tuple[MetricSample, ...] = ()
    #: How long the server had been idle before this execution started; None when unknown.
    idle_before_s: float | None = None
    #: Whether the server returned to idle after every request ended, within the leak window
    #: (:func:`leak_window_s`); None when unknown.
    idle_after: bool | None = None
    #: Harness warnings: prompt-length mismatches, dispatch lateness, ... (client trouble).
    warnings: tuple[str, ...] = ()
    #: The worst stall of the client's own event loop while the requests ran (a busy or
    #: descheduled client stamps events late); None when not measured (virtual time).
    client_lag_s: float | None = None
    #: The engine's speed right after the execution: the median inter-token gap of one short
    #: request run alone once the server was idle again (the oracle scales its bounds by how
    #: much slower than calibrated that is: a busier machine is not a scheduler pathology);
    #: None when not measured (virtual time, or a server that did not return to idle).
    speed_check_itl_s: float | None = None
    #: Simulator ground truth (request id -> pathologies that delayed it). Filled only by the
    #: in-process simulator, for tests and benchmarks; the oracle never reads it.
    ground_truth: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def request(self, request_id: str) -> RequestResult:
        for r in self.requests:
            if r.request_id == request_id:
                return r
        raise KeyError(request_id)

    @property
    def failures(self) -> tuple[RequestResult, ...]:
        return tuple(r for r in self.requests if r.outcome.failed)


#: The prefixes of the warnings that say the server went down during an execution, whatever its requests saw:
#: a launched server's process died (fuzzer.execute.managed, with its log's last lines), or a server that did not
#: return to idle after the execution then refused a connection (fuzzer.execute.http). vLLM 0.32's CPU engine died
#: in a --target campaign: its API server streamed an error event to every open request (HTTP 200) and exited, so
#: no request met a refused connection.
SERVER_DIED = "server died"
SERVER_GONE = "server gone"


def server_down(result: "ExecutionResult") -> str | None:
    """The warning of ``result`` that says its server went down (a death's, with its log, first), or None."""
    return next((w for prefix in (SERVER_DIED, SERVER_GONE) for w in result.warnings if w.startswith(prefix)), None)


#: After the last request ended, a server may take this many decode steps to return to idle before the
#: execution counts as a leak, and never less than the executor's floor (5 s): a host slowed by other work
#: slows the server's aborts and frees as much as its steps, while a leaked stream of the leak shapes'
#: 2048+ tokens runs far longer ...
LEAK_WINDOW_STEPS = 200
#: ... a step being the median inter-token gap of the execution's streams, where they had this many gaps ...
LEAK_WINDOW_MIN_GAPS = 8
#: ... and the window never longer than this.
LEAK_WINDOW_MAX_S = 60.0


def step_pace_s(requests: Sequence[RequestResult]) -> float | None:
    """The execution's own decode step: the median inter-token gap of its streams; None with too few gaps."""
    gaps = sorted(g for r in requests for g in r.itl_s)
    return gaps[len(gaps) // 2] if len(gaps) >= LEAK_WINDOW_MIN_GAPS else None


#: A server with nothing running or waiting that still reports this much more of its KV cache in use than
#: before the execution (``kv_usage``, 0-1) holds blocks nobody owns: a leak too, when it lasts the leak
#: window (vllm-ascend #16662, vLLM #46283: blocks of aborted requests never given back). Engines count
#: cached blocks nobody references as free (vLLM's block pool, SGLang's evictable tokens, llama.cpp's idle
#: slots), and a hundredth is 20 blocks of a 2048-block cache: more than one page of a prompt.
KV_HELD_MARGIN = 0.01


def kv_held(before: float | None, now: float | None) -> bool:
    """Does a server with nothing running or waiting hold more KV (``now``) than before the execution?"""
    return before is not None and now is not None and now > before + KV_HELD_MARGIN


def left_over(result: "ExecutionResult") -> str | None:
    """What a server that did not return to idle still held at ``result``'s last metrics sample (taken once the
    leak window's first part had passed): requests running or waiting, or, with none, more of its KV cache in use
    than at the first sample (:func:`kv_held`); None when the samples do not say."""
    if len(result.samples) < 2:
        return None
    first, last = result.samples[0].values, result.samples[-1].values
    running, waiting = last.get("running"), last.get("waiting")
    if running is None and waiting is None:
        return None
    if (running or 0.0) + (waiting or 0.0) > 0:
        return f"{running or 0:.0f} request(s) running and {waiting or 0:.0f} waiting at the last metrics sample"
    if kv_held(first.get("kv_usage"), last.get("kv_usage")):
        return (f"no request running or waiting, but {last['kv_usage']:.1%} of the KV cache still in use "
                f"({first['kv_usage']:.1%} at the start)")
    return None


def leak_window_s(pace_s: float | None, floor_s: float) -> float:
    """How long after the last request ended a server stepping every ``pace_s`` may take to return to idle."""
    return floor_s if pace_s is None else max(floor_s, min(LEAK_WINDOW_MAX_S, LEAK_WINDOW_STEPS * pace_s))


@runtime_checkable
class Target(Protocol):
    """Something a trace can be executed against (ARCHITECTURE.md, "Layering").

    Implementations: the HTTP executor (``fuzzer.execute.http``) and the simulator's
    virtual-time runner (``fuzzer.sim``). Optional: ``idle(seconds)`` (virtual time:
    advance the clock instead of sleeping) and ``kv_cache() -> (blocks, block size)``
    (the KV capacity the oracle's bound models, as the server reported it).
    """

    #: A short description for reports: the base URL, or the simulator's configuration.
    name: str

    async def execute(self, trace: Trace, *, cut_s: float | None = None) -> ExecutionResult:
        """Run the trace once and measure every request. Never raises for a request's failure.

        ``cut_s``: the execution's time cap. Requests still running that long after its start
        are closed (outcome CUT) and requests scheduled later are not sent; None: no cap.
        """
        ...

    async def aclose(self) -> None:
        """Release connections and processes."""
        ...
