"""The executor's hot path (fuzzer.execute.fastpath) gives what the aiohttp path gives (issue 19).

Hypothesis writes SSE streams (token events of both APIs, usage, role chunks, comments,
multi-line data, CRLF or LF, a huge event, a malformed event, with or without [DONE]),
frames them (chunked at arbitrary sizes, Content-Length, or read until close) and cuts the
bytes at arbitrary points: inside an event, inside a chunk-size line, between CR and LF.
The hot path's parser fed those pieces must account the stream exactly as the existing
:class:`StreamAccount` fed the whole body; and over loopback, a misbehaving server writing
the pieces one by one must give the same results through both paths of :class:`HttpTarget`.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from yarl import URL

from fuzzer import trace as tf
from fuzzer.execute import fastpath
from fuzzer.execute.http import HttpTarget
from fuzzer.execute.sse import StreamAccount
from fuzzer.execution import Outcome

USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=6)
_payload = st.one_of(
    st.builds(lambda t: {"choices": [{"index": 0, "text": t, "finish_reason": None}]}, _text),
    st.builds(lambda t: {"choices": [{"index": 0, "delta": {"content": t}}]}, _text),
    st.just({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
    st.just({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}),
    st.just({"choices": [], "usage": USAGE}),
)


@st.composite
def sse_bodies(draw) -> bytes:
    eol = draw(st.sampled_from(["\n", "\r\n"]))
    events = []
    for payload in draw(st.lists(_payload, max_size=8)):
        data = json.dumps(payload, ensure_ascii=draw(st.booleans()))
        if draw(st.integers(0, 5)) == 0:  # one JSON object on two data lines
            cut = data.index(",") + 1 if "," in data else len(data)
            lines = [f"data: {data[:cut]}", f"data:{data[cut:]}"]
        else:
            lines = [f"data: {data}"]
        if draw(st.integers(0, 6)) == 0:
            lines.insert(0, ": keep-alive")
        if draw(st.integers(0, 6)) == 0:
            lines.insert(0, "event: message")
        events.append(eol.join(lines))
    if draw(st.integers(0, 4)) == 0:  # a huge event
        events.insert(draw(st.integers(0, len(events))), "data: " + json.dumps(
            {"choices": [{"index": 0, "text": "x" * draw(st.integers(70_000, 200_000))}]}))
    ending = draw(st.sampled_from(["done", "done", "done", "none", "malformed", "notsse", "error"]))
    if ending == "malformed":
        events.append("data: {not json")
    elif ending == "notsse":
        events.append("this is not sse")
    elif ending == "error":
        events.append('data: {"error": {"message": "engine died"}}')
    if ending != "none":
        events.append("data: [DONE]")
    return "".join(e + eol + eol for e in events).encode()


def _cuts(draw, data: bytes, most: int) -> list[bytes]:
    points = sorted(set(draw(st.lists(st.integers(0, len(data)), max_size=most))))
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)]) if b > a]


@st.composite
def responses(draw) -> tuple[bytes, str, list[bytes]]:
    """(SSE body, framing, the response's bytes as the server writes them)."""
    body = draw(sse_bodies())
    framing = draw(st.sampled_from(["chunked", "chunked", "length", "close"]))
    head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    if framing == "chunked":
        ext = draw(st.sampled_from(["", ";name=value"]))
        chunks = [b"%x%s\r\n%s\r\n" % (len(c), ext.encode(), c) for c in _cuts(draw, body, 12)]
        wire = (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + b"".join(chunks) + b"0\r\n\r\n"
    elif framing == "length":
        wire = (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    else:
        wire = (head + "Connection: close\r\n\r\n").encode() + body
    return body, framing, _cuts(draw, wire, 20)


def _summary(account: StreamAccount) -> tuple:
    return (account.events, account.tokens, account.first_token_t is not None, account.first_event_t is not None,
            account.usage, account.finish_reason, account.done_t is not None, account.fault, account.detail)


class _Transport:
    def __init__(self):
        self.closed = False

    def write(self, data):
        pass

    def close(self):
        self.closed = True

    def get_extra_info(self, name):
        return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(responses())
def test_the_parser_accounts_any_cut_of_a_stream_as_the_existing_account(response):
    asyncio.run(_parse(*response))


async def _parse(body: bytes, framing: str, pieces: list[bytes]) -> None:
    expected = StreamAccount()
    expected.feed(body, 1.0)
    loop = asyncio.get_running_loop()
    pool = fastpath.Pool("http://127.0.0.1:1", clock=lambda: 1.0, read_timeout_s=1, total_timeout_s=1, keepalive_s=1)
    conn = fastpath._Connection(pool)
    conn.connection_made(_Transport())
    account = StreamAccount()
    conn.head_fut, conn.done_fut, conn.account = loop.create_future(), loop.create_future(), account
    for piece in pieces:
        conn.data_received(piece)
        if conn.transport.closed:
            break
    if framing == "close" and not conn.transport.closed:
        conn.connection_lost(None)
    conn.drain()
    pool.close()
    assert conn.status == 200
    assert _summary(account) == _summary(expected)
    if expected.finished:
        assert conn.done_fut.result()[0] is (expected.fault or Outcome.OK)
    else:
        assert conn.done_fut.result()[0] is Outcome.MISSING_DONE


# --- over loopback: the same results through both paths ----------------------------------------


class _Server(asyncio.Protocol):
    """GETs answer the detection, /tokenize counts words + 1, completions write ``script``."""

    script: list[bytes] = []
    close = False  # close the connection after the script (a read-until-close body)
    abort = False  # reset the connection after the script (a server that died mid-reply)

    def connection_made(self, transport):
        self.transport, self.buf = transport, b""

    def data_received(self, data):
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end].decode("latin-1").split("\r\n")
            length = next((int(h.split(":")[1]) for h in head if h.lower().startswith("content-length")), 0)
            if len(self.buf) < end + 4 + length:
                return
            body, self.buf = self.buf[end + 4 : end + 4 + length], self.buf[end + 4 + length :]
            path = head[0].split(" ")[1]
            if path == "/v1/completions":
                asyncio.ensure_future(self._write(list(_Server.script)))
                return
            if path == "/tokenize":
                answer = {"count": 1 + len(json.loads(body)["prompt"].split()), "max_model_len": 4096}
            elif path == "/metrics":  # idle at once (without /metrics the executor waits a quiet period)
                data = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
                continue
            elif path == "/v1/models":
                answer = {"object": "list", "data": [{"id": "m", "owned_by": "vllm", "max_model_len": 4096}]}
            else:
                self.transport.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                continue
            data = json.dumps(answer).encode()
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))

    async def _write(self, pieces):
        for piece in pieces:
            if self.transport.is_closing():
                return
            self.transport.write(piece)
            await asyncio.sleep(0.0005)  # a separate read for each piece, mostly
        if _Server.abort:
            self.transport.abort()
        elif _Server.close:
            self.transport.close()


CAPS = {"tokenize": True, "chat": True, "n": True, "logprobs": True, "stream_options": True, "ignore_eos": True}
TRACE = tf.from_dict({"requests": [{"id": "s", "at_ms": 0, "prompt_tokens": 8, "max_tokens": 4}]})


async def _both_paths(framing: str, pieces: list[bytes], abort: bool = False) -> tuple:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Server, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    made = []
    for client in ("fast", "aiohttp"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(fastpath.ENV, client)
            target = HttpTarget(url, server="vllm", capabilities=CAPS, rng=random.Random(0), timeout_s=2,
                                idle_timeout_s=0.5, idle_after_timeout_s=0.1, speed_check=False)
            await target.start()
        made.append(target)
    assert made[0]._fast is not None and made[1]._fast is None
    _Server.script, _Server.close, _Server.abort = pieces, framing == "close", abort
    try:
        return tuple([_result((await t.execute(TRACE)).requests[0]) for t in made])
    finally:
        for target in made:
            await target.aclose()
        server.close()


def _result(r) -> tuple:
    return (r.outcome, len(r.token_times_s), r.ttft_s is None, r.first_event_s is None, r.finish_reason,
            r.prompt_tokens, r.completion_tokens, r.e2e_s is None)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(response=responses(), cut=st.one_of(st.none(), st.integers(1, 20)))
def test_a_misbehaving_server_gives_the_same_results_through_both_paths(response, cut):
    _, framing, pieces = response
    if cut is not None:  # the server writes only the first pieces, then resets the connection
        pieces = pieces[: max(1, len(pieces) * cut // 21)]
    fast, slow = asyncio.run(_both_paths(framing, pieces, abort=cut is not None))
    assert fast == slow


# --- the pool ---------------------------------------------------------------------------------


async def _post(pool: fastpath.Pool, wire: bytes) -> tuple[int, bytes]:
    async with pool.post(wire) as response:
        return response.status, await response.read()


async def test_connections_are_reused_dropped_when_stale_and_refusals_are_client_errors(unused_tcp_port):
    import aiohttp

    opened = []

    class Echo(asyncio.Protocol):
        def connection_made(self, transport):
            opened.append(transport)
            self.transport = transport

        def data_received(self, data):
            if data.endswith(b"}"):
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    loop = asyncio.get_running_loop()
    server = await loop.create_server(Echo, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    now = [0.0]
    pool = fastpath.Pool(url, clock=lambda: now[0], read_timeout_s=1, total_timeout_s=5, keepalive_s=4)
    wire = fastpath.encode_post(URL(url + "/v1/completions"), {"Content-Type": "application/json"}, b"{}")
    assert wire.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    try:
        await pool.warm(2)
        assert len(opened) == 2
        assert await _post(pool, wire) == (200, b"{}")
        assert await _post(pool, wire) == (200, b"{}")
        assert len(opened) == 2  # kept alive and reused
        now[0] = 10.0  # idle longer than keepalive_s: the server may be closing it
        assert await _post(pool, wire) == (200, b"{}")
        assert len(opened) == 3
    finally:
        pool.close()
        server.close()
    refused = fastpath.Pool(f"http://127.0.0.1:{unused_tcp_port}", clock=lambda: 0.0, read_timeout_s=1,
                            total_timeout_s=5, keepalive_s=4)
    with pytest.raises(aiohttp.ClientOSError):
        await _post(refused, wire)
    assert fastpath.usable("http://h:1/v1") and not fastpath.usable("https://h") and not fastpath.usable("http://[::1]:8")


async def test_a_connection_the_server_closed_while_the_loop_was_busy_is_not_reused():
    """A server's keep-alive timer closes an idle connection while the client's loop is busy (CI:
    llama-server and the fuzzer sharing 2 cores): the next request must not be written on it."""
    import socket
    import threading
    import time

    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def serve() -> None:  # one response per connection, then closed at once (a 0 s keep-alive timer)
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)
            data = b""
            while not data.endswith(b"{}"):
                data += conn.recv(4096)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            time.sleep(0.05)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    pool = fastpath.Pool(url, clock=time.monotonic, read_timeout_s=2, total_timeout_s=5, keepalive_s=60)
    wire = fastpath.encode_post(URL(url + "/v1/completions"), {"Content-Type": "application/json"}, b"{}")
    try:
        assert await _post(pool, wire) == (200, b"{}")
        time.sleep(0.3)  # the loop is blocked: it has not seen the server's close yet
        assert await _post(pool, wire) == (200, b"{}")
        assert len(accepted) == 2
    finally:
        pool.close()
        listener.close()


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (b"HTTP/1.1 204 No Content\r\n\r\n", (204, b"")),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", (200, b"{}")),
        (b"HTTP/1.1 500 Boom\r\nTransfer-Encoding: chunked\r\n\r\n4;x=y\r\nboom\r\n0\r\nTrailer: t\r\n\r\n", (500, b"boom")),
        (b"HTTP/1.0 200 OK\r\n\r\nuntil close", (200, b"until close")),
    ],
    ids=["no-content", "interim", "chunked-error-with-trailer", "until-close"],
)
async def test_bodies_without_length_interim_replies_and_trailers(reply, expected):
    class Reply(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport

        def data_received(self, data):
            self.transport.write(reply)
            if b"until close" in reply:
                self.transport.close()

    server = await asyncio.get_running_loop().create_server(Reply, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    pool = fastpath.Pool(url, clock=lambda: 0.0, read_timeout_s=1, total_timeout_s=5, keepalive_s=4)
    try:
        assert await _post(pool, fastpath.encode_post(URL(url + "/x"), {}, b"{}")) == expected
    finally:
        pool.close()
        server.close()


async def test_the_watchdog_times_out_silence_and_trickles_and_an_unstarted_task_closes_its_connection():
    import time

    class Trickle(asyncio.Protocol):
        """``/silent``: headers, then nothing; ``/trickle``: a byte of chunk every 20 ms, forever."""

        def connection_made(self, transport):
            self.transport = transport

        def data_received(self, data):
            self.transport.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            if b"/trickle" in data:
                asyncio.ensure_future(self.trickle())

        async def trickle(self):
            while not self.transport.is_closing():
                self.transport.write(b"1\r\n:\r\n")
                await asyncio.sleep(0.02)

    server = await asyncio.get_running_loop().create_server(Trickle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    pool = fastpath.Pool(url, clock=time.perf_counter, read_timeout_s=0.2, total_timeout_s=0.5, keepalive_s=4)
    try:
        for path, at_least in (("/silent", 0.2), ("/trickle", 0.5)):
            start = time.perf_counter()
            with pytest.raises(asyncio.TimeoutError):
                async with pool.post(fastpath.encode_post(URL(url + path), {}, b"{}"), StreamAccount()) as response:
                    await response.stream()
            assert at_least <= time.perf_counter() - start < at_least + 0.3
        await pool.warm(1)
        post = pool.start(fastpath.encode_post(URL(url + "/silent"), {}, b"{}"), StreamAccount(), None)
        assert post is not None and post.sent is not None

        async def never_started():
            async with post:
                pass

        task = asyncio.ensure_future(never_started())
        task.add_done_callback(post.abandon)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert post._conn.closed and not pool._active
    finally:
        pool.close()
        server.close()
