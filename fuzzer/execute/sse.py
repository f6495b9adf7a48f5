"""Reading an OpenAI-compatible server-sent-event stream, one network read at a time.

:class:`StreamAccount` is fed raw bytes as they arrive, each read with the clock
reading taken when it arrived; every event in a read gets that time (they arrived
together). It keeps what ARCHITECTURE.md, "Execute" asks of a stream: the first event of any kind,
the first event with non-empty text (a role-only or empty delta is not a token),
every content-bearing event of choice 0, the longest any other choice went without text
once the stream's first token came (``n > 1``), the finish reason, ``usage``, the
``[DONE]`` marker, and the first protocol fault (an unparsable event, a line that
is not SSE, an error object in the stream).
"""

from __future__ import annotations

import json
from typing import Any

from fuzzer.execution import Outcome

_DONE = b"[DONE]"
_SSE_FIELDS = (b"event", b"id", b"retry")
# Text fields of a choice whose non-empty value is a generated token (chat deltas,
# completions text, and the reasoning fields some servers stream separately).
_DELTA_TEXT = ("content", "reasoning_content", "reasoning")
# A detail longer than this is cut: it goes into tables and the database.
_DETAIL_CHARS = 200


class StreamAccount:
    """Everything a stream told the client, with arrival times on the caller's clock."""

    __slots__ = (
        "_buffer",
        "_cr",
        "first_event_t",
        "first_token_t",
        "token_times",
        "choice_gap",
        "choice_gap_end",
        "_choice_last",
        "events",
        "finish_reason",
        "usage",
        "done_t",
        "fault",
        "detail",
    )

    def __init__(self) -> None:
        self._buffer = b""
        self._cr = False
        self.first_event_t: float | None = None
        self.first_token_t: float | None = None
        #: Arrival of every event carrying non-empty text for choice 0.
        self.token_times: list[float] = []
        #: The longest silence of a choice other than 0 (n > 1): from the stream's first token to its first, or
        #: between two of its events; None until such a choice has text.
        self.choice_gap: float | None = None
        #: When that gap ended (the clock ``now`` is on).
        self.choice_gap_end: float | None = None
        self._choice_last: dict[Any, float] = {}
        self.events = 0
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.done_t: float | None = None
        #: The first protocol fault seen (MALFORMED or HTTP_ERROR for an in-stream error object).
        self.fault: Outcome | None = None
        self.detail: str | None = None

    @property
    def finished(self) -> bool:
        """[DONE] arrived or the stream broke: nothing after this matters."""
        return self.done_t is not None or self.fault is not None

    @property
    def tokens(self) -> int:
        """Content-bearing events of choice 0 so far (an event may carry several tokens)."""
        return len(self.token_times)

    def feed(self, data: bytes, now: float) -> None:
        if self.finished:
            return
        if b"\r" in data or self._cr:
            self._cr = True
            data = self._buffer + data
            # Keep a trailing CR: its LF may come in the next read.
            hold = data.endswith(b"\r")
            if hold:
                data = data[:-1]
            self._buffer = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + (b"\r" if hold else b"")
        else:
            self._buffer = self._buffer + data if self._buffer else data
        buffer, pos = self._buffer, 0
        while not self.finished:
            end = buffer.find(b"\n\n", pos)
            if end < 0:
                break
            block = buffer[pos:end]
            pos = end + 2
            self._event(block, now)
        self._buffer = buffer[pos:] if pos else buffer

    def _event(self, block: bytes, now: float) -> None:
        if block[:6] == b"data: " and b"\n" not in block:  # the usual event: one data line
            self._payload(block[6:], now)
            return
        data_lines = []
        for line in block.split(b"\n"):
            if not line or line[:1] == b":":
                continue
            name, sep, value = line.partition(b":")
            if name == b"data":
                data_lines.append(value[1:] if value[:1] == b" " else value)
            elif name not in _SSE_FIELDS:
                self._fail(Outcome.MALFORMED, f"not an SSE line: {line[:80]!r}")
                return
        if data_lines:
            self._payload(b"\n".join(data_lines), now)

    def _payload(self, payload: bytes, now: float) -> None:
        if self.first_event_t is None:
            self.first_event_t = now
        self.events += 1
        if payload.strip() == _DONE:
            self.done_t = now
            return
        try:
            event = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            self._fail(Outcome.MALFORMED, f"event is not JSON: {payload[:80]!r}")
            return
        if not isinstance(event, dict):
            self._fail(Outcome.MALFORMED, f"event is not a JSON object: {payload[:80]!r}")
            return
        if "error" in event or event.get("object") == "error":
            error = event.get("error", event)
            message = error.get("message") if isinstance(error, dict) else error
            self._fail(Outcome.HTTP_ERROR, f"error event in stream: {message}")
            return
        usage = event.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = event.get("choices")
        if choices is None:
            return
        if not isinstance(choices, list):
            self._fail(Outcome.MALFORMED, f"choices is not a list: {payload[:80]!r}")
            return
        for choice in choices:
            if not isinstance(choice, dict):
                self._fail(Outcome.MALFORMED, f"a choice is not an object: {payload[:80]!r}")
                return
            index = choice.get("index", 0)
            if _has_text(choice):
                if self.first_token_t is None:
                    self.first_token_t = now
                if index == 0:
                    self.token_times.append(now)
                else:
                    gap = now - self._choice_last.get(index, self.first_token_t)
                    if self.choice_gap is None or gap > self.choice_gap:
                        self.choice_gap, self.choice_gap_end = gap, now
                    self._choice_last[index] = now
            reason = choice.get("finish_reason")
            if reason and index == 0:
                self.finish_reason = str(reason)

    def _fail(self, outcome: Outcome, detail: str) -> None:
        self.fault = outcome
        self.detail = detail[:_DETAIL_CHARS]


def _has_text(choice: dict[str, Any]) -> bool:
    text = choice.get("text")
    if isinstance(text, str) and text:
        return True
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return any(isinstance(delta.get(k), str) and delta[k] for k in _DELTA_TEXT)
    return False


def usage_counts(usage: Any) -> tuple[int | None, int | None, int | None]:
    """(prompt_tokens, completion_tokens, cached_tokens) from a usage object, None where absent."""
    if not isinstance(usage, dict):
        return None, None, None

    def num(value: Any) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    details = usage.get("prompt_tokens_details")
    cached = num(details.get("cached_tokens")) if isinstance(details, dict) else None
    return num(usage.get("prompt_tokens")), num(usage.get("completion_tokens")), cached


def short(detail: str | bytes) -> str:
    """A failure detail short enough for a table cell."""
    if isinstance(detail, bytes):
        detail = detail.decode("utf-8", "replace")
    detail = " ".join(detail.split())
    return detail[:_DETAIL_CHARS]
