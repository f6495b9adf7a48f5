"""A deterministic word-level tokenizer: one token per whitespace-separated word.

Token ids do not depend on the process or on the order words were seen: a word
of the built-in vocabulary has its index as id, any other word an id derived
from a stable hash of its text. So equal text gives equal ids (prefix caching
works on real prompt text) and a client can build a prompt of an exact token
count by counting words, or check it with ``/tokenize``.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Mapping, Sequence

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "te", "vo", "zi", "pa", "do", "fe", "gu", "hi", "ju", "bo")
#: 16^3 three-syllable words: a vocabulary large enough that generated text does not look periodic.
VOCAB: tuple[str, ...] = tuple(a + b + c for a in _SYLLABLES for b in _SYLLABLES for c in _SYLLABLES)
_INDEX = {w: i for i, w in enumerate(VOCAB)}
#: Ids of words outside the vocabulary live above it, in a 2^30-wide hashed range.
_HASHED_RANGE = 1 << 30
#: Unknown words remembered for /detokenize; beyond this many, new ones decode as "<unk>"
#: (fuzzing salts every prompt, so the table would otherwise grow without bound).
MAX_REMEMBERED_WORDS = 200_000
UNKNOWN = "<unk>"

#: Chat template markers (ChatML, as Qwen2.5 uses); each is one token.
_IM_START = "<|im_start|>"
_IM_END = "<|im_end|>"


class Tokenizer:
    """Word-level tokenizer with a stable id for every word."""

    def __init__(self) -> None:
        self._seen: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        return [self._id(word) for word in text.split()]

    def count(self, text: str) -> int:
        return len(text.split())

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(self._word(i) for i in ids)

    def apply_chat_template(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True) -> str:
        """ChatML text of a conversation; the caller has checked the message shapes."""
        parts = []
        for m in messages:
            parts.append(f"{_IM_START} {m['role']} {_content_text(m.get('content'))} {_IM_END}")
        if add_generation_prompt:
            parts.append(f"{_IM_START} assistant")
        return " ".join(parts)

    def _id(self, word: str) -> int:
        index = _INDEX.get(word)
        if index is not None:
            return index
        digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
        token = len(VOCAB) + int.from_bytes(digest, "little") % _HASHED_RANGE
        if token not in self._seen and len(self._seen) < MAX_REMEMBERED_WORDS:
            self._seen[token] = word
        return token

    def _word(self, token: int) -> str:
        if 0 <= token < len(VOCAB):
            return VOCAB[token]
        return self._seen.get(token, UNKNOWN)


def _content_text(content: object) -> str:
    """Message content: a string, or OpenAI's list of parts (text parts are joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def output_token(request_key: int, choice: int, index: int) -> int:
    """The id of generated token ``index`` of a choice: deterministic, varied, in the vocabulary."""
    return (request_key * 31 + choice * 977 + index * 7919) % len(VOCAB)


def output_text(token: int) -> str:
    """Streamed text of a generated token (a leading space, as BPE tokenizers emit words)."""
    return " " + VOCAB[token]
