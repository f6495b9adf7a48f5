"""The seat probe: how many sequences a server runs at once, where that is fewer than the fuzzer sends.

vLLM runs at most ``--max-num-seqs`` sequences at once (256 by default on GPUs, 128 on its CPU
build, whatever a deployment chooses); SGLang has ``--max-running-requests``, llama-server its
slots. A request beyond them waits for a seat by design, and the FCFS bound gives it one only
when the scheduler assumption knows the count. Without this probe that was the adapter's
documented default: a clean vLLM-like server started with 16 seats gave three confirmed
ttft-outliers (29-362x, all false) in a 10-minute campaign, each a request that waited for a seat.

The probe: SEAT_PROBE_STREAMS short streams sent together, SEAT_PROBE_TOKENS tokens each. Their
prompts are tiny (a few of them fit one step's token budget), so every stream that has a seat gets
its first token in the first steps, long before any stream ends; a stream without one gets its
first token only after some stream ended and freed one. The streams whose first token came before
the first end are the seats. Orders, not durations: a busy host changes none of it. The probe
runs SEAT_PROBE_REPEATS times and a count is kept only when every run gives the same one: a seat
count is a constant of the deployment, where a scheduler that stalls admission now and then
(a bug the fuzzer is there to find) would not repeat itself to the stream.
"""

from __future__ import annotations

from fuzzer.execution import Target
from fuzzer.trace import Request, Trace

#: More streams than a fuzzed trace usually runs at once (fuzzer.search.mutators: 48 requests).
SEAT_PROBE_STREAMS = 64
#: Tokens each stream decodes: the first end comes this many steps after the first tokens.
SEAT_PROBE_TOKENS = 32
SEAT_PROBE_PROMPT_TOKENS = 16
SEAT_PROBE_REPEATS = 2


def seat_probe(run: int = 0) -> Trace:
    """The probe's trace: SEAT_PROBE_STREAMS streams sent at once."""
    return Trace(requests=tuple(
        Request(id=f"seat{i}", at_ms=0.0, prompt_tokens=SEAT_PROBE_PROMPT_TOKENS, max_tokens=SEAT_PROBE_TOKENS)
        for i in range(SEAT_PROBE_STREAMS)
    ), name=f"calibration-seats-{run}")


def seated(result) -> int | None:
    """How many streams of one probe run got their first token before the first one ended; None when
    some stream failed or gave no token (nothing to tell)."""
    requests = result.requests
    if len(requests) < SEAT_PROBE_STREAMS or any(
            r.outcome.failed or r.ttft_s is None or r.e2e_s is None or r.sent_s is None for r in requests):
        return None
    if any(r.completion_tokens is not None and r.completion_tokens < SEAT_PROBE_TOKENS for r in requests):
        return None  # a stream ended early (a server that stops at EOS whatever it is asked): no seat freed by design
    first_end = min(r.sent_s + r.e2e_s for r in requests)
    return sum(r.sent_s + r.ttft_s < first_end for r in requests)


async def seat_count(target: Target) -> int:
    """The sequences ``target`` runs at once when fewer than SEAT_PROBE_STREAMS; SEAT_PROBE_STREAMS when
    every stream had a seat (one run: a server that seats them all has at least that many, and
    maybe no more); 0 when a run failed, or the runs disagree."""
    counts = set()
    for run in range(SEAT_PROBE_REPEATS):
        count = seated(await target.execute(seat_probe(run)))
        if count is None:
            return 0  # the probe could not tell: the assumption stands
        if count >= SEAT_PROBE_STREAMS:
            return SEAT_PROBE_STREAMS
        counts.add(count)
    return counts.pop() if len(counts) == 1 and min(counts) >= 1 else 0
