"""Minimization on the simulator: requests left, executions used, wall time (virtual and HTTP).

    .venv/bin/python benchmarks/minimization.py [--http] [--seeds 3]

Cases (each on a simulator with only the named pathology on):

- ``vllm-37308 / cold-start``: corpus/vllm-37308.json. On a warm simulator its requests
  never wait together, so it does not trigger hol-prefix-burst; its first run after an
  idle period is slow: a cold-start finding.
- ``hol-prefix-burst trigger``: the trigger trace of fuzzer.sim.triggers (nine requests).
- ``n-logprobs``: corpus/n-logprobs.json on logprobs-batch-cost (seven requests; the
  one tests/test_reduction.py minimizes).

For each: calibrate, examine the trace as ``fuzz replay`` does (3 runs, judge, confirm),
store the first confirmed finding on the victim request, then ``minimize_finding`` it
exactly as ``fuzz minimize`` does (every run of a candidate must reproduce at 1.25x the
report threshold, 10-run final confirmation). Counted: the minimizer's executions, the
final confirmation included (the examination before it is not).
With --http the same runs go over HTTP to a SimProcess (cold-start waits out real idle
periods there: COLD_IDLE_S per check).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from pathlib import Path

import numpy as np

from fuzzer import trace as tf
from fuzzer.oracle.calibrate import calibrate
from fuzzer.oracle.confirm import examine, let_idle
from fuzzer.oracle.policy import COLD_IDLE_S
from fuzzer.shrink.finding import minimize_finding
from fuzzer.sim import VirtualTarget
from fuzzer.sim import pathologies as P
from fuzzer.sim.triggers import TRIGGERS
from fuzzer.store import Store
from fuzzer.trace import Trace

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "vllm-37308": (P.COLD_START, ROOT / "corpus" / "vllm-37308.json", "r08"),
    "hol-prefix-burst trigger": (P.HOL_PREFIX_BURST, None, TRIGGERS[P.HOL_PREFIX_BURST].victim),
    "n-logprobs": (P.LOGPROBS_BATCH_COST, ROOT / "corpus" / "n-logprobs.json", "b4"),
}


async def _no_sleep(seconds: float) -> None:
    return None


@contextlib.asynccontextmanager
async def _target(pathology: str, seed: int, http: bool):
    if not http:
        yield VirtualTarget(pathologies=(pathology,), seed=seed), _no_sleep
        return
    from fuzzer.execute.http import HttpTarget
    from fuzzer.sim.process import SimProcess

    async with SimProcess(pathologies=(pathology,), seed=seed) as sim, \
            HttpTarget(sim.url, rng=random.Random(seed)) as target:
        yield target, asyncio.sleep


async def one_case(name: str, seed: int, http: bool) -> dict:
    pathology, path, victim = CASES[name]
    trace: Trace = tf.load(path) if path else TRIGGERS[pathology].trace
    async with _target(pathology, seed, http) as (target, sleep):
        calibration = await calibrate(target, rng=random.Random(seed))
        rng = np.random.default_rng(seed)
        if pathology == P.COLD_START:
            await let_idle(target, COLD_IDLE_S, sleep)  # the morning after: the server sat idle
        exam = await examine(target, trace, calibration, rng=rng, sleep=sleep)
        verdict = next((v for v in exam.findings if v.request_id == victim), None)
        verdict = verdict or next(iter(exam.findings), None)
        if verdict is None:
            return {"case": name, "seed": seed, "http": http, "finding": None}
        store = Store.memory()
        fid, _ = store.add_finding(kind=str(verdict.kind), signature=verdict.signature or "x", trace=trace,
                                   verdict=verdict.to_dict(), slowdown=verdict.slowdown,
                                   reproduced=verdict.reproduction, details={"request_id": verdict.request_id})
        virtual_start = getattr(target, "now_s", 0.0)
        start = time.perf_counter()
        reduction = await minimize_finding(store, store.get_finding(fid), target, calibration, sleep=sleep, seed=seed)
        wall = time.perf_counter() - start
        r = reduction.result
        return {
            "case": name, "seed": seed, "http": http, "finding": f"{verdict.kind} on {verdict.request_id}",
            "requests_before": len(trace.requests), "requests_after": len(r.minimized.requests),
            "executions": r.executions, "tests": r.tests, "stop": str(r.stop), "reproduced": r.reproduction,
            "wall_s": wall, "virtual_s": getattr(target, "now_s", 0.0) - virtual_start if not http else None,
            "minimized": tf.dumps(r.minimized, indent=None), "others": len(reduction.others),
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--http", action="store_true", help="over HTTP to a SimProcess instead of virtual time")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args(argv)
    print("| case | seed | transport | finding | requests before -> after | executions (tests) | stop | final k/10 | wall s | virtual s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.cases.split(","):
        for seed in range(args.seeds):
            row = asyncio.run(one_case(name, seed, args.http))
            if row["finding"] is None:
                print(f"| {name} | {seed} | {'HTTP' if args.http else 'virtual'} | none confirmed | | | | | | |", flush=True)
                continue
            virtual = "-" if row["virtual_s"] is None else f"{row['virtual_s']:.0f}"
            print(f"| {name} | {seed} | {'HTTP' if args.http else 'virtual'} | {row['finding']} | "
                  f"{row['requests_before']} -> {row['requests_after']} | {row['executions']} ({row['tests']}) | "
                  f"{row['stop']} | {row['reproduced']} | {row['wall_s']:.1f} | {virtual} |", flush=True)
            print(f"<!-- minimized: {row['minimized']} -->", flush=True)


if __name__ == "__main__":
    main()
