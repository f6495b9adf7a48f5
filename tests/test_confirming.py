"""The campaign's confirmer: one bug met in many trace shapes is not confirmed over and over."""

from __future__ import annotations

import asyncio
import contextlib
import random

import numpy as np
from paper_target import PaperTarget

from fuzzer.oracle.calibrate import calibrate
from fuzzer.oracle.policy import OraclePolicy
from fuzzer.oracle.signature import family, signature
from fuzzer.search.confirming import FAMILY_EVERY, Confirmer, family_gap
from fuzzer.store import Store
from fuzzer.trace import Request, Trace


_CALIBRATION = []


async def _calibration():
    if not _CALIBRATION:
        _CALIBRATION.append(await calibrate(PaperTarget(seed=99), rng=random.Random(0), clock=lambda: 0.0))
    return _CALIBRATION[0]


def _shapes(count):
    """Traces in which a stream ``v`` follows k = 0, 1, 2, ... other requests of growing prompts:
    a new signature each (what arrived before the victim differs), one family (the victim's kind)."""
    out = []
    for k in range(count):
        j, lap = k % 9, k // 9  # past 9 the victim's output class tells the shapes apart
        before = tuple(Request(id=f"o{i}", at_ms=i, prompt_tokens=16 << j, max_tokens=8) for i in range(j))
        out.append(Trace(requests=(*before, Request(id="v", at_ms=20, prompt_tokens=256, max_tokens=32 << lap))))
    return out


def _confirmer(store, target):
    campaign_id = store.start_campaign(seed=1, target="paper", settings={})

    async def recover():
        return None

    return Confirmer(target, store, OraclePolicy(), campaign_id=campaign_id, target_id=None,
                     rng=np.random.default_rng(0), sleep=asyncio.sleep, checkpoint=lambda: None, clock=lambda: 0.0,
                     in_phase=lambda phase: contextlib.nullcontext(), recover=recover, on_finding=lambda i, v: None)


async def test_a_found_family_is_confirmed_once_in_family_every_sightings():
    traces = _shapes(2 + FAMILY_EVERY)
    kinds = {(signature(k, t, "v"), family(k, t, "v")) for t in traces for k in [_stall_kind()]}
    assert len({s for s, _ in kinds}) == len(traces) and len({f for _, f in kinds}) == 1
    store = Store.memory()
    target = PaperTarget(stall_s={"v": 0.4}, seed=1)
    target._idle_s = 0.5  # warm
    confirmer = _confirmer(store, target)
    runs = []
    for t in traces:
        before = target.executions
        first = await target.execute(t)
        await confirmer.examine(t, first, await _calibration())
        runs.append(target.executions - before - 1)  # confirmation runs only
    findings = store.list_findings()
    # The first sighting is confirmed (3 runs); the next FAMILY_EVERY - 1 new signatures cost nothing;
    # the FAMILY_EVERY-th is confirmed again, so a second bug of the family would still be found.
    assert runs[0] >= 3 and runs[1:FAMILY_EVERY] == [0] * (FAMILY_EVERY - 1) and runs[FAMILY_EVERY] >= 3
    assert len(findings) == 2 and {f.details["family"] for f in findings} == {family(_stall_kind(), traces[0], "v")}
    assert [f.details["request_id"] for f in findings] == ["v", "v"]
    # and the count starts again: the sighting after costs nothing. A checkpoint keeps the count.
    assert runs[FAMILY_EVERY + 1] == 0
    assert confirmer.to_state()["family_seen"] == {findings[0].details["family"]: 1}


async def test_an_execution_is_one_sighting_of_a_family_however_many_victims_show_it():
    # With every bug on, the held-out server's bug5 stalls every stream beside a long prompt: one
    # execution of ten streams counted ten sightings and spent the family's gap at once (4 findings of
    # one family in a 30-minute campaign).
    store = Store.memory()
    victims = [f"w{i}" for i in range(2 * FAMILY_EVERY)]
    target = PaperTarget(stall_s={"v": 0.4, **{w: 0.4 for w in victims}}, seed=1)
    target._idle_s = 0.5
    confirmer = _confirmer(store, target)
    first = _shapes(1)[0]
    await confirmer.examine(first, await target.execute(first), await _calibration())
    assert len(store.list_findings()) == 1
    # Streams of growing prompts one after another: each a new signature of the found family.
    many = Trace(requests=tuple(Request(id=w, at_ms=i, prompt_tokens=16 << i, max_tokens=32)
                                for i, w in enumerate(victims)))
    assert len({signature(_stall_kind(), many, w) for w in victims}) == len(victims)
    assert {family(_stall_kind(), many, w) for w in victims} == {family(_stall_kind(), first, "v")}
    before = target.executions
    await confirmer.examine(many, await target.execute(many), await _calibration())
    assert target.executions - before == 1  # passed over: one sighting, not ten
    assert confirmer.to_state()["family_seen"] == {store.list_findings()[0].details["family"]: 1}


async def test_each_finding_of_a_family_doubles_the_sightings_before_the_next_confirmation():
    # With every bug on, the held-out vLLM-like server's campaign confirmed one bug under 26
    # signatures at one in 5: the gap doubles per finding (5, then 10, ...).
    assert [family_gap(k) for k in (1, 2, 3)] == [FAMILY_EVERY, 2 * FAMILY_EVERY, 4 * FAMILY_EVERY]
    traces = _shapes(2 + 3 * FAMILY_EVERY)
    assert len({signature(_stall_kind(), t, "v") for t in traces}) == len(traces)
    store = Store.memory()
    target = PaperTarget(stall_s={"v": 0.4}, seed=1)
    target._idle_s = 0.5
    confirmer = _confirmer(store, target)
    confirmed = []
    for i, t in enumerate(traces):
        before = target.executions
        await confirmer.examine(t, await target.execute(t), await _calibration())
        if target.executions - before - 1:
            confirmed.append(i)
    second = FAMILY_EVERY
    third = second + 2 * FAMILY_EVERY
    assert confirmed == [0, second, third]
    assert len(store.list_findings()) == 3


async def test_without_a_found_family_every_new_signature_is_confirmed():
    # The control: the same sightings with nothing of the family found before each (a fresh store each time).
    for t in _shapes(3):
        store = Store.memory()
        target = PaperTarget(stall_s={"v": 0.4}, seed=1)
        target._idle_s = 0.5
        confirmer = _confirmer(store, target)
        await confirmer.examine(t, await target.execute(t), await _calibration())
        assert target.executions >= 4 and len(store.list_findings()) == 1


def _stall_kind():
    from fuzzer.oracle.kinds import FindingKind

    return FindingKind.ITL_STALL
