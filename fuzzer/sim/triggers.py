"""One small trace per planted pathology that triggers it (for tests, the oracle and benchmarks).

Each :class:`Trigger` names the request that suffers and the measure that shows
it (``ttft``, ``itl`` = max inter-token gap, ``e2e``, ``drain``: how long the
server stays busy, for a request it runs on after its client left, or ``held``: the KV cache the
server still reports in use when the execution ends). Run on a warm simulator,
the measure is clearly larger with the pathology on than off
(tests/test_sim_pathologies.py checks it); cold-start needs a cold server
instead (a fresh target, or one left idle for more than ``cold_idle_s``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from fuzzer.sim import pathologies as P
from fuzzer.trace import Trace, from_dict


@dataclass(frozen=True)
class Trigger:
    trace: Trace
    #: The id of the request the pathology hurts most.
    victim: str
    #: "ttft", "itl", "e2e", "drain" (the execution's length: how long the server stays busy) or "held" (the
    #: KV usage the server reports at the end).
    measure: str
    #: Whether the effect needs a cold server (only cold-start).
    cold: bool = False


def _trace(name: str, requests: list[dict], prefixes: dict[str, int] | None = None) -> Trace:
    return from_dict({"name": name, "prefixes": prefixes or {}, "requests": requests})


def _stream_then_long_prompt(name: str) -> Trace:
    """D streams 200 tokens; 100 ms in, X's 8192-token prompt (four step budgets) arrives."""
    return _trace(name, [
        {"id": "D", "at_ms": 0, "prompt_tokens": 128, "max_tokens": 200},
        {"id": "X", "at_ms": 100, "prompt_tokens": 8192, "max_tokens": 4},
    ])


def _build() -> dict[str, Trigger]:
    return {
        # Two short members of a prefix group wait with six long ones (they arrive during L0's prefill).
        P.HOL_PREFIX_BURST: Trigger(
            _trace(
                "trigger-hol-prefix-burst",
                [{"id": "L0", "at_ms": 0, "prompt_tokens": 2048, "prefix": "p", "max_tokens": 16}]
                + [{"id": f"S{i}", "at_ms": 5 * i, "prompt_tokens": 128, "prefix": "p", "max_tokens": 16}
                   for i in (1, 2)]
                + [{"id": f"L{i}", "at_ms": 10 + 5 * i, "prompt_tokens": 2048, "prefix": "p", "max_tokens": 16}
                   for i in range(1, 7)],
                {"p": 32},
            ),
            "S1",
            "ttft",
        ),
        # An 8192-token prompt arrives while D streams.
        P.UNCHUNKED_PREFILL: Trigger(_stream_then_long_prompt("trigger-unchunked-prefill"), "D", "itl"),
        # B asks for n=8, logprobs=20; C arrives while it runs.
        P.LOGPROBS_BATCH_COST: Trigger(
            _trace(
                "trigger-logprobs-batch-cost",
                [
                    {"id": "A", "at_ms": 0, "prompt_tokens": 128, "max_tokens": 100},
                    {"id": "B", "at_ms": 10, "prompt_tokens": 128, "max_tokens": 50, "n": 8, "logprobs": 20},
                    {"id": "C", "at_ms": 50, "prompt_tokens": 128, "max_tokens": 32},
                ],
            ),
            "C",
            "ttft",
        ),
        # X's 4096-token prompt fills two steps' budgets while S waits; D decodes for a long time.
        P.STICKY_BATCH_FULL: Trigger(
            _trace(
                "trigger-sticky-batch-full",
                [
                    {"id": "D", "at_ms": 0, "prompt_tokens": 128, "max_tokens": 300},
                    {"id": "X", "at_ms": 20, "prompt_tokens": 4096, "max_tokens": 200},
                    {"id": "S", "at_ms": 30, "prompt_tokens": 128, "max_tokens": 16},
                ],
            ),
            "S",
            "ttft",
        ),
        # 24 x (1024 prompt + 800 output) tokens do not fit the 40960 KV tokens.
        P.PREEMPTION_THRASH: Trigger(
            _trace(
                "trigger-preemption-thrash",
                [{"id": f"R{i:02d}", "at_ms": i, "prompt_tokens": 1024, "max_tokens": 800} for i in range(24)],
            ),
            "R23",
            "itl",
        ),
        # The vLLM 37308 trace itself: its first run on a cold server is slow.
        P.COLD_START: Trigger(
            _trace(
                "trigger-cold-start",
                [
                    {"id": "r08", "at_ms": 0, "prompt_tokens": 128, "prefix": "p0", "max_tokens": 32},
                    {"id": "r05", "at_ms": 8, "prompt_tokens": 128, "prefix": "p0", "max_tokens": 64},
                    {"id": "r04", "at_ms": 16, "prompt_tokens": 2048, "prefix": "p0", "max_tokens": 256},
                    {"id": "r06", "at_ms": 24, "prompt_tokens": 2048, "prefix": "p0", "max_tokens": 128,
                     "stream": False},
                    {"id": "r07", "at_ms": 32, "prompt_tokens": 2048, "prefix": "p0", "max_tokens": 512},
                    {"id": "r02", "at_ms": 40, "prompt_tokens": 2048, "prefix": "p0", "max_tokens": 128},
                ],
                {"p0": 32},
            ),
            "r08",
            "ttft",
            cold=True,
        ),
        # A 16k-token prompt ahead of a short one in the tokenizer queue.
        P.SERIAL_TOKENIZER: Trigger(
            _trace(
                "trigger-serial-tokenizer",
                [
                    {"id": "L", "at_ms": 0, "prompt_tokens": 16384, "max_tokens": 1},
                    {"id": "S", "at_ms": 1, "prompt_tokens": 32, "max_tokens": 8},
                ],
            ),
            "S",
            "ttft",
        ),
        # Three prompts of 8192 tokens reserve 3 x 762 of the 2560 KV blocks for their 4000-token
        # outputs; V's 6000-token prompt (375 blocks) fits the blocks really used, not the reservations.
        P.KV_RESERVE_ADMISSION: Trigger(
            _trace(
                "trigger-kv-reserve-admission",
                [{"id": f"L{i}", "at_ms": i, "prompt_tokens": 8192, "max_tokens": 4000} for i in range(3)]
                + [{"id": "V", "at_ms": 100, "prompt_tokens": 6000, "max_tokens": 16}],
            ),
            "V",
            "ttft",
        ),
        # Z's client leaves after 4 of 3000 tokens; the server decodes the rest into nothing.
        P.DISCONNECT_LEAK: Trigger(
            _trace(
                "trigger-disconnect-leak",
                [
                    {"id": "Z", "at_ms": 0, "prompt_tokens": 128, "max_tokens": 3000, "cancel_after_tokens": 4},
                    {"id": "W", "at_ms": 50, "prompt_tokens": 128, "max_tokens": 64},
                ],
            ),
            "Z",
            "drain",
        ),
        # Z's client gives up after 20 ms, during its 8000-token prefill (four budgets); the server runs it to 3000 tokens.
        P.EARLY_ABORT_LEAK: Trigger(
            _trace(
                "trigger-early-abort-leak",
                [
                    {"id": "Z", "at_ms": 0, "prompt_tokens": 8000, "max_tokens": 3000, "disconnect_after_ms": 20},
                    {"id": "W", "at_ms": 50, "prompt_tokens": 128, "max_tokens": 64},
                ],
            ),
            "Z",
            "drain",
        ),
        # Six prompts of one step budget each arrive during L0's step: FCFS serves L1 next, LIFO last.
        P.LIFO_ADMISSION: Trigger(
            _trace(
                "trigger-lifo-admission",
                [{"id": f"L{i}", "at_ms": 10 * i, "prompt_tokens": 2048, "max_tokens": 16} for i in range(6)],
            ),
            "L1",
            "ttft",
        ),
        # X's 8192-token prompt is prefilled in four chunks of the budget; D streams meanwhile.
        P.DECODE_STARVATION: Trigger(_stream_then_long_prompt("trigger-decode-starvation"), "D", "itl"),
        # F0, F1 and O (who owns the 8192-token prefix) leave 421 of the 2560 blocks free once
        # prefilled; V needs 3 new blocks, but its whole prompt (514 blocks) does not fit.
        P.RESIDENT_PREFIX_REFUSAL: Trigger(
            _trace(
                "trigger-resident-prefix-refusal",
                [
                    {"id": "F0", "at_ms": 0, "prompt_tokens": 13000, "max_tokens": 400},
                    {"id": "F1", "at_ms": 1, "prompt_tokens": 13000, "max_tokens": 400},
                    {"id": "O", "at_ms": 2, "prompt_tokens": 8224, "prefix": "sys", "max_tokens": 400},
                    {"id": "V", "at_ms": 1300, "prompt_tokens": 8224, "prefix": "sys", "max_tokens": 16},
                ],
                {"sys": 8192},
            ),
            "V",
            "ttft",
        ),
        # X asks for a seed at temperature 1.0 among 16 short streams: every decode step samples 17 rows one by one.
        P.SEEDED_SAMPLING_PATH: Trigger(
            _trace(
                "trigger-seeded-sampling-path",
                [{"id": f"S{i:02d}", "at_ms": 0, "prompt_tokens": 64, "max_tokens": 128} for i in range(16)]
                + [{"id": "X", "at_ms": 0, "prompt_tokens": 64, "max_tokens": 128, "temperature": 1.0,
                    "seed": 1234}],
            ),
            "X",  # the carrier: an option-slowdown names the request whose option slows everyone (itself too)
            "e2e",
        ),
        # Six 8000-token prompts whose clients leave at 100 ms, Z0 prefilling and the rest queued; V (32
        # tokens) comes at 150 ms. Aborted at once, the queued five never run; left queued, V waits for them.
        P.QUEUED_ABORT_LATE: Trigger(
            _trace(
                "trigger-queued-abort-late",
                [{"id": f"Z{i}", "at_ms": i, "prompt_tokens": 8000, "max_tokens": 16, "disconnect_after_ms": 100}
                 for i in range(6)]
                + [{"id": "V", "at_ms": 150, "prompt_tokens": 32, "max_tokens": 16}],
            ),
            "V",
            "ttft",
        ),
        # F0-F3 (6000-token prompts, 300 tokens each) fill 60% of the 40960-token cache and decode; B asks
        # for 30000 tokens at 1.5 s, V (64 tokens) follows: their prompts fit, B's whole output does not.
        P.HEAD_RESERVE_ADMISSION: Trigger(
            _trace(
                "trigger-head-reserve-admission",
                [{"id": f"F{i}", "at_ms": i, "prompt_tokens": 6000, "max_tokens": 300} for i in range(4)]
                + [{"id": "B", "at_ms": 1500, "prompt_tokens": 256, "max_tokens": 30000, "ignore_eos": False},
                   {"id": "V", "at_ms": 1510, "prompt_tokens": 64, "max_tokens": 16}],
            ),
            "V",
            "ttft",
        ),
        # L0-L3 stream 350 tokens with 20 logprobs each; V, a plain 100-token stream, comes at 1.5 s, when the
        # frontend's per-step work on their outputs has long outgrown a decode step.
        P.LOGPROBS_REDETOKENIZE: Trigger(
            _trace(
                "trigger-logprobs-redetokenize",
                [{"id": f"L{i}", "at_ms": i, "prompt_tokens": 64, "max_tokens": 350, "logprobs": 20}
                 for i in range(4)]
                + [{"id": "V", "at_ms": 1500, "prompt_tokens": 64, "max_tokens": 100}],
            ),
            "V",
            "ttft",
        ),
        # O computes the 1024-token prefix "sys"; at 300 ms W0-W2 (the prefix and 1024 tokens of their own: two fill
        # the 2048-token budget) and C, a cold 128-token prompt, arrive; W3-W11 follow every 10 ms from 330 ms, faster
        # than a step admits them. FCFS serves C after W2; sorted by cached prefix, after W11.
        P.LONGEST_PREFIX_FIRST: Trigger(
            _trace(
                "trigger-longest-prefix-first",
                [{"id": "O", "at_ms": 0, "prompt_tokens": 1040, "prefix": "sys", "max_tokens": 4}]
                + [{"id": f"W{i}", "at_ms": 300 + i, "prompt_tokens": 2048, "prefix": "sys", "max_tokens": 16}
                   for i in range(3)]
                + [{"id": "C", "at_ms": 303, "prompt_tokens": 128, "max_tokens": 16}]
                + [{"id": f"W{i}", "at_ms": 330 + 10 * (i - 3), "prompt_tokens": 2048, "prefix": "sys",
                    "max_tokens": 16} for i in range(3, 12)],
                {"sys": 1024},
            ),
            "C",
            "ttft",
        ),
        # Z's client leaves at 100 ms, during its 8000-token prefill (four budgets): its blocks stay held, in use
        # with nothing running, until a step 30 s on.
        P.ABORTED_BLOCKS_HELD: Trigger(
            _trace(
                "trigger-aborted-blocks-held",
                [
                    {"id": "Z", "at_ms": 0, "prompt_tokens": 8000, "max_tokens": 16, "disconnect_after_ms": 100},
                    {"id": "W", "at_ms": 300, "prompt_tokens": 128, "max_tokens": 16},
                ],
            ),
            "Z",
            "held",
        ),
    }


#: Pathology name -> its trigger.
TRIGGERS: Mapping[str, Trigger] = _build()
