"""The server's /metrics: parse, map to common names, sample, wait for idle (ARCHITECTURE.md, "Execute").

``parse`` turns Prometheus text (read with prometheus-client's parser) into the
common names of :data:`COMMON_NAMES` through a server adapter. ``Scraper`` fetches
and parses one page; ``Sampler`` polls on an absolute schedule while a trace runs;
``wait_idle`` is the barrier before an execution and ``settle`` / ``settles_idle`` the check
after it (did running + waiting return to 0, and the KV cache in use to its level before?).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from fuzzer.errors import TargetError
from fuzzer.execute.adapters import Adapter
from fuzzer.execute.periodic import Periodic
from fuzzer.execution import MetricSample, kv_held

#: Common metric names every adapter maps onto (counters are cumulative).
COMMON_NAMES = (
    "running",
    "waiting",
    "kv_usage",
    "preemptions",
    "prefix_cache_hits",
    "prefix_cache_queries",
    "prompt_tokens",
    "generation_tokens",
)

#: ARCHITECTURE.md, "Execute": poll /metrics every 50 ms during an execution.
DEFAULT_INTERVAL_S = 0.05
# The idle barrier polls faster than the sampler: it only delays the next execution.
IDLE_POLL_S = 0.02
# A server is called idle after this many consecutive idle scrapes, so one scrape
# taken between two engine steps does not count as idle.
IDLE_CONFIRMATIONS = 2
# Without metrics the barrier can only wait a quiet period after the client's own
# requests ended: long enough for an engine to finish an aborted step.
QUIET_PERIOD_S = 0.25
# A scrape slower than this is a stuck server, not a measurement.
SCRAPE_TIMEOUT_S = 5.0


def parse(text: str, adapter: Adapter) -> dict[str, float]:
    """Prometheus text exposition -> {common name: value} for the names the adapter maps.

    Samples of the chosen wire name are summed over labels (several engines or
    models), or averaged for ``mean`` metrics. Raises :class:`TargetError` when the
    text is not Prometheus exposition format.
    """
    totals: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(_wanted_lines(text, adapter)):
            for sample in family.samples:
                totals.setdefault(sample.name, []).append(float(sample.value))
    except (ValueError, TypeError, IndexError) as e:
        raise TargetError(f"the /metrics page is not Prometheus text: {e}") from None
    values: dict[str, float] = {}
    for common, metric in adapter.metrics.items():
        for name in metric.names:
            if name in totals:
                found = totals[name]
                values[common] = sum(found) / len(found) if metric.mean else sum(found)
                break
    return values


def _wanted_lines(text: str, adapter: Adapter) -> str:
    """Only the sample lines of metrics the adapter maps, comments dropped.

    A vLLM page is ~100 kB of histograms the fuzzer never reads; parsing all of it
    every 50 ms would cost the measuring client milliseconds of CPU per scrape.
    Without their TYPE lines the kept samples parse as untyped, under the same names.
    """
    wanted = _wanted_names(adapter)
    kept = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = len(line)
        for stop in ("{", " "):
            i = line.find(stop)
            if 0 <= i < end:
                end = i
        if line[:end] in wanted:
            kept.append(line)
    return "\n".join(kept) + "\n"


def _wanted_names(adapter: Adapter) -> frozenset[str]:
    return frozenset(name for metric in adapter.metrics.values() for name in metric.names)


def busy(values: Mapping[str, float]) -> float | None:
    """running + waiting, or None when the server does not export them."""
    if "running" not in values and "waiting" not in values:
        return None
    return values.get("running", 0.0) + values.get("waiting", 0.0)


class Scraper:
    """Fetches and parses one /metrics page with a shared session.

    Where the adapter reads some common names from a slots endpoint instead (llama.cpp's
    /slots for ``kv_usage``), that endpoint is fetched at the same time and its values
    merged in. A slots endpoint that fails (llama-server started with ``--no-slots``
    answers 501) is dropped for good: ``slots_disabled`` says why, and /metrics alone is read.
    """

    def __init__(self, session: aiohttp.ClientSession, base_url: str, adapter: Adapter, *, headers: Mapping[str, str]):
        if adapter.metrics_path is None:
            raise TargetError(f"a {adapter.kind} server has no /metrics to scrape")
        self._session = session
        self._url = base_url + adapter.metrics_path
        self._slots_url = base_url + adapter.slots_path if adapter.slots_path and adapter.slots_metrics else None
        self._adapter = adapter
        self._headers = dict(headers)
        self._timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        #: Why the slots endpoint is no longer read, or None while it is (or there is none).
        self.slots_disabled: str | None = None

    async def __call__(self) -> dict[str, float]:
        if self._slots_url is None:
            return parse(await self._get(self._url), self._adapter)
        page, slots = await asyncio.gather(self._get(self._url), self._get(self._slots_url), return_exceptions=True)
        if isinstance(page, BaseException):
            raise page
        values = parse(page, self._adapter)
        if isinstance(slots, TargetError):
            self._slots_url, self.slots_disabled = None, str(slots)
        elif isinstance(slots, BaseException):
            raise slots
        else:
            try:
                from_slots = self._adapter.slots_metrics(json.loads(slots))  # type: ignore[misc]
            except (ValueError, TargetError) as e:
                self._slots_url, self.slots_disabled = None, f"unreadable slots answer: {e}"
            else:
                values.update({k: v for k, v in from_slots.items() if k not in values})
        return values

    async def _get(self, url: str) -> str:
        try:
            async with self._session.get(url, headers=self._headers, timeout=self._timeout) as resp:
                text = (await resp.read()).decode("utf-8", "replace")
                if resp.status != 200:
                    raise TargetError(f"GET {url} answered HTTP {resp.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise TargetError(f"GET {url} failed: {e.__class__.__name__}") from None
        return text


Scrape = Callable[[], Awaitable[Mapping[str, float]]]


@dataclass(frozen=True)
class IdleReport:
    """What the idle barrier saw."""

    #: How long the server had been seen idle when the barrier let go; None without metrics.
    idle_s: float | None
    #: False when the barrier gave up waiting.
    reached: bool
    last: Mapping[str, float]


async def wait_idle(
    scrape: Scrape | None,
    *,
    timeout_s: float,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    poll_s: float = IDLE_POLL_S,
    quiet_s: float = QUIET_PERIOD_S,
    kv_before: float | None = None,
) -> IdleReport:
    """Wait until running + waiting = 0 on IDLE_CONFIRMATIONS scrapes in a row (and, given ``kv_before``, the KV
    usage back within ``KV_HELD_MARGIN`` of that level: blocks nobody owns are not idle either).

    Without a scrape (a server without metrics) this waits a quiet period and
    reports the idle time as unknown. Gives up after ``timeout_s`` with
    ``reached=False`` (the caller records a warning) rather than raising: a server
    that never drains is a finding (``leak``), not a harness error.
    """
    if scrape is None:
        await sleep(quiet_s)
        return IdleReport(idle_s=None, reached=True, last={})
    start = clock()
    idle_since: float | None = None
    seen = 0
    last: Mapping[str, float] = {}
    while True:
        asked = clock()
        try:
            last = await scrape()
        except TargetError:
            seen, idle_since = 0, None
        else:
            load = busy(last)
            if load is None:
                # Metrics, but no running/waiting gauges: fall back to a quiet period.
                await sleep(quiet_s)
                return IdleReport(idle_s=None, reached=True, last=last)
            if load == 0 and not kv_held(kv_before, last.get("kv_usage")):
                idle_since = asked if idle_since is None else idle_since
                seen += 1
                if seen >= IDLE_CONFIRMATIONS:
                    return IdleReport(idle_s=clock() - idle_since, reached=True, last=last)
            else:
                seen, idle_since = 0, None
        if clock() - start >= timeout_s:
            return IdleReport(idle_s=None, reached=False, last=last)
        await sleep(poll_s)


async def settle(
    scrape: Scrape | None,
    *,
    timeout_s: float,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    poll_s: float = IDLE_POLL_S,
    kv_before: float | None = None,
) -> IdleReport | None:
    """After the last request ended: what the wait for idle (:func:`wait_idle`, with ``kv_before`` its KV usage
    too) saw within ``timeout_s``; None when the server exports no running/waiting gauges (unknown)."""
    if scrape is None:
        return None
    report = await wait_idle(scrape, timeout_s=timeout_s, clock=clock, sleep=sleep, poll_s=poll_s, kv_before=kv_before)
    if report.reached and busy(report.last) is None:
        return None
    return report


async def settles_idle(scrape: Scrape | None, *, timeout_s: float, **options) -> bool | None:
    """After the last request ended: does the server return to idle within ``timeout_s`` (:func:`settle`)?

    None when the server exports no running/waiting gauges (unknown).
    """
    report = await settle(scrape, timeout_s=timeout_s, **options)
    return None if report is None else report.reached


class Sampler(Periodic):
    """Polls /metrics every ``interval_s`` on an absolute schedule while an execution runs.

    A tick that comes due while the previous scrape is still running is skipped
    (no catch-up burst). Each sample is stamped at the middle of its scrape, as an
    offset from ``t0``.
    """

    def __init__(
        self,
        scrape: Scrape,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        super().__init__(interval_s=interval_s, clock=clock, sleep=sleep)
        self._scrape = scrape
        self._samples: list[MetricSample] = []
        self._failures = 0
        self._t0 = 0.0

    def start(self, tasks: asyncio.TaskGroup, t0: float) -> None:
        """Poll in a task of ``tasks``, from half an interval after ``t0``.

        Half an interval: a scrape never competes with the first dispatch.
        """
        self._t0 = t0
        self._launch(tasks)

    async def stop(self) -> tuple[tuple[MetricSample, ...], int]:
        """Stop polling; returns (samples, failed scrapes)."""
        await self._cancel()
        return tuple(self._samples), self._failures

    async def _run(self) -> None:
        start = self._t0 + self._interval_s / 2
        await self._sleep(max(0.0, start - self._clock()))
        tick = 0
        while True:
            asked = self._clock()
            try:
                values = await self._scrape()
            except TargetError:
                self._failures += 1
            else:
                got = self._clock()
                self._samples.append(MetricSample(t_s=(asked + got) / 2 - self._t0, values=dict(values)))
            now = self._clock()
            tick = max(tick + 1, int((now - start) / self._interval_s) + 1)
            await self._sleep(max(0.0, start + tick * self._interval_s - now))
