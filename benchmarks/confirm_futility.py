"""Sequential confirmation with and without its futility stop, side by side (virtual time).

For each simulator pathology and seed, a guided campaign (the same set-up as
campaign_efficiency.py: its own calibration not counted, the corpus minus the traces that
trigger the pathology by themselves) runs until its first confirmed finding on a request the
pathology really delayed, or the cap; with ``--clean`` a simulator with no pathology runs the
whole cap and every finding is a false positive. Reported per run: executions and virtual
server seconds to the first right finding, confirmation runs, findings.

    .venv/bin/python benchmarks/confirm_futility.py --seeds 5 --out benchmarks/out/futility.jsonl
    .venv/bin/python benchmarks/confirm_futility.py --table --out benchmarks/out/futility.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from campaign_efficiency import _Recording, seed_corpus  # noqa: E402

from fuzzer import trace as tf  # noqa: E402
from fuzzer.oracle.calibrate import calibrate  # noqa: E402
from fuzzer.oracle.verdict import Verdict  # noqa: E402
from fuzzer.search.campaign import Campaign  # noqa: E402
from fuzzer.search.settings import Settings  # noqa: E402
from fuzzer.sim import VirtualTarget  # noqa: E402
from fuzzer.sim.pathologies import describe  # noqa: E402
from fuzzer.store import Store  # noqa: E402

CORPUS = Path(__file__).resolve().parent.parent / "corpus"


async def one_run(pathology: str | None, seed: int, futility: bool, cap: int) -> dict:
    if pathology is None:
        seeds = [tf.load(p) for p in sorted(CORPUS.glob("*.json"))]
    else:
        seeds, _ = seed_corpus(pathology, seed)
    sim = VirtualTarget(pathologies=(pathology,) if pathology else (), seed=seed)
    target = _Recording(sim)
    store = Store.memory()
    stop = asyncio.Event()
    first: dict = {}
    findings: list[dict] = []

    def on_finding(finding_id: int, verdict: Verdict) -> None:
        finding = store.get_finding(finding_id)
        delayed = target.delayed.get(finding.trace_hash, {})
        right = pathology is not None and (
            pathology in delayed.get(verdict.request_id, set()) if verdict.request_id is not None
            else any(pathology in names for names in delayed.values()))
        findings.append({"kind": str(verdict.kind), "right": right})
        if right and not first:
            first.update(executions=store.count_executions(), virtual_s=sim.now_s - start)
            stop.set()

    calibration = await calibrate(target, rng=random.Random(seed))
    campaign = Campaign(target, store, Settings(seed=seed, max_execs=cap, futility=futility), seeds=seeds,
                        target_key=f"bench:{pathology}:{seed}", calibration=calibration,
                        on_finding=on_finding, stop=stop)
    start = sim.now_s
    summary = await campaign.run()
    return {
        "pathology": pathology or "clean", "seed": seed, "futility": futility, "cap": cap,
        "found": bool(first), "executions": first.get("executions"), "virtual_s": first.get("virtual_s"),
        "total_executions": summary.stats.executions, "total_virtual_s": sim.now_s - start,
        "purposes": store.purposes(campaign_id=summary.campaign_id), "findings": findings,
    }


def table(rows: list[dict]) -> str:
    out = ["| target | futility | found | executions to first right finding (median) | virtual s (median) "
           "| confirmation runs per run (mean) | wrong findings |", "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["pathology"], r["futility"]) for r in rows}, key=lambda k: (k[0] != "clean", k[0], not k[1]))
    for name, fut in keys:
        rs = [r for r in rows if r["pathology"] == name and r["futility"] == fut]
        found = [r for r in rs if r["found"]]
        med = statistics.median([r["executions"] for r in found]) if found else None
        vmed = statistics.median([r["virtual_s"] for r in found]) if found else None
        conf = statistics.mean([r["purposes"].get("confirm", 0) for r in rs])
        wrong = sum(not f["right"] for r in rs for f in r["findings"])
        out.append(f"| {name} | {'on' if fut else 'off'} | {len(found)}/{len(rs)} | {med if med is not None else '-'} "
                   f"| {f'{vmed:.0f}' if vmed is not None else '-'} | {conf:.1f} | {wrong} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--cap", type=int, default=200)
    ap.add_argument("--pathologies", nargs="*", default=None)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/futility.jsonl"))
    ap.add_argument("--table", action="store_true")
    args = ap.parse_args()
    if args.table:
        print(table([json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]))
        return
    names: list[str | None] = [None, *(args.pathologies if args.pathologies is not None else [p.name for p in describe()])]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for name in names:
                for futility in (False, True):
                    row = asyncio.run(one_run(name, seed, futility, args.cap))
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(row["pathology"], seed, futility, row["found"], row["executions"],
                          row["purposes"].get("confirm", 0), file=sys.stderr)


if __name__ == "__main__":
    main()
