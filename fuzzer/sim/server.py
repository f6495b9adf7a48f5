"""The simulator over HTTP: an aiohttp front end that speaks vLLM's OpenAI-compatible API.

Endpoints: ``/v1/completions`` and ``/v1/chat/completions`` (stream or not),
``/tokenize``, ``/detokenize``, ``/v1/models``, ``/health``, ``/version`` and
``/metrics`` (vLLM v1 names). The engine runs in a task of the same event loop
on the loop's clock: each step is planned, slept through, then completed, and
its tokens are handed to the waiting handlers. Steps follow each other on a
nominal timeline (the next step starts when the previous one was due to end,
not when the loop happened to wake up), so sleep overshoot does not accumulate
and an HTTP run tracks a virtual-time run of the same trace.

A client that disconnects aborts its request in the engine (its KV is freed at
once). Ground truth (server-side times, pathologies that delayed each request)
is kept in memory and optionally appended to a JSON-lines file; it is never
served over HTTP.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import os
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Callable

from aiohttp import web

from fuzzer import __version__
from fuzzer.errors import ConfigError
from fuzzer.sim import faults as sim_faults
from fuzzer.sim import protocol as wire
from fuzzer.sim.config import SimConfig
from fuzzer.sim.engine import Engine
from fuzzer.sim.metrics import CONTENT_TYPE, SimMetrics
from fuzzer.sim.protocol import BadRequest, Generation, parse_generation
from fuzzer.sim.request import GroundTruth, SimRequest
from fuzzer.sim.tokenizer import Tokenizer, output_text, output_token

#: When the event loop falls this far behind the engine's nominal timeline (a
#: blocked loop, a machine under load), the engine resynchronizes to the clock
#: instead of running steps back to back to catch up.
MAX_TIMELINE_LAG_S = 0.05
#: A token is out once the clock is within this of its time (a timer may fire a hair early).
_DELIVERY_SLACK_S = 1e-3


class SimServer:
    """One simulated server: engine, front end, metrics and ground truth."""

    def __init__(
        self,
        config: SimConfig | None = None,
        pathologies: tuple[str, ...] | list[str] = (),
        seed: int = 0,
        ground_truth_path: str | Path | None = None,
        *,
        faults: sim_faults.FaultPlan | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = Engine(config, pathologies, seed)
        self.config = self.engine.config
        self._engine_args = (config, pathologies, seed)
        self.faults = faults or sim_faults.FaultPlan()
        #: Faults injected so far, by name (a crash counts once per crash).
        self.fault_counts: dict[str, int] = {name: 0 for name in sim_faults.NAMES}
        self._site: web.BaseSite | None = None
        self._address: tuple[str, int] | None = None
        self._crash: asyncio.Task | None = None
        self._down = False
        #: Generation requests received since start, over crashes (the faults' grace period).
        self.served = 0
        self.tokenizer = Tokenizer()
        self.metrics = SimMetrics(self.engine)
        self._clock = clock
        self._wall = wall_clock
        self._waiters: dict[SimRequest, asyncio.Event] = {}
        self._wake = asyncio.Event()
        self._driver: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self._gt_file = None
        self._gt_path = Path(ground_truth_path) if ground_truth_path else None
        self.url: str | None = None

    @property
    def ground_truth(self) -> tuple[GroundTruth, ...]:
        """Records of finished requests, keyed by X-Request-Id when the client sent one."""
        return tuple(self.engine.records)

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        if self._gt_path is not None:
            try:
                self._gt_file = self._gt_path.open("a", buffering=1)
            except OSError as e:
                raise ConfigError(f"cannot write ground truth to {self._gt_path}: {e.strerror}") from None
            self.engine.on_finish = self._write_ground_truth
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        # handler_cancellation: a client that goes away cancels its handler, which aborts its request.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        port = await self._listen(host, port)
        self._driver = asyncio.create_task(self._drive(), name="sim-engine")
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{port}"
        return self.url

    async def _listen(self, host: str, port: int) -> int:
        assert self._runner is not None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        self._site = web.SockSite(self._runner, sock)
        await self._site.start()
        self._address = (host, sock.getsockname()[1])
        return self._address[1]

    @property
    def down(self) -> bool:
        """True while a crashed server waits to restart."""
        return self._down

    async def crash(self, down_s: float | None = None) -> None:
        """Go down like a crashed process (connections reset, port closed), restart cold after ``down_s``."""
        if down_s is None:
            down_s = sim_faults.CRASH_DOWN_S / self.config.speed
        self.fault_counts[sim_faults.CRASH] += 1
        self._down = True
        assert self._runner is not None and self._address is not None
        if self._site is not None:
            await self._site.stop()  # closes the listening socket: new connections are refused
            self._site = None
        for handler in list(self._runner.server.connections if self._runner.server else ()):
            if handler.transport is not None:
                handler.transport.abort()
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
        # A restarted process: a fresh engine (no KV, no prefix cache, cold), metrics from zero.
        self.engine = Engine(*self._engine_args)
        if self._gt_file is not None:
            self.engine.on_finish = self._write_ground_truth
        self.metrics = SimMetrics(self.engine)
        self._waiters.clear()
        await asyncio.sleep(down_s)
        await self._listen(*self._address)
        self._driver = asyncio.create_task(self._drive(), name="sim-engine")
        self._down = False

    async def stop(self) -> None:
        if self._crash is not None:
            self._crash.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._crash
            self._crash = None
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
            self._driver = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._gt_file is not None:
            self._gt_file.close()
            self._gt_file = None

    def _write_ground_truth(self, record: GroundTruth) -> None:
        if self._gt_file is not None:
            self._gt_file.write(record.to_json() + "\n")

    # --- the engine loop ---------------------------------------------------------------------

    async def _drive(self) -> None:
        engine = self.engine
        nominal: float | None = None
        while True:
            now = self._clock()
            start = now if nominal is None or now - nominal > MAX_TIMELINE_LAG_S else nominal
            step = engine.step(start)
            if step is None:
                nominal = None
                ready = engine.next_ready_s()
                self._wake.clear()
                timeout = None if ready is None else max(0.0, ready - self._clock())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                continue
            delay = step.end_s - self._clock()
            await asyncio.sleep(max(0.0, delay))  # sleep(0) still yields to the handlers
            progressed = engine.complete(step)
            nominal = step.end_s
            now = self._clock()
            for req in progressed:
                times = req.token_times_s
                if len(times) == 1:
                    self.metrics.observe_ttft(times[0] - req.arrival_s)
                elif len(times) > 1:
                    self.metrics.observe_itl(times[-1] - times[-2])
                waiter = self._waiters.get(req)
                if waiter is None:
                    continue
                late = times[-1] - now if times else 0.0
                if late > 0:  # its frontend is behind the engine (logprobs-redetokenize)
                    asyncio.get_running_loop().call_later(late, waiter.set)
                else:
                    waiter.set()

    # --- generation ----------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, api: str) -> web.StreamResponse:
        try:
            body = await _json_body(request)
            gen = parse_generation(api, body, self.config, self.tokenizer)
            if gen.max_tokens > self.engine.max_request_tokens(len(gen.prompt_ids), gen.n):
                raise BadRequest(
                    f"n={gen.n} x max_tokens={gen.max_tokens} with a {len(gen.prompt_ids)}-token prompt does not fit "
                    f"the KV cache ({self.config.kv_capacity_tokens} tokens)",
                    param="max_tokens",
                )
        except BadRequest as e:
            return web.json_response(e.body(), status=e.status)
        header_id = request.headers.get("X-Request-Id")
        engine_id = header_id or uuid.uuid4().hex
        response_id = f"{'chatcmpl' if api == 'chat' else 'cmpl'}-{engine_id}"
        fault = self.faults.choose(len(gen.prompt_ids), gen.max_tokens, self.served)
        self.served += 1
        if fault == sim_faults.CRASH:
            if not self.down:
                # Its own task: the crash aborts this very connection, which cancels this handler.
                self._crash = asyncio.create_task(self.crash(), name="sim-crash")
            await asyncio.Event().wait()
        if fault is not None:
            self.fault_counts[fault] += 1
            return await sim_faults.respond(
                fault, request, stream=gen.stream, chat=api == "chat", response_id=response_id,
                model=self.config.model_name,
            )
        req = self.engine.add_request(
            engine_id,
            gen.prompt_ids,
            gen.max_tokens,
            now_s=self._clock(),
            n=gen.n,
            logprobs=gen.logprobs,
            ignore_eos=gen.ignore_eos,
            min_tokens=gen.min_tokens,
            seed=gen.seed,
            temperature=gen.temperature,
            stream=gen.stream,
        )
        waiter = asyncio.Event()
        self._waiters[req] = waiter
        self._wake.set()
        try:
            # Greedy decoding of the same prompt gives the same text (ints hash the same in every process).
            output = _Output(req, gen, hash(gen.prompt_ids) & 0xFFFFFFFF)
            if gen.stream:
                return await self._stream(request, req, gen, output, waiter, response_id)
            return await self._whole(req, gen, output, waiter, response_id)
        finally:
            self._waiters.pop(req, None)
            if not req.finished:
                self.engine.abort(req, self._clock())  # the client went away
                self._wake.set()

    async def _stream(
        self, request: web.Request, req: SimRequest, gen: Generation, output: "_Output", waiter: asyncio.Event, rid: str
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": req.request_id}
        )
        await response.prepare(request)
        created = int(self._wall())
        model = self.config.model_name
        while True:
            await waiter.wait()
            waiter.clear()
            events = []
            for k, pieces, lps, finish in output.advance(self.engine, self._clock()):
                if k == 0 and gen.api == "chat":
                    roles = [wire.stream_choice("chat", c, None, None, None, role=True) for c in range(gen.n)]
                    events.append(wire.chunk("chat", rid, created, model, roles))
                choices = [wire.stream_choice(gen.api, c, pieces[c], finish, lps[c]) for c in range(gen.n)]
                events.append(wire.chunk(gen.api, rid, created, model, choices))
            if output.done and gen.include_usage:
                events.append(wire.chunk(gen.api, rid, created, model, [], output.usage()))
            data = b"".join(b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events)
            if output.done:
                data += b"data: [DONE]\n\n"
            if data:
                await response.write(data)
            if output.done:
                await response.write_eof()
                return response

    async def _whole(
        self, req: SimRequest, gen: Generation, output: "_Output", waiter: asyncio.Event, rid: str
    ) -> web.StreamResponse:
        while not output.done:
            await waiter.wait()
            waiter.clear()
            list(output.advance(self.engine, self._clock()))
        body = wire.full_response(
            gen.api, rid, int(self._wall()), self.config.model_name, output.texts, output.finish_reason,
            [wire.merge_logprobs(gen.api, parts) for parts in output.logprobs], output.usage(),
        )
        return web.json_response(body, headers={"X-Request-Id": req.request_id})

    # --- other endpoints -------------------------------------------------------------------------

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            if "messages" in body:
                wire._check_messages(body["messages"])  # noqa: SLF001 - same package, same rules
                add = body.get("add_generation_prompt", True)
                text = self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=bool(add))
            elif isinstance(body.get("prompt"), str):
                text = body["prompt"]
            else:
                raise BadRequest("prompt must be a string (or give messages)", param="prompt")
        except BadRequest as e:
            return web.json_response(e.body(), status=e.status)
        tokens = self.tokenizer.encode(text)
        out = {"count": len(tokens), "max_model_len": self.config.max_model_len, "tokens": tokens, "token_strs": None}
        if body.get("return_token_strs"):
            out["token_strs"] = text.split()
        return web.json_response(out)

    async def _detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise BadRequest("tokens must be a list of integers", param="tokens")
        except BadRequest as e:
            return web.json_response(e.body(), status=e.status)
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    async def _models(self, request: web.Request) -> web.Response:
        model = self.config.model_name
        card = {
            "id": model, "object": "model", "created": int(self._wall()), "owned_by": "vllm", "root": model,
            "parent": None, "max_model_len": self.config.max_model_len, "permission": [],
        }
        return web.json_response({"object": "list", "data": [card]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": f"{__version__}+sim"})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


class _Output:
    """Turns the engine's token count into per-choice text, logprobs and a finish reason."""

    def __init__(self, req: SimRequest, gen: Generation, key: int) -> None:
        self._req = req
        self._gen = gen
        self._key = key
        self.sent = 0
        self.texts = [""] * gen.n
        self.logprobs: list[list[dict]] = [[] for _ in range(gen.n)]
        self.finish_reason: str | None = None
        self.done = False

    def advance(self, engine: Engine, now_s: float):
        """Yield (token index, text per choice, logprobs per choice, finish reason or None) for new tokens."""
        req, gen = self._req, self._gen
        # The tokens that have reached the frontend's output by now (all the engine made, unless it lags behind).
        upto = bisect.bisect_right(req.token_times_s, now_s + _DELIVERY_SLACK_S)
        while self.sent < upto and not self.done:
            k = self.sent
            self.sent += 1
            pieces, lps = [], []
            stopped = False
            for c in range(gen.n):
                token = output_token(self._key, c, k)
                piece = output_text(token)
                if c == 0 and gen.stop and k >= gen.min_tokens:
                    piece, stopped = _cut_at_stop(self.texts[0], piece, gen.stop)
                lp = wire.token_logprobs(gen.api, token, gen.logprobs, len(self.texts[c])) if gen.logprobs else None
                self.texts[c] += piece
                if lp is not None:
                    self.logprobs[c].append(lp)
                pieces.append(piece)
                lps.append(lp)
            last = stopped or (req.finished and self.sent >= req.generated)
            if stopped:
                engine.finish_early(req, now_s, "stop")
            if last:
                self.done = True
                self.finish_reason = "stop" if stopped else (req.finish_reason or "abort")
            yield k, pieces, lps, self.finish_reason if last else None
        if req.finished and self.sent >= req.generated:
            if not self.done:
                self.finish_reason = req.finish_reason
            self.done = True

    def usage(self) -> dict:
        req = self._req
        return wire.usage(req.prompt_len, self.sent * self._gen.n, req.cached_tokens or 0)


def _cut_at_stop(before: str, piece: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """The piece up to the first stop string that completes in it, and whether one did."""
    text = before + piece
    hits = [text.find(s, max(0, len(before) - len(s) + 1)) for s in stops]
    hits = [h for h in hits if h >= 0]
    if not hits:
        return piece, False
    return text[len(before) : max(len(before), min(hits))], True


async def _json_body(request: web.Request):
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None


@contextlib.asynccontextmanager
async def running_server(
    config: SimConfig | None = None,
    pathologies: tuple[str, ...] | list[str] = (),
    seed: int = 0,
    host: str = "127.0.0.1",
    port: int = 0,
    ground_truth_path: str | Path | None = None,
    faults: sim_faults.FaultPlan | None = None,
) -> AsyncIterator[str]:
    """Serve a simulator in the current event loop; yields its base URL, stops on exit."""
    server = SimServer(config, pathologies, seed, ground_truth_path, faults=faults)
    url = await server.start(host, port)
    try:
        yield url
    finally:
        await server.stop()


def serve_forever(
    host: str,
    port: int,
    config: SimConfig | None,
    pathologies: tuple[str, ...] | list[str],
    seed: int,
    on_ready: Callable[[str], None],
    ground_truth_path: str | Path | None = None,
    faults: sim_faults.FaultPlan | None = None,
    parent_pid: int | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM (for ``fuzz sim``); ``on_ready(url)`` once listening.

    With ``parent_pid``, also stop when that process is gone (a SIGKILLed campaign must
    not leave its simulator running).
    """

    async def main() -> None:
        server = SimServer(config, pathologies, seed, ground_truth_path, faults=faults)
        url = await server.start(host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        watcher = asyncio.create_task(_watch_parent(parent_pid, stop)) if parent_pid else None
        try:
            on_ready(url)
            await stop.wait()
        finally:
            if watcher is not None:
                watcher.cancel()
            await server.stop()

    asyncio.run(main())


#: How often a child simulator checks that the process that started it is still there.
PARENT_POLL_S = 0.5


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    """Set ``stop`` once ``parent_pid`` is no longer our parent (it died; we were re-parented)."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_POLL_S)
    stop.set()
