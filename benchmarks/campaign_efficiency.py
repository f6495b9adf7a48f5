"""Fuzzing efficiency on the simulator (virtual time): guided campaign versus the null mutator.

    .venv/bin/python benchmarks/campaign_efficiency.py [--seeds 5] [--max-execs 300]
        [--pathologies a,b] [--mutators guided,null] [--out results.jsonl]
    .venv/bin/python benchmarks/campaign_efficiency.py --http 300 --pathologies disconnect-leak,none

For every planted pathology, a campaign runs against a simulator with only that
pathology on, once per seed and mutator, until its first *right* confirmed finding
or the execution cap. Right: the finding's request was really delayed by the
pathology (simulator ground truth, read here only, never by the oracle); for a
finding without a request (leak, crash), some request of its trace was. Counted:
every execution the campaign stored (seed, fuzz, stability, cold-probe and confirmation
runs; the row's "purposes" counts them by kind);
the calibration that starts every campaign is done first on the same simulator and
not counted (it is the same for both mutators). Wall time is this process's time
(simulator and fuzzer together); virtual time is what the runs would take on a
server as fast as the simulated one.

Seed corpus: the committed corpus/ traces, minus those that already trigger the
pathology on their own (any request delayed by it in one run on a warm simulator),
so that what is measured is the search, not the seed.

Each run appends one JSON line to --out (runs already there are skipped, so an
interrupted benchmark resumes); --table prints the Markdown table for
benchmarks/README.md from that file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

from fuzzer import trace as tf
from fuzzer.cli._target import limits_for
from fuzzer.errors import ConfigError
from fuzzer.execution import ExecutionResult
from fuzzer.oracle.calibrate import calibrate
from fuzzer.oracle.verdict import Verdict
from fuzzer.search.campaign import Campaign
from fuzzer.search.settings import Settings
from fuzzer.sim import VirtualTarget
from fuzzer.sim import pathologies as P
from fuzzer.store import Store
from fuzzer.trace import Trace

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "corpus"
#: Execution cap of one run: a few minutes of a real server per run, far more on virtual time.
DEFAULT_MAX_EXECS = 300
DEFAULT_SEEDS = 5


class _Recording:
    """The simulator seen by the campaign: records ground truth by trace and time spent executing."""

    def __init__(self, target: VirtualTarget):
        self._target = target
        self.name = target.name
        if hasattr(target, "idle"):  # virtual time: confirmation advances the clock instead of sleeping
            self.idle = target.idle
        self.kv_cache = target.kv_cache  # the KV capacity the oracle's bound models (as /metrics reports it)
        self.delayed: dict[str, dict[str, set[str]]] = {}
        self.execute_s = 0.0

    async def execute(self, trace: Trace, *, cut_s: float | None = None) -> ExecutionResult:
        start = time.perf_counter()
        result = await self._target.execute(trace, cut_s=cut_s)
        self.execute_s += time.perf_counter() - start
        seen = self.delayed.setdefault(trace.content_hash(), {})
        for rid, names in result.ground_truth.items():
            seen.setdefault(rid, set()).update(names)
        return result

    async def aclose(self) -> None:
        await self._target.aclose()


def seed_corpus(pathology: str, seed: int) -> tuple[list[Trace], list[str]]:
    """The committed corpus minus the traces that trigger ``pathology`` by themselves."""
    target = VirtualTarget(pathologies=(pathology,), seed=seed)
    target.run(tf.load(CORPUS / "stream-mix.json"))  # warm: a cold start is not what a seed triggers
    kept, dropped = [], []
    for path in sorted(CORPUS.glob("*.json")):
        trace = tf.load(path)
        result = target.run(trace)
        (dropped if any(pathology in names for names in result.ground_truth.values()) else kept).append(trace)
    return kept, [t.name or "?" for t in dropped]


async def one_run(pathology: str, mutator: str, seed: int, max_execs: int) -> dict:
    seeds, dropped = seed_corpus(pathology, seed)
    sim = VirtualTarget(pathologies=(pathology,), seed=seed)
    target = _Recording(sim)
    store = Store.memory()
    stop = asyncio.Event()
    found: dict = {}
    campaign: Campaign | None = None

    def on_finding(finding_id: int, verdict: Verdict) -> None:
        finding = store.get_finding(finding_id)
        delayed = target.delayed.get(finding.trace_hash, {})
        if verdict.request_id is not None:
            right = pathology in delayed.get(verdict.request_id, set())
        else:
            right = any(pathology in names for names in delayed.values())
        found.setdefault("all", []).append({"kind": str(verdict.kind), "right": right})
        if right and "executions" not in found:
            found.update(executions=store.count_executions(), kind=str(verdict.kind),
                         wall_s=time.perf_counter() - start, virtual_s=sim.now_s - virtual_start,
                         phase=str(campaign._phase) if campaign else "?")
            stop.set()

    # The campaign's own first step, done here so that its time is not counted: calibrating
    # warms the (pathological) server up and fits the model the oracle judges against.
    calibration = await calibrate(target, rng=random.Random(seed))
    target.execute_s = 0.0
    # The limits a campaign gets from `fuzz campaign` (the KV-pressure shapes need the cache's size).
    settings = Settings(seed=seed, max_execs=max_execs, mutator=mutator, limits=limits_for(sim))
    campaign = Campaign(target, store, settings, seeds=seeds,
                        target_key=f"bench:{pathology}:{seed}", calibration=calibration,
                        on_finding=on_finding, stop=stop)
    start = time.perf_counter()
    virtual_start = sim.now_s
    summary = await campaign.run()
    wall = time.perf_counter() - start
    return {
        "pathology": pathology, "mutator": mutator, "seed": seed, "max_execs": max_execs,
        "found": "executions" in found, "executions": found.get("executions"), "kind": found.get("kind"),
        "phase": found.get("phase"), "wall_s": found.get("wall_s"), "virtual_s": found.get("virtual_s"),
        "total_executions": summary.stats.executions, "total_wall_s": wall, "execute_s": target.execute_s,
        "findings": found.get("all", []), "dropped_seeds": dropped,
        "purposes": store.purposes(campaign_id=summary.campaign_id),
    }


async def overhead(pathology: str, max_execs: int, seed: int = 0) -> dict:
    """A short campaign over HTTP to a SimProcess: the share of wall time outside the target.

    Time inside ``execute`` (the idle barrier, sending, streaming, the /metrics sampler) and
    inside the campaign's sleeps is the server's; everything else (coverage, oracle,
    corpus, mutation, store) is the fuzzer's overhead.
    """
    from fuzzer.execute.http import HttpTarget  # noqa: PLC0415
    from fuzzer.sim.process import SimProcess  # noqa: PLC0415

    slept = [0.0]

    async def sleep(seconds: float) -> None:
        start = time.perf_counter()
        await asyncio.sleep(seconds)
        slept[0] += time.perf_counter() - start

    async with SimProcess(pathologies=(pathology,), seed=seed) as sim, \
            HttpTarget(sim.url, rng=random.Random(seed)) as http:
        target = _Recording(http)  # type: ignore[arg-type]
        calibration = await calibrate(target, rng=random.Random(seed))
        target.execute_s = 0.0
        store = Store.memory()
        seeds = [tf.load(p) for p in sorted(CORPUS.glob("*.json"))]
        campaign = Campaign(target, store, Settings(seed=seed, max_execs=max_execs, limits=limits_for(http)), seeds=seeds,
                            target_key="bench:http", calibration=calibration, sleep=sleep)
        start = time.perf_counter()
        summary = await campaign.run()
        wall = time.perf_counter() - start
    outside = wall - target.execute_s - slept[0]
    return {"pathology": pathology, "executions": summary.stats.executions, "wall_s": wall,
            "execute_s": target.execute_s, "sleep_s": slept[0], "overhead_s": outside, "overhead": outside / wall,
            "findings": len(summary.new_findings)}


async def http_run(pathology: str, duration_s: float, seed: int = 0) -> dict:
    """A campaign over HTTP against a SimProcess with ``pathology`` on ("none": the clean configuration).

    Like ``fuzz campaign --target`` on ``fuzz sim --ground-truth FILE``: the whole committed
    corpus as seeds (nothing left out), wall-clock ``duration_s`` after the calibration. Each
    confirmed finding is judged by the simulator's ground-truth file (by X-Request-Id): right
    when a run of its request (any request, for a finding on the whole execution) was
    delayed by the pathology.
    """
    import tempfile  # noqa: PLC0415

    from fuzzer.execute.http import HttpTarget  # noqa: PLC0415
    from fuzzer.sim.process import SimProcess  # noqa: PLC0415

    planted = () if pathology == "none" else (pathology,)
    with tempfile.TemporaryDirectory() as tmp:
        gt_path = Path(tmp) / "ground-truth.jsonl"
        async with SimProcess(pathologies=planted, seed=seed, extra_args=["--ground-truth", str(gt_path)]) as sim, \
                HttpTarget(sim.url, rng=random.Random(seed)) as http:
            calibration = await calibrate(http, rng=random.Random(seed))
            store = Store.memory()
            seeds = [tf.load(p) for p in sorted(CORPUS.glob("*.json"))]
            campaign = Campaign(http, store, Settings(seed=seed, duration_s=duration_s, limits=limits_for(http)), seeds=seeds,
                                target_key=f"bench:http:{pathology}", calibration=calibration)
            summary = await campaign.run()
        truth = {}
        for line in gt_path.read_text().splitlines() if gt_path.exists() else []:
            record = json.loads(line)
            truth[record["request_id"]] = set(record["pathologies"])
    findings = []
    for finding in store.list_findings():
        victim = finding.verdict.get("request_id")
        runs = [r for eid in store.execution_ids(trace_hash=finding.trace_hash)
                for r in store.get_execution(eid).requests if victim is None or r.request_id == victim]
        hit = sum(pathology in truth.get(r.x_request_id or "", set()) for r in runs)
        findings.append({"kind": finding.kind, "request": victim, "slowdown": finding.slowdown,
                         "reproduced": finding.reproduced, "runs": len(runs), "runs_delayed": hit, "right": hit > 0})
    return {"pathology": pathology, "mode": "http", "seed": seed, "duration_s": duration_s,
            "executions": summary.stats.executions, "findings": findings}


def http_run_sync(pathology: str, duration_s: float, seed: int) -> dict:
    return asyncio.run(http_run(pathology, duration_s, seed))


def _load(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table(rows: list[dict]) -> str:
    out = ["| pathology | mutator | found | executions to first right finding (median; per seed) | wall s (median) | virtual s (median) |",
           "|---|---|---|---|---|---|"]
    for pathology in P.NAMES:
        for mutator in ("guided", "null"):
            runs = sorted((r for r in rows if r["pathology"] == pathology and r["mutator"] == mutator),
                          key=lambda r: r["seed"])
            if not runs:
                continue
            hits = [r for r in runs if r["found"]]
            per_seed = ", ".join(str(r["executions"]) if r["found"] else f">{r['max_execs']}" for r in runs)
            med = statistics.median([r["executions"] if r["found"] else float("inf") for r in runs])
            wall = statistics.median([r["wall_s"] for r in hits]) if hits else None
            virt = statistics.median([r["virtual_s"] for r in hits]) if hits else None
            out.append(
                f"| {pathology} | {mutator} | {len(hits)}/{len(runs)} | "
                f"{'∞' if med == float('inf') else f'{med:g}'} ({per_seed}) | "
                f"{'-' if wall is None else f'{wall:.1f}'} | {'-' if virt is None else f'{virt:.0f}'} |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=DEFAULT_SEEDS)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--max-execs", type=int, default=DEFAULT_MAX_EXECS)
    parser.add_argument("--pathologies", default=",".join(P.NAMES))
    parser.add_argument("--mutators", default="guided,null")
    parser.add_argument("--out", type=Path, default=Path("campaign_efficiency.jsonl"))
    parser.add_argument("--table", action="store_true", help="print the Markdown table of --out and exit")
    parser.add_argument("--overhead", type=int, metavar="EXECS", default=0,
                        help="instead: a campaign of EXECS executions over HTTP to a SimProcess; print the overhead share")
    parser.add_argument("--http", type=float, metavar="SECONDS", default=0,
                        help="instead: a campaign of SECONDS over HTTP per pathology ('none' too: the clean "
                             "simulator); print its findings judged by ground truth")
    args = parser.parse_args(argv)
    if args.http < 0:
        parser.error("--http must be a number of seconds > 0")
    try:  # an unknown name is a usage error, not a traceback ("none": the clean simulator, --http only)
        P.parse(",".join(n for n in args.pathologies.split(",") if n != "none" or not args.http))
    except ConfigError as e:
        parser.error(str(e))
    if args.http:
        for pathology in args.pathologies.split(","):
            print(json.dumps(http_run_sync(pathology, args.http, args.first_seed)), flush=True)
        return
    if args.overhead:
        for pathology in args.pathologies.split(","):
            print(json.dumps(asyncio.run(overhead(pathology, args.overhead))), flush=True)
        return
    if args.table:
        print(table(_load(args.out)))
        return
    done = {(r["pathology"], r["mutator"], r["seed"], r["max_execs"]) for r in _load(args.out)}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for pathology in args.pathologies.split(","):
            for mutator in args.mutators.split(","):
                if (pathology, mutator, seed, args.max_execs) in done:
                    continue
                row = asyncio.run(one_run(pathology, mutator, seed, args.max_execs))
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{pathology:18s} {mutator:6s} seed {seed}: "
                      f"{'found in ' + str(row['executions']) if row['found'] else 'missed'} "
                      f"({row['total_wall_s']:.0f} s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
