"""Each planted scheduler (planted.py) really changes the real engine's order in the intended way.

Measured with a plain streaming client (client.py), not the fuzzer: the same schedule of
requests is sent to the session's stock server and to a server running the planted class
(same flags otherwise), and the order of first tokens (or the tokens a stream gets while a
prefill runs) is compared. Orders, not absolute times, so a slow or loaded machine changes
the durations but not the verdicts. Token budget: vLLM's CPU default, 2048 per step.

Every schedule starts with a blocker prompt of BLOCKER tokens (two steps of prefill), sent
to an idle server: the requests sent during its first step all wait together for the next.
"""

from __future__ import annotations

import random

import pytest

from . import client
from .client import Sent
from .conftest import group_members, stop_vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BUDGET = 2048  # vLLM's max_num_batched_tokens on CPU (API server)
BLOCKER = 2500  # two prefill steps: 2048 + 452
# Sent this long after the blocker: inside its first step (over 0.5 s even on a fast idle machine).
QUEUE_AT_S = (0.15, 0.25, 0.35)


def _blocker(rng: random.Random) -> Sent:
    return Sent("blocker", 0.0, client.prompt(BLOCKER, rng), 2)


def _summary(results: dict[str, Sent]) -> str:
    return ", ".join(f"{n}: sent {r.sent_s:.2f} first {r.token_s[0] if r.token_s else float('nan'):.2f}"
                     for n, r in results.items())


def _hol_schedule(seed: int) -> list[Sent]:
    """A short request S and two long ones sharing its 15-word prefix, queued behind the blocker, S first.

    Stock FCFS: S is admitted in the blocker's second step with L1's first chunk; L2 after.
    HolLongestFirst: S is held until L1 and L2 are prefilled (admitted a step after L2).
    """
    rng = random.Random(seed)
    prefix = client.prompt(16, rng)  # 15 words: with <s>, the 16 tokens planted.PREFIX_KEY_TOKENS compares
    return [
        _blocker(rng),
        Sent("S", QUEUE_AT_S[0], client.prompt(48, rng, prefix), 4),
        Sent("L1", QUEUE_AT_S[1], client.prompt(1900, rng, prefix), 4),
        Sent("L2", QUEUE_AT_S[2], client.prompt(1900, rng, prefix), 4),
    ]


def _lifo_schedule(seed: int) -> list[Sent]:
    """Three 1500-token requests A1, A2, A3 queued in that order behind the blocker.

    Stock FCFS: first tokens in arrival order (A1, A2, A3: one budget step apart).
    LifoAdmission: reversed (A3, A2, A1).
    """
    rng = random.Random(seed)
    return [_blocker(rng), *(Sent(f"A{i + 1}", at, client.prompt(1500, rng), 4) for i, at in enumerate(QUEUE_AT_S))]


def _starvation_schedule(seed: int) -> list[Sent]:
    """A decode stream D, then (while it streams) a prompt P of 5000 tokens: three prefill steps.

    Stock (chunked prefill): D gets a token in each of P's prefill steps.
    DecodeStarvation: D gets none from P's arrival until P's prefill is done.
    """
    rng = random.Random(seed)
    return [Sent("D", 0.0, client.prompt(32, rng), 160), Sent("P", 0.6, client.prompt(5000, rng), 4)]


def _tokens_during_prefill(results: dict[str, Sent]) -> int:
    d, p = results["D"], results["P"]
    return sum(1 for t in d.token_s if p.sent_s + 0.05 < t < p.first_s - 0.01)


def _check_all_served(results: dict[str, Sent]) -> None:
    for r in results.values():
        assert r.error is None and len(r.token_s) == r.max_tokens, (r.name, r.error, len(r.token_s))


PLANTED = {
    "planted.HolLongestFirst": _hol_schedule,
    "planted.LifoAdmission": _lifo_schedule,
    "planted.DecodeStarvation": _starvation_schedule,
}


def _verdicts(cls: str, stock: dict[str, Sent], planted: dict[str, Sent]) -> None:
    if cls == "planted.HolLongestFirst":
        # The victim: S, the short member of the burst, first in the queue.
        assert stock["S"].first_s < stock["L2"].first_s, _summary(stock)
        assert planted["S"].first_s > planted["L2"].first_s and planted["S"].first_s > planted["L1"].first_s, \
            _summary(planted)
    elif cls == "planted.LifoAdmission":
        # The victim: A1, the earliest arrival, admitted last.
        firsts = lambda rs: [rs[f"A{i}"].first_s for i in (1, 2, 3)]  # noqa: E731
        assert firsts(stock) == sorted(firsts(stock)), _summary(stock)
        assert firsts(planted) == sorted(firsts(planted), reverse=True), _summary(planted)
    else:
        # The victims: the running stream D, silent through P's whole prefill.
        assert _tokens_during_prefill(stock) >= 2, (stock["D"].token_s, _summary(stock))
        assert _tokens_during_prefill(planted) <= 1, (planted["D"].token_s, _summary(planted))
        p = planted["P"]
        assert max(planted["D"].gaps()) > 0.6 * (p.first_s - p.sent_s), (planted["D"].gaps(), _summary(planted))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cls", list(PLANTED))
def test_the_planted_scheduler_changes_the_order_as_documented(cls, vllm_server, vllm_server_factory):
    schedule = PLANTED[cls]
    stock = client.run(vllm_server.base_url, vllm_server.model, schedule(1))
    _check_all_served(stock)
    planted_server = vllm_server_factory(scheduler_cls=cls)
    assert f"Using custom scheduler class {cls}" in planted_server.log.read_text(errors="replace")
    planted = client.run(planted_server.base_url, planted_server.model, schedule(2))
    _check_all_served(planted)
    _verdicts(cls, stock, planted)
    print(f"\n{cls}: ready in {planted_server.ready_s:.0f} s\n  stock:   {_summary(stock)}\n  planted: {_summary(planted)}")
    if "D" in stock:
        print(f"  D's tokens during P's prefill / longest gap: stock {_tokens_during_prefill(stock)} / "
              f"{max(stock['D'].gaps()):.2f} s, planted {_tokens_during_prefill(planted)} / {max(planted['D'].gaps()):.2f} s")
    # Stopping kills the whole process group: API server, engine core and worker.
    assert len(group_members(planted_server.pid)) >= 3
    stop_vllm_server(planted_server)
    assert group_members(planted_server.pid) == []
