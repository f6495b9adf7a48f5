"""Stretches of pure decoding in the paper schedule (:mod:`fuzzer.oracle.paper`), many steps at once.

When nothing is left to prefill and nobody waiting can be admitted, every step until something
changes (a request's last token, an arrival, a client's abort, the shared frontend's turn, the KV
cache running out) has the same shape: the decodes of the running sequences over a context that
grows by one token per sequence a step. Their times are computed with numpy in one go, float for
float the same as one step after another."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from fuzzer.oracle.kvblocks import KVBlocks
    from fuzzer.oracle.model import StepModel


class Job(Protocol):
    """What a decode run reads and writes of a request of the paper schedule (fuzzer.oracle.paper.Job)."""

    prompt: int
    out: int
    tokens: int
    ready_s: float
    max_step: float
    token_times: list[float]


# A stretch of pure decode steps with no end in sight (nobody decoding, a request that can
# never be admitted) is computed this many steps at a time, so memory stays small.
_DECODE_RUN_MAX = 65_536


def decode_run(
    t: float,
    last_dt: float,
    decoding: list[Job],
    decode_seqs: int,
    context: int,
    waiting: deque[Job],
    running: list[Job],
    pending: deque[Job],
    model: StepModel,
    *,
    lookahead: bool,
    max_steps: int,
    kv: KVBlocks | None = None,
    stop_at: float | None = None,
    held: float = 0.0,
) -> tuple[float, float, int]:
    """Take the pure-decode steps from ``t`` on at once; returns (t, last_dt, steps taken).

    The run stops after the step in which the first decoding request gets its last
    token, or before the step at whose start the next arrival would be admitted to the
    waiting queue, or before the step at whose start ``stop_at`` has come (a client's abort, the shared frontend's turn),
    whichever comes first (at least one step is taken: the caller found none admissible at ``t``). Step k has the context of step 0 plus k tokens of every
    decoding sequence; the times are accumulated in order, exactly as step-by-step. With
    ``kv``, it also stops before the first step whose decodes need more blocks than are free.
    ``held``: how long the shared frontend held the thread just before (it lengthens the first gap).
    """
    left = min((j.out - j.tokens for j in decoding), default=None)
    count = min(max_steps, _DECODE_RUN_MAX if left is None else left)
    if kv is not None and decoding:
        count = kv.decode_steps(decoding, count)
    # overhead + prefill x 0 + decode: the same float operations, in the same order, as step_s.
    base = model.overhead_s + model.prefill_token_s * 0 + model.decode_seq_s * decode_seqs
    contexts = np.arange(count, dtype=np.float64)
    contexts *= decode_seqs
    contexts += context
    dts = base + model.context_token_s * contexts
    ends = np.cumsum(np.concatenate(([t], dts)))[1:]  # sequential: ends[k] = ends[k-1] + dts[k]
    if pending:
        # Step k >= 1 starts at ends[k-1]; the next arrival joins the queue there when it is
        # due (with lookahead: due within the previous step's length).
        due = ends[:-1] + dts[:-1] if lookahead and running else ends[:-1]
        late = np.flatnonzero(pending[0].ready_s <= due)
        if late.size:
            count = int(late[0]) + 1
            dts, ends = dts[:count], ends[:count]
    if stop_at is not None:
        gone = np.flatnonzero(stop_at <= ends[:-1])  # the first step boundary at or after it
        if gone.size:
            count = int(gone[0]) + 1
            dts, ends = dts[:count], ends[:count]
    longest = float(dts.max())
    for j in (*waiting, *running):
        j.max_step = max(j.max_step, longest)
    if held:  # the thread was held before the first of these steps: between two of each stream's tokens
        for j in decoding:
            j.max_step = max(j.max_step, float(dts[0]) + held)
    if pending:
        # An arrival is exposed to every step that ends after it arrives.
        rising = bool(dts.min() > 0)
        tail_max = np.maximum.accumulate(dts[::-1])[::-1]
        for j in pending:
            if rising:
                k = int(np.searchsorted(ends, j.ready_s, side="right"))
                exposed = float(tail_max[k]) if k < count else None
            else:  # a fitted model with negative costs: step ends need not rise
                mask = ends > j.ready_s
                exposed = float(dts[mask].max()) if mask.any() else None
            if exposed is None:
                break
            j.max_step = max(j.max_step, exposed)
    times = ends.tolist()
    for j in decoding:
        j.tokens += count
        j.token_times.extend(times)
        if kv is not None:
            kv.hold(j, j.prompt + j.tokens - 1)
    return times[-1], float(dts[-1]), count
