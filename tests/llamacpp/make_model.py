"""A small llama-architecture GGUF with random weights, for serving llama-server in tests.

Serving latency depends on a model's shapes (layers, widths, vocabulary size), not on its
weight values, so a model written here from a seed loads and serves like a real one of the
same size: output text is random, and `ignore_eos` fixes output lengths. Nothing is
downloaded. The vocabulary is SentencePiece-style ("llama" tokenizer model): control
tokens, the 256 byte-fallback tokens `<0x00>`..`<0xFF>`, and word pieces with scores, so
any UTF-8 text tokenizes.

Usage as a script (for benchmarks or a manual server):

    .venv/bin/python tests/llamacpp/make_model.py /tmp/tiny.gguf --seed 0
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

__all__ = ["ModelShape", "Vocab", "build_vocab", "write_model"]

# Word pieces come from these words (and every contiguous piece of "▁word"), so common
# English text tokenizes into a mix of whole words and fragments, as with a real SPM model;
# anything else falls back to bytes.
_WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which "
    "this be or has had not but first one their its new after who they have two been also "
    "more time year she would can about other when into all over there during only most "
    "some world up out used such many then these three may state city school later made "
    "under known between both part while since people house team season war being game "
    "film work well through where several however long group number second each same "
    "until because life old water light prompt token request server latency queue slot "
    "batch cache model decode prefill stream short fuzz trace random text place small "
    "large high low north south east west day night river music public book open line"
).split()
_SPACE = "\u2581"  # SentencePiece's word-boundary mark "▁"
_CHAT_TEMPLATE = (  # ChatML, so /v1/chat/completions renders messages without guessing
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Random weights this small keep activations bounded through a few layers (as GPT-2's init).
_WEIGHT_STD = 0.02


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that set a model's cost per token."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    ffn: int = 768
    context: int = 16384

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"hidden ({self.hidden}) must divide by heads ({self.heads}) and heads by "
                f"kv_heads ({self.kv_heads})"
            )


@dataclass(frozen=True)
class Vocab:
    """A SentencePiece-style vocabulary: parallel tuples, index = token id."""

    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2


def build_vocab() -> Vocab:
    """The fixed vocabulary: <unk> <s> </s>, 256 byte tokens, then scored word pieces."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    scores = [0.0, 0.0, 0.0]
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        types.append(gguf.TokenType.BYTE)
        scores.append(0.0)
    pieces: set[str] = {_SPACE} | {chr(c) for c in range(33, 127)}
    pieces |= {_SPACE + chr(c) for c in range(ord("a"), ord("z") + 1)}
    for word in _WORDS:
        marked = _SPACE + word
        for start in range(len(marked)):
            for end in range(start + 2, len(marked) + 1):
                pieces.add(marked[start:end])
    # SPM merges the adjacent pair whose piece scores highest: longer pieces win, ties by text.
    for piece in sorted(pieces, key=lambda p: (len(p), p)):
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        scores.append(float(len(piece)))
    return Vocab(tuple(tokens), tuple(scores), tuple(int(t) for t in types))


def write_model(path: Path | str, *, seed: int = 0, shape: ModelShape = ModelShape()) -> Path:
    """Write the random-weight GGUF to `path` (same seed and shape: same bytes) and return it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocab = build_vocab()
    n_vocab = len(vocab.tokens)
    head_dim = shape.hidden // shape.heads
    kv_dim = head_dim * shape.kv_heads

    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_name(f"fuzzer-random-llama-h{shape.hidden}-l{shape.layers}-seed{seed}")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_scores(list(vocab.scores))
    writer.add_token_types(list(vocab.types))
    writer.add_unk_token_id(vocab.unk_id)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    writer.add_chat_template(_CHAT_TEMPLATE)

    def matrix(rows: int, cols: int) -> np.ndarray:
        # numpy (rows, cols) is ggml ne = (cols, rows): cols is the input width.
        return (rng.standard_normal((rows, cols), dtype=np.float32) * _WEIGHT_STD).astype(np.float16)

    def norm() -> np.ndarray:
        return np.ones(shape.hidden, dtype=np.float32)

    writer.add_tensor("token_embd.weight", matrix(n_vocab, shape.hidden))
    for layer in range(shape.layers):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", norm())
        writer.add_tensor(f"{prefix}.attn_q.weight", matrix(shape.hidden, shape.hidden))
        writer.add_tensor(f"{prefix}.attn_k.weight", matrix(kv_dim, shape.hidden))
        writer.add_tensor(f"{prefix}.attn_v.weight", matrix(kv_dim, shape.hidden))
        writer.add_tensor(f"{prefix}.attn_output.weight", matrix(shape.hidden, shape.hidden))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", norm())
        writer.add_tensor(f"{prefix}.ffn_gate.weight", matrix(shape.ffn, shape.hidden))
        writer.add_tensor(f"{prefix}.ffn_up.weight", matrix(shape.ffn, shape.hidden))
        writer.add_tensor(f"{prefix}.ffn_down.weight", matrix(shape.hidden, shape.ffn))
    writer.add_tensor("output_norm.weight", norm())
    writer.add_tensor("output.weight", matrix(n_vocab, shape.hidden))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="where to write the .gguf")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=ModelShape.hidden)
    parser.add_argument("--layers", type=int, default=ModelShape.layers)
    args = parser.parse_args()
    write_model(args.out, seed=args.seed, shape=ModelShape(hidden=args.hidden, layers=args.layers))


if __name__ == "__main__":
    _main()
