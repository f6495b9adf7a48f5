"""Request schedules that show each planted bug (planted.py), timed for the machine they run on.

Which requests wait together depends on how long the engine's steps take, and that differs
tenfold between machines (measured: a 2048-token prefill step of the test model took about
70 ms on an idle AVX-512/AMX Xeon guest and over 1 s on a busy 2-core EPYC). So the schedules
are shaped by token counts, which fix what each step holds, and timed by :class:`Speed`, the
stock server's step and decode times measured just before:

- A blocker of ``BLOCKER`` tokens is prefilled in four steps of the token budget, the last
  one ``BLOCKER_TAIL`` tokens: requests that arrive during its first three steps all wait
  for its fourth, and the budget that step leaves (``BUDGET - BLOCKER_TAIL``) holds one
  1500-token request and part of another, so each request of a queued group gets its first
  token in a step of its own.
- The queued requests are sent half a full step apart from half a step on: all three are in
  the queue a full step and a half before the blocker's fourth step begins.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from . import client
from .client import Sent

BUDGET = 2048  # vLLM's max_num_batched_tokens on CPU (API server)
BLOCKER_TAIL = 400
BLOCKER = 3 * BUDGET + BLOCKER_TAIL  # four prefill steps
GROUP = 1500  # one queued request: the blocker's last step holds one and part of the next
SHORT = 48
# Two steps each: held behind both (planted HOL), S gets its first token four steps after it
# would have, over three after L1's; a lead that survives a client stalled 150 ms on a fast machine.
LONG = 2 * BUDGET - 96
PREFIX = 16  # tokens (with <s>): what planted.PREFIX_KEY_TOKENS compares
STARVED_PROMPT = 3 * BUDGET + 856  # the prompt whose prefill starves the stream: four steps
STREAM_PROMPT = 32
MIN_GAP_S = 0.03  # the order check's reach is 20 ms: sends at least this far apart


@dataclass(frozen=True)
class Speed:
    """The stock server's costs on this machine, measured idle."""

    #: First-token time of a prompt of a full budget: one full prefill step and the frontend.
    step_s: float
    #: Mean gap between the tokens of a lone stream.
    decode_s: float

    @property
    def gap_s(self) -> float:
        """How far apart the queued requests are sent."""
        return max(MIN_GAP_S, self.step_s / 2)

    def queue_at_s(self, n: int = 3) -> tuple[float, ...]:
        return tuple(self.gap_s * (i + 1) for i in range(n))


def measure(base_url: str, model: str, seed: int = 0) -> Speed:
    """Time a full-budget prefill (best of three) and a lone stream of 64 tokens on the idle server."""
    rng = random.Random(seed)
    steps = []
    for i in range(3):
        done = client.run(base_url, model, [Sent(f"step{i}", 0.0, client.prompt(BUDGET, rng), 1)])[f"step{i}"]
        steps.append(done.first_s - done.sent_s)
    # Each stream's whole time over its tokens (its short prefill included: a little high, which the
    # starvation schedule's margins cover): a busy API server sends a fast stream's tokens many to
    # an event, so the gaps between events say little. The best of three: one stalled stream once
    # put a 3 ms token at 86 ms.
    decode = []
    for i in range(3):
        stream = client.run(base_url, model, [Sent(f"stream{i}", 0.0, client.prompt(STREAM_PROMPT, rng), 64)])[f"stream{i}"]
        tokens = (stream.usage or {}).get("completion_tokens", len(stream.token_s))
        decode.append((stream.token_s[-1] - stream.sent_s) / max(1, tokens))
    return Speed(step_s=min(steps), decode_s=min(decode))


def _blocker(rng: random.Random) -> Sent:
    return Sent("blocker", 0.0, client.prompt(BLOCKER, rng), 2)


def hol(speed: Speed, seed: int) -> list[Sent]:
    """A short request S and two long ones sharing its 15-word prefix, queued behind the blocker, S first.

    Stock FCFS: S is admitted in the blocker's last step with L1's first chunk; L2 after.
    HolLongestFirst: S is held until L1 and L2 are prefilled (two steps each), admitted a step after L2.
    """
    rng = random.Random(seed)
    prefix = client.prompt(PREFIX, rng)  # 15 words: with <s>, the tokens planted.PREFIX_KEY_TOKENS compares
    s_at, l1_at, l2_at = speed.queue_at_s()
    return [
        _blocker(rng),
        Sent("S", s_at, client.prompt(SHORT, rng, prefix), 4),
        Sent("L1", l1_at, client.prompt(LONG, rng, prefix), 4),
        Sent("L2", l2_at, client.prompt(LONG, rng, prefix), 4),
    ]


def lifo(speed: Speed, seed: int) -> list[Sent]:
    """Three GROUP-token requests A1, A2, A3 queued in that order behind the blocker.

    Stock FCFS: first tokens in arrival order (A1, A2, A3: one step apart).
    LifoAdmission: reversed (A3, A2, A1).
    """
    rng = random.Random(seed)
    return [_blocker(rng), *(Sent(f"A{i + 1}", at, client.prompt(GROUP, rng), 4)
                             for i, at in enumerate(speed.queue_at_s()))]


def starvation(speed: Speed, seed: int) -> list[Sent]:
    """A decode stream D, then (while it streams) a prompt P prefilled in four steps.

    Stock (chunked prefill): D gets a token in each of P's prefill steps.
    DecodeStarvation: D gets none from P's arrival until P's prefill is done.
    D is long enough to stream through P's prefill three times over.
    """
    rng = random.Random(seed)
    p_at = min(1.0, max(0.3, 30 * speed.decode_s))
    prefill_s = 4 * speed.step_s
    d_tokens = min(6000, math.ceil((p_at + 3 * prefill_s + 1.0) / speed.decode_s))
    return [Sent("D", 0.0, client.prompt(STREAM_PROMPT, rng), d_tokens),
            Sent("P", p_at, client.prompt(STARVED_PROMPT, rng), 4)]


def as_trace(name: str, schedule: list[Sent]) -> dict:
    """The schedule as a fuzzer trace (the fuzzer writes its own prompts of the same lengths):
    the requests that share the schedule's prefix (HOL's S, L1, L2) share a 16-token prefix."""
    prefixed = {"S", "L1", "L2"}
    requests = []
    for s in schedule:
        tokens = len(s.prompt.split()) + 1  # one token a word, and <s>
        request = {"id": s.name, "at_ms": round(s.at_s * 1000), "prompt_tokens": tokens, "max_tokens": s.max_tokens}
        if s.name in prefixed:
            request["prefix"] = "p"
        requests.append(request)
    prefixes = {"p": PREFIX} if any(s.name in prefixed for s in schedule) else {}
    return {"format": 1, "name": name, "prefixes": prefixes, "requests": requests}
