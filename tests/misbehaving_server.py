"""A small vLLM-shaped test server on 127.0.0.1 that misbehaves on request.

The behaviour of a completion request is chosen by the start of its trace request
id (the X-Request-Id header is ``<id>-<suffix>``), up to the first ``_``:

    ok        a correct stream / body (the default for any other id)
    e500      HTTP 500            e400     HTTP 400
    reset     a few tokens, then the TCP connection is aborted
    hang      headers, then nothing (the client's timeout must fire)
    malformed a token, then ``data: {not json``
    notsse    a line that is not SSE
    nodone    a correct stream that ends without ``data: [DONE]``
    short     usage reports fewer completion tokens than max_tokens
    slow      tokens 80 ms apart
    errevent  an in-stream error object, then [DONE]
    dies      an in-stream error object, then the server stops listening and drops every
              connection (vLLM's API server once its engine died)

Tokenizer: one token per whitespace-separated word plus one BOS token; a chat
template adds CHAT_TEMPLATE_TOKENS. /metrics exports vLLM gauge names for the
requests in flight. Every request is logged with server-side perf_counter times
(arrival, first token written, end) and whether the client went away (abort).
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from aiohttp import web

CHAT_TEMPLATE_TOKENS = 5
MODEL = "test-model"


@dataclass
class Logged:
    x_request_id: str
    arrival_t: float
    body: dict
    first_token_t: float | None = None
    end_t: float | None = None
    aborted: bool = False
    authorization: str | None = None


@dataclass
class ServerState:
    token_delay_s: float = 0.002
    ttft_s: float = 0.005
    log: dict[str, Logged] = field(default_factory=dict)
    running: int = 0
    #: Add this much to running (a leak the idle check must see).
    stuck: int = 0
    #: A request still counts as running this long after it ended (a server slow to free it).
    linger_s: float = 0.0
    tokenize_calls: int = 0
    #: Stops the server listening and drops its connections but the one given (set by ``running``).
    go_down: Callable[[Any], Awaitable[None]] | None = None
    #: (num_gpu_blocks, block_size) for a vllm:cache_config_info line; None: no such line.
    kv_config: tuple[int, int] | None = None
    #: The vllm:kv_cache_usage_perc reported (0-1); None: no such line.
    kv_usage: float | None = None
    #: Each request that ends leaves this much of the KV cache in use (blocks it does not give back) ...
    kv_left_by_request: float = 0.0
    #: ... for this long; None: for good.
    kv_left_s: float | None = None

    def leave_kv(self) -> None:
        if not self.kv_left_by_request or self.kv_usage is None:
            return
        self.kv_usage += self.kv_left_by_request
        if self.kv_left_s is not None:
            asyncio.get_running_loop().call_later(self.kv_left_s, self.give_back_kv, self.kv_left_by_request)

    def give_back_kv(self, share: float) -> None:
        self.kv_usage = (self.kv_usage or 0.0) - share

    def release(self) -> None:
        self.running -= 1

    def by_request(self, request_id: str) -> Logged:
        for xid, entry in self.log.items():
            if xid.rsplit("-", 1)[0] == request_id:
                return entry
        raise KeyError(request_id)


def count_tokens(text: str) -> int:
    return 1 + len(text.split())


def _chunk(chat: bool, text: str, finish: str | None = None) -> bytes:
    if chat:
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return b"data: " + json.dumps({"id": "x", "object": obj, "model": MODEL, "choices": [choice]}).encode() + b"\n\n"


def make_app(state: ServerState) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        body = await request.json()
        now = time.perf_counter()
        xid = request.headers.get("X-Request-Id", f"anon-{len(state.log)}")
        entry = Logged(xid, now, body, authorization=request.headers.get("Authorization"))
        state.log[xid] = entry
        kind = xid.split("-")[0].split("_")[0]
        prompt = body["messages"][0]["content"] if chat else body.get("prompt", "")
        prompt_tokens = count_tokens(prompt) + (CHAT_TEMPLATE_TOKENS if chat else 0)
        max_tokens = int(body.get("max_tokens", 16))
        n_out = max_tokens - 1 if kind == "short" else max_tokens
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n_out, "total_tokens": prompt_tokens + n_out}
        if kind == "e500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if kind == "e400":
            return web.json_response({"error": {"message": "bad request"}}, status=400)
        state.running += 1
        try:
            await asyncio.sleep(state.ttft_s)
            if not body.get("stream"):
                if request.transport is None or request.transport.is_closing():
                    entry.aborted = True  # the client went away while its answer was computed
                    return web.Response(status=499)
                entry.first_token_t = entry.end_t = time.perf_counter()
                choices = [{"index": 0, "text": "tok " * n_out, "finish_reason": "length"}]
                return web.json_response({"id": "x", "object": "text_completion", "choices": choices, "usage": usage})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            if kind == "hang":
                await asyncio.sleep(3600)
            if chat:
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                await resp.write(b"data: " + json.dumps({"choices": [role]}).encode() + b"\n\n")
                await asyncio.sleep(state.token_delay_s)
            delay = 0.08 if kind == "slow" else state.token_delay_s
            try:
                for i in range(n_out):
                    if i:
                        await asyncio.sleep(delay)
                    if kind == "reset" and i == 2:
                        request.transport.abort()
                        return resp
                    if kind == "malformed" and i == 1:
                        await resp.write(b"data: {not json\n\n")
                        break
                    if kind == "notsse" and i == 1:
                        await resp.write(b"this is not sse\n\n")
                        break
                    if kind in ("errevent", "dies") and i == 1:
                        if kind == "dies" and state.go_down is not None:
                            await state.go_down(request.transport)  # gone before the client hears of it
                        await resp.write(b'data: {"error": {"message": "engine died", "code": 500}}\n\n')
                        break
                    await resp.write(_chunk(chat, "tok", "length" if i == n_out - 1 else None))
                    if entry.first_token_t is None:
                        entry.first_token_t = time.perf_counter()
                if (body.get("stream_options") or {}).get("include_usage"):
                    await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
                if kind != "nodone":
                    await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
            except (ConnectionResetError, ConnectionError):
                entry.aborted = True
            entry.end_t = time.perf_counter()
            return resp
        except asyncio.CancelledError:
            entry.aborted = True
            raise
        except ConnectionError:  # the client went away before the headers (a timeout while queued)
            entry.aborted = True
            raise
        finally:
            state.leave_kv()
            if state.linger_s:
                asyncio.get_running_loop().call_later(state.linger_s, state.release)
            else:
                state.running -= 1

    async def tokenize(request: web.Request) -> web.Response:
        state.tokenize_calls += 1
        body = await request.json()
        if "messages" in body:
            count = count_tokens(body["messages"][0]["content"]) + CHAT_TEMPLATE_TOKENS
        else:
            count = count_tokens(body["prompt"])
        return web.json_response({"count": count, "max_model_len": 4096, "tokens": list(range(count))})

    async def models(request: web.Request) -> web.Response:
        data = [{"id": MODEL, "object": "model", "owned_by": "vllm", "max_model_len": 4096}]
        return web.json_response({"object": "list", "data": data})

    async def metrics(request: web.Request) -> web.Response:
        text = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} {state.running + state.stuck}\n'
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0\n'
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.\n"
            "# TYPE vllm:num_preemptions_total counter\n"
            f'vllm:num_preemptions_total{{engine="0",model_name="{MODEL}"}} 3.0\n'
        )
        if state.kv_usage is not None:
            text += ("# TYPE vllm:kv_cache_usage_perc gauge\n"
                     f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} {state.kv_usage}\n')
        if state.kv_config is not None:
            blocks, size = state.kv_config
            text += ("# TYPE vllm:cache_config_info gauge\n"
                     f'vllm:cache_config_info{{block_size="{size}",engine="0",num_gpu_blocks="{blocks}"}} 1.0\n')
        return web.Response(text=text, content_type="text/plain")

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.0.test"})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    return app


@asynccontextmanager
async def running(state: ServerState | None = None) -> AsyncIterator[tuple[str, ServerState]]:
    """Serve on 127.0.0.1 on a free port inside the current event loop; stop on exit."""
    state = state or ServerState()
    runner = web.AppRunner(make_app(state), access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def go_down(keep) -> None:
        await site.stop()  # new connections are refused
        for handler in list(runner.server.connections if runner.server else ()):
            if handler.transport is not None and handler.transport is not keep:
                handler.transport.abort()

    state.go_down = go_down
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        await runner.cleanup()
