"""How long one engine step takes: a linear cost model with multiplicative noise.

    step_s = (overhead + prefill_tokens x prefill_token_s + decode_seqs x decode_seq_s
              + context_tokens x context_token_s + logprob_units x logprob_s) x noise

``context_tokens`` are the KV tokens the step's decodes read (attention);
``logprob_units`` the sum of n x logprobs over the requests in the step. The noise is
lognormal with median 1, drawn from an injected ``random.Random``. Pathology extras
are added by the engine; the engine divides the total by ``speed``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from fuzzer.sim.config import SimConfig


@dataclass(frozen=True)
class StepLoad:
    """What one step computes."""

    prefill_tokens: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0
    logprob_units: int = 0


def base_time_s(config: SimConfig, load: StepLoad) -> float:
    """The noise-free step time in simulated seconds (before ``speed``)."""
    return (
        config.step_overhead_s
        + load.prefill_tokens * config.prefill_token_s
        + load.decode_seqs * config.decode_seq_s
        + load.context_tokens * config.context_token_s
        + load.logprob_units * config.logprob_s
    )


class StepTimer:
    """Draws noisy step times from the configuration and an injected random generator."""

    def __init__(self, config: SimConfig, rng: random.Random) -> None:
        self._config = config
        self._rng = rng

    def noise(self) -> float:
        sigma = self._config.noise_sigma
        return math.exp(self._rng.gauss(0.0, sigma)) if sigma > 0 else 1.0

    def time_s(self, load: StepLoad) -> float:
        return base_time_s(self._config, load) * self.noise()
