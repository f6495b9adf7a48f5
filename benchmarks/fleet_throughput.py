"""Fleet campaigns (issue 18): executions per minute with 1, 2 and 4 simulated HTTP targets.

    .venv/bin/python benchmarks/fleet_throughput.py [--duration 60] [--speed 10] [--targets 1,2,4]

One local Ray (``--cpus``, default all), four built-in simulators on 127.0.0.1 (speed-scaled,
no pathology planted, distinct seeds), calibrated once into a template database. Then, side
by side in one run, a fleet campaign of ``--duration`` seconds on the first 1, 2 and 4 of
them (the order repeated ``--rounds`` times), each on a copy of the template. Per run:

- executions per minute over the steady span (first execution's start to the last one's
  end, every execution the coordinator stored: seed, fuzz, sync, confirm, recheck);
- speed-up over one target and its share of linear (n targets: n times one target's rate);
- the coordinator's CPU time per execution (``time.process_time`` of this process, which is
  the coordinator: workers and simulators are other processes) and its share of the span.

The machine's load (``/proc/loadavg``) is printed before and after each run: figures taken
while other jobs shared the cores say so. Prints a Markdown table for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fuzzer import trace as tf
from fuzzer.fleet.coordinator import Coordinator
from fuzzer.fleet.pool import RayPool
from fuzzer.fleet.targets import FleetTarget
from fuzzer.fleet.worker import Worker
from fuzzer.search.settings import Settings
from fuzzer.sim.process import SimProcess
from fuzzer.store import Store

CORPUS = Path(__file__).resolve().parents[1] / "corpus"


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def calibrate_all(targets: list[FleetTarget], db: Path) -> None:
    with Store.open(db) as store, ThreadPoolExecutor(len(targets)) as threads:
        workers = [Worker(t, seed=i) for i, t in enumerate(targets)]
        for t, info in zip(targets, threads.map(lambda w: w.start(), workers)):
            store.save_calibration(t.identity, info["measured"])
        for w in workers:
            w.stop()


def steady_rate(db: Path) -> tuple[int, float]:
    """(executions, per minute over the span from the first start to the last end)."""
    with sqlite3.connect(db) as c:
        n, first, last = c.execute("select count(*), min(started_at), max(started_at + duration_s) from executions").fetchone()
    return n, 60.0 * n / (last - first) if n and last > first else 0.0


def run_one(targets: list[FleetTarget], template: Path, folder: Path, duration_s: float, seed: int) -> dict:
    db = folder / f"fleet-{len(targets)}-{seed}.db"
    shutil.copy(template, db)
    seeds = [tf.load(p) for p in sorted(CORPUS.glob("*.json"))]
    before = load()
    pool = RayPool("auto")
    try:
        with Store.open(db) as store:
            summary = Coordinator(pool, targets, store, Settings(duration_s=duration_s, seed=seed), seeds=seeds).run()
    finally:
        pool.close()
    n, rate = steady_rate(db)
    cpu = summary.coordinator_cpu_per_exec_s or 0.0
    return {"targets": len(targets), "executions": n, "per_min": rate, "cpu_ms": 1000 * cpu,
            "cpu_share": cpu * rate / 60.0, "load_before": before, "load_after": load(),
            "findings": len(summary.new_findings)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per fleet campaign")
    parser.add_argument("--speed", type=float, default=10.0, help="simulator speed-up")
    parser.add_argument("--targets", default="1,2,4", help="fleet sizes to run, side by side")
    parser.add_argument("--rounds", type=int, default=1, help="times the sizes are run, in turn")
    parser.add_argument("--cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    args = parser.parse_args()
    import ray

    sizes = [int(x) for x in args.targets.split(",")]
    print(f"machine: {os.cpu_count()} CPUs, load {load()}", flush=True)
    ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    sims = [SimProcess(speed=args.speed, seed=i) for i in range(max(sizes))]
    rows = []
    try:
        for sim in sims:
            sim.start()
        targets = [FleetTarget(f"sim{i}", url=sim.url) for i, sim in enumerate(sims)]
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            template = folder / "template.db"
            calibrate_all(targets, template)
            for r in range(args.rounds):
                for n in sizes:
                    row = run_one(targets[:n], template, folder, args.duration, seed=r)
                    rows.append(row)
                    print(row, flush=True)
    finally:
        for sim in sims:
            sim.stop()
        ray.shutdown()
    one = [r["per_min"] for r in rows if r["targets"] == 1]
    base = sum(one) / len(one) if one else None
    print("\n| targets | executions | executions/min | speed-up | of linear | coordinator CPU/execution | "
          "coordinator CPU share | load before / after |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        up = r["per_min"] / base if base else float("nan")
        print(f"| {r['targets']} | {r['executions']} | {r['per_min']:.0f} | {up:.2f}x | {up / r['targets']:.0%} | "
              f"{r['cpu_ms']:.1f} ms | {r['cpu_share']:.1%} | {r['load_before']} / {r['load_after']} |")


if __name__ == "__main__":
    main()
