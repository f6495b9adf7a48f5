"""Where a campaign's server time goes, for two checkouts of the fuzzer side by side.

Runs ``fuzz campaign`` (the README's main job: the built-in simulator over HTTP, its
default pathologies) for ``--duration`` with each seed, alternating between this checkout
and ``--before`` (another checkout of the project, e.g. ``git worktree add /tmp/before
REV``; it runs with this venv's packages, its own ``fuzzer`` first on the path), then reads
``fuzz status --json`` and ``fuzz findings --json`` of each database.

    .venv/bin/python benchmarks/campaign_time.py --before /tmp/before --seeds 1 2 --duration 3m
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def run(checkout: Path, seed: int, duration: str, extra: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "c.db"
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "fuzzer", "campaign", "--duration", duration, "--seed", str(seed),
                               "--db", str(db), *extra], cwd=checkout, env=env, capture_output=True, text=True)
        wall = time.monotonic() - started
        if done.returncode != 0:
            return {"checkout": str(checkout), "seed": seed, "rc": done.returncode, "stderr": done.stderr[-2000:]}
        status = json.loads(subprocess.run([sys.executable, "-m", "fuzzer", "status", "--db", str(db), "--json"],
                                           cwd=checkout, env=env, capture_output=True, text=True, check=True).stdout)
        found = json.loads(subprocess.run([sys.executable, "-m", "fuzzer", "findings", "--db", str(db), "--json"],
                                          cwd=checkout, env=env, capture_output=True, text=True, check=True).stdout)
    return {"checkout": str(checkout), "seed": seed, "rc": 0, "wall_s": wall, "status": status,
            "findings": [{k: f.get(k) for k in ("id", "kind", "slowdown", "reproduced", "requests")} for f in found]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="the other checkout")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--duration", default="3m")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/campaign_time.jsonl"))
    ap.add_argument("extra", nargs="*", help="more `fuzz campaign` arguments (after --)")
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for seed in args.seeds:
            for checkout in (args.before.resolve(), HERE):
                row = run(checkout, seed, args.duration, args.extra)
                row["load"] = os.getloadavg()
                f.write(json.dumps(row) + "\n")
                f.flush()
                st = row.get("status", {})
                print(f"{'before' if checkout != HERE else 'after '} seed {seed}: rc {row['rc']}, "
                      f"{json.dumps(st.get('executions'))} executions, time {json.dumps(st.get('time_by_phase_s'))}, "
                      f"{len(row.get('findings', []))} findings, load {row['load'][0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
