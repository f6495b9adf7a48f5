"""Exact-length prompts: fitting to the server's count, shared prefixes, fresh salt."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
from loopback import serving
from misbehaving_server import CHAT_TEMPLATE_TOKENS, running

from fuzzer import trace as tf
from fuzzer.errors import TargetError
from fuzzer.execute import adapters, prompts


class WordCounter:
    """One token per word, a BOS token, a chat template; optionally slow and out of order."""

    exact = True

    def __init__(self, *, bos=1, chat=7, per_word=lambda w: 1, jitter: random.Random | None = None):
        self.bos, self.chat, self.per_word, self.jitter = bos, chat, per_word, jitter
        self.calls = 0

    async def count(self, text, *, chat=False):
        self.calls += 1
        if self.jitter:
            await asyncio.sleep(self.jitter.random() * 0.002)
        return self.bos + sum(self.per_word(w) for w in text.split()) + (self.chat if chat else 0)


TRACE = tf.from_dict(
    {
        "prefixes": {"p0": 32, "p1": 100},
        "requests": [
            {"id": "a", "at_ms": 0, "prompt_tokens": 128, "prefix": "p0", "max_tokens": 4},
            {"id": "b", "at_ms": 1, "prompt_tokens": 2048, "prefix": "p0", "max_tokens": 4},
            {"id": "c", "at_ms": 2, "prompt_tokens": 100, "prefix": "p1", "max_tokens": 4},
            {"id": "d", "at_ms": 3, "prompt_tokens": 300, "prefix": "p1", "max_tokens": 4, "api": "chat"},
            {"id": "e", "at_ms": 4, "prompt_tokens": 1, "max_tokens": 4},
            {"id": "f", "at_ms": 5, "prompt_tokens": 57, "max_tokens": 4, "api": "chat"},
        ],
    }
)


async def test_every_prompt_has_exactly_the_requested_token_count():
    counter = WordCounter()
    built = await prompts.build(TRACE, counter, random.Random(1))
    assert built.warnings == () and built.exact
    for r in TRACE.requests:
        p = built.prompts[r.id]
        assert p.counted_tokens == r.prompt_tokens
        assert await counter.count(p.text, chat=r.api == "chat") == r.prompt_tokens, r.id


async def test_a_prefix_group_shares_its_text_and_other_prompts_share_nothing():
    built = await prompts.build(TRACE, WordCounter(), random.Random(2))
    a, b, c, d, e, f = (built.prompts[k] for k in "abcdef")
    assert a.text[: a.prefix_chars] == b.text[: b.prefix_chars] and a.prefix_chars > 0
    assert await WordCounter().count(a.text[: a.prefix_chars]) == 32
    assert c.text == d.text[: d.prefix_chars] == c.text[: c.prefix_chars]  # c is all prefix
    assert a.text[:40] != c.text[:40]
    # Private parts diverge right after the prefix.
    assert a.text[a.prefix_chars :][:30] != b.text[b.prefix_chars :][:30]
    assert e.prefix_chars == f.prefix_chars == 0


async def test_each_execution_draws_fresh_text_and_a_seed_reproduces_it():
    rng = random.Random(3)
    first = await prompts.build(TRACE, WordCounter(), rng)
    second = await prompts.build(TRACE, WordCounter(), rng)
    for r in TRACE.requests:
        if r.prompt_tokens > 4:
            # A fresh salt: no prefix-cache state can leak between executions.
            assert first.prompts[r.id].text.split()[:4] != second.prompts[r.id].text.split()[:4], r.id
    again = await prompts.build(TRACE, WordCounter(), random.Random(3))
    assert {k: p.text for k, p in again.prompts.items()} == {k: p.text for k, p in first.prompts.items()}


async def test_texts_do_not_depend_on_the_order_counts_come_back_in():
    calm = await prompts.build(TRACE, WordCounter(), random.Random(4))
    jittery = await prompts.build(TRACE, WordCounter(jitter=random.Random(9)), random.Random(4))
    assert {k: p.text for k, p in calm.prompts.items()} == {k: p.text for k, p in jittery.prompts.items()}


async def test_a_tokenizer_with_multi_token_words_is_still_fitted():
    # Words with an "e" are two tokens: the fit must still land on the target.
    counter = WordCounter(per_word=lambda w: 2 if "e" in w else 1)
    built = await prompts.build(TRACE, counter, random.Random(5))
    off = {k: p for k, p in built.prompts.items() if p.counted_tokens != p.target_tokens}
    for k, p in off.items():
        assert abs(p.counted_tokens - p.target_tokens) <= 1
        assert any(w.startswith(f"{k}: built") for w in built.warnings)
    assert len(off) <= 1


async def test_an_impossible_length_is_a_warning_never_a_silent_mismatch():
    # Every word is two tokens and BOS is one: only odd lengths exist.
    trace = tf.from_dict({"requests": [{"id": "even", "at_ms": 0, "prompt_tokens": 64, "max_tokens": 1}]})
    built = await prompts.build(trace, WordCounter(per_word=lambda w: 2), random.Random(6))
    p = built.prompts["even"]
    assert p.counted_tokens in (63, 65)
    assert built.warnings == (f"even: built a {p.counted_tokens}-token prompt, not 64",)


async def test_a_counter_fitted_from_usage_finds_tokens_per_word_and_overheads():
    async def measure(text, chat):
        return round(2 + 1.5 * len(text.split())) + (9 if chat else 0)

    counter = await prompts.fit_counter(measure, random.Random(7))
    assert counter.per_word == pytest.approx(1.5) and counter.overhead == pytest.approx(2)
    assert counter.chat_overhead == 9 and not counter.exact
    assert await counter.count("a b c d", chat=True) == 2 + 6 + 9
    built = await prompts.build(TRACE, counter, random.Random(8))
    assert not built.exact


async def test_a_counter_fit_without_usage_is_a_target_error():
    async def measure(text, chat):
        return None

    with pytest.raises(TargetError, match="no usage.prompt_tokens"):
        await prompts.fit_counter(measure, random.Random(0))


async def test_server_counter_uses_the_servers_tokenize_for_text_and_chat():
    async with running() as (url, state), aiohttp.ClientSession() as session:
        counter = prompts.ServerCounter(session, url, adapters.adapter("vllm"), "test-model", headers={})
        assert counter.templates_chat
        assert await counter.count("one two three") == 4
        assert await counter.count("one two three", chat=True) == 4 + CHAT_TEMPLATE_TOKENS
        built = await prompts.build(TRACE, counter, random.Random(9))
        assert built.warnings == ()
        assert state.tokenize_calls >= len(TRACE.requests)


def test_server_counter_needs_a_tokenize_endpoint():
    with pytest.raises(TargetError, match="no tokenize endpoint"):
        prompts.ServerCounter(None, "http://127.0.0.1:1", adapters.adapter("openai"), None, headers={})  # type: ignore[arg-type]


async def test_words_of_several_tokens_are_topped_up_with_a_one_token_word_to_the_exact_length():
    # Like the random llama model's small vocabulary: most words are 2 tokens, " the" is 1.
    counter = WordCounter(per_word=lambda w: 1 if w == prompts.PAD_WORD else 2)
    built = await prompts.build(TRACE, counter, random.Random(7))
    assert built.warnings == ()
    assert all(p.counted_tokens == p.target_tokens for p in built.prompts.values())


async def test_a_server_without_chat_tokenize_counts_chat_through_its_template_endpoint():
    """llama.cpp: /apply-template renders the messages, /tokenize counts the rendered text."""
    from aiohttp import web

    seen = []

    async def apply_template(request):
        body = await request.json()
        seen.append("template")
        return web.json_response({"prompt": "<|im_start|>user\n" + body["messages"][0]["content"] + "<|im_end|>\n"})

    async def tokenize(request):
        body = await request.json()
        seen.append("tokenize")
        assert body["add_special"] and body["parse_special"]
        return web.json_response({"tokens": list(range(1 + len(body["content"].split())))})

    app = web.Application()
    app.router.add_post("/apply-template", apply_template)
    app.router.add_post("/tokenize", tokenize)
    async with serving(app) as url, aiohttp.ClientSession() as session:
        counter = prompts.ServerCounter(session, url, adapters.adapter("llamacpp"), None, headers={})
        assert counter.templates_chat
        assert await counter.count("one two three") == 4
        assert seen == ["tokenize"]
        # Rendered: "<|im_start|>user", "one", "two", "three<|im_end|>" = 4 words, + BOS.
        assert await counter.count("one two three", chat=True) == 5
        assert seen[1:] == ["template", "tokenize"]
