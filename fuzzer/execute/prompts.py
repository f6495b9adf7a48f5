"""Prompts of exact token length, salted per execution (ARCHITECTURE.md, "Traces").

Client tokenizers drift from the server's (up to 5x), so lengths are fitted with
the server's own count: a :class:`TokenCounter` answers "how many prompt tokens is
this text", through the server's /tokenize (:class:`ServerCounter`) or, where
there is none, through a linear model calibrated once from ``usage.prompt_tokens``
(:class:`CalibratedCounter`; the executor then checks every answer's usage and
records a mismatch as a harness warning).

Text is a sequence of common English words drawn from an injected
``random.Random``: every execution draws fresh words, so no prefix-cache state
leaks between executions, while requests of one shared-prefix group start with
the very same prefix text (fitted to the group's token count) and then diverge.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Protocol

import aiohttp

from fuzzer.errors import TargetError
from fuzzer.execute import scope
from fuzzer.execute.adapters import Adapter
from fuzzer.trace import Request, Trace

# Words most BPE and SentencePiece vocabularies hold as one token with a leading
# space, so a word is about one token everywhere and the fit converges fast.
WORDS = tuple(
    """the of and to in is was for that with as on by at from his her are were this which be or
    have had not but they you all one an their there been has when who will more no if out so
    said what up its about into than them can only other new some could time these two may then
    do first any my now such like our over man me even most made after also did many before must
    through back years where much your way well down should because each just those people how
    too little state good very make world still own see men work long get here between both life
    being under never day same another know while last might us great old year off come since
    against go came right used take three states himself few house use during without again place
    around however home small found thought went say part once general high upon school every
    does got united left number course war until always away something fact though water less
    public put think almost hand enough far took head yet government system better set told
    nothing night end why called eyes find going look asked later knew point next program city
    business give group toward young days let room president side social given present several
    order national possible rather second face per among form important often things looking
    early white case john become large big need four within felt along children saw best church
    ever least power development light thing seemed family interest want members mind country
    area others done turned although open god service certain kind problem began different door
    thus help sense means whole matter perhaps itself york times law human line above name example
    action company hands local show whether five history gave today either act feet across taken
    past quite anything seen having death week experience body word half really field am car words
    already themselves information tell together college shall money period held keep sure free""".split()
)

#: How many times the fit asks the counter before it settles for the closest length.
MAX_FIT_ROUNDS = 6
# Where whole words jump past the target (a vocabulary that splits words into several
# pieces, like a small SentencePiece model), the text is topped up with this word: one
# token after a space in every BPE and SentencePiece vocabulary met so far.
PAD_WORD = "the"
# Top-up attempts: the second corrects a pad that merged with the text before it.
PAD_ROUNDS = 2
# Tokenize calls in flight at once: enough to hide loopback latency, few enough not
# to load the server's frontend right before an execution.
TOKENIZE_CONCURRENCY = 16
# Sizes (in words) of the two texts that estimate tokens per word and fixed overhead.
_PROBE_WORDS = (16, 64)


class TokenCounter(Protocol):
    """Counts the prompt tokens the server will see for a text."""

    #: True when the count comes from the server's tokenizer, not from a model.
    exact: bool

    async def count(self, text: str, *, chat: bool = False) -> int: ...


class ServerCounter:
    """Counts with the server's tokenize endpoint (see :class:`fuzzer.execute.adapters.Adapter`).

    For a chat prompt on a server whose tokenize cannot apply the chat template,
    adds ``chat_overhead`` (the template's tokens, calibrated from usage).
    """

    exact = True

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        adapter: Adapter,
        model: str | None,
        *,
        headers: Mapping[str, str],
        chat_overhead: int = 0,
        timeout_s: float = 30.0,
    ):
        if not (adapter.tokenize_path and adapter.tokenize_body and adapter.tokenize_count):
            raise TargetError(f"a {adapter.kind} server has no tokenize endpoint")
        self._session = session
        self._base_url = base_url
        self._url = base_url + adapter.tokenize_path
        self._adapter = adapter
        self._model = model
        self._headers = dict(headers)
        self.chat_overhead = chat_overhead
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    @property
    def templates_chat(self) -> bool:
        """True when a chat prompt is counted exactly (the tokenize endpoint or a template endpoint renders it)."""
        return (
            self._adapter.tokenize_body("x", self._model, True) is not None  # type: ignore[misc]
            or self._adapter.template_path is not None
        )

    async def count(self, text: str, *, chat: bool = False) -> int:
        body = self._adapter.tokenize_body(text, self._model, chat)  # type: ignore[misc]
        extra = 0
        if body is None and chat and self._adapter.template_path is not None:
            # Render the messages with the server's own template, then count the rendered text.
            rendered = await self._post(
                self._base_url + self._adapter.template_path, {"messages": [{"role": "user", "content": text}]}
            )
            if not isinstance(rendered, dict) or not isinstance(rendered.get("prompt"), str):
                raise TargetError(f"the {self._adapter.template_path} answer has no prompt text: {str(rendered)[:80]}")
            body = self._adapter.tokenize_body(rendered["prompt"], self._model, False)  # type: ignore[misc]
        elif body is None:
            body = self._adapter.tokenize_body(text, self._model, False)  # type: ignore[misc]
            extra = self.chat_overhead
        answer = await self._post(self._url, body)
        return self._adapter.tokenize_count(answer) + extra  # type: ignore[misc]

    async def _post(self, url: str, body: Any) -> Any:
        try:
            async with self._session.post(url, json=body, headers=self._headers, timeout=self._timeout) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise TargetError(f"POST {url} answered HTTP {resp.status}: {raw[:160]!r}")
                return await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise TargetError(f"POST {url} failed: {e.__class__.__name__}: {e}") from None


@dataclass
class CalibratedCounter:
    """tokens = overhead + per_word x words (+ chat_overhead for chat): the fallback without /tokenize."""

    per_word: float = 1.0
    overhead: float = 0.0
    chat_overhead: int = 0
    exact = False

    async def count(self, text: str, *, chat: bool = False) -> int:
        words = len(text.split())
        return round(self.overhead + self.per_word * words) + (self.chat_overhead if chat else 0)


#: Sends a prompt with max_tokens=1 and returns the server's usage.prompt_tokens (None if absent).
Measure = Callable[[str, bool], Awaitable[int | None]]


async def fit_counter(measure: Measure, rng: random.Random) -> CalibratedCounter:
    """Fit tokens per word and the fixed overhead (BOS, template) from two usage answers."""
    small, large = (_words(rng, n) for n in _PROBE_WORDS)
    c_small = await measure(" ".join(small), False)
    c_large = await measure(" ".join(large), False)
    if c_small is None or c_large is None or c_large <= c_small:
        raise TargetError("the server reports no usage.prompt_tokens, so prompt lengths cannot be calibrated")
    per_word = (c_large - c_small) / (len(large) - len(small))
    overhead = c_small - per_word * len(small)
    c_chat = await measure(" ".join(small), True)
    chat_overhead = 0 if c_chat is None else c_chat - c_small
    return CalibratedCounter(per_word=per_word, overhead=overhead, chat_overhead=chat_overhead)


async def chat_overhead(measure: Measure, counter: TokenCounter, rng: random.Random) -> int:
    """Tokens a chat template adds: chat usage minus the counter's count of the bare text."""
    text = " ".join(_words(rng, _PROBE_WORDS[0]))
    chat = await measure(text, True)
    if chat is None:
        return 0
    return chat - await counter.count(text, chat=False)


@dataclass(frozen=True)
class Prompt:
    text: str
    #: The trace's prompt_tokens.
    target_tokens: int
    #: The counter's answer for ``text`` (equal to target_tokens unless the fit failed).
    counted_tokens: int
    #: Characters of ``text`` that belong to the shared prefix (0 without one).
    prefix_chars: int = 0


@dataclass(frozen=True)
class PromptSet:
    prompts: Mapping[str, Prompt]
    #: True when every count came from the server's tokenizer.
    exact: bool
    warnings: tuple[str, ...] = ()


async def build(trace: Trace, counter: TokenCounter, rng: random.Random) -> PromptSet:
    """One prompt per request, fitted to its prompt_tokens, with fresh words from ``rng``.

    Every word is drawn before the first count is asked, so the texts depend only on
    the rng state, never on the order tokenize answers arrive in.
    """
    fitter = _Fitter(counter)
    group_words = {name: _words(rng, tokens + _SPARE_WORDS) for name, tokens in trace.prefixes.items()}
    private_words = {
        r.id: _words(rng, r.prompt_tokens - trace.prefix_tokens(r) + _SPARE_WORDS) for r in trace.requests
    }
    await fitter.estimate(rng)
    used = sorted({r.prefix for r in trace.requests if r.prefix})
    fitted = await scope.run_all(*(fitter.fit("", 0, group_words[g], trace.prefixes[g], chat=False) for g in used))
    prefix_text = {g: text for g, (text, _) in zip(used, fitted)}
    prefix_count = {g: count for g, (_, count) in zip(used, fitted)}
    warnings = [
        f"prefix {g}: built {count} tokens, not {trace.prefixes[g]} (the tokenizer merges words)"
        for g, (_, count) in zip(used, fitted)
        if count != trace.prefixes[g]
    ]

    async def one(r: Request) -> Prompt:
        head = prefix_text[r.prefix] if r.prefix else ""
        head_tokens = prefix_count[r.prefix] if r.prefix else 0
        if r.prefix and r.prompt_tokens == head_tokens and r.api == "completions":
            return Prompt(head, r.prompt_tokens, head_tokens, len(head))
        text, count = await fitter.fit(head, head_tokens, private_words[r.id], r.prompt_tokens, chat=r.api == "chat")
        return Prompt(text, r.prompt_tokens, count, len(head))

    built = await scope.run_all(*(one(r) for r in trace.requests))
    for r, p in zip(trace.requests, built):
        if p.counted_tokens != p.target_tokens:
            warnings.append(f"{r.id}: built a {p.counted_tokens}-token prompt, not {p.target_tokens}")
    return PromptSet({r.id: p for r, p in zip(trace.requests, built)}, exact=counter.exact, warnings=tuple(warnings))


# Extra words drawn beyond the token target, for tokenizers that make some words
# shorter than one token (rare) so the fit can add words without drawing again.
_SPARE_WORDS = 32


def _words(rng: random.Random, n: int) -> list[str]:
    return [WORDS[rng.randrange(len(WORDS))] for _ in range(max(0, n))]


class _Fitter:
    """Finds how many words of a list make a text of exactly the target token count."""

    def __init__(self, counter: TokenCounter):
        self._counter = counter
        self._limit = asyncio.Semaphore(TOKENIZE_CONCURRENCY)
        self.per_word = 1.0
        self.overhead = 0.0

    async def count(self, text: str, *, chat: bool) -> int:
        async with self._limit:
            return await self._counter.count(text, chat=chat)

    async def estimate(self, rng: random.Random) -> None:
        small, large = (_words(rng, n) for n in _PROBE_WORDS)
        c_small = await self.count(" ".join(small), chat=False)
        c_large = await self.count(" ".join(large), chat=False)
        if c_large > c_small:
            self.per_word = (c_large - c_small) / (len(large) - len(small))
            self.overhead = c_small - self.per_word * len(small)

    async def fit(self, head: str, head_tokens: int, words: list[str], target: int, *, chat: bool) -> tuple[str, int]:
        """(text, count): head plus the first k words, k fitted so count == target if it can be."""

        def text(k: int) -> str:
            tail = " ".join(words[:k])
            return f"{head} {tail}" if head and tail else head or tail

        base = head_tokens if head else self.overhead
        k = round((target - base) / self.per_word)
        best: tuple[int, str, int] | None = None
        tried: dict[int, int] = {}
        for _ in range(MAX_FIT_ROUNDS):
            k = min(max(k, 0), len(words))
            if k in tried:
                break
            candidate = text(k)
            c = await self.count(candidate, chat=chat)
            tried[k] = c
            if best is None or abs(c - target) < abs(best[2] - target):
                best = (k, candidate, c)
            if c == target:
                break
            step = (target - c) / self.per_word
            k += int(step) if abs(step) >= 1 else (1 if step > 0 else -1)
        assert best is not None
        if best[2] != target:
            under = [(kk, c) for kk, c in tried.items() if c < target]
            if under:
                # Word counts jump by more than one token (words of several pieces): top the
                # longest text below the target up with PAD_WORD, one token per repetition.
                kk, c = max(under, key=lambda item: item[1])
                padded = text(kk)
                for _ in range(PAD_ROUNDS):
                    padded = (padded + " " if padded else "") + " ".join([PAD_WORD] * (target - c))
                    c = await self.count(padded, chat=chat)
                    if abs(c - target) < abs(best[2] - target):
                        best = (kk, padded, c)
                    if c >= target:
                        break
        return best[1], best[2]
