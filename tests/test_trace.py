"""The trace format: round-trips, canonical hashing and validation messages."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import traces

from fuzzer import trace as tf
from fuzzer.errors import TraceError

CORPUS = Path(__file__).resolve().parent.parent / "corpus"


@given(traces(leaving=True))
def test_load_dump_round_trip(trace):
    assert tf.loads(tf.dumps(trace)) == trace
    assert tf.loads(tf.dumps(trace, indent=None)) == trace


@given(traces(leaving=True))
def test_strategy_produces_valid_traces(trace):
    assert tf.validate(trace) == trace


@settings(max_examples=50)
@given(traces(leaving=True))
def test_hash_is_stable_under_key_order(trace):
    data = trace.to_dict()
    rng = random.Random(0)
    shuffled_requests = []
    for r in data["requests"]:
        items = list(r.items())
        rng.shuffle(items)
        shuffled_requests.append(dict(items))
    top = [("requests", shuffled_requests), ("prefixes", data["prefixes"]), ("format", 1), ("name", data["name"])]
    rng.shuffle(top)
    again = tf.loads(json.dumps(dict(top)))
    assert again.content_hash() == trace.content_hash()


def test_hash_ignores_name_but_not_content():
    base = tf.loads('{"requests": [{"id": "a", "at_ms": 0, "prompt_tokens": 10, "max_tokens": 3}]}')
    named = tf.loads('{"name": "x", "requests": [{"id": "a", "at_ms": 0, "prompt_tokens": 10, "max_tokens": 3}]}')
    other = tf.loads('{"requests": [{"id": "a", "at_ms": 0, "prompt_tokens": 11, "max_tokens": 3}]}')
    assert base.content_hash() == named.content_hash()
    assert base.content_hash() != other.content_hash()


def test_defaults_are_filled_and_equal_to_explicit_values():
    short = tf.loads('{"requests": [{"id": "a", "at_ms": 0, "prompt_tokens": 10, "max_tokens": 3}]}')
    explicit = tf.loads(
        '{"format": 1, "prefixes": {}, "requests": [{"id": "a", "at_ms": 0.0, "prompt_tokens": 10, '
        '"max_tokens": 3, "prefix": null, "stream": true, "api": "completions", "ignore_eos": true, '
        '"cancel_after_tokens": null, "n": 1, "logprobs": null, "temperature": 0}]}'
    )
    assert short == explicit
    assert short.content_hash() == explicit.content_hash()


def test_fields_added_after_format_1_keep_earlier_hashes_and_change_the_hash_when_set():
    plain = {"id": "a", "at_ms": 0, "prompt_tokens": 8, "max_tokens": 4}
    before = tf.from_dict({"requests": [plain]})
    # The canonical form of a trace without them is what format 1 wrote: the same hash as ever.
    assert "disconnect_after_ms" not in before.to_dict()["requests"][0] and "seed" not in before.to_dict()["requests"][0]
    assert tf.from_dict({"requests": [{**plain, "disconnect_after_ms": None, "seed": None}]}).content_hash() == before.content_hash()
    assert before.content_hash() == hashlib.sha256(tf.canonical_json(
        {"format": 1, "prefixes": {}, "requests": [{**plain, "prefix": None, "stream": True, "api": "completions",
         "ignore_eos": True, "cancel_after_tokens": None, "n": 1, "logprobs": None, "temperature": 0.0}]}).encode()).hexdigest()
    for extra in ({"disconnect_after_ms": 30}, {"seed": 0}):
        changed = tf.from_dict({"requests": [{**plain, **extra}]})
        assert changed.content_hash() != before.content_hash()
        assert tf.loads(tf.dumps(changed)) == changed and changed.to_dict()["requests"][0][next(iter(extra))] == next(iter(extra.values()))
    # A client that leaves after a time needs no stream (a non-streaming client times out too).
    assert tf.from_dict({"requests": [{**plain, "stream": False, "disconnect_after_ms": 12.5}]}).requests[0].disconnect_after_ms == 12.5


def test_requests_are_ordered_by_arrival_keeping_ties_in_given_order():
    t = tf.loads(
        '{"requests": ['
        '{"id": "late", "at_ms": 9, "prompt_tokens": 1, "max_tokens": 1},'
        '{"id": "tie1", "at_ms": 3, "prompt_tokens": 1, "max_tokens": 1},'
        '{"id": "tie2", "at_ms": 3, "prompt_tokens": 1, "max_tokens": 1}]}'
    )
    assert [r.id for r in t.requests] == ["tie1", "tie2", "late"]


def _bad(request: dict, **top) -> str:
    base = {"id": "a", "at_ms": 0, "prompt_tokens": 64, "max_tokens": 8}
    base.update(request)
    doc = {"prefixes": {"p0": 32}, "requests": [{"id": "ok", "at_ms": 0, "prompt_tokens": 4, "max_tokens": 1}, base]}
    doc.update(top)
    with pytest.raises(TraceError) as info:
        tf.from_dict(doc)
    return str(info.value)


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("max_tokens", 0, "requests[1].max_tokens: must be >= 1, got 0"),
        ("max_tokens", "8", 'requests[1].max_tokens: must be an integer, got "8"'),
        ("max_tokens", 2.5, "requests[1].max_tokens: must be an integer, got 2.5"),
        ("prompt_tokens", -3, "requests[1].prompt_tokens: must be >= 1, got -3"),
        ("prompt_tokens", True, "requests[1].prompt_tokens: must be an integer, got true"),
        ("at_ms", -1, "requests[1].at_ms: must be a number >= 0, got -1"),
        ("at_ms", None, "requests[1].at_ms: must be a number >= 0, got null"),
        ("at_ms", 4_000_000, "requests[1].at_ms: must be <= 3600000 (one hour), got 4000000"),
        ("id", "", 'requests[1].id: must be 1-64 letters, digits or _.:- starting with a letter or digit, got ""'),
        ("id", "ok", 'requests[1].id: must be unique (also used by requests[0]), got "ok"'),
        ("stream", "yes", 'requests[1].stream: must be true or false, got "yes"'),
        ("api", "responses", 'requests[1].api: must be one of completions, chat, got "responses"'),
        ("ignore_eos", 1, "requests[1].ignore_eos: must be true or false, got 1"),
        ("prefix", "p9", 'requests[1].prefix: must name a group in prefixes (p0), got "p9"'),
        ("prefix", 3, "requests[1].prefix: must be the name of a group in prefixes, or null, got 3"),
        ("cancel_after_tokens", 8, "requests[1].cancel_after_tokens: must be < max_tokens (8) or null, got 8"),
        ("cancel_after_tokens", 0, "requests[1].cancel_after_tokens: must be >= 1, got 0"),
        ("n", 0, "requests[1].n: must be >= 1, got 0"),
        ("n", 17, "requests[1].n: must be <= 16, got 17"),
        ("logprobs", 21, "requests[1].logprobs: must be <= 20, got 21"),
        ("temperature", 3, "requests[1].temperature: must be a number between 0 and 2.0, got 3"),
        ("disconnect_after_ms", 0, "requests[1].disconnect_after_ms: must be a number > 0 (ms after sending) or null, got 0"),
        ("disconnect_after_ms", "1s", 'requests[1].disconnect_after_ms: must be a number > 0 (ms after sending) or null, got "1s"'),
        ("disconnect_after_ms", 4_000_000, "requests[1].disconnect_after_ms: must be <= 3600000 (one hour), got 4000000"),
        ("seed", -1, "requests[1].seed: must be >= 0, got -1"),
        ("seed", 1.5, "requests[1].seed: must be an integer, got 1.5"),
        ("colour", "red", "requests[1].colour: unknown field"),
    ],
)
def test_bad_request_field_names_path_rule_and_value(field, value, expected):
    assert _bad({field: value}).startswith(expected)


def test_missing_required_field():
    doc = {"requests": [{"id": "a", "at_ms": 0, "prompt_tokens": 5}]}
    with pytest.raises(TraceError, match=r"^requests\[0\]\.max_tokens: is required$"):
        tf.from_dict(doc)


def test_prompt_shorter_than_its_prefix():
    assert _bad({"prefix": "p0", "prompt_tokens": 16}) == (
        "requests[1].prompt_tokens: must be >= the 32 tokens of prefix 'p0' it includes, got 16"
    )


def test_cancel_needs_a_stream():
    assert _bad({"cancel_after_tokens": 2, "stream": False}).startswith(
        "requests[1].cancel_after_tokens: requires stream: true"
    )


@pytest.mark.parametrize(
    "doc, expected",
    [
        ([], "$: must be a JSON object, got []"),
        ({}, "requests: is required"),
        ({"requests": []}, "requests: must hold at least one request, got []"),
        ({"requests": {}}, "requests: must be a list, got {}"),
        ({"requests": [5]}, "requests[0]: must be a JSON object, got 5"),
        ({"format": 2, "requests": []}, "format: is newer than this fuzzer understands (<= 1); upgrade the fuzzer, got 2"),
        ({"format": "1", "requests": []}, 'format: must be a positive integer, got "1"'),
        ({"name": 3, "requests": []}, "name: must be a string, got 3"),
        ({"prefixes": {"p0": 0}, "requests": []}, "prefixes.p0: must be an integer >= 1, got 0"),
        ({"prefixes": [], "requests": []}, "prefixes: must be an object mapping a group name to its token count, got []"),
        ({"extra": 1, "requests": []}, "extra: unknown field"),
    ],
)
def test_bad_trace_level_fields(doc, expected):
    with pytest.raises(TraceError) as info:
        tf.from_dict(doc)
    assert str(info.value).startswith(expected)


def test_invalid_json_and_missing_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"requests": [')
    with pytest.raises(TraceError, match=r"bad\.json: \$: must be valid JSON"):
        tf.load(bad)
    with pytest.raises(TraceError, match=r"nope\.json: \$: file does not exist"):
        tf.load(tmp_path / "nope.json")


def test_every_corpus_trace_is_valid_and_canonical_on_disk():
    paths = sorted(CORPUS.glob("*.json"))
    assert len(paths) >= 6
    for path in paths:
        trace = tf.load(path)
        assert trace.name == path.stem, path
        assert tf.validate(trace) == trace


def test_vllm_37308_seed_matches_the_public_report():
    trace = tf.load(CORPUS / "vllm-37308.json")
    shape = [(r.id, r.prompt_tokens, r.max_tokens, r.stream) for r in trace.requests]
    assert shape == [
        ("r08", 128, 32, True),
        ("r05", 128, 64, True),
        ("r04", 2048, 256, True),
        ("r06", 2048, 128, False),
        ("r07", 2048, 512, True),
        ("r02", 2048, 128, True),
    ]
    assert trace.duration_ms() <= 40
    assert trace.prefixes == {"p0": 32}
    assert all(r.prefix == "p0" for r in trace.requests)


@given(st.integers(min_value=0, max_value=1 << 40), st.integers(min_value=1, max_value=1 << 12))
def test_ceil_div_is_exact_integer_ceiling(a, b):
    q = tf.ceil_div(a, b)
    assert (q - 1) * b < a <= q * b or a == q == 0
