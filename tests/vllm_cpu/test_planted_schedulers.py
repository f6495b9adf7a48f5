"""Each planted scheduler (planted.py) really changes the real engine's order in the intended way.

Measured with a plain streaming client (client.py), not the fuzzer: the same schedule of
requests is sent to the session's stock server and to a server running the planted class
(same flags otherwise), and the order of first tokens (or the tokens a stream gets while a
prefill runs) is compared. Orders, not absolute times, so a slow or loaded machine changes
the durations but not the verdicts; the schedules (schedules.py) are timed by the stock
server's measured step time, so the same requests wait together on a fast machine and a slow one.
"""

from __future__ import annotations

import functools

import pytest

from . import client, schedules
from .client import Sent
from .conftest import group_members, stop_vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _tokens_during_prefill(results: dict[str, Sent]) -> int:
    """D's tokens while P's prefill surely ran: from a sixth of P's wait on (P's tokenization and its
    trip to the engine core come first, and take over 100 ms on a loaded machine) to its first token."""
    d, p = results["D"], results["P"]
    start = p.sent_s + max(0.05, (p.first_s - p.sent_s) / 6)
    return sum(1 for t in d.token_s if start < t < p.first_s - 0.01)


def _longest_silence(results: dict[str, Sent]) -> float:
    """D's longest gap between tokens within P's wait (a gap that overlaps the wait is clipped to it),
    as a share of that wait. (A starved D's next token may arrive in P's first token's step or after
    it, so the gap is judged by its overlap with the wait, not by where it ends.)"""
    d, p = results["D"], results["P"]
    wait = p.first_s - p.sent_s
    gaps = [min(b, p.first_s) - max(a, p.sent_s) for a, b in zip(d.token_s, d.token_s[1:])
            if a < p.first_s and b > p.sent_s]
    return max(gaps, default=wait) / wait


def _summary(results: dict[str, Sent]) -> str:
    return ", ".join(f"{n}: sent {r.sent_s:.2f} first {r.token_s[0] if r.token_s else float('nan'):.2f}"
                     for n, r in results.items())


def _check_all_served(results: dict[str, Sent]) -> None:
    # Every token was generated; a few of a long random-weight stream decode to no text (no event).
    for r in results.values():
        assert r.error is None and r.usage and r.usage["completion_tokens"] == r.max_tokens, (r.name, r.error, r.usage)
        assert len(r.token_s) >= 0.5 * r.max_tokens, (r.name, len(r.token_s), r.max_tokens)


PLANTED = {
    "planted.HolLongestFirst": schedules.hol,
    "planted.LifoAdmission": schedules.lifo,
    "planted.DecodeStarvation": schedules.starvation,
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
        # The victims: the running stream D, silent through P's whole prefill. (vLLM coalesces the
        # tokens of a fast stream into fewer events, so events are counted loosely; the longest
        # silence, most of P's wait or a step or two of it, is what tells the two apart.)
        for results in (stock, planted):  # D still streamed when P's prefill ended: it could have been starved
            assert results["D"].token_s[-1] > results["P"].first_s, _summary(results)
        assert _tokens_during_prefill(stock) >= 1, (stock["D"].token_s, _summary(stock))
        assert _longest_silence(stock) < 0.6, (_longest_silence(stock), _summary(stock))
        assert _tokens_during_prefill(planted) <= 1, (planted["D"].token_s, _summary(planted))
        assert _longest_silence(planted) > 0.6, (_longest_silence(planted), _summary(planted))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cls", list(PLANTED))
def test_the_planted_scheduler_changes_the_order_as_documented(cls, vllm_server, vllm_server_factory, vllm_speed):
    schedule = functools.partial(PLANTED[cls], vllm_speed)
    stock = client.run(vllm_server.base_url, vllm_server.model, schedule(1))
    _check_all_served(stock)
    planted_server = vllm_server_factory(scheduler_cls=cls)
    assert f"Using custom scheduler class {cls}" in planted_server.log.read_text(errors="replace")
    planted = client.run(planted_server.base_url, planted_server.model, schedule(2))
    _check_all_served(planted)
    _verdicts(cls, stock, planted)
    print(f"\n{cls}: ready in {planted_server.ready_s:.0f} s\n  stock:   {_summary(stock)}\n  planted: {_summary(planted)}")
    if "D" in stock:
        print(f"  D's tokens during P's prefill / longest silence (share of P's wait): stock {_tokens_during_prefill(stock)}"
              f" / {_longest_silence(stock):.2f}, planted {_tokens_during_prefill(planted)} / {_longest_silence(planted):.2f}")
    # Stopping kills the whole process group: API server, engine core and worker.
    assert len(group_members(planted_server.pid)) >= 3
    stop_vllm_server(planted_server)
    assert group_members(planted_server.pid) == []
