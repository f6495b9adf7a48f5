"""Summarize a benchmarks/vllm/truth.sh output folder as the tables of benchmarks/README.md.

    .venv/bin/python benchmarks/vllm/summarize.py /tmp/truth

Campaigns (campaign-NAME.db): executions by purpose, time by phase, and every finding with its
victim, kind, the evidence that decided it, its reproduction and the execution that first ran
its trace. Replays (replay-*.json, corpus-*.json): the confirmed findings of each.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fuzzer.store import Store


def _json(path: Path) -> dict:
    text = path.read_text()
    return json.loads(text[text.index("{"):])  # older truth.sh runs put a log line first


def campaigns(out: Path) -> None:
    print("| server | executions (by purpose) | time by phase | findings: victim, kind, evidence, k/n, first run of its trace (execution, s) |")
    print("|---|---|---|---|")
    for db in sorted(out.glob("campaign-*.db")):
        with Store.open(db, create=False) as store:
            campaign = store.latest_campaign()
            if campaign is None:
                continue
            cid = campaign["id"]
            rows = store.execution_rows(campaign_id=cid)
            start = min((r["started_at"] for r in rows), default=0.0)
            purposes = store.purposes(campaign_id=cid)
            stats = campaign["state"].get("stats", {})
            spent = stats.get("time_s") or {}
            total = sum(spent.values())
            time_text = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1])
                                  if v > 0) if total else "not recorded"
            found = []
            for f in store.list_findings(campaign_id=cid):
                v = f.verdict
                evidence = "order" if v.get("overtakers") else ("bound" if v.get("metric") else "count")
                first = next((r for r in rows if r["trace_hash"] == f.trace_hash), None)
                where = f"#{first['number']} at {first['started_at'] - start:.0f} s" if first else "?"
                effect = v.get("effect")
                found.append(f"{v.get('request_id')} {f.kind} ({evidence}, {effect:.2f}x) {f.reproduced}, {where}"
                             if effect is not None else f"{v.get('request_id')} {f.kind} ({evidence}) {f.reproduced}, {where}")
            name = db.stem.removeprefix("campaign-")
            by_purpose = ", ".join(f"{k} {n}" for k, n in sorted(purposes.items()))
            print(f"| {name} | {sum(purposes.values())} ({by_purpose}) | {time_text} | {'; '.join(found) or 'none'} |")


def replays(out: Path) -> None:
    print()
    print("| replay | runs | confirmed findings (victim kind evidence k/n effect) |")
    print("|---|---:|---|")
    for path in sorted([*out.glob("replay-*.json"), *out.glob("corpus-*.json")]):
        data = _json(path)
        found = [f"{v.get('request_id')} {v.get('kind')} ({'order' if v.get('overtakers') else 'bound'}) "
                 f"{v.get('reproduction')} {v.get('effect') or 0:.2f}x" for v in data.get("findings", [])]
        runs = data.get("runs")
        print(f"| {path.stem} | {len(runs) if isinstance(runs, list) else runs} | {'; '.join(found) or 'none'} |")


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/truth")
    campaigns(folder)
    replays(folder)
