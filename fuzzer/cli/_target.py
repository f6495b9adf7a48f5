"""Opening the target a command runs against: a live server, or the built-in simulator.

The API key comes from an environment variable only (default OPENAI_API_KEY); it is
handed to the executor and never stored, printed or exported.
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import AsyncIterator, Sequence

from fuzzer.errors import ConfigError
from fuzzer.mutators import Limits

API_KEY_ENV = "OPENAI_API_KEY"

#: What `fuzz campaign` plants in the simulator when no --target is given, so a first
#: run finds something: the two reports this project started from (vLLM 37308, 37343).
DEFAULT_SIM_PATHOLOGIES = ("hol-prefix-burst", "logprobs-batch-cost")


@contextlib.asynccontextmanager
async def open_target(
    url: str | None,
    *,
    server: str = "auto",
    model: str | None = None,
    pathologies: Sequence[str] = (),
    seed: int = 0,
) -> AsyncIterator:
    """Yield a started HttpTarget on ``url``, or on a simulator child process when ``url`` is None."""
    from fuzzer.executor import HttpTarget  # noqa: PLC0415 - aiohttp import only for commands that run traces

    api_key = os.environ.get(API_KEY_ENV) or None
    rng = random.Random(seed)
    if url is None:
        from fuzzer.sim.process import SimProcess  # noqa: PLC0415

        async with SimProcess(pathologies=tuple(pathologies), seed=seed) as sim:
            async with HttpTarget(sim.url, server=server, model=model, api_key=api_key, rng=rng) as target:
                yield target
        return
    if pathologies:
        raise ConfigError("--pathologies applies to the built-in simulator only; drop it or drop --target")
    async with HttpTarget(url, server=server, model=model, api_key=api_key, rng=rng) as target:
        yield target


def limits_for(target) -> Limits:
    """What the mutators must respect on this target: its context length and rejected features."""
    info = getattr(target, "info", None)
    if info is None:
        return Limits()
    unsupported = frozenset(name for name, ok in (info.capabilities or {}).items() if not ok)
    max_len = info.max_model_len or Limits().max_model_len
    return Limits(max_model_len=max_len, unsupported=unsupported & {"chat", "n", "logprobs"})


def parse_duration(text: str) -> float:
    """'90s', '10m', '8h', '1h30m', '2d' or plain seconds -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    if not t:
        raise ConfigError("--duration must not be empty (e.g. 90s, 10m, 8h)")
    try:
        return float(t)
    except ValueError:
        pass
    total, number = 0.0, ""
    for ch in t:
        if ch.isdigit() or ch == ".":
            number += ch
        elif ch in units and number:
            total += float(number) * units[ch]
            number = ""
        else:
            raise ConfigError(f"--duration must look like 90s, 10m, 8h or 1h30m, got {text!r}")
    if number or total <= 0:
        raise ConfigError(f"--duration must look like 90s, 10m, 8h or 1h30m, got {text!r}")
    return total
