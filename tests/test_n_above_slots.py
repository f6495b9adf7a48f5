"""A request asking for more choices (n) than the server has slots: modelled, probed, never fatal."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import numpy as np
from aiohttp import web
from loopback import serving

from fuzzer.execute import adapters
from fuzzer.execute.adapters import ServerInfo
from fuzzer.oracle.calibrate import calibrate
from fuzzer.oracle.expectation import expect, paper_schedule
from fuzzer.oracle.judge import judge
from fuzzer.oracle.model import SchedulerAssumption, StepModel
from fuzzer.sim import VirtualTarget
from fuzzer.trace import Request, Trace

MODEL = StepModel(overhead_s=0.004, prefill_token_s=30e-6, decode_seq_s=20e-6, context_token_s=1e-8,
                  request_overhead_s=0.002)
FOUR_SLOTS = SchedulerAssumption(max_num_seqs=4, source="a 4-slot llama-server")


def _trace(n: int) -> Trace:
    return Trace(requests=(
        Request(id="a", at_ms=0, prompt_tokens=256, max_tokens=16, n=n, temperature=1.0),
        Request(id="b", at_ms=1, prompt_tokens=64, max_tokens=4),
    ))


def test_choices_beyond_the_slots_wait_for_free_slots():
    four = paper_schedule(_trace(4), MODEL, FOUR_SLOTS)
    eight = paper_schedule(_trace(8), MODEL, FOUR_SLOTS)
    twelve = paper_schedule(_trace(12), MODEL, FOUR_SLOTS)
    # Choice 0 (the one a client times) runs in the first wave, as with n = slots ...
    assert eight["a"].token_times_s == four["a"].token_times_s
    # ... the others follow in further waves of at most 4, so the request ends later each wave ...
    assert four["a"].e2e_s < eight["a"].e2e_s < twelve["a"].e2e_s
    # ... and a request behind it gets a slot only when the last wave has taken its own.
    assert four["b"].ttft_s < eight["b"].ttft_s
    # With slots for every choice there are no waves.
    roomy = SchedulerAssumption(max_num_seqs=8)
    assert paper_schedule(_trace(8), MODEL, roomy)["a"].e2e_s < eight["a"].e2e_s
    # The idle expectation (the request alone) is modelled the same way.
    assert expect(_trace(8), MODEL, FOUR_SLOTS)["a"].idle_e2e_s > expect(_trace(4), MODEL, FOUR_SLOTS)["a"].idle_e2e_s


def test_the_oracle_judges_a_trace_with_n_above_the_slots():
    target = VirtualTarget(seed=3)
    cal = asyncio.run(calibrate(target, rng=random.Random(0), max_model_len=target.config.max_model_len))
    cal = cal.with_assumption(FOUR_SLOTS)
    trace = _trace(8)
    results = [target.run(trace) for _ in range(3)]
    verdicts = judge(trace, results, cal, rng=np.random.default_rng(0))
    assert {v.request_id for v in verdicts} == {"a", "b"}


async def _probe(limit: int | None, logprobs: int | None = None) -> dict:
    """Capabilities probed from a server that refuses n above ``limit`` (None: any n; 1: n > 1), and
    logprobs above ``logprobs`` (None: any)."""

    async def completions(request):
        body = await request.json()
        if limit is not None and body.get("n", 1) > limit:
            return web.json_response({"error": {"message": "n exceeds the number of slots"}}, status=400)
        if logprobs is not None and body.get("logprobs", 0) > logprobs:
            return web.json_response({"error": {"message": "logprobs above --max-logprobs"}}, status=400)
        return web.json_response({"choices": [{"text": "x"}], "usage": {"prompt_tokens": 2, "completion_tokens": 1}})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serving(app) as url, aiohttp.ClientSession() as session:
        return await adapters.probe_capabilities(session, url, adapters.adapter("openai"), None, headers={})


async def test_the_probe_records_the_largest_n_a_server_accepts():
    for limit, expected in ((4, 4), (2, 2), (1, 1), (None, None)):
        caps = await _probe(limit)
        assert caps["n"] is (limit != 1)
        assert caps.get(adapters.MAX_N) == (expected if limit not in (1, None) else None)
        info = ServerInfo(kind="openai", version=None, model=None, max_model_len=None, capabilities=caps)
        assert info.max_n == expected
        assert info.accepts("n") is (limit != 1)


async def test_the_probe_records_the_largest_logprobs_a_server_accepts():
    # heldout11 refuses logprobs above 5 (its --max-logprobs): every request the mutators gave 20 was
    # rejected, the option's load never put on the server.
    from fuzzer.execute.harness import status_outcome
    from fuzzer.execution import Outcome

    for limit, expected in ((5, 5), (1, 1), (None, None)):
        caps = await _probe(None, logprobs=limit)
        assert caps["logprobs"] and caps.get(adapters.MAX_LOGPROBS) == expected
        info = ServerInfo(kind="openai", version=None, model=None, max_model_len=None, capabilities=caps)
        assert info.max_logprobs == expected
        over = Request(id="x", at_ms=0, prompt_tokens=8, max_tokens=2, logprobs=20)
        assert status_outcome(400, over, info) is (Outcome.REJECTED if limit is None else Outcome.UNSUPPORTED)
