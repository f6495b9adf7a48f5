"""The simulator's deterministic word-level tokenizer."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from fuzzer.sim.tokenizer import VOCAB, Tokenizer, output_text, output_token

words = st.text(alphabet=st.characters(blacklist_categories=("Z", "C")), min_size=1, max_size=12)


@given(st.lists(words, max_size=30))
def test_one_token_per_word_and_round_trip(ws):
    tok = Tokenizer()
    text = " ".join(ws)
    ids = tok.encode(text)
    assert len(ids) == len(ws) == tok.count(text)
    assert tok.decode(ids) == text


def test_ids_are_stable_across_processes():
    code = "from fuzzer.sim.tokenizer import Tokenizer; print(Tokenizer().encode('hello kalomi wörld'))"
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
               for _ in range(2)}
    assert len(outputs) == 1
    assert str(Tokenizer().encode("hello kalomi wörld")) == outputs.pop().strip()


def test_vocabulary_words_have_their_index_and_outputs_decode():
    tok = Tokenizer()
    assert tok.encode(VOCAB[5]) == [5]
    token = output_token(123, 0, 7)
    assert tok.decode([token]) == output_text(token).strip()
    assert output_token(123, 0, 7) != output_token(123, 1, 7)


def test_chat_template_counts_match_tokenize():
    tok = Tokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    text = tok.apply_chat_template(messages)
    assert text.split()[-2:] == ["<|im_start|>", "assistant"]
    # "<|im_start|> system be brief <|im_end|>" + "<|im_start|> user hi <|im_end|>" + "<|im_start|> assistant"
    assert tok.count(text) == 5 + 4 + 2
