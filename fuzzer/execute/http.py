"""The HTTP executor: precise open-loop replay of a trace against a live server (ARCHITECTURE.md, "Execute").

:class:`HttpTarget` implements :class:`fuzzer.execution.Target`. On first use it
detects the server kind, asks which features it accepts, picks a prompt counter
(/tokenize or a usage calibration); then every ``execute``:

1. builds fresh prompts of exact length and pre-encodes every request body;
2. waits at the idle barrier (running + waiting = 0 on /metrics);
3. opens as many keep-alive connections as the trace has requests (TCP setup is
   not server latency) and starts the /metrics sampler; over plain http:// the
   completion requests take the hot path (:mod:`fuzzer.execute.fastpath`), everything
   else aiohttp;
4. sends request *i* at ``t0 + at_ms`` on an absolute schedule, stamping the
   actual send (dispatch lateness = sent - scheduled), and reads each stream
   with a ``perf_counter`` stamp per network read;
5. after the last request, checks that the server returns to idle; one that does not and then refuses a
   connection went down (:data:`fuzzer.execution.SERVER_GONE`: a crash whatever its requests saw).

Failures are data (:class:`fuzzer.execution.Outcome`); only a target that cannot
be used at all raises :class:`fuzzer.errors.TargetError`. Every task an execution
starts ends before ``execute`` returns or raises (:mod:`fuzzer.execute.scope`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable, Mapping

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from fuzzer.errors import TargetError
from fuzzer.execute import adapters, clientlag, detection, fastpath, gcquiet, scope
from fuzzer.execute import prompts as prompt_builder
from fuzzer.execute.adapters import Adapter, ServerInfo
from fuzzer.execute.harness import LATENESS_WARN_S, request_result, result_warnings, status_outcome  # noqa: F401 (LATENESS_WARN_S: public)
from fuzzer.execute.metrics import (
    DEFAULT_INTERVAL_S,
    IdleReport,
    Sampler,
    Scraper,
    busy,
    settle,
    wait_idle,
)
from fuzzer.execute.sse import StreamAccount, short, usage_counts
from fuzzer.execute.recovery import refuses_connections
from fuzzer.execution import SERVER_GONE, ExecutionResult, MetricSample, Outcome, RequestResult, kv_held
from fuzzer.execution import leak_window_s, step_pace_s
from fuzzer.trace import MAX_REQUESTS, Request, Trace

#: No byte from the server for this long is a hang (the request's outcome is TIMEOUT).
DEFAULT_TIMEOUT_S = 60.0
#: A request still streaming after this long is cut off as TIMEOUT too (a server that trickles forever).
DEFAULT_TOTAL_TIMEOUT_S = 600.0
#: How long the idle barrier waits for running + waiting = 0 before going ahead with a warning.
DEFAULT_IDLE_TIMEOUT_S = 30.0
#: After the last request: how long the server may take to return to idle at least (else idle_after = False;
#: fuzzer.execution.leak_window_s stretches it with a slow server's steps).
DEFAULT_IDLE_AFTER_TIMEOUT_S = 5.0
#: The context a request without disconnect_after_ms is read in (reused: it holds no state).
_STAYS = contextlib.nullcontext()
# Connector limit: above any trace's concurrency (a trace holds at most MAX_REQUESTS
# requests), plus room for the metrics sampler and tokenize calls.
_CONNECTION_LIMIT = MAX_REQUESTS + 16
# aiohttp reads 64 KiB at a time by default, which throttles long streams and big
# non-streaming bodies (vllm#39963); 4 MiB never binds for one response.
_READ_BUFSIZE = 1 << 22
# t0 is set this far after the connections are warm, so building the dispatch tasks
# does not make the first request late.
_START_DELAY_S = 0.005
# asyncio timers fire with ~1 ms granularity: sleep until this close to a send
# time, then yield to the loop until it is due.
_SPIN_S = 0.0015
# Idle pooled connections are dropped by the client after this long, before the server
# drops them: llama-server (cpp-httplib) and uvicorn (vLLM, SGLang) close an idle
# keep-alive connection after 5 s, and a request written onto a connection the server is
# closing fails ("Can not write request body"), measured against llama-server. Connections
# are warmed right before each execution, so nothing longer is needed.
_KEEPALIVE_S = 4.0
# A vLLM server that did not report its KV capacity when first met is asked again before
# each of its first few executions (fuzzer.oracle.calibrate reads it after its pilot).
_KV_REREADS = 3
#: The speed check after an execution: one short streaming request, run alone once the server
#: is idle again. Its median inter-token gap is one decode step of one sequence: how fast the
#: engine is now, next to how fast it was when calibrated (a few decode steps, ~1-3% of an
#: execution's server time).
SPEED_CHECK = Trace(requests=(Request(id="speed-check", at_ms=0, prompt_tokens=16, max_tokens=8),))


@dataclass(frozen=True)
class _Planned:
    request: Request
    x_request_id: str
    url: URL
    body: bytes
    headers: CIMultiDict[str]
    scheduled_s: float
    wire: bytes | None = None  # the whole request, pre-encoded for the hot path (fuzzer.execute.fastpath)


class HttpTarget:
    """A live OpenAI-compatible server as a fuzzing target."""

    def __init__(
        self,
        base_url: str,
        *,
        server: str = "auto",
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        total_timeout_s: float = DEFAULT_TOTAL_TIMEOUT_S,
        metrics_interval_s: float = DEFAULT_INTERVAL_S,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        idle_after_timeout_s: float = DEFAULT_IDLE_AFTER_TIMEOUT_S,
        capabilities: Mapping[str, bool | int] | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        speed_check: bool = True,
        told: Mapping[str, int] | None = None,
    ):
        """``told``: scheduler settings the server was started with (a launched server's command line and
        log, :func:`fuzzer.execute.launch.told_scheduler`); what it reports of itself overrides them."""
        if server != "auto":
            adapters.adapter(server)  # raises ConfigError for an unknown kind
        if not base_url.startswith(("http://", "https://")):
            raise TargetError(f"target must be an http:// or https:// URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.name = self.base_url
        self._server = server
        self._model = model
        self._api_key = api_key
        self._timeout = aiohttp.ClientTimeout(total=total_timeout_s, sock_read=timeout_s)
        self._metrics_interval_s = metrics_interval_s
        self._idle_timeout_s = idle_timeout_s
        self._idle_after_timeout_s = idle_after_timeout_s
        self._given_capabilities = dict(capabilities) if capabilities is not None else None
        self._told = dict(told or {})
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        self._wall_clock = wall_clock
        self._sleep = sleep
        self._speed_check = speed_check
        self._session: aiohttp.ClientSession | None = None
        self._fast: fastpath.Pool | None = None
        self._timeouts = (timeout_s, total_timeout_s)
        self._adapter: Adapter | None = None
        self._scraper: Scraper | None = None
        self._counter: prompt_builder.TokenCounter | None = None
        self._setup_warnings: list[str] = []
        self._speed_prompts: prompt_builder.PromptSet | None = None
        self._executions = 0
        self.info: ServerInfo | None = None

    def __repr__(self) -> str:  # never shows the API key
        return f"HttpTarget({self.base_url!r}, server={self._server!r})"

    # --- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> "HttpTarget":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    async def start(self) -> ServerInfo:
        """Detect the server, probe its features, choose the prompt counter. Idempotent."""
        if self.info is not None:
            return self.info
        connector = aiohttp.TCPConnector(limit=_CONNECTION_LIMIT, keepalive_timeout=_KEEPALIVE_S, ttl_dns_cache=None)
        # No cookies, no proxy lookup from the environment (trust_env costs two thread-pool
        # hops per request), no compression: less work between dispatch and the socket.
        self._session = aiohttp.ClientSession(
            connector=connector,
            read_bufsize=_READ_BUFSIZE,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
        )
        if fastpath.enabled() and fastpath.usable(self.base_url):
            self._fast = fastpath.Pool(self.base_url, clock=self._clock, read_timeout_s=self._timeouts[0],
                                       total_timeout_s=self._timeouts[1], keepalive_s=_KEEPALIVE_S)
        try:
            fp = await detection.fingerprint(self._session, self.base_url, headers=self._headers)
            kind = detection.detect(fp) if self._server == "auto" else self._server
            self._adapter = adapters.adapter(kind)
            version, listed_model, max_len = detection.describe(fp, kind)
            model = self._model or listed_model
            if self._given_capabilities is not None:
                caps = self._given_capabilities
            else:
                caps = await adapters.probe_capabilities(
                    self._session, self.base_url, self._adapter, model, headers=self._headers
                )
            self.info = ServerInfo(
                kind=kind, version=version, model=model, max_model_len=max_len, capabilities=caps,
                scheduler={**self._told, **detection.reported_scheduler(fp, kind)},
            )
            if self._adapter.has_metrics and fp.ok(self._adapter.metrics_path or "") is not None:
                self._scraper = Scraper(self._session, self.base_url, self._adapter, headers=self._headers)
            await self._choose_counter()
        except BaseException:
            await self.aclose()
            raise
        return self.info

    def kv_cache(self) -> tuple[int, int] | None:
        """(KV blocks, tokens per block) the server reported when first met, or None."""
        return self.info.kv_cache() if self.info is not None else None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._fast is not None:
            self._fast.close()
            self._fast = None
        self.info = None

    async def _choose_counter(self) -> None:
        assert self._session is not None and self._adapter is not None and self.info is not None
        rng = random.Random(self._rng.getrandbits(64))
        if self.info.accepts("tokenize") and self.info.capabilities.get("tokenize"):
            counter = prompt_builder.ServerCounter(
                self._session, self.base_url, self._adapter, self.info.model, headers=self._headers
            )
            if self.info.accepts("chat") and not counter.templates_chat:
                counter.chat_overhead = await prompt_builder.chat_overhead(self._measure, counter, rng)
            self._counter = counter
            return
        try:
            self._counter = await prompt_builder.fit_counter(self._measure, rng)
            self._setup_warnings.append(
                "the server has no /tokenize: prompt lengths come from a usage calibration and are checked against usage"
            )
        except TargetError as e:
            self._counter = prompt_builder.CalibratedCounter()
            self._setup_warnings.append(f"prompt lengths are estimates (1 token per word): {e}")

    async def tokenize_seconds(self, tokens: int) -> float | None:
        """Wall time of one /tokenize of a ``tokens``-word prompt, or None without an exact counter.

        The calibration bounds the frontend's per-token time with it: the server's own
        tokenizer, timed directly, is what a prompt costs before the engine sees it.
        """
        if not isinstance(self._counter, prompt_builder.ServerCounter):
            return None
        text = " ".join(prompt_builder.WORDS[i % len(prompt_builder.WORDS)] for i in range(max(1, tokens)))
        start = self._clock()
        await self._counter.count(text)
        return self._clock() - start

    async def _reread_kv(self, info: ServerInfo) -> ServerInfo:
        """``info`` with the KV capacity read again from /metrics when the server had not
        reported it when first met (vLLM publishes ``vllm:cache_config_info`` once its engine
        is up, which can come after /health answers); tried before the first few executions."""
        if info.kind != "vllm" or info.kv_cache() is not None or self._executions >= _KV_REREADS:
            return info
        assert self._session is not None
        try:
            async with self._session.get(self.base_url + "/metrics", headers=self._headers,
                                         timeout=aiohttp.ClientTimeout(total=5.0)) as response:
                text = await response.text() if response.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return info
        found = detection.cache_config_labels(text)
        if found:
            self.info = info = replace(info, scheduler={**info.scheduler, **found})
        return info

    async def _measure(self, text: str, chat: bool) -> int | None:
        """usage.prompt_tokens of a one-token completion of ``text``."""
        assert self._session is not None and self._adapter is not None and self.info is not None
        body: dict[str, Any] = {"max_tokens": 1, "temperature": 0.0}
        if self.info.model:
            body["model"] = self.info.model
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
            url = self.base_url + self._adapter.chat_path
        else:
            body["prompt"] = text
            url = self.base_url + self._adapter.completions_path
        try:
            async with self._session.post(url, json=body, headers=self._headers, timeout=self._timeout) as resp:
                if resp.status != 200:
                    return None
                answer = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None
        return usage_counts(answer.get("usage") if isinstance(answer, dict) else None)[0]

    # --- one execution ------------------------------------------------------------------

    async def execute(self, trace: Trace, *, cut_s: float | None = None) -> ExecutionResult:
        """Run the trace once (``cut_s``: its time cap, see ``Target.execute``). Never raises for a request's failure."""
        info = await self._reread_kv(await self.start())
        assert self._session is not None and self._counter is not None
        self._executions += 1
        warnings = list(self._setup_warnings)
        prompt_set = await prompt_builder.build(trace, self._counter, self._rng)
        warnings.extend(prompt_set.warnings)
        plans, plan_warnings = self._plan(trace, prompt_set, info)
        warnings.extend(plan_warnings)

        idle = await wait_idle(self._scraper, timeout_s=self._idle_timeout_s, clock=self._clock, sleep=self._sleep)
        if not idle.reached:
            warnings.append(f"the server was not idle after {self._idle_timeout_s:g} s (last scrape: {dict(idle.last)})")
        await self._warm(len(plans))

        samples: tuple[MetricSample, ...] = ()
        failed_scrapes = 0
        # Every task of the execution belongs to this scope. When the execution raises or
        # is cancelled, the requests still in flight are cancelled (their connections
        # closed: the server sees an abort) and the sampler and the lag ticker stopped
        # before the exception leaves execute(). A request's failure is its outcome, never
        # an exception, so it does not cancel its siblings.
        async with scope.task_scope() as tasks, gcquiet.frozen_heap():
            sampler = None
            t0 = self._clock() + _START_DELAY_S
            started_at = self._wall_clock() + _START_DELAY_S
            if self._scraper is not None:
                sampler = Sampler(
                    self._scraper, interval_s=self._metrics_interval_s, clock=self._clock, sleep=self._sleep
                )
                sampler.start(tasks, t0)
            lag = clientlag.LagMonitor(clock=self._clock, sleep=self._sleep)
            lag.start(tasks)
            sends: list[asyncio.Task[RequestResult]] = []
            cut_at = None if cut_s is None else t0 + cut_s
            for plan in plans:
                if cut_at is not None and plan.scheduled_s >= cut_s:
                    sends.append(tasks.create_task(self._unsent(plan, t0)))
                    continue
                await self._sleep_until(t0 + plan.scheduled_s)
                # The hot path writes the request at once; its task only reads the answer.
                post = self._fast.start(plan.wire, StreamAccount() if plan.request.stream else None,
                                        plan.request.cancel_after_tokens) if self._fast and plan.wire else None
                sends.append(task := tasks.create_task(self._send(plan, t0, post, cut_at)))
                if post is not None:
                    task.add_done_callback(post.abandon)
            if sends:  # asyncio.wait refuses an empty set
                await asyncio.wait(sends)
            duration_s = self._clock() - t0
            client_lag_s = await lag.stop()
            ended_at = self._clock()
            # On an engine whose KV gauge is current once it is idle, KV still in use is not idle either.
            judge_kv = self._adapter is not None and self._adapter.kv_settles_idle
            kv_before = idle.last.get("kv_usage") if judge_kv else None
            after = await settle(self._scraper, timeout_s=self._idle_after_timeout_s, kv_before=kv_before,
                                       clock=self._clock, sleep=self._sleep)
            if sampler is not None:
                samples, failed_scrapes = await sampler.stop()
        results = [send.result() for send in sends]
        if cut_s is not None and (cut := sum(r.outcome is Outcome.CUT for r in results)):
            warnings.append(f"{cut} request(s) still running at the execution's time cap ({cut_s:.0f} s) were cut: "
                            "their latencies are lower bounds")
        if failed_scrapes:
            warnings.append(f"{failed_scrapes} /metrics scrapes failed during the execution")
        warnings.extend(result_warnings(trace, results))
        lag_warning = clientlag.warning(client_lag_s)
        if lag_warning:
            warnings.append(lag_warning)
        if after is not None and not after.reached:
            after = await self._settles_at_pace(info, results, ended_at, after, kv_before)
        idle_after = None if after is None else after.reached
        if idle_after is False and (refused := await refuses_connections(self.base_url)) is not None:
            warnings.append(f"{SERVER_GONE}: it refused a connection after the execution ({refused})")
        if idle_after is False and busy(after.last) == 0 and kv_held(kv_before, after.last.get("kv_usage")):
            warnings.append(f"with no request running or waiting, the server still reported "
                            f"{after.last['kv_usage']:.1%} of its KV cache in use at the end of the leak window "
                            f"({kv_before:.1%} before it)")
        speed_itl_s = await self._check_speed(info) if self._speed_check and idle_after else None
        return ExecutionResult(
            trace_hash=trace.content_hash(),
            target=self.base_url,
            started_at=started_at,
            duration_s=duration_s,
            requests=tuple(results),
            samples=samples,
            idle_before_s=idle.idle_s,
            idle_after=idle_after,
            warnings=tuple(warnings),
            client_lag_s=client_lag_s,
            speed_check_itl_s=speed_itl_s,
        )

    async def _settles_at_pace(self, info: ServerInfo, results: list[RequestResult], ended_at: float,
                               busy_report: IdleReport, kv_before: float | None) -> IdleReport:
        """Still busy after the floor (``busy_report``): does the server return to idle within the leak window of
        its pace (``leak_window_s``)? The pace is the execution's own step; where its clients all left before a
        token it has none, and the speed check's median gap, taken beside what the server still holds, is used."""
        pace = step_pace_s(results)
        if pace is None and self._speed_check:
            try:
                pace = await self._check_speed(info)
            except TargetError:  # it went down: a crash, which the oracle tells by itself
                return busy_report
        left_s = leak_window_s(pace, self._idle_after_timeout_s) - (self._clock() - ended_at)
        if left_s <= 0:
            return busy_report
        return await settle(self._scraper, timeout_s=left_s, kv_before=kv_before, clock=self._clock,
                            sleep=self._sleep) or busy_report

    async def _check_speed(self, info: ServerInfo) -> float | None:
        """The median inter-token gap of SPEED_CHECK run now (the server is idle), or None."""
        # Built once: only the inter-token gaps count, so a prefix-cache hit on the prompt is harmless.
        if self._speed_prompts is None:
            self._speed_prompts = await prompt_builder.build(SPEED_CHECK, self._counter, self._rng)
        plans, _ = self._plan(SPEED_CHECK, self._speed_prompts, info)
        result = await self._send(plans[0], self._clock())
        gaps = sorted(result.itl_s)
        if result.outcome is not Outcome.OK or len(gaps) < 3:
            return None
        return gaps[len(gaps) // 2]

    def _plan(
        self, trace: Trace, prompt_set: prompt_builder.PromptSet, info: ServerInfo
    ) -> tuple[list[_Planned], list[str]]:
        """Pre-encode every request body and header set, so sending does no work."""
        assert self._adapter is not None
        warnings = []
        suffix = f"{self._executions:x}{self._rng.getrandbits(32):08x}"
        send_ignore_eos = info.accepts("ignore_eos")
        if not send_ignore_eos and any(r.ignore_eos for r in trace.requests):
            warnings.append("the server rejects ignore_eos: it is not sent, so outputs may end before max_tokens")
        usage_ok = info.accepts("stream_options")
        plans = []
        urls = {
            api: URL(self.base_url + path, encoded=True)
            for api, path in (("chat", self._adapter.chat_path), ("completions", self._adapter.completions_path))
        }
        for r in trace.requests:
            body: dict[str, Any] = {"max_tokens": r.max_tokens, "temperature": r.temperature, "stream": r.stream}
            if info.model:
                body["model"] = info.model
            text = prompt_set.prompts[r.id].text
            if r.api == "chat":
                body["messages"] = [{"role": "user", "content": text}]
                if r.logprobs is not None:
                    body["logprobs"] = True
                    body["top_logprobs"] = r.logprobs
            else:
                body["prompt"] = text
                if r.logprobs is not None:
                    body["logprobs"] = r.logprobs
            if r.n != 1:
                body["n"] = r.n
            if r.seed is not None:
                body["seed"] = r.seed
            if r.ignore_eos and send_ignore_eos:
                body["ignore_eos"] = True
            if r.stream and usage_ok:
                body["stream_options"] = {"include_usage": True}
            xid = f"{r.id}-{suffix}"
            headers = CIMultiDict({"Content-Type": "application/json", "X-Request-Id": xid, **self._headers})
            data = json.dumps(body).encode()
            wire = fastpath.encode_post(urls[r.api], headers, data) if self._fast is not None else None
            plans.append(_Planned(r, xid, urls[r.api], data, headers, r.at_ms / 1000.0, wire))
        return plans, warnings

    async def _warm(self, connections: int) -> None:
        """Open ``connections`` keep-alive connections now, so no request pays for TCP setup."""
        assert self._session is not None and self._adapter is not None
        if self._fast is not None:
            return await self._fast.warm(connections)
        url = self.base_url + self._adapter.health_path

        async def touch() -> None:
            try:
                async with self._session.get(url, headers=self._headers, timeout=self._timeout) as resp:  # type: ignore[union-attr]
                    await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass

        await scope.run_all(*(touch() for _ in range(connections)))

    async def _sleep_until(self, due: float) -> None:
        while True:
            remaining = due - self._clock()
            if remaining <= 0:
                return
            await self._sleep(remaining - _SPIN_S if remaining > _SPIN_S else 0)

    async def _unsent(self, plan: _Planned, t0: float) -> RequestResult:
        """A request scheduled after the execution's time cap: never sent."""
        return self._result(plan, t0, t0 + plan.scheduled_s, None, None, Outcome.CUT,
                            "scheduled after the execution's time cap: not sent", None, None)

    async def _send(self, plan: _Planned, t0: float, post: Any = None, cut_at: float | None = None) -> RequestResult:
        """Send one request (``post``: already written on the hot path) and read its answer; every failure becomes an outcome.

        ``cut_at``: when the execution's time cap closes the request if it is still running (outcome CUT).
        """
        assert self._session is not None
        r = plan.request
        clock = self._clock
        sent = clock() if post is None else post.sent
        account = (StreamAccount() if r.stream else None) if post is None else post.account
        status: int | None = None
        end: float | None = None
        body: Any = None
        outcome = Outcome.OK
        detail: str | None = None
        # A client that goes away after a time (the trace's disconnect_after_ms, or the execution's time
        # cap), whatever it got. Without either it stays: one shared null context (an asyncio.timeout(None)
        # per request costs ~5 us, this ~0.6); a campaign with --duration pays the 5 us for its cap.
        leave_at = None if r.disconnect_after_ms is None else sent + r.disconnect_after_ms / 1000.0
        cut = cut_at is not None and (leave_at is None or cut_at < leave_at)
        if cut:
            leave_at = cut_at
        leave = _STAYS if leave_at is None else asyncio.timeout(max(0.0, leave_at - clock()))
        try:
            if post is None and self._fast is not None and plan.wire is not None:
                post = self._fast.post(plan.wire, account, r.cancel_after_tokens)
            if post is None:
                post = self._session.post(plan.url, data=plan.body, headers=plan.headers, timeout=self._timeout)
            async with leave, post as resp:
                status = resp.status
                if status >= 400:
                    raw = await resp.read()
                    end = clock()
                    outcome = status_outcome(status, r, self.info)
                    detail = short(raw) or f"HTTP {status}"
                elif account is not None:
                    outcome, end = await self._read_stream(resp, account, r)
                else:
                    raw = await resp.read()
                    end = clock()
                    try:
                        body = json.loads(raw)
                    except ValueError:
                        outcome, detail = Outcome.MALFORMED, f"body is not JSON: {short(raw[:80])}"
        except asyncio.TimeoutError:
            if leave is not _STAYS and leave.expired():
                end = clock()  # leaving `async with post` unread dropped the connection: the server sees an abort
                outcome, detail = (Outcome.CUT, "still running at the execution's time cap") if cut else (
                    Outcome.CANCELLED, None)
            else:
                outcome, detail = Outcome.TIMEOUT, "no answer within the client timeout"
        except aiohttp.ClientPayloadError as e:
            outcome, detail = Outcome.CONNECTION_ERROR, f"response cut off: {short(str(e))}"
        except aiohttp.ClientError as e:
            outcome, detail = Outcome.CONNECTION_ERROR, f"{e.__class__.__name__}: {short(str(e))}"
        return self._result(plan, t0, sent, status, end, outcome, detail, account, body)

    async def _read_stream(
        self, resp: aiohttp.ClientResponse | fastpath.Response, account: StreamAccount, r: Request
    ) -> tuple[Outcome, float]:
        if isinstance(resp, fastpath.Response):
            return await resp.stream()
        clock = self._clock
        content = resp.content
        cancel_after = r.cancel_after_tokens
        while True:
            data = await content.readany()
            now = clock()
            if not data:
                return (Outcome.MISSING_DONE if account.done_t is None else Outcome.OK), now
            account.feed(data, now)
            if cancel_after is not None and account.tokens >= cancel_after and not account.finished:
                resp.close()  # drop the connection, as a client that stops listening does
                return Outcome.CANCELLED, now
            if account.finished:
                if account.fault is not None:
                    resp.close()
                    return account.fault, now
                return Outcome.OK, account.done_t or now

    def _result(self, plan: _Planned, t0: float, sent: float, status: int | None, end: float | None, outcome: Outcome,
                detail: str | None, account: StreamAccount | None, body: Any) -> RequestResult:
        return request_result(plan.request, plan.x_request_id, plan.scheduled_s, t0, sent, status, end, outcome, detail,
                              account, body, self.info)
