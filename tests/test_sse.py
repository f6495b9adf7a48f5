"""Stream accounting: which event is the first token, timestamps per read, faults."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzer.execute.sse import StreamAccount, usage_counts
from fuzzer.execution import Outcome, RequestResult


def ev(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chat(content=None, role=None, finish=None, index=0):
    delta = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return ev({"choices": [{"index": index, "delta": delta, "finish_reason": finish}]})


def comp(text, finish=None, index=0):
    return ev({"choices": [{"index": index, "text": text, "finish_reason": finish}]})


STREAM = (
    chat(role="assistant", content="")
    + chat(content="")
    + chat(content="Hel")
    + chat(content="lo", finish="length")
    + ev({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}}})
    + b"data: [DONE]\n\n"
)


def test_role_only_and_empty_deltas_are_not_the_first_token():
    a = StreamAccount()
    a.feed(chat(role="assistant", content=""), 1.0)
    a.feed(chat(content=""), 2.0)
    assert a.first_event_t == 1.0 and a.first_token_t is None
    a.feed(chat(content="x"), 3.0)
    assert a.first_token_t == 3.0 and a.token_times == [3.0]


def test_a_whole_stream_gives_times_finish_usage_and_done():
    a = StreamAccount()
    a.feed(STREAM, 5.0)
    assert a.first_token_t == 5.0 and a.token_times == [5.0, 5.0]
    assert a.finish_reason == "length" and a.done_t == 5.0 and a.fault is None
    assert usage_counts(a.usage) == (9, 2, 4)


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=12))
def test_any_split_into_reads_gives_the_same_account(cuts):
    a = StreamAccount()
    bounds = [0, *sorted(set(cuts)), len(STREAM)]
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        a.feed(STREAM[lo:hi], float(i))
    assert a.fault is None and a.done_t is not None and a.finish_reason == "length"
    assert len(a.token_times) == 2 and a.token_times == sorted(a.token_times)
    assert a.first_token_t == a.token_times[0]


def test_events_in_one_read_share_its_time_and_split_events_get_the_later_read():
    a = StreamAccount()
    first = comp("a") + comp("b")
    third = comp("c")
    a.feed(first + third[:10], 1.0)
    a.feed(third[10:], 2.0)
    assert a.token_times == [1.0, 1.0, 2.0]


def test_crlf_framing_and_comments_are_understood():
    a = StreamAccount()
    body = (b": keep-alive\r\n\r\n" + comp("x").replace(b"\n", b"\r\n") + b"data: [DONE]\r\n\r\n")
    a.feed(body[:-1], 1.0)  # the last CR arrives alone
    a.feed(body[-1:], 2.0)
    assert a.token_times == [1.0] and a.done_t == 2.0 and a.fault is None


def test_only_choice_zero_makes_token_times_but_any_choice_is_a_first_token():
    a = StreamAccount()
    a.feed(comp("x", index=1), 1.0)
    a.feed(comp("y", index=0), 2.0)
    assert a.first_token_t == 1.0 and a.token_times == [2.0]


def test_a_choice_held_back_is_the_longest_silence_of_the_request():
    """heldout12's bug4: choices 1.. of an n > 1 stream held until choice 0 finished, then sent at once. Choice 0's
    gaps stay small; choice 1 went 0.5 s without text from the stream's first token."""
    a = StreamAccount()
    for t in (1.0, 1.01, 1.02):
        a.feed(comp("x", index=0), t)
    a.feed(comp("a", index=1) + comp("b", index=1), 1.5)
    assert a.first_token_t == 1.0 and a.token_times == [1.0, 1.01, 1.02]
    assert abs(a.choice_gap - 0.5) < 1e-9 and a.choice_gap_end == 1.5  # when it ended: where it lies in the run
    lockstep = StreamAccount()
    for t in (1.0, 1.01, 1.02):
        lockstep.feed(comp("x", index=0) + comp("y", index=1), t)
    assert abs(lockstep.choice_gap - 0.01) < 1e-9 and lockstep.choice_gap_end == 1.01  # the first of the longest
    result = RequestResult("m", "m-1", 0.0, 0.0, Outcome.OK, token_times_s=(0.1, 0.11, 0.12), choice_gap_s=0.5)
    assert result.max_itl_s == 0.5
    assert replace(result, choice_gap_s=None).max_itl_s == pytest.approx(0.01)
    # Where that silence lies in the run: choice 0's longest gap until the later choice's end is known.
    assert result.longest_gap_s == pytest.approx((0.1, 0.11))
    assert replace(result, choice_gap_end_s=0.6).longest_gap_s == pytest.approx((0.1, 0.6))


def test_reasoning_deltas_are_tokens():
    a = StreamAccount()
    a.feed(ev({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]}), 1.0)
    assert a.first_token_t == 1.0


def test_faults_are_typed_and_stop_the_account():
    cases = {
        b"data: {not json\n\n": Outcome.MALFORMED,
        b"hello world\n\n": Outcome.MALFORMED,
        b"data: [1, 2]\n\n": Outcome.MALFORMED,
        b'data: {"choices": 3}\n\n': Outcome.MALFORMED,
        b'data: {"error": {"message": "engine died"}}\n\n': Outcome.HTTP_ERROR,
        b'data: {"object": "error", "message": "oops"}\n\n': Outcome.HTTP_ERROR,
    }
    for body, outcome in cases.items():
        a = StreamAccount()
        a.feed(comp("x") + body + comp("after"), 1.0)
        assert a.fault is outcome, body
        assert a.finished and a.token_times == [1.0] and a.detail


def test_nothing_after_done_counts():
    a = StreamAccount()
    a.feed(comp("x") + b"data: [DONE]\n\n" + comp("late"), 1.0)
    assert a.token_times == [1.0] and a.events == 2


def test_usage_counts_tolerates_missing_and_odd_values():
    assert usage_counts(None) == (None, None, None)
    assert usage_counts({"prompt_tokens": True, "completion_tokens": 3}) == (None, 3, None)


# --- a real llama-server's streams (data/servers/llamacpp/live/*.sse) ---

_LIVE = __import__("pathlib").Path(__file__).parent / "data" / "servers" / "llamacpp" / "live"


def _feed_per_event(name: str) -> StreamAccount:
    """Feed a recorded stream one event per read, the read's time being the event's index."""
    account = StreamAccount()
    for i, block in enumerate((_LIVE / name).read_bytes().split(b"\n\n")):
        if block.strip():
            account.feed(block + b"\n\n", float(i))
    return account


def test_llamacpp_chat_stream_role_chunk_is_not_a_token_and_usage_comes_from_the_empty_choices_chunk():
    a = _feed_per_event("chat_completions_stream.sse")
    assert a.fault is None and a.done_t is not None
    assert a.first_event_t == 0.0  # the role-only chunk (content null)
    assert a.first_token_t == 1.0  # the first chunk with content
    assert a.tokens == 8 and a.finish_reason == "length"
    assert usage_counts(a.usage) == (40, 8, 0)


def test_llamacpp_completion_stream_carries_usage_on_the_finishing_chunk():
    a = _feed_per_event("completions_stream.sse")
    assert a.fault is None and a.done_t is not None
    assert a.finish_reason == "length"
    assert usage_counts(a.usage) == (6, 8, 5)
    # 7 text events for 8 tokens: llama.cpp holds a byte-fallback piece back until its UTF-8
    # character is whole; the finishing chunk has empty text and is not a token.
    assert a.tokens == 7 and a.token_times[-1] == a.done_t - 2
