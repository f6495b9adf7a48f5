"""A test target with a known step model, noise and planted faults (oracle and calibration tests).

Timings come from the paper FCFS scheduler of fuzzer.oracle.expectation with a known
StepModel, so a calibration can be checked against the truth and an oracle against
exactly planted faults, independently of the simulator. Virtual time: nothing sleeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from fuzzer.execution import ExecutionResult, Outcome, RequestResult
from fuzzer.oracle.expectation import paper_schedule
from fuzzer.oracle.model import SchedulerAssumption, StepModel
from fuzzer.trace import Trace

TRUE_MODEL = StepModel(overhead_s=0.004, prefill_token_s=35e-6, decode_seq_s=80e-6, context_token_s=2e-8,
                       request_overhead_s=0.003)

CLIENT_TIMEOUT_S = 60.0


class PaperTarget:
    """Executes traces on paper, with multiplicative noise per token gap and planted faults.

    - ``delay_s``: request id -> seconds added before its first token (a scheduler stall);
    - ``stall_s``: request id -> seconds added to one inter-token gap in mid-stream;
    - ``cold_penalty_s``: added to every request's first token when the server had been
      idle at least ``cold_after_s`` (a cold start);
    - ``fail``: request id -> Outcome it ends with; ``leak``: idle_after is False;
    - ``seeded_slowdown``: every token gap of every request is this many times longer in a trace
      where some request has a sampling seed and some has none (one seeded row slows the batch,
      vllm-omni#6178; seeded rows alone take the per-row path at no extra cost); with
      ``seeded_alone``, seeded rows alone are that much slower too (the option's own cost);
    - ``seeded_row_s``: each seeded row (a seeded request's choices) adds this to every token gap of
      every request of the trace: a per-row sampler cost, which FCFS charges to every step the rows
      share (heldout7's clean logprobs, stop 42); ``seeded_batch_s``: with a seeded row in the trace,
      every row of the batch adds this to every token gap after the first of every request (a sampler that
      computes for the whole batch when one row asks: heldout12's bug5, vllm#37343).
    """

    def __init__(
        self,
        model: StepModel = TRUE_MODEL,
        *,
        noise: float = 0.03,
        seed: int = 0,
        delay_s: Mapping[str, float] | None = None,
        stall_s: Mapping[str, float] | None = None,
        cold_penalty_s: float = 0.0,
        cold_after_s: float = 5.0,
        idle_gap_s: float = 0.5,
        fail: Mapping[str, Outcome] | None = None,
        fail_every_run: bool = True,
        leak: bool = False,
        assumption: SchedulerAssumption | None = None,
        seeded_slowdown: float = 1.0,
        seeded_alone: bool = False,
        seeded_row_s: float = 0.0,
        seeded_batch_s: float = 0.0,
    ):
        self.name = "paper://known-model"
        self.model = model
        self.noise = noise
        self.rng = np.random.default_rng(seed)
        self.delay_s = dict(delay_s or {})
        self.stall_s = dict(stall_s or {})
        self.cold_penalty_s = cold_penalty_s
        self.cold_after_s = cold_after_s
        self.idle_gap_s = idle_gap_s
        self.fail = dict(fail or {})
        self.fail_every_run = fail_every_run
        self.leak = leak
        self.assumption = assumption or SchedulerAssumption()
        self.seeded_slowdown = seeded_slowdown
        self.seeded_alone = seeded_alone
        self.seeded_row_s = seeded_row_s
        self.seeded_batch_s = seeded_batch_s
        self.executions = 0
        #: A freshly started server has been idle "for ever".
        self._idle_s = 3600.0
        self._clock_s = 0.0

    def idle(self, seconds: float) -> None:
        self._idle_s += seconds
        self._clock_s += seconds

    def run(self, trace: Trace) -> ExecutionResult:
        self.executions += 1
        idle_before = self._idle_s
        cold = idle_before >= self.cold_after_s
        paper = paper_schedule(trace, self.model, self.assumption)
        seeded = {r.seed is not None for r in trace.requests}
        slowdown = self.seeded_slowdown if seeded == {True, False} or (self.seeded_alone and True in seeded) else 1.0
        rows = sum(r.n for r in trace.requests if r.seed is not None)
        batch = sum(r.n for r in trace.requests)
        results = []
        for r in trace.requests:
            p = paper[r.id]
            gaps = np.diff(np.concatenate([[0.0], p.token_times_s]))
            gaps = gaps * slowdown + self.seeded_row_s * rows
            gaps[1:] += self.seeded_batch_s * batch if rows else 0.0
            gaps = gaps * np.exp(self.rng.normal(0.0, self.noise, len(gaps)))
            gaps[0] += self.delay_s.get(r.id, 0.0) + (self.cold_penalty_s if cold else 0.0)
            if r.id in self.stall_s and len(gaps) > 2:
                gaps[len(gaps) // 2] += self.stall_s[r.id]
            times = tuple(float(x) for x in np.cumsum(gaps))
            outcome = Outcome.OK if r.cancel_after_tokens is None else Outcome.CANCELLED
            failing = r.id in self.fail and (self.fail_every_run or self.executions % 2 == 1)
            if failing:
                outcome = self.fail[r.id]
            results.append(RequestResult(
                request_id=r.id, x_request_id=f"{r.id}-{self.executions}", scheduled_s=r.at_ms / 1000,
                sent_s=r.at_ms / 1000, outcome=outcome,
                ttft_s=times[0] if r.stream and not failing else None,
                first_event_s=times[0] if r.stream and not failing else None,
                token_times_s=times if r.stream and not failing else (),
                e2e_s=None if failing else times[-1],
                prompt_tokens=r.prompt_tokens, completion_tokens=len(times),
                http_status=500 if outcome is Outcome.HTTP_ERROR else 200,
            ))
        # A request that timed out kept the client waiting for its timeout (the executor's default).
        duration = max((x.sent_s + (x.e2e_s or (CLIENT_TIMEOUT_S if x.outcome is Outcome.TIMEOUT else 0.0))
                        for x in results), default=0.0)
        self._clock_s += duration + self.idle_gap_s
        self._idle_s = self.idle_gap_s
        return ExecutionResult(
            trace_hash=trace.content_hash(), target=self.name, started_at=self._clock_s - duration,
            duration_s=duration, requests=tuple(results), idle_before_s=idle_before,
            idle_after=not self.leak,
        )

    async def execute(self, trace: Trace, *, cut_s: float | None = None) -> ExecutionResult:
        return self.run(trace)  # on paper: no time to cap

    async def aclose(self) -> None:
        pass


def with_model(target: PaperTarget, **changes) -> PaperTarget:
    target.model = replace(target.model, **changes)
    return target
