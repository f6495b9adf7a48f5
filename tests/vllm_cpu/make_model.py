"""A small Llama-architecture Hugging Face model with random weights, for serving vLLM in tests.

Serving latency depends on a model's shapes (layers, widths, vocabulary size), not on its
weight values, so a model written here from a seed loads and serves like a real one of the
same size: output text is random, and `ignore_eos` fixes output lengths. Nothing is
downloaded (vLLM loads it with HF_HUB_OFFLINE=1).

The tokenizer is word-level (a `tokenizers` WordLevel model with a whitespace/punctuation
pre-tokenizer, saved through `PreTrainedTokenizerFast`): every word of the vocabulary is one
token, anything else one `<unk>`, and `<s>` is put in front of every prompt, as Llama's
tokenizer does. The vocabulary holds the words the fuzzer builds prompts from (`WORDS` of
the fuzzer's prompt builder, read from its source, plus any `--extra-words`), so a prompt of N words is
N + 1 tokens and /tokenize counts exactly. The chat template is ChatML
(`<|im_start|>role\\n...<|im_end|>\\n`), its markers are special tokens.

This runs with the python of the vLLM venv (it needs torch and transformers, which the
project's own venv does not have):

    ~/.cache/fuzzer/vllm/<version>-py3.11/venv/bin/python tests/vllm_cpu/make_model.py /tmp/tiny --seed 0
"""

from __future__ import annotations

import argparse
import ast
import json
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["ModelShape", "build_vocab", "write_model"]

SPECIAL = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
UNK, BOS, EOS, IM_START, IM_END = range(len(SPECIAL))

# The fuzzer's prompt builder: every word it draws must be one token here. This script runs in
# the vLLM venv, where the fuzzer is not importable, so the WORDS literal is read from its source.
PROMPTS_SOURCE = Path(__file__).resolve().parents[2] / "fuzzer" / "execute" / "prompts.py"


def fuzzer_words(source: Path = PROMPTS_SOURCE) -> list[str]:
    """The words of the string literal assigned to ``WORDS`` in the fuzzer's prompt builder."""
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "WORDS" for t in node.targets):
            text = next((n.value for n in ast.walk(node.value) if isinstance(n, ast.Constant)
                         and isinstance(n.value, str)), None)
            if text:
                return text.split()
    raise RuntimeError(f"no WORDS string literal in {source}")


# Words of the chat roles and of the fuzzer's domain, then single letters, digits and punctuation.
_MORE_WORDS = (
    "system user assistant tool prompt token tokens request requests server latency queue slot batch "
    "cache model decode prefill stream short fuzz trace random text river music book north south "
    "east west low hello world"
).split()
_CHARS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)] + list(".,;:!?'\"()-_/[]{}<>|=+*#@$%&~`^\\")

MIN_VOCAB = 1024
VOCAB_MULTIPLE = 64
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that set a model's cost per token."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4  # head dim 64
    kv_heads: int = 2
    ffn: int = 512
    context: int = 16384


def build_vocab(extra_words: tuple[str, ...] = ()) -> list[str]:
    """Special tokens, then every word once (first occurrence wins), in a fixed order.

    Filler words ("w0001", ...) pad it to a multiple of VOCAB_MULTIPLE, which also makes a
    random model's draw of a special token (empty text in a stream) rarer.
    """
    vocab: list[str] = list(SPECIAL)
    seen = set(vocab)
    for word in [*fuzzer_words(), *_MORE_WORDS, *extra_words, *_CHARS]:
        if word and word not in seen:
            seen.add(word)
            vocab.append(word)
    filler = 0
    while len(vocab) < MIN_VOCAB or len(vocab) % VOCAB_MULTIPLE:
        filler += 1
        if f"w{filler:04d}" not in seen:
            vocab.append(f"w{filler:04d}")
    return vocab


def write_model(out: Path | str, *, seed: int = 0, shape: ModelShape = ModelShape(),
                extra_words: tuple[str, ...] = ()) -> Path:
    """Write config, bfloat16 safetensors weights and tokenizer into the folder `out`; return it.

    The same seed, shape and words give the same weights and vocabulary.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_vocab(tuple(extra_words))

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>", pad_token="</s>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=shape.context,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.context,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.02,
        bos_token_id=BOS,
        eos_token_id=IM_END,
        pad_token_id=EOS,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "fuzzer_model.json").write_text(
        json.dumps({"seed": seed, "shape": asdict(shape), "vocab_size": len(vocab)}, indent=1) + "\n"
    )
    return out


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to write the model into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extra-words", type=Path, help="a file of more vocabulary words, whitespace-separated")
    args = parser.parse_args()
    extra = tuple(args.extra_words.read_text().split()) if args.extra_words else ()
    write_model(args.out, seed=args.seed, extra_words=extra)
    print(args.out)


if __name__ == "__main__":
    _main()
