"""The test model's vocabulary holds every word the fuzzer builds prompts from (no vLLM needed)."""

from __future__ import annotations

from fuzzer.execute.prompts import WORDS

from .make_model import build_vocab, fuzzer_words


def test_the_words_are_read_from_the_prompt_builders_source():
    assert fuzzer_words() == list(WORDS)


def test_every_prompt_word_is_one_token_of_the_vocabulary():
    vocab = build_vocab()
    assert set(WORDS) <= set(vocab) and len(vocab) == len(set(vocab))
