"""The simulator on a virtual clock: a :class:`~fuzzer.execution.Target` with no HTTP and no sleeping.

:class:`VirtualTarget` drives one :class:`~fuzzer.sim.engine.Engine` through a
trace and returns what a client would have measured (TTFT of stream requests,
the arrival of every token, E2E, usage), plus the simulator's ground truth.
One target keeps one engine across executions, as one real server would: the
prefix cache and the cold-start idle clock persist. Between executions the
virtual clock advances by ``idle_gap_s`` (what an idle barrier and quiet period
cost on a real server); :meth:`VirtualTarget.idle` advances it further.

Prompt identity: every execution salts the tokens of private prompt parts and
of each prefix group, so nothing hits the prefix cache across executions;
requests of one prefix group in the same execution share the group's tokens.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import replace

from fuzzer.errors import ConfigError
from fuzzer.execution import (
    ExecutionResult,
    MetricSample,
    Outcome,
    RequestResult,
    kv_held,
    leak_window_s,
    step_pace_s,
)
from fuzzer.sim.config import SimConfig
from fuzzer.sim.engine import Engine
from fuzzer.sim.pathologies import NAMES, parse
from fuzzer.sim.request import SimRequest
from fuzzer.trace import Request, Trace

#: Virtual seconds between two executions: an idle barrier plus a short quiet
#: period on a real server. Well below the 10 s after which a server goes cold.
DEFAULT_IDLE_GAP_S = 1.0
#: Virtual interval of metric samples, as the HTTP executor's /metrics poller.
DEFAULT_SAMPLE_INTERVAL_S = 0.05
#: Token ids of salted prompt text start above the tokenizer's vocabulary and hashed range.
_TOKEN_BASE = 1 << 32
#: After the client's last request ended, the server must be idle within this long at least (the HTTP
#: executor's ``DEFAULT_IDLE_AFTER_TIMEOUT_S``; ``leak_window_s`` stretches it with the execution's
#: steps), else the execution has ``idle_after`` False.
IDLE_AFTER_S = 5.0
#: Upper bound of one fast-path run of decode steps (the sample interval bounds it anyway).
_MAX_FAST_STEPS = 1 << 20


class VirtualTarget:
    """Runs traces through the simulated engine on virtual time (deterministic for a seed)."""

    def __init__(
        self,
        config: SimConfig | None = None,
        pathologies: tuple[str, ...] | list[str] | str = (),
        seed: int = 0,
        idle_gap_s: float = DEFAULT_IDLE_GAP_S,
        sample_interval_s: float = DEFAULT_SAMPLE_INTERVAL_S,
    ) -> None:
        if idle_gap_s < 0:
            raise ConfigError(f"idle_gap_s must be >= 0 seconds, got {idle_gap_s!r}")
        if sample_interval_s <= 0:
            raise ConfigError(f"sample_interval_s must be > 0 seconds, got {sample_interval_s!r}")
        if isinstance(pathologies, str):
            pathologies = parse(pathologies)
        self.engine = Engine(config, pathologies, seed)
        self.config = self.engine.config
        self.seed = seed
        self.idle_gap_s = idle_gap_s
        self.sample_interval_s = sample_interval_s
        self._clock_s = 0.0
        self._executions = 0
        names = ",".join(sorted(self.engine.pathologies)) or "none"
        self.name = f"sim+virtual://{self.config.model_name}?pathologies={names}&seed={seed}"

    @property
    def now_s(self) -> float:
        """The virtual clock."""
        return self._clock_s

    def kv_cache(self) -> tuple[int, int]:
        """(KV blocks, tokens per block): what the HTTP simulator reports in ``vllm:cache_config_info``."""
        return self.config.num_kv_blocks, self.config.block_size

    def idle(self, seconds: float) -> None:
        """Let the server sit idle (a cold start may follow a long enough idle)."""
        if seconds < 0:
            raise ConfigError(f"idle time must be >= 0 seconds, got {seconds!r}")
        self._clock_s += seconds

    async def execute(self, trace: Trace, *, cut_s: float | None = None) -> ExecutionResult:
        return self.run(trace, cut_s=cut_s)

    async def aclose(self) -> None:
        return None

    def run(self, trace: Trace, *, cut_s: float | None = None) -> ExecutionResult:
        """Execute a trace once on virtual time (``cut_s``: its time cap, see ``Target.execute``)."""
        if self._executions:
            self._clock_s += self.idle_gap_s
        index = self._executions
        self._executions += 1
        engine = self.engine
        t0 = self._clock_s
        last = engine.last_step_end_s
        idle_before = None if last is None else max(0.0, t0 - last)
        kv_before = engine.kv.usage

        arrivals: list[tuple[float, Request, list[int]]] = []
        rejected: dict[str, str] = {}
        cut_at = math.inf if cut_s is None else t0 + cut_s
        for r in trace.requests:
            problem = self._check(r)
            if problem:
                rejected[r.id] = problem
                continue
            if t0 + r.at_ms / 1000.0 >= cut_at:
                continue  # scheduled after the time cap: never sent
            arrivals.append((t0 + r.at_ms / 1000.0, r, self._prompt(trace, r, index)))

        handles: dict[str, SimRequest] = {}
        cancel_after: dict[int, int] = {}
        cancelled_at: dict[str, float] = {}
        #: Requests the time cap closed (a subset of cancelled_at).
        cut: set[str] = set()
        #: Clients that go away at a time (disconnect_after_ms): (when, their request), soonest first.
        leaving: list[tuple[float, SimRequest]] = []
        samples: list[MetricSample] = []
        next_sample = t0
        t = t0
        i = 0

        def arrive(until: float, inclusive: bool) -> None:
            nonlocal i
            while i < len(arrivals) and (arrivals[i][0] <= until if inclusive else arrivals[i][0] < until):
                at, r, prompt = arrivals[i]
                handle = engine.add_request(
                    f"{r.id}-{index}", prompt, r.max_tokens, now_s=at, n=r.n, logprobs=r.logprobs,
                    ignore_eos=r.ignore_eos, seed=r.seed, temperature=r.temperature, stream=r.stream,
                )
                handles[r.id] = handle
                if r.cancel_after_tokens is not None:
                    cancel_after[id(handle)] = r.cancel_after_tokens
                if r.disconnect_after_ms is not None:
                    bisect.insort(leaving, (at + r.disconnect_after_ms / 1000.0, handle), key=lambda x: x[0])
                i += 1

        def leave(until: float) -> None:
            """Clients whose time is up by ``until`` close their connections (an abort, if unfinished)."""
            while leaving and leaving[0][0] <= until:
                when, handle = leaving.pop(0)
                if not handle.finished and handle.request_id not in cancelled_at:
                    engine.abort(handle, until)
                    cancelled_at[handle.request_id] = when

        while True:
            arrive(t, inclusive=True)
            while next_sample <= t:
                samples.append(self._sample(next_sample - t0))
                next_sample += self.sample_interval_s
            leave(t)
            if t >= cut_at:
                for handle in handles.values():  # the client closes whatever still runs
                    if not handle.finished and handle.request_id not in cancelled_at:
                        engine.abort(handle, t)
                        cancelled_at[handle.request_id] = cut_at
                        cut.add(handle.request_id)
                cut_at = math.inf  # once
            horizon = min(arrivals[i][0] if i < len(arrivals) else math.inf, next_sample,
                          leaving[0][0] if leaving else math.inf, cut_at)
            ready = engine.next_ready_s()
            if ready is not None:
                horizon = min(horizon, ready)
            run = engine.decode_run(t, horizon, self._steps_before_cancel(engine, cancel_after))
            if run is not None:
                t, progressed = run
                arrive(t, inclusive=False)
                self._cancel(engine, progressed, t, cancel_after, cancelled_at)
                continue
            step = engine.step(t)
            if step is None:
                upcoming = [arrivals[i][0]] if i < len(arrivals) else []
                upcoming += [leaving[0][0]] if leaving else []
                ready = engine.next_ready_s()
                if ready is not None:
                    upcoming.append(ready)
                if not upcoming:
                    break
                t = max(t, min(upcoming))
                continue
            arrive(step.end_s, inclusive=False)
            t = step.end_s
            self._cancel(engine, engine.complete(step), t, cancel_after, cancelled_at)
        samples.append(self._sample(t - t0))
        self._clock_s = max(t, t0)
        results = []
        for r in trace.requests:
            h = handles.get(r.id)
            if h is None and r.id not in rejected:  # scheduled after the time cap
                results.append(RequestResult(request_id=r.id, x_request_id=f"{r.id}-{index}", scheduled_s=r.at_ms / 1000.0,
                                             sent_s=r.at_ms / 1000.0, outcome=Outcome.CUT,
                                             detail="scheduled after the execution's time cap: not sent"))
                continue
            result = self._result(r, t0, h, rejected.get(r.id), cancelled_at, index)
            if h is not None and h.request_id in cut:
                result = replace(result, outcome=Outcome.CUT, detail="still running at the execution's time cap")
            results.append(result)
        # What the HTTP executor checks after the last request: the server idle again soon after.
        ends = [cancelled_at.get(h.request_id, h.finish_s) for h in handles.values()]
        client_end = max((e for e in ends if e is not None), default=t)
        drain_s = t - client_end  # the pace is read only past the floor, as the HTTP executor does
        idle_after = engine.idle and (
            drain_s <= IDLE_AFTER_S or drain_s <= leak_window_s(step_pace_s(results), IDLE_AFTER_S)
        ) and not kv_held(kv_before, engine.kv.usage)  # no step runs while idle: what is held now stays held
        ground_truth = {rid: tuple(sorted(h.delayed_by, key=_registry_order)) for rid, h in handles.items()}
        return ExecutionResult(
            trace_hash=trace.content_hash(),
            target=self.name,
            started_at=t0,
            duration_s=self._clock_s - t0,
            requests=tuple(results),
            samples=tuple(samples),
            idle_before_s=idle_before,
            idle_after=idle_after,
            ground_truth=ground_truth,
        )

    # --- helpers --------------------------------------------------------------------------

    @staticmethod
    def _steps_before_cancel(engine: Engine, cancel_after: dict[int, int]) -> int:
        """Decode steps the fast path may take before some client cancels."""
        steps = _MAX_FAST_STEPS
        if cancel_after:
            for req in engine.running():
                limit = cancel_after.get(id(req))
                if limit is not None:
                    steps = min(steps, limit - req.generated)
        return steps

    @staticmethod
    def _cancel(
        engine: Engine, progressed: list[SimRequest], t: float, cancel_after: dict[int, int], cancelled_at: dict[str, float]
    ) -> None:
        """Clients that asked to cancel after N tokens close their connection once they have them."""
        for req in progressed:
            limit = cancel_after.get(id(req))
            if limit is not None and req.generated >= limit and not req.finished and req.request_id not in cancelled_at:
                del cancel_after[id(req)]  # once: a server that leaks the abort runs it on
                engine.abort(req, t)
                # The client leaves once it has read its tokens: later than the step where the frontend lags.
                cancelled_at[req.request_id] = max(t, req.token_times_s[limit - 1])

    def _check(self, r: Request) -> str | None:
        """The 400 a vLLM-like server would answer, or None."""
        cfg = self.config
        if r.prompt_tokens + r.max_tokens > cfg.max_model_len:
            return (
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
                f"{r.prompt_tokens + r.max_tokens} tokens ({r.prompt_tokens} in the messages, "
                f"{r.max_tokens} in the completion). Please reduce the length of the messages or completion."
            )
        if r.max_tokens > self.engine.max_request_tokens(r.prompt_tokens, r.n):
            return f"n={r.n} x max_tokens={r.max_tokens} does not fit the KV cache ({cfg.kv_capacity_tokens} tokens)"
        return None

    def _prompt(self, trace: Trace, r: Request, index: int) -> list[int]:
        prefix_len = trace.prefix_tokens(r)
        tokens: list[int] = []
        if prefix_len:
            tokens.extend(_salted(f"{self.seed}:{index}:prefix:{r.prefix}", prefix_len))
        tokens.extend(_salted(f"{self.seed}:{index}:private:{r.id}", r.prompt_tokens - prefix_len))
        return tokens

    def _sample(self, t_s: float) -> MetricSample:
        e = self.engine
        s = e.stats
        return MetricSample(
            t_s=t_s,
            values={
                "running": float(e.num_running),
                "waiting": float(e.num_waiting),
                "kv_usage": e.kv.usage,
                "preemptions": float(s.preemptions),
                "prefix_cache_hits": float(s.prefix_cache_hits),
                "prefix_cache_queries": float(s.prefix_cache_queries),
                "prompt_tokens": float(s.prompt_tokens),
                "generation_tokens": float(s.generation_tokens),
            },
        )

    @staticmethod
    def _result(
        r: Request,
        t0: float,
        h: SimRequest | None,
        rejection: str | None,
        cancelled_at: dict[str, float],
        index: int,
    ) -> RequestResult:
        sent = r.at_ms / 1000.0
        common = {"request_id": r.id, "x_request_id": f"{r.id}-{index}", "scheduled_s": sent, "sent_s": sent}
        if h is None:
            return RequestResult(
                **common, outcome=Outcome.REJECTED, http_status=400, detail=rejection, e2e_s=0.0, first_event_s=0.0
            )
        send_abs = t0 + sent
        times = [tt - send_abs for tt in h.token_times_s]
        if h.request_id in cancelled_at:
            # What the client read before it left: up to its token count, or up to its time.
            times = [x for x in times if x <= cancelled_at[h.request_id] - send_abs][: r.cancel_after_tokens]
            return RequestResult(
                **common,
                outcome=Outcome.CANCELLED,
                ttft_s=times[0] if times else None,
                first_event_s=times[0] if times else None,
                token_times_s=tuple(times),
                e2e_s=cancelled_at[h.request_id] - send_abs,
            )
        if h.finish_s is None:
            return RequestResult(**common, outcome=Outcome.TIMEOUT, detail="the simulated engine never finished it")
        # Its last token may reach it after the engine finished it (a frontend behind: logprobs-redetokenize).
        e2e = max(h.finish_s, *h.token_times_s[-1:]) - send_abs
        usage = {
            "finish_reason": h.finish_reason,
            "prompt_tokens": h.prompt_len,
            "completion_tokens": h.generated * h.n,
            "cached_tokens": h.cached_tokens or 0,
            "http_status": 200,
        }
        if r.stream:
            return RequestResult(
                **common,
                outcome=Outcome.OK,
                ttft_s=times[0] if times else None,
                first_event_s=times[0] if times else e2e,
                token_times_s=tuple(times),
                e2e_s=e2e,
                **usage,
            )
        return RequestResult(**common, outcome=Outcome.OK, first_event_s=e2e, e2e_s=e2e, **usage)


def _salted(key: str, count: int) -> list[int]:
    """``count`` token ids unique to ``key`` (consecutive ids from a hashed base)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    base = _TOKEN_BASE + (int.from_bytes(digest, "little") << 20)
    return list(range(base, base + count))


def _registry_order(name: str) -> int:
    return NAMES.index(name)
