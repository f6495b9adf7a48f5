"""Real time the simulator's virtual-time target takes per execution (issue 3: "a 6-request
trace in a few milliseconds of real time").

    .venv/bin/python benchmarks/virtual_speed.py [--repeats 50] [--pathologies none]

Runs every corpus trace on one warm ``VirtualTarget`` (``run``, the synchronous entry the
campaign benchmarks use) ``--repeats`` times each, interleaved so that machine noise spreads
over all traces alike, and prints a Markdown table: requests, output tokens, virtual
seconds of one run, real milliseconds per run (best, median, p90).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from fuzzer import trace as trace_format
from fuzzer.sim import VirtualTarget

CORPUS = Path(__file__).resolve().parent.parent / "corpus"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--pathologies", default="none")
    args = parser.parse_args()

    traces = {p.name: trace_format.load(p) for p in sorted(CORPUS.glob("*.json"))}
    target = VirtualTarget(pathologies=args.pathologies, seed=0)
    virtual_s = {}
    for name, trace in traces.items():  # warm-up run, and the virtual duration
        virtual_s[name] = target.run(trace).duration_s
    times: dict[str, list[float]] = {name: [] for name in traces}
    for _ in range(args.repeats):
        for name, trace in traces.items():
            start = time.perf_counter()
            target.run(trace)
            times[name].append(time.perf_counter() - start)

    print(f"{args.repeats} runs per trace, pathologies: {args.pathologies}\n")
    print("| trace | requests | output tokens | virtual s | real ms: best | median | p90 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, trace in traces.items():
        ms = sorted(t * 1000 for t in times[name])
        tokens = sum(r.max_tokens * r.n for r in trace.requests)
        p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
        print(f"| {name} | {len(trace.requests)} | {tokens} | {virtual_s[name]:.3f} | {ms[0]:.2f} | "
              f"{statistics.median(ms):.2f} | {p90:.2f} |")


if __name__ == "__main__":
    main()
