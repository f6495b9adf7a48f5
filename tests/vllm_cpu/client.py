"""A tiny streaming client for measuring scheduling order on a real server, independent of the fuzzer.

Each request is sent from a thread of its own at its offset from a common start, as a
streamed /v1/completions with ``ignore_eos``; the time of every SSE event that carries text
is recorded. Prompts are built from words that are each one token of the test model's
vocabulary (plus ``<s>``), so a prompt of N tokens is N - 1 words.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from dataclasses import dataclass, field

# Words of the test model's vocabulary (tests/vllm_cpu/make_model.py), one token each.
WORDS = tuple(
    "the of and to in is was for that with as on by at from his her are were this which be or have had not "
    "but they you all one an their there been has when who will more no if out so said what up its about".split()
)


def prompt(tokens: int, rng: random.Random, prefix: str = "") -> str:
    """A prompt of exactly ``tokens`` tokens (``<s>`` included), starting with ``prefix`` (whole words)."""
    head = prefix.split()
    if len(head) + 1 > tokens:
        raise ValueError(f"a {tokens}-token prompt cannot hold a {len(head)}-word prefix")
    return " ".join(head + [rng.choice(WORDS) for _ in range(tokens - 1 - len(head))])


@dataclass
class Sent:
    name: str
    at_s: float
    prompt: str
    max_tokens: int
    sent_s: float | None = None
    token_s: list[float] = field(default_factory=list)
    usage: dict | None = None
    error: str | None = None

    @property
    def first_s(self) -> float:
        """When the first token arrived (from the common start)."""
        if not self.token_s:
            raise AssertionError(f"{self.name} got no token: {self.error}")
        return self.token_s[0]

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_s, self.token_s[1:])]


def _stream(base_url: str, model: str, item: Sent, t0: float, timeout_s: float) -> None:
    delay = t0 + item.at_s - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    body = {"model": model, "prompt": item.prompt, "max_tokens": item.max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    request = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    item.sent_s = time.perf_counter() - t0
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            for line in response:
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter() - t0
                event = json.loads(line[6:])
                if event.get("usage"):
                    item.usage = event["usage"]
                if any(c.get("text") for c in event.get("choices") or ()):
                    item.token_s.append(now)
    except Exception as exc:  # recorded; the test's assertions say what was missing
        item.error = repr(exc)


def run(base_url: str, model: str, requests: list[Sent], *, timeout_s: float = 300.0) -> dict[str, Sent]:
    """Send ``requests`` open-loop at their offsets; return them by name once all have finished."""
    t0 = time.perf_counter() + 0.05
    threads = [threading.Thread(target=_stream, args=(base_url, model, r, t0, timeout_s), daemon=True)
               for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    return {r.name: r for r in requests}
