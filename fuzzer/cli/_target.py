"""Opening the target a command runs against: a live server, or the built-in simulator.

The API key comes from an environment variable only (default OPENAI_API_KEY); it is
handed to the executor and never stored, printed or exported.
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import Any, AsyncIterator, Mapping, Sequence

from fuzzer.errors import ConfigError
from fuzzer.search.mutators import Limits

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
    prompt_seed: int | None = None,
    sim_options: Mapping[str, Any] | None = None,
    timeout_s: float | None = None,
    api_key_env: str = API_KEY_ENV,
    launch=None,
) -> AsyncIterator:
    """Yield a started HttpTarget on ``url``, or on a simulator child process when ``url`` is None.

    ``seed``: the simulator's (its noise and faults) and, unless ``prompt_seed`` is given, the
    prompt text's. ``sim_options``: more SimProcess arguments for the built-in simulator
    (speed, faults, fault_rate, fault_grace). ``timeout_s``: the client's read timeout (a
    hang is declared after it); the executor's default when None. ``api_key_env``: the
    environment variable holding the API key. ``launch``: a LaunchSpec to start and own
    (``--launch``, ``--target-file``; :mod:`fuzzer.cli._launch`).
    """
    from fuzzer.execute.http import HttpTarget  # noqa: PLC0415 - aiohttp import only for commands that run traces

    api_key = os.environ.get(api_key_env) or None
    rng = random.Random(seed if prompt_seed is None else prompt_seed)
    extra: dict[str, Any] = {} if timeout_s is None else {"timeout_s": timeout_s}
    if launch is not None:
        if url is not None or pathologies or sim_options:
            raise ConfigError("--launch and --target-file start a server of their own; drop --target, --pathologies, "
                              "--faults and --speed")
        from fuzzer.cli._launch import open_launched  # noqa: PLC0415

        async with open_launched(launch, server=server, model=model, api_key=api_key, rng=rng, **extra) as target:
            yield target
        return
    if url is None:
        from fuzzer.sim.process import SimProcess  # noqa: PLC0415

        async with SimProcess(pathologies=tuple(pathologies), seed=seed, **dict(sim_options or {})) as sim:
            async with HttpTarget(sim.url, server=server, model=model, api_key=api_key, rng=rng, **extra) as target:
                yield target
        return
    if pathologies or sim_options:
        raise ConfigError("--pathologies, --faults and --speed apply to the built-in simulator only; drop them or drop --target")
    async with HttpTarget(url, server=server, model=model, api_key=api_key, rng=rng, **extra) as target:
        yield target


SIM_PREFIX = "sim:"


def sim_key(planted: Sequence[str], sim_options: Mapping[str, Any] | None = None, seed: int = 0) -> str:
    """The built-in simulator's identity in the store: what it plants, how fast it runs, its faults.

    ``sim:hol-prefix-burst;speed=10;faults=crash,hang;rate=0.05;seed=7``. The fault seed is
    part of it because it decides which requests a fault hits: ``fuzz minimize`` must start
    the same simulator to reproduce a fault finding. :func:`parse_sim_key` reads it back.
    """
    options = dict(sim_options or {})
    key = SIM_PREFIX + (",".join(planted) or "none")
    speed = float(options.get("speed", 1.0))
    if speed != 1.0:
        key += f";speed={speed:g}"
    faults = tuple(options.get("faults", ()))
    if faults:
        from fuzzer.sim.faults import DEFAULT_RATE  # noqa: PLC0415

        key += f";faults={','.join(faults)};rate={float(options.get('fault_rate', DEFAULT_RATE)):g};seed={seed}"
    return key


def parse_sim_key(key: str) -> tuple[tuple[str, ...], dict[str, Any], int]:
    """(pathologies, SimProcess options, seed) of a key made by :func:`sim_key`."""
    head, *parts = key[len(SIM_PREFIX):].split(";")
    planted = tuple(n for n in head.split(",") if n and n != "none")
    options: dict[str, Any] = {}
    seed = 0
    for part in parts:
        name, _, value = part.partition("=")
        try:
            if name == "speed":
                options["speed"] = float(value)
            elif name == "faults":
                options["faults"] = tuple(f for f in value.split(",") if f)
            elif name == "rate":
                options["fault_rate"] = float(value)
            elif name == "seed":
                seed = int(value)
            else:
                raise ValueError(name)
        except ValueError:
            raise ConfigError(f"cannot read the simulator settings {key!r} stored with this finding") from None
    return planted, options, seed


def limits_for(target) -> Limits:
    """What the mutators must respect on this target: its context length and rejected features (and
    its KV cache's size where it tells it, for the KV-pressure shapes)."""
    from fuzzer.fleet.worker import limits_of  # noqa: PLC0415 - one rule for a campaign and a fleet's workers

    kv_cache = getattr(target, "kv_cache", None)
    return limits_of(getattr(target, "info", None), kv_cache() if callable(kv_cache) else None)


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
