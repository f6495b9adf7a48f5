"""The worker of a fleet campaign: runs next to one engine and owns it (a Ray actor, see pool.py).

TTFT taken across a network carries the network's jitter, which the oracle cannot tell from
the server's; so the client that measures runs on the target's node, and judges its
executions by a calibration of its own target. The worker's typed tasks:

- :meth:`Worker.start`: open the target (connect, or launch it), calibrate (or reuse the
  stored calibration while fresh); returns what the coordinator records.
- :meth:`Worker.execute`: run one trace, return the execution, its candidates (by this
  target's calibration) and its coverage.
- :meth:`Worker.confirm`: re-run a trace until the oracle decides a candidate; returns the
  verdict and every run (the coordinator stores them: it is the only writer). A candidate of
  kind ``option-slowdown`` (its detail the option) is the option's test against the trace
  without it (fuzzer.oracle.ablation.confirm_option).

With ``--duration`` each task comes with a :class:`TimeCap` (the campaign's duration and how
far into it the task was sent): every run of the task is capped as a campaign caps its
executions (fuzzer.search.pacing.execution_cut_s), by the end of the trace's FCFS schedule
under this worker's calibration.

Plain Python with its own event loop on its own thread (an actor's methods are called one at a time); values
crossing Ray are the seam's frozen dataclasses and plain dicts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuzzer.execution import ExecutionResult
from fuzzer.fleet.targets import FleetTarget
from fuzzer.oracle import judge
from fuzzer.oracle.ablation import confirm_option
from fuzzer.oracle.calibrate import reuse_or_calibrate, with_target_kv
from fuzzer.oracle.calibration import Calibration
from fuzzer.oracle.capcheck import cap_checked, probe_cap
from fuzzer.oracle.confirm import confirm
from fuzzer.oracle.kinds import FindingKind
from fuzzer.oracle.policy import OraclePolicy
from fuzzer.search.confirming import candidate_from_dict, candidate_to_dict
from fuzzer.search.cuts import ConfirmationTarget, Cuts, confirmation_cut_s
from fuzzer.search.coverage import Coverage, calibrated
from fuzzer.search.crashes import crash_needs
from fuzzer.search.mutators import Limits
from fuzzer.search.pacing import ScheduleEnds, earliest_cut_s, execution_budget_s, execution_cut_s
from fuzzer.trace import Trace

API_KEY_ENV = "OPENAI_API_KEY"


@dataclass(frozen=True)
class TimeCap:
    """What a worker needs to cap a task's runs as a campaign with ``--duration`` caps its executions."""

    duration_s: float
    #: Seconds into the campaign when the coordinator sent the task.
    elapsed_s: float


@dataclass(frozen=True)
class Executed:
    """One execution on a worker's target, judged there."""

    result: ExecutionResult
    #: Candidates by the worker's calibration, worst first (``candidate_to_dict`` form).
    candidates: tuple[dict, ...]
    coverage: Coverage
    #: Seconds the worker spent on the task (the execution and judging it).
    busy_s: float


@dataclass(frozen=True)
class Confirmed:
    """A confirmation on a worker's target: the verdict and every run it took."""

    verdict: dict
    runs: tuple[ExecutionResult, ...]
    busy_s: float
    #: For a confirmed crash of a launched server: the request traits it needs (fuzzer.search.crashes).
    crash_needs: tuple[str, ...] = ()


class Worker:
    """Owns one target of the fleet; see the module doc."""

    def __init__(self, target: FleetTarget, *, seed: int, policy: dict[str, Any] | None = None,
                 futility: bool = True, max_age_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.spec = target
        #: Times a task's runs into the campaign (its TimeCap's elapsed_s is when it was sent).
        self._clock = clock
        self._seed = seed
        self._rng = random.Random(seed)
        self._np_rng = np.random.default_rng(seed)
        self._policy = OraclePolicy(**(policy or {}))
        self._futility = futility
        #: Whether confirmation re-runs may end with their candidate's request (as a campaign's, see
        #: fuzzer.search.cuts.Cuts): not for traces whose cut run left this worker's server busy.
        self._cuts = Cuts()
        self._max_age_s = max_age_s
        # Its own event loop on a thread of its own: the actor's calling thread may run Ray's.
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name=f"fleet-{target.name}", daemon=True).start()
        self._stack = contextlib.AsyncExitStack()
        self._target = None
        self.calibration: Calibration | None = None
        #: When each trace's FCFS schedule ends, under the calibration of the moment.
        self._ends = ScheduleEnds()
        #: The calibration with the long-prefill cap probed at a prompt size (fuzzer.oracle.capcheck.cap_checked).
        self._caps: dict[tuple[float, int], Calibration] = {}

    # --- tasks -----------------------------------------------------------------------

    def start(self, stored_calibration: dict | None = None) -> dict[str, Any]:
        """Open the target and calibrate it; what the coordinator records of it."""
        self._target = self._run(self._open())
        measured: list[Calibration] = []
        stored = None if stored_calibration is None else Calibration.from_dict(stored_calibration)
        extra = {} if self._max_age_s is None else {"max_age_s": self._max_age_s}
        self.calibration = self._run(reuse_or_calibrate(
            self._target, stored, rng=lambda: random.Random(self._rng.getrandbits(64)), save=measured.append, **extra,
        ))
        info = self._target.info
        return {
            "name": self.spec.name,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "kind": info.kind if info else "unknown",
            "model": info.model if info else None,
            "version": info.version if info else None,
            "capabilities": dict(info.capabilities) if info else {},
            "limits": limits_of(info).to_dict(),
            "measured": measured[-1].to_dict() if measured else None,
        }

    def execute(self, trace: Trace, cap: TimeCap | None = None) -> Executed:
        start = time.perf_counter()
        result = self._run(self._target.execute(trace, cut_s=self._capper(cap)(trace)))
        assert self.calibration is not None
        if self.calibration.assumption.kv_blocks is None:
            self.calibration = with_target_kv(self.calibration, self._target)
        found = []
        for c in judge.candidates(trace, result, self.calibration, self._policy):
            # An inversion that rests on no cap: the cap probed at its size first, as a campaign's (oracle/capcheck.py).
            judged, stands = self._run(cap_checked(lambda cal, n: probe_cap(self._target, cal, n), self._caps, trace,
                                                   result, c, self.calibration, self._policy))
            if judged.assumption.long_prefill_threshold:
                self.calibration = judged
            if stands:
                found.append(c)
        coverage = calibrated(trace, result, self.calibration)
        return Executed(result, tuple(candidate_to_dict(c) for c in found), coverage, time.perf_counter() - start)

    def confirm(self, trace: Trace, candidate: dict, cap: TimeCap | None = None) -> Confirmed:
        """Confirm ``candidate`` on ``trace``; an option-slowdown's is the test of its option (its detail)."""
        start = time.perf_counter()
        runs: list[ExecutionResult] = []
        assert self.calibration is not None
        recording = _Recording(self._target, runs, self._capper(cap))
        target = ConfirmationTarget(recording, lambda t, cut_s: recording.execute(t, cut_s=cut_s), self._cuts)
        wanted = candidate_from_dict(candidate)
        if wanted.kind is FindingKind.OPTION_SLOWDOWN:
            verdict = self._run(confirm_option(target, trace, wanted.detail, policy=self._policy,
                                               futility=self._futility, cut_s=confirmation_cut_s(wanted)))
        else:
            verdict = self._run(confirm(target, trace, wanted, self.calibration, rng=self._np_rng,
                                        policy=self._policy, futility=self._futility,
                                        cut_s=confirmation_cut_s(wanted)))
        needs: tuple[str, ...] = ()
        restarts_left = getattr(self._target, "restarts_left", None)
        if wanted.kind is FindingKind.CRASH and verdict.is_finding and restarts_left is not None:
            # Only a launched server, which this worker starts again: one nobody restarts would stay down.
            async def crashes(t: Trace) -> bool:
                return judge.crashed(await target.execute(t))

            needs = self._run(crash_needs(trace, crashes, restarts_left))
        return Confirmed(verdict.to_dict(), tuple(runs), time.perf_counter() - start, needs)

    def _capper(self, cap: TimeCap | None) -> Callable[[Trace], float | None]:
        """The time cap of each run of a task sent with ``cap`` (None: no --duration, no cap), as a campaign's
        (fuzzer.search.pacing.execution_cut_s): the task's time on this worker is added to its elapsed_s."""
        received = self._clock()

        def cut_s(trace: Trace) -> float | None:
            if cap is None:
                return None
            elapsed_s = cap.elapsed_s + self._clock() - received
            expected = self.expected_end_s(trace, beyond=execution_budget_s(cap.duration_s))
            return execution_cut_s(cap.duration_s, elapsed_s, expected, self._policy.factor)

        return cut_s

    def expected_end_s(self, trace: Trace, *, beyond: float | None = None) -> float | None:
        """When ``trace`` would end by its FCFS bounds under this worker's calibration (None: not calibrated, or
        well within ``beyond``), as a campaign's (fuzzer.search.pacing.ScheduleEnds)."""
        return self._ends.end_s(trace, self.calibration, beyond=beyond)

    def ping(self) -> str:
        return self.spec.name

    def stop(self) -> None:
        """Close the target (a launched server is stopped with its process group)."""
        with contextlib.suppress(Exception):
            self._run(self._stack.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)

    # --- the target ------------------------------------------------------------------

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _open(self):
        from fuzzer.execute.http import HttpTarget  # noqa: PLC0415 - aiohttp only where traces run

        spec = self.spec
        options: dict[str, Any] = {"server": spec.server, "model": spec.model, "rng": random.Random(self._seed),
                                   "api_key": os.environ.get(API_KEY_ENV) or None}
        if spec.timeout_s is not None:
            options["timeout_s"] = spec.timeout_s
        if spec.launch is None:
            return await self._stack.enter_async_context(HttpTarget(spec.url, **options))
        from fuzzer.execute.launch import ManagedServer  # noqa: PLC0415
        from fuzzer.execute.managed import ManagedTarget  # noqa: PLC0415

        server = ManagedServer(spec.launch)
        self._stack.callback(server.close)
        url = await server.start()
        http = await self._stack.enter_async_context(HttpTarget(url, told=server.told(), **options))
        return ManagedTarget(http, server, sleep=asyncio.sleep)


class _Recording:
    """The worker's target for a confirmation: every run is kept for the coordinator to store, and capped
    by ``cut_s`` (trace -> its time cap, None: none) as a campaign caps its confirmation runs."""

    def __init__(self, target, runs: list[ExecutionResult],
                 cut_s: Callable[[Trace], float | None] = lambda trace: None):
        self._target = target
        self._runs = runs
        self._cut_s = cut_s
        self.name = target.name
        fresh_start = getattr(target, "fresh_start", None)
        if fresh_start is not None:
            self.fresh_start = fresh_start

    async def execute(self, trace: Trace, *, cut_s: float | None = None) -> ExecutionResult:
        result = await self._target.execute(trace, cut_s=earliest_cut_s(self._cut_s(trace), cut_s))
        self._runs.append(result)
        return result


def limits_of(info, kv: tuple[int, int] | None = None) -> Limits:
    """What the mutators must respect on a target of this ServerInfo (None: the defaults); ``kv``:
    (blocks, tokens per block) of a target that tells them without a ServerInfo (the simulator)."""
    if info is None:
        return Limits() if kv is None else Limits(kv_tokens=kv[0] * kv[1])
    unsupported = frozenset(name for name, ok in (info.capabilities or {}).items() if ok is False)
    max_len = info.max_model_len or Limits().max_model_len
    kv = info.kv_cache() or kv
    return Limits(max_model_len=max_len, unsupported=unsupported & {"chat", "n", "logprobs"}, max_n=info.max_n,
                  max_logprobs=info.max_logprobs,
                  kv_tokens=None if kv is None else kv[0] * kv[1])
