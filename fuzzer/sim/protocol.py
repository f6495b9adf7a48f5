"""vLLM's OpenAI-compatible wire format: request parsing and response bodies.

Request bodies are checked the way vLLM checks them; a bad one raises
:class:`BadRequest`, which the front end answers with vLLM's error JSON
(``{"error": {"message", "type", "param", "code"}}``). Response builders make
the chunk and body shapes of ARCHITECTURE.md, "Engines": ``text_completion`` chunks,
``chat.completion.chunk`` chunks with a role-only first chunk, ``finish_reason``
on the last content chunk, a usage chunk with ``choices: []``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fuzzer.sim.config import SimConfig
from fuzzer.sim.tokenizer import Tokenizer, output_text

#: vLLM's default --max-logprobs; more is a 400.
MAX_LOGPROBS = 20
#: A bound on n that keeps one request's KV inside the simulated cache (vLLM has none of its own).
MAX_N = 16
#: The seeds vLLM takes (a signed 64-bit integer).
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 63) - 1


class BadRequest(Exception):
    """A request vLLM would refuse; carries the HTTP status and vLLM's error type."""

    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class Generation:
    """A checked completion or chat request."""

    api: str  # "completions" | "chat"
    prompt_ids: tuple[int, ...]
    max_tokens: int
    n: int
    stream: bool
    include_usage: bool
    #: Top logprobs per token, None when not asked (chat: top_logprobs when logprobs is true).
    logprobs: int | None
    ignore_eos: bool
    min_tokens: int
    stop: tuple[str, ...]
    #: Sampling temperature (OpenAI's default 1.0 when absent; 0: greedy).
    temperature: float = 1.0
    #: The per-request sampling seed, None when not asked.
    seed: int | None = None


def parse_generation(api: str, body: Any, config: SimConfig, tokenizer: Tokenizer) -> Generation:
    """Check a /v1/completions or /v1/chat/completions body; raises :class:`BadRequest`."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != config.model_name:
        raise BadRequest(f"The model `{model}` does not exist.", status=404, kind="NotFoundError", param="model")

    if api == "chat":
        messages = body.get("messages")
        _check_messages(messages)
        prompt_ids = tuple(tokenizer.encode(tokenizer.apply_chat_template(messages)))
    else:
        prompt_ids = _prompt_ids(body.get("prompt"), tokenizer)
    if not prompt_ids:
        raise BadRequest("The prompt cannot be empty.", param="prompt")

    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not stream:
            raise BadRequest("Stream options can only be defined when `stream=True`.", param="stream_options")
        if not isinstance(stream_options, dict):
            raise BadRequest("stream_options must be an object", param="stream_options")
    include_usage = bool(stream_options and stream_options.get("include_usage"))

    limit = config.max_model_len - len(prompt_ids)
    key = "max_completion_tokens" if api == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = max(limit, 0)
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise BadRequest(f"{key} must be at least 1, got {max_tokens}.", param=key)
    if len(prompt_ids) + max_tokens > config.max_model_len or max_tokens < 1:
        raise BadRequest(
            f"This model's maximum context length is {config.max_model_len} tokens. However, you requested "
            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the messages, {max_tokens} in the "
            f"completion). Please reduce the length of the messages or completion.",
            param=key,
        )

    n = body.get("n", 1)
    if n is None:
        n = 1
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be an integer between 1 and {MAX_N}, got {n}.", param="n")

    logprobs = _logprobs(api, body)
    temperature = body.get("temperature", 1.0)
    if temperature is not None and (not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0):
        raise BadRequest(f"temperature must be non-negative, got {temperature}.", param="temperature")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not MIN_SEED <= seed <= MAX_SEED):
        raise BadRequest(f"seed must be an integer between {MIN_SEED} and {MAX_SEED}, got {seed}.", param="seed")
    min_tokens = body.get("min_tokens", 0) or 0
    if not _is_int(min_tokens) or min_tokens < 0 or min_tokens > max_tokens:
        raise BadRequest(f"min_tokens must be between 0 and max_tokens={max_tokens}, got {min_tokens}.", param="min_tokens")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(s for s in stop if s)
    else:
        raise BadRequest("stop must be a string or a list of strings", param="stop")

    return Generation(
        api=api,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        n=n,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        ignore_eos=_bool(body, "ignore_eos", False),
        min_tokens=min_tokens,
        stop=stops,
        temperature=1.0 if temperature is None else float(temperature),
        seed=seed,
    )


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string role", param="messages")
        if not isinstance(m.get("content"), (str, list)):
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts", param="messages")


def _prompt_ids(prompt: Any, tokenizer: Tokenizer) -> tuple[int, ...]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tuple(tokenizer.encode(prompt))
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("this server accepts one prompt per request (a string or a list of token ids)", param="prompt")
    raise BadRequest("prompt must be a string or a list of token ids", param="prompt")


def _logprobs(api: str, body: dict) -> int | None:
    if api == "chat":
        if not _bool(body, "logprobs", False):
            if body.get("top_logprobs"):
                raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
            return None
        top = body.get("top_logprobs") or 0
        if not _is_int(top) or not 0 <= top <= MAX_LOGPROBS:
            raise BadRequest(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {top}.", param="top_logprobs")
        return max(top, 1)
    value = body.get("logprobs")
    if value is None:
        return None
    if not _is_int(value) or value < 0:
        raise BadRequest(f"logprobs must be a non-negative integer, got {value}.", param="logprobs")
    if value > MAX_LOGPROBS:
        raise BadRequest(f"Requested sample logprobs of {value}, which is greater than max allowed: {MAX_LOGPROBS}", param="logprobs")
    return max(value, 1)


def _bool(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false", param=key)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --- responses -------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def token_logprobs(api: str, token: int, top: int, offset: int) -> dict[str, Any]:
    """Made-up but well-formed logprobs of one generated token."""
    text = output_text(token)
    alternatives = [(text, -0.05)] + [(f" alt{k}", -1.0 - k) for k in range(1, top)]
    if api == "chat":
        return {
            "content": [
                {
                    "token": text,
                    "logprob": -0.05,
                    "bytes": list(text.encode()),
                    "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in alternatives],
                }
            ]
        }
    return {
        "text_offset": [offset],
        "token_logprobs": [-0.05],
        "tokens": [text],
        "top_logprobs": [dict(alternatives)],
    }


def merge_logprobs(api: str, parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Join per-token logprobs into one non-streaming choice's logprobs."""
    if not parts:
        return None
    if api == "chat":
        return {"content": [item for p in parts for item in p["content"]]}
    out: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for p in parts:
        for key in out:
            out[key].extend(p[key])
    return out


def stream_choice(api: str, index: int, text: str | None, finish_reason: str | None, logprobs: Any, role: bool = False) -> dict:
    if api == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": None}


def chunk(api: str, rid: str, created: int, model: str, choices: list[dict], usage_info: dict | None = None) -> dict:
    body = {
        "id": rid,
        "object": "chat.completion.chunk" if api == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage_info is not None:
        body["usage"] = usage_info
    return body


def full_response(
    api: str, rid: str, created: int, model: str, texts: list[str], finish_reason: str | None,
    logprobs: list[dict | None], usage_info: dict,
) -> dict:
    choices = []
    for i, text in enumerate(texts):
        if api == "chat":
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text, "tool_calls": []},
                    "logprobs": logprobs[i],
                    "finish_reason": finish_reason,
                    "stop_reason": None,
                }
            )
        else:
            choices.append(
                {"index": i, "text": text, "logprobs": logprobs[i], "finish_reason": finish_reason, "stop_reason": None}
            )
    return {
        "id": rid,
        "object": "chat.completion" if api == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_info,
    }
