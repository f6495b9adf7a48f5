"""Re-judge stored campaigns with today's oracle: which executions have a candidate, by ground truth.

    .venv/bin/python benchmarks/rejudge_campaigns.py DIR [DIR ...]

Each DIR is what ``benchmarks/truth_campaign.py --keep DIR`` kept: a campaign database and the
server's ground truth (``*.truth.jsonl``). Every stored execution is held against its bounds as
the oracle does today (:func:`fuzzer.oracle.judge.observe`, under the calibration the campaign
used), and each candidate request is grouped by the planted bugs that delayed it (``-``: none).
Printed per group: executions with a candidate, and of those, executions where only the
long-excess factor (``fuzzer.oracle.policy.LONG_EXCESS_SHARE``) made one. On a clean server's
campaign every candidate is one a campaign would have spent confirmation on; a trace is only
a false positive once confirmed, so this counts the exposure, not the false findings.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from fuzzer.oracle.calibration import Calibration, calibration_keys
from fuzzer.oracle.judge import observe
from fuzzer.oracle.policy import LONG_EXCESS_SHARE
from fuzzer.store import Store


def read_truth(folder: Path) -> dict[str, tuple[str, ...]]:
    """X-Request-Id -> the bugs that delayed it (a line cut short by a stop is skipped)."""
    truth: dict[str, tuple[str, ...]] = {}
    for path in folder.glob("*.truth.jsonl"):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            truth[row["request_id"]] = tuple(sorted(row.get("pathologies") or ()))
    return truth


def rejudge(folder: Path) -> tuple[int, dict[str, set[int]], dict[str, set[int]]]:
    """Executions, then executions with a candidate and with a long-excess-only one, by bug group."""
    (db,) = folder.glob("*.db")
    truth = read_truth(folder)
    store = Store.open(db, create=False)
    try:
        target = next(store.get_target(t) for t in store.executions_by_target(1) if t is not None)
        stored = store.latest_calibration(*calibration_keys(str(target["url"]), target.get("model")))
        if stored is None:
            raise SystemExit(f"{db}: no calibration stored for its target")
        calibration = Calibration.from_dict(stored)
        flagged: dict[str, set[int]] = collections.defaultdict(set)
        long_only: dict[str, set[int]] = collections.defaultdict(set)
        rows = store.execution_rows()
        for row in rows:
            result = store.get_execution(row["id"])
            trace = store.get_trace(row["trace_hash"])
            sent_as = {r.request_id: r.x_request_id for r in result.requests}
            for report in observe(trace, result, calibration):
                group = ",".join(truth.get(sent_as.get(report.request_id) or "", ())) or "-"
                for o in report.observations.values():
                    if o.candidate:
                        flagged[group].add(row["id"])
                        # Below the full factor: only the long-excess one made it a candidate.
                        if o.min_excess_s is not None and o.ratio < o.factor / LONG_EXCESS_SHARE:
                            long_only[group].add(row["id"])
        return len(rows), flagged, long_only
    finally:
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    args = ap.parse_args()
    print("| campaign | executions | group | with a candidate | of those only at the long-excess factor |")
    print("|---|---:|---|---:|---:|")
    for folder in args.folders:
        n, flagged, long_only = rejudge(folder)
        if not flagged:
            print(f"| {folder.name} | {n} | (none) | 0 | 0 |")
        for group in sorted(flagged):
            print(f"| {folder.name} | {n} | {group} | {len(flagged[group])} | {len(long_only[group])} |")


if __name__ == "__main__":
    main()
