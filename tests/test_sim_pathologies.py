"""Planted pathologies: the registry, and for each one a trace that shows it only when it is on."""

from __future__ import annotations

import pytest

from fuzzer.errors import ConfigError
from fuzzer.sim import VirtualTarget, pathologies
from fuzzer.sim.pathologies import NAMES, describe, parse
from fuzzer.trace import from_dict

CONTRACT_NAMES = (
    "hol-prefix-burst",
    "unchunked-prefill",
    "logprobs-batch-cost",
    "sticky-batch-full",
    "preemption-thrash",
    "cold-start",
    "serial-tokenizer",
)


def test_names_are_the_contract():
    assert NAMES == CONTRACT_NAMES


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("none", ()),
        ("", ()),
        (None, ()),
        ("all", CONTRACT_NAMES),
        ("cold-start,hol-prefix-burst", ("hol-prefix-burst", "cold-start")),
        (" Cold-Start , cold-start ", ("cold-start",)),
    ],
)
def test_parse(spec, expected):
    assert parse(spec) == expected


def test_parse_unknown_names_the_valid_ones():
    with pytest.raises(ConfigError) as e:
        parse("cold-start,warp-drive")
    message = str(e.value)
    assert "'warp-drive'" in message
    for name in CONTRACT_NAMES:
        assert name in message


def test_every_pathology_is_described_with_its_report_and_trigger():
    infos = describe()
    assert [i.name for i in infos] == list(CONTRACT_NAMES)
    for info in infos:
        assert info.summary and info.trigger and info.effect
        assert any(ch.isdigit() for ch in info.models), f"{info.name} must name the public report it models"
        assert info.kind in {"ttft-outlier", "itl-stall", "e2e-outlier", "cold-start"}
    for cls in pathologies._REGISTRY:  # noqa: SLF001 - each mechanism is documented where it is named
        assert "Models " in cls.__doc__ and "Trigger: " in cls.__doc__, cls.__name__


def _trace(requests, prefixes=None):
    return from_dict({"prefixes": prefixes or {}, "requests": requests})


#: For each pathology: a trace that triggers it, the request that suffers, and what to compare.
TRIGGERS = {
    # Short requests of a prefix group wait with six long members (they arrive during L0's prefill step).
    "hol-prefix-burst": (
        _trace(
            [{"id": "L0", "at_ms": 0, "prompt_tokens": 2048, "prefix": "p", "max_tokens": 16}]
            + [{"id": f"S{i}", "at_ms": 5 * i, "prompt_tokens": 128, "prefix": "p", "max_tokens": 16} for i in (1, 2)]
            + [
                {"id": f"L{i}", "at_ms": 10 + 5 * i, "prompt_tokens": 2048, "prefix": "p", "max_tokens": 16}
                for i in range(1, 7)
            ],
            {"p": 32},
        ),
        "S1",
        "ttft",
    ),
    # An 8192-token prompt arrives while D streams.
    "unchunked-prefill": (
        _trace(
            [
                {"id": "D", "at_ms": 0, "prompt_tokens": 128, "max_tokens": 200},
                {"id": "X", "at_ms": 100, "prompt_tokens": 8192, "max_tokens": 4},
            ]
        ),
        "D",
        "itl",
    ),
    # B asks for n=8, logprobs=20; C arrives while it runs.
    "logprobs-batch-cost": (
        _trace(
            [
                {"id": "A", "at_ms": 0, "prompt_tokens": 128, "max_tokens": 100},
                {"id": "B", "at_ms": 10, "prompt_tokens": 128, "max_tokens": 50, "n": 8, "logprobs": 20},
                {"id": "C", "at_ms": 50, "prompt_tokens": 128, "max_tokens": 32},
            ]
        ),
        "C",
        "ttft",
    ),
    # X's 4096-token prompt fills two steps' budgets while S waits; D decodes for a long time.
    "sticky-batch-full": (
        _trace(
            [
                {"id": "D", "at_ms": 0, "prompt_tokens": 128, "max_tokens": 300},
                {"id": "X", "at_ms": 20, "prompt_tokens": 4096, "max_tokens": 200},
                {"id": "S", "at_ms": 30, "prompt_tokens": 128, "max_tokens": 16},
            ]
        ),
        "S",
        "ttft",
    ),
    # 24 x (1024 prompt + 800 output) tokens do not fit 40960 KV tokens.
    "preemption-thrash": (
        _trace([{"id": f"R{i:02d}", "at_ms": i, "prompt_tokens": 1024, "max_tokens": 800} for i in range(24)]),
        "R23",
        "itl",
    ),
    # A 16k-token prompt ahead of a short one in the tokenizer queue.
    "serial-tokenizer": (
        _trace(
            [
                {"id": "L", "at_ms": 0, "prompt_tokens": 16384, "max_tokens": 1},
                {"id": "S", "at_ms": 1, "prompt_tokens": 32, "max_tokens": 8},
            ]
        ),
        "S",
        "ttft",
    ),
}

#: The suffering request's measure must grow at least this much with the pathology on.
MIN_EFFECT = 1.25


def _measure(result, request_id, what):
    r = result.request(request_id)
    return {"ttft": r.ttft_s, "itl": r.max_itl_s, "e2e": r.e2e_s}[what]


def _warm_run(pathology_names, trace, seed=0):
    """The second execution of a target (the first one warms a cold-start server up)."""
    target = VirtualTarget(pathologies=pathology_names, seed=seed)
    target.run(_trace([{"id": "warm", "at_ms": 0, "prompt_tokens": 16, "max_tokens": 2}]))
    return target.run(trace)


@pytest.mark.parametrize("name", sorted(TRIGGERS))
def test_trigger_shows_the_pathology_only_when_it_is_on(name):
    trace, victim, what = TRIGGERS[name]
    off = _warm_run((), trace)
    on = _warm_run((name,), trace)
    assert _measure(on, victim, what) > MIN_EFFECT * _measure(off, victim, what)
    assert name in on.ground_truth[victim]
    assert all(not names for names in off.ground_truth.values())
    # Other pathologies do not claim this trace's damage when they are the only ones on.
    others = tuple(n for n in NAMES if n not in (name, "cold-start"))
    assert name not in set().union(*(set(v) for v in _warm_run(others, trace).ground_truth.values()))


def test_each_trigger_is_specific_enough_to_stay_quiet_on_a_clean_server():
    # The triggers are ordinary traffic: a clean server finishes them all.
    for trace, _, _ in TRIGGERS.values():
        result = _warm_run((), trace)
        assert not result.failures


def test_preemption_thrash_multiplies_preemptions():
    trace, _, _ = TRIGGERS["preemption-thrash"]
    off = _warm_run((), trace).samples[-1].values["preemptions"]
    on = _warm_run(("preemption-thrash",), trace).samples[-1].values["preemptions"]
    assert on > 10 * max(off, 1)


def test_cold_start_slows_only_the_first_run_after_idle(seed_trace):
    target = VirtualTarget(pathologies=("cold-start",))
    first, second = target.run(seed_trace), target.run(seed_trace)
    assert first.request("r08").ttft_s > 10 * second.request("r08").ttft_s
    assert "cold-start" in first.ground_truth["r08"] and second.ground_truth["r08"] == ()
    target.idle(30.0)
    again = target.run(seed_trace)
    assert again.request("r08").ttft_s > 10 * second.request("r08").ttft_s
    assert again.idle_before_s >= 30.0

    clean = VirtualTarget()
    assert clean.run(seed_trace).request("r08").ttft_s < 2 * second.request("r08").ttft_s
