"""The hot path for completion requests: HTTP/1.1 on pre-opened keep-alive connections (issue 19).

aiohttp's request path costs about half of the executor's CPU per request, and every
network read a task wake-up and a re-armed timer. A completion request needs none of
it: :class:`Pool` writes the request's pre-encoded bytes on a connection opened before
t0, and its :class:`_Connection` (an :class:`asyncio.Protocol`) parses the status line,
the headers and a Content-Length, chunked or read-until-close body from bytes as they
arrive. Each read of a streaming body is stamped in ``data_received`` and kept with its
stamp; the pool feeds the kept reads to their :class:`~fuzzer.execute.sse.StreamAccount`
once per loop iteration, after the iteration's reads were all stamped (parsing the
events of one stream no longer delays the stamps of the others: in a burst of 1024
streams that was most of the added TTFT). A stream costs one task wake-up in all, when
it ends. One watchdog timer per pool stands for aiohttp's per-read and total timeouts. Failures are raised as the aiohttp exceptions the aiohttp path raises
(:mod:`fuzzer.execute.http` handles both alike), so outcomes and their details agree.

Only plain ``http://`` targets take this path; TLS, the /metrics sampler, /tokenize and
detection stay on aiohttp. ``FUZZ_HTTP_CLIENT=aiohttp`` switches it off.
"""

from __future__ import annotations

import asyncio
import os
import select
from typing import Any, Callable

import aiohttp
from yarl import URL

from fuzzer.execute.sse import StreamAccount
from fuzzer.execution import Outcome

#: ``FUZZ_HTTP_CLIENT=aiohttp`` sends completion requests through aiohttp as before.
ENV = "FUZZ_HTTP_CLIENT"
_MAX_HEAD = 1 << 16
_CUT_OFF = "Response payload is not completed"
# Parsing kept stream reads runs in slices this long, so a read arriving meanwhile waits at
# most about this long for its stamp (a burst of 1024 streams is ~150 ms of parsing).
_SLICE_S = 0.0005


def enabled() -> bool:
    return os.environ.get(ENV, "fast").strip().lower() != "aiohttp"


def usable(base_url: str) -> bool:
    """Whether requests to ``base_url`` can take the hot path (plain http, a plain host)."""
    url = URL(base_url)
    return url.scheme == "http" and bool(url.host) and url.user is None and ":" not in (url.host or "")


def encode_post(url: URL, headers: Any, body: bytes) -> bytes:
    """The whole HTTP/1.1 request, bytes ready for the socket."""
    lines = [f"POST {url.raw_path_qs} HTTP/1.1", f"Host: {url.raw_authority}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the response it is reading (one at a time)."""

    def __init__(self, pool: "Pool"):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self._poll: Any = None  # select.poll() on the socket, made once (dropped() runs at dispatch)
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.buf = b""
        self.status: int | None = None
        self.head: dict[str, str] = {}
        self.mode = ""  # "chunked", "length", "close"
        self.left = 0  # bytes left of the current chunk (chunked) or of the body (length)
        self.trailers = False
        self.complete = False
        self.keep_alive = True
        self.body: list[bytes] = []
        self.account: StreamAccount | None = None  # set for a streaming request
        self.reads: list[tuple[bytes, float]] = []  # stream reads not yet fed to the account
        self.cancel_after: int | None = None
        self.head_fut: asyncio.Future[None] | None = None
        self.done_fut: asyncio.Future[Any] | None = None
        self.sent = self.last = 0.0

    # --- protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._poll = select.poll()
            self._poll.register(sock.fileno(), select.POLLIN)

    def dropped(self) -> bool:
        """Whether the idle connection's socket is readable now: the server closed it (or sent what
        nobody asked for), and the event loop, busy elsewhere, has not yet seen it. Reusing it would
        fail the next request before its first byte (ServerDisconnected)."""
        return self._poll is not None and bool(self._poll.poll(0))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._gone(self)
        if self.head_fut is None:
            return
        if self.status is not None and self.mode == "close" and exc is None:  # the end of the body
            self.complete = True
            if self._streams():
                self.reads.append((b"", self.pool.clock()))
            else:
                self._end(self.pool.clock())
        self.drain()
        if self.status is None:
            self._fail(aiohttp.ServerDisconnectedError())
        else:
            why = f"{_CUT_OFF}: {exc!r}" if exc is not None else _CUT_OFF
            self._fail(aiohttp.ClientPayloadError(why))

    def data_received(self, data: bytes) -> None:
        now = self.pool.clock()
        self.last = now
        if self.head_fut is None or self.complete:
            return  # nothing asked (or a reply already read): ignored, the connection is not reused
        buf = self.buf + data if self.buf else data
        self.buf = b""
        try:
            if self.status is None:
                buf = self._parse_head(buf)
                if self.status is None:
                    self.buf = buf
                    return
            pieces = self._parse_body(buf)
        except ValueError as e:
            self.keep_alive = False
            self._fail(aiohttp.ClientConnectionError(f"bad HTTP response: {e}"))
            self.close()
            return
        if self._streams():
            if pieces or self.complete:
                if not self.reads:
                    self.pool._keep(self)
                self.reads.append((pieces[0] if len(pieces) == 1 else b"".join(pieces), now))
        else:
            self.body.extend(pieces)
            if self.complete:
                self._end(now)

    def _streams(self) -> bool:
        return self.account is not None and self.status is not None and self.status < 400

    # --- parsing ----------------------------------------------------------------------

    def _parse_head(self, buf: bytes) -> bytes:
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    raise ValueError("header section too long")
                return buf
            lines = buf[:end].decode("latin-1").split("\r\n")
            buf = buf[end + 4 :]
            version, _, rest = lines[0].partition(" ")
            if not version.startswith("HTTP/1."):
                raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
            status = int(rest[:3])
            if 100 <= status < 200:
                continue  # an interim response: the real one follows
            head = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if not sep:
                    raise ValueError(f"bad header line: {line[:80]!r}")
                head[name.strip().lower()] = value.strip()
            self.status, self.head = status, head
            connection = head.get("connection", "").lower()
            self.keep_alive = "close" not in connection and (version != "HTTP/1.0" or "keep-alive" in connection)
            if status in (204, 304):  # no body, whatever the headers say
                self.mode, self.complete = "length", True
            elif "chunked" in head.get("transfer-encoding", "").lower():
                self.mode, self.left = "chunked", -1
            elif "content-length" in head:
                self.mode, self.left = "length", int(head["content-length"])
                if self.left < 0:
                    raise ValueError(f"negative Content-Length: {self.left}")
                self.complete = self.left == 0
            else:
                self.mode, self.keep_alive = "close", False
            assert self.head_fut is not None
            if not self.head_fut.done():
                self.head_fut.set_result(None)
            return buf

    def _parse_body(self, buf: bytes) -> list[bytes]:
        """The body bytes in ``buf`` (chunk framing removed); a partial frame is kept for later."""
        if self.mode == "close":
            return [buf] if buf else []
        if self.mode == "length":
            piece = buf[: self.left]
            self.left -= len(piece)
            self.complete = self.left == 0
            return [piece] if piece else []
        pieces, pos, n = [], 0, len(buf)
        while pos < n and not self.complete:
            if self.left > 0:  # inside a chunk's data
                piece = buf[pos : pos + self.left]
                pieces.append(piece)
                pos += len(piece)
                self.left -= len(piece)
                if self.left == 0:
                    self.left = -2  # its CRLF follows
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                if n - pos > _MAX_HEAD:
                    raise ValueError("chunk size line too long")
                break
            line = buf[pos:eol]
            pos = eol + 2
            if self.left == -2:  # the CRLF after a chunk's data
                if line:
                    raise ValueError("chunk data longer than its size")
                self.left = -1
            elif self.trailers:
                self.complete = not line
            else:
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    self.trailers = True
                else:
                    self.left = size
        self.buf = buf[pos:] if pos < n and not self.complete else b""
        return pieces

    # --- outcomes ---------------------------------------------------------------------

    def drain(self) -> None:
        """Feed the kept reads to the account, each with its stamp; settle the stream if it ended."""
        reads, self.reads = self.reads, []
        account = self.account
        if account is None or self.done_fut is None or self.done_fut.done():
            return
        for data, now in reads:
            account.feed(data, now)
            if account.finished:
                if account.fault is not None:
                    self._settle(account.fault, now)
                    self.close()
                else:
                    self._settle(Outcome.OK, account.done_t or now)
                return
            if self.cancel_after is not None and account.tokens >= self.cancel_after:
                self._settle(Outcome.CANCELLED, now)
                self.close()  # drop the connection, as a client that stops listening does
                return
        if self.complete and reads:
            self._settle(Outcome.MISSING_DONE, reads[-1][1])

    def _settle(self, outcome: Outcome, t: float) -> None:
        if self.done_fut is not None and not self.done_fut.done():
            self.done_fut.set_result((outcome, t))

    def _end(self, t: float) -> None:
        if self.done_fut is not None and not self.done_fut.done():
            self.done_fut.set_result(t)

    def _fail(self, error: BaseException) -> None:
        for fut in (self.head_fut, self.done_fut):
            if fut is not None and not fut.done():
                fut.set_exception(error)
                fut.exception()  # marked retrieved: nobody may be waiting on this one

    def timed_out(self) -> None:
        self.drain()
        self._fail(asyncio.TimeoutError())
        self.close()

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()


class Response:
    """What ``async with pool.post(...)`` gives: status, then the body or the stream."""

    def __init__(self, conn: _Connection):
        self._conn = conn
        self.status = conn.status

    async def read(self) -> bytes:
        """The whole body (non-streaming requests and error replies)."""
        conn = self._conn
        assert conn.done_fut is not None
        if not conn.complete:
            await conn.done_fut
        return b"".join(conn.body)

    async def stream(self) -> tuple[Outcome, float]:
        """(outcome, end time) of the SSE body, as aiohttp's reader gives them; the account was fed."""
        conn = self._conn
        assert conn.done_fut is not None
        # The pool's slices feed the kept reads (feeding them here, in the task woken by the
        # headers, would delay the stamps of every read arriving meanwhile).
        return await conn.done_fut  # type: ignore[no-any-return]

    def close(self) -> None:
        self._conn.close()


class Post:
    """One request: ``async with`` it for the :class:`Response`. :meth:`Pool.start` writes it at once."""

    def __init__(self, pool: "Pool", wire: bytes, account: StreamAccount | None, cancel_after: int | None):
        self._pool, self._wire, self.account, self._cancel_after = pool, wire, account, cancel_after
        self._conn: _Connection | None = None
        self._released = False
        #: When the request was written (the pool's clock).
        self.sent: float | None = None

    def _begin(self, conn: _Connection) -> None:
        self._conn = conn
        loop = asyncio.get_running_loop()
        conn.head_fut, conn.done_fut = loop.create_future(), loop.create_future()
        conn.account, conn.cancel_after = self.account, self._cancel_after
        conn.sent = conn.last = self.sent = self._pool.clock()
        self._pool._busy(conn)
        assert conn.transport is not None
        conn.transport.write(self._wire)

    async def __aenter__(self) -> Response:
        if self._conn is None:
            self._begin(await self._pool._acquire())
        conn = self._conn
        assert conn is not None and conn.head_fut is not None
        try:
            await conn.head_fut
        except BaseException:
            self._release(clean=False)
            raise
        return Response(conn)

    async def __aexit__(self, *exc: object) -> None:
        self._release(clean=exc[0] is None)

    def _release(self, *, clean: bool) -> None:
        if self._conn is not None and not self._released:
            self._released = True
            self._pool._release(self._conn, clean=clean)

    def abandon(self, _task: object = None) -> None:
        """Close the connection unless the request was read and released (a task's done callback:
        a task cancelled before its first step never enters the ``async with``)."""
        self._release(clean=False)


class Pool:
    """Keep-alive connections to one host, a watchdog for hangs, opened in advance by :meth:`warm`."""

    def __init__(self, base_url: str, *, clock: Callable[[], float], read_timeout_s: float,
                 total_timeout_s: float, keepalive_s: float):
        url = URL(base_url)
        self.host, self.port = url.host or "", url.port or 80
        self.clock = clock
        self._read_timeout_s, self._total_timeout_s, self._keepalive_s = read_timeout_s, total_timeout_s, keepalive_s
        self._idle: list[_Connection] = []
        self._active: set[_Connection] = set()
        self._watchdog: asyncio.TimerHandle | None = None
        self._pending: list[_Connection] = []  # connections with stream reads to feed
        self._drainer: asyncio.Handle | None = None
        # Hangs are seen within a tenth of the read timeout (aiohttp's per-read timer: exact).
        self._tick_s = max(0.01, min(0.25, read_timeout_s / 10))

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except OSError as e:
            raise aiohttp.ClientOSError(e.errno, f"cannot connect to {self.host}:{self.port}: {e}") from e
        conn.idle_since = self.clock()
        return conn

    async def warm(self, connections: int) -> None:
        """Have ``connections`` fresh idle connections open (TCP setup is not server latency)."""
        self._prune()
        need = connections - len(self._idle)
        if need <= 0:
            return
        opened = await asyncio.gather(*(self._open() for _ in range(need)), return_exceptions=True)
        self._idle.extend(c for c in opened if isinstance(c, _Connection))

    def post(self, wire: bytes, account: StreamAccount | None = None, cancel_after: int | None = None) -> Post:
        """``async with pool.post(...) as response``; a streaming request's body goes to ``account``."""
        return Post(self, wire, account, cancel_after)

    def start(self, wire: bytes, account: StreamAccount | None, cancel_after: int | None) -> Post | None:
        """The request written now, on an idle connection, before any task exists; None when none is open."""
        conn = self._take()
        if conn is None:
            return None
        post = Post(self, wire, account, cancel_after)
        post._begin(conn)
        return post

    def _keep(self, conn: _Connection) -> None:
        self._pending.append(conn)
        if self._drainer is None:
            self._drainer = asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        """Feed kept reads for at most _SLICE_S, then let the loop stamp new reads before the rest."""
        self._drainer = None
        pending, end, done = self._pending, self.clock() + _SLICE_S, 0
        while done < len(pending):
            pending[done].drain()
            done += 1
            if self.clock() > end:
                break
        self._pending = pending[done:]
        if self._pending:
            self._drainer = asyncio.get_running_loop().call_soon(self._drain)

    def _prune(self) -> None:
        """Drop idle connections the server may be closing (idle for longer than keepalive_s)."""
        now = self.clock()
        keep = []
        for conn in self._idle:
            if conn.closed or now - conn.idle_since > self._keepalive_s:
                conn.close()
            else:
                keep.append(conn)
        self._idle = keep

    def _take(self) -> _Connection | None:
        """The most recently used idle connection still fit to use, or None."""
        while self._idle:
            conn = self._idle.pop()
            if (not conn.closed and not conn.transport.is_closing()  # type: ignore[union-attr]
                    and self.clock() - conn.idle_since <= self._keepalive_s and not conn.dropped()):
                return conn
            conn.close()
        return None

    async def _acquire(self) -> _Connection:
        return self._take() or await self._open()

    def _busy(self, conn: _Connection) -> None:
        self._active.add(conn)
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_later(self._tick_s, self._watch)

    def _release(self, conn: _Connection, *, clean: bool) -> None:
        self._active.discard(conn)
        if clean and conn.complete and conn.keep_alive and not conn.closed:
            # Idle since its last byte arrived: the server's keep-alive timer started when it wrote
            # it, and a release the busy loop runs late must not make the connection look fresher.
            last = conn.last
            conn._reset()
            conn.idle_since = last
            self._idle.append(conn)
        else:
            conn.close()

    def _gone(self, conn: _Connection) -> None:
        self._active.discard(conn)

    def _watch(self) -> None:
        """The one timer for hangs: no byte for read_timeout_s, or a request running past total_timeout_s."""
        self._watchdog = None
        now = self.clock()
        for conn in list(self._active):
            if now - conn.last > self._read_timeout_s or now - conn.sent > self._total_timeout_s:
                self._active.discard(conn)
                conn.timed_out()
        if self._active:
            self._watchdog = asyncio.get_running_loop().call_later(self._tick_s, self._watch)

    def close(self) -> None:
        if self._drainer is not None:
            self._drainer.cancel()
            self._drainer = None
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for conn in [*self._idle, *self._active]:
            conn.close()
        self._idle.clear()
        self._active.clear()
