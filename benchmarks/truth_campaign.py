"""Truth of a real campaign: `fuzz campaign` against a launched server that writes ground truth.

The server is any command that takes a port and a ground-truth file (one JSON line per
finished request: its ``request_id`` = the X-Request-Id the client sent, and the
``pathologies`` that delayed it): the built-in simulator (``--sim PATHOLOGIES``) or
another vLLM-like server (``--launch CMD`` with ``{port}`` and ``{gt}`` in it). The
campaign is the user's command, run as a child process (`fuzz campaign --launch ...`),
calibration included. Each confirmed finding is then judged by the ground truth through
its victim's X-Request-Ids in the stored executions: *right* when some run of its request
(any request, for a finding on a whole execution) was delayed by a planted pathology,
and which ones; on a clean server every finding is a false positive.

    .venv/bin/python benchmarks/truth_campaign.py --sim lifo-admission --duration 30m --stop-when-right
    .venv/bin/python benchmarks/truth_campaign.py --sim none --duration 30m
    .venv/bin/python benchmarks/truth_campaign.py --launch "python server.py --port {port} --bugs all \\
        --ground-truth {gt}" --duration 30m --label other-all

``--stop-when-right`` interrupts the campaign (SIGINT: it finishes the current execution and
saves) once a finding is right, and reports the wall time and execution it was confirmed at.
One JSON line per campaign goes to ``--out``, with how many requests each planted pathology delayed
(found or not); the database and the ground truth stay in ``--keep DIR`` if given.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fuzzer.store import Store

ROOT = Path(__file__).resolve().parent.parent
#: How often the database and the ground truth are read while the campaign runs.
POLL_S = 2.0


#: The name a request gets in the ground truth when its client went away and the server ran it
#: on anyway (a server that writes client_disconnected and finish_reason: the held-out one): the
#: truth of a leak finding, not of a latency one. Either it finished other than by an abort, or it
#: was "aborted" but its line came LEAK_AFTER_S after the client left (sibling sequences of an
#: n > 1 request that ran on: the line is written when the last one ends).
LEAKED = "(ran-after-disconnect)"
LEAK_AFTER_S = 1.0
#: The ground truth's name for the time the server spent on a disconnected, aborted request.
SERVED = "(served-s)"


def read_truth(path: Path) -> dict[str, set[str]]:
    """X-Request-Id -> the pathologies that delayed it (a line being written is skipped)."""
    truth: dict[str, set[str]] = {}
    if not path.exists():
        return truth
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        # heldout11 names the X-Request-Id client_request_id, its tags delayed_by, and gives times, not e2e_s.
        rid = record["client_request_id"] if "client_request_id" in record else record["request_id"]
        if rid is None:
            continue
        names = truth.setdefault(rid, set())
        names.update(record.get("pathologies") or record.get("delayed_by") or ())
        e2e_s = record.get("e2e_s")
        if e2e_s is None and record.get("finish_time") is not None and record.get("arrival_time") is not None:
            e2e_s = record["finish_time"] - record["arrival_time"]
        if record.get("client_disconnected") and record.get("finish_reason") not in (None, "abort"):
            names.add(LEAKED)
        elif record.get("client_disconnected") and e2e_s is not None:
            names.add(f"{SERVED}{float(e2e_s)}")
    return truth


def _names(names: set[str], client_e2e_s: float | None, leak: bool) -> set[str]:
    """The pathologies of one run of a request as a finding of this kind counts them."""
    served = [n for n in names if n.startswith(SERVED)]
    names = names - set(served)
    if leak and client_e2e_s is not None and any(float(n[len(SERVED):]) > client_e2e_s + LEAK_AFTER_S for n in served):
        names = names | {LEAKED}
    return names if leak else names - {LEAKED}


def judge_findings(store: Store, truth: dict[str, set[str]], campaign_id: int | None = None) -> list[dict]:
    """Every finding with the pathologies that delayed its victim in its stored runs."""
    out = []
    first_run: dict[str, dict] = {}
    for row in store.execution_rows(campaign_id=campaign_id):
        first_run.setdefault(row["trace_hash"], row)
    for finding in store.list_findings(campaign_id=campaign_id):
        # An option-slowdown names the option's first carrier; the requests it claims were slowed are the others
        # (a carrier the server rejected has no ground truth at all: heldout11, logprobs 20).
        victim = None if finding.kind == "option-slowdown" else finding.verdict.get("request_id")
        runs = [r for eid in store.execution_ids(trace_hash=finding.trace_hash)
                for r in store.get_execution(eid).requests if victim is None or r.request_id == victim]
        tagged: dict[str, int] = {}
        hit = 0
        for r in runs:
            names = _names(truth.get(r.x_request_id or "", set()), r.e2e_s, finding.kind == "leak")
            hit += bool(names)
            for name in names:
                tagged[name] = tagged.get(name, 0) + 1
        out.append({"id": finding.id, "kind": finding.kind, "request": victim, "slowdown": finding.slowdown,
                    "reproduced": finding.reproduced, "runs": len(runs), "runs_delayed": hit,
                    "by": dict(sorted(tagged.items())), "right": hit > 0,
                    "signature": finding.signature,
                    # Which phase first ran the finding's trace: a corpus seed, or the search's own mutant.
                    "trace_first_run": {k: first_run.get(finding.trace_hash, {}).get(k) for k in ("number", "purpose")}})
    return out


def delayed_by(truth: dict[str, set[str]]) -> dict[str, int]:
    """How many requests each planted pathology delayed in the whole campaign, found or not."""
    counts: dict[str, int] = {}
    for names in truth.values():
        for name in names:
            if not name.startswith(SERVED):
                counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def run(launch: str, *, duration: str, seed: int, stop_when_right: bool, keep: Path | None,
        extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        name = f"truth-{os.getpid()}-{int(time.time())}"
        db = (keep or Path(tmp)) / f"{name}.db"
        # Kept beside the database: which requests a planted bug delayed, for a bug the campaign missed.
        gt = (keep or Path(tmp)) / f"{name}.truth.jsonl"
        command = launch.replace("{gt}", shlex.quote(str(gt)))
        argv = [sys.executable, "-m", "fuzzer", "campaign", "--launch", command, "--duration", duration,
                "--seed", str(seed), "--db", str(db), *extra]
        started = time.monotonic()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        first_right: dict | None = None
        while proc.poll() is None:
            time.sleep(POLL_S)
            if not stop_when_right or first_right is not None or not db.exists():
                continue
            try:
                with Store.open(db, create=False) as store:
                    right = [f for f in judge_findings(store, read_truth(gt)) if f["right"]]
                    if right:
                        first_right = {**right[0], "wall_s": time.monotonic() - started,
                                       "executions": store.count_executions()}
                        proc.send_signal(signal.SIGINT)
            except Exception as e:  # noqa: BLE001 - a read racing the writer; the next poll reads again
                print(f"truth_campaign: read failed, again in {POLL_S} s: {e}", file=sys.stderr)
        _, stderr = proc.communicate()
        wall = time.monotonic() - started
        row: dict = {"command": command, "duration": duration, "seed": seed, "rc": proc.returncode,
                     "wall_s": wall, "load": os.getloadavg()}
        if not db.exists():
            return {**row, "stderr": stderr[-2000:]}
        with Store.open(db, create=False) as store:
            campaign = store.latest_campaign()
            stats = campaign["state"].get("stats", {}) if campaign else {}
            findings = judge_findings(store, read_truth(gt), campaign["id"] if campaign else None)
            purposes = store.purposes(campaign_id=campaign["id"]) if campaign else {}
        time_s = stats.get("time_s") or {}
        total = sum(time_s.values()) or 1.0
        row.update(executions=stats.get("executions"), purposes=purposes,
                   time_share={k: round(v / total, 3) for k, v in sorted(time_s.items(), key=lambda kv: -kv[1])},
                   time_s=time_s, findings=findings, first_right=first_right,
                   pathologies_found=sorted({name for f in findings for name in f["by"]}),
                   false_positives=sum(not f["right"] for f in findings), db=str(db) if keep else None,
                   truth=str(gt) if keep else None, delayed=delayed_by(read_truth(gt)))
        if proc.returncode not in (0, 1, 130):
            row["stderr"] = stderr[-2000:]
        return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--sim", metavar="PATHOLOGIES", help="the built-in simulator with these ('none': clean)")
    which.add_argument("--launch", metavar="CMD", help="a server command with {port} and {gt} in it")
    ap.add_argument("--sim-seed", type=int, default=1, help="the simulator's seed (--sim)")
    ap.add_argument("--seed", type=int, default=1, help="the campaign's seed")
    ap.add_argument("--duration", default="30m")
    ap.add_argument("--stop-when-right", action="store_true", help="stop at the first right finding")
    ap.add_argument("--label", default="", help="a name for the row")
    ap.add_argument("--keep", type=Path, help="keep the campaign database in this folder")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/truth_campaign.jsonl"))
    ap.add_argument("extra", nargs="*", help="more `fuzz campaign` arguments (after --)")
    args = ap.parse_args(argv)
    if args.sim is not None:
        launch = (f"{shlex.quote(sys.executable)} -m fuzzer sim --port {{port}} --pathologies {args.sim} "
                  f"--seed {args.sim_seed} --ground-truth {{gt}}")
    else:
        launch = args.launch
    if "{port}" not in launch or "{gt}" not in launch:
        ap.error("the server command needs {port} and {gt}")
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    row = {"label": args.label or (args.sim or "launch"), **run(
        launch, duration=args.duration, seed=args.seed, stop_when_right=args.stop_when_right, keep=args.keep,
        extra=args.extra)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
