"""The random-weight GGUF writer: deterministic, small, and a llama model llama.cpp can read."""

from __future__ import annotations

import gguf
import pytest

from .make_model import ModelShape, build_vocab, write_model


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = write_model(tmp_path / "a.gguf", seed=3)
    b = write_model(tmp_path / "b.gguf", seed=3)
    c = write_model(tmp_path / "c.gguf", seed=4)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_model_is_a_few_megabytes(tmp_path):
    size = write_model(tmp_path / "m.gguf").stat().st_size
    assert 1_000_000 < size < 16_000_000


def test_vocabulary_has_byte_fallback_and_unique_pieces():
    vocab = build_vocab()
    assert len(set(vocab.tokens)) == len(vocab.tokens)
    byte_tokens = [t for t, kind in zip(vocab.tokens, vocab.types) if kind == gguf.TokenType.BYTE]
    assert byte_tokens == [f"<0x{b:02X}>" for b in range(256)]
    assert vocab.tokens[vocab.bos_id] == "<s>" and vocab.tokens[vocab.eos_id] == "</s>"
    assert "\u2581the" in vocab.tokens
    assert len(vocab.tokens) == len(vocab.scores) == len(vocab.types)


def test_written_file_reads_back_as_llama_with_the_shape(tmp_path):
    shape = ModelShape(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256)
    reader = gguf.GGUFReader(write_model(tmp_path / "m.gguf", seed=1, shape=shape))

    def value(key):
        return reader.fields[key].contents()

    assert value("general.architecture") == "llama"
    assert value("llama.block_count") == 2
    assert value("llama.embedding_length") == 128
    assert value("llama.attention.head_count_kv") == 2
    assert value("tokenizer.ggml.model") == "llama"
    tensors = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    n_vocab = len(build_vocab().tokens)
    # GGUF lists dimensions innermost first (ggml's ne): (input width, output width).
    assert tensors["token_embd.weight"] == (128, n_vocab)
    assert tensors["blk.1.attn_k.weight"] == (128, 64)
    assert tensors["blk.0.ffn_down.weight"] == (256, 128)
    assert len(tensors) == 2 + 2 * 9 + 1


def test_shape_rejects_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="heads"):
        ModelShape(hidden=100, heads=3)
