"""Judge the stored executions of each finding's trace again with the current oracle.

    .venv/bin/python benchmarks/vllm/rejudge.py CAMPAIGN.db [--frontend-fifo]

For every finding of the database, every execution stored for its trace (the one that raised
the candidate and the confirmation runs) is judged again by ``fuzzer.oracle.judge.judge`` with
the calibration stored in the database, and the victim's verdict is printed next to the stored
one: how an oracle change would have decided the same measurements. ``--frontend-fifo`` judges
under the assumption a calibration of an HTTP server now stores (its frontend hands requests to
the engine in arrival order), which calibrations stored before it was added lack. Nothing is
run against a server and nothing is written.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from fuzzer.oracle.calibration import Calibration
from fuzzer.oracle.judge import judge
from fuzzer.store import Store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("db")
    parser.add_argument("--frontend-fifo", action="store_true")
    args = parser.parse_args()
    with Store.open(args.db, create=False) as store:
        calibration = None
        for finding in store.list_findings():
            if calibration is None:
                key = (store.latest_campaign() or {}).get("target", "")
                data = store.latest_calibration(key) or store.latest_calibration(f"{key}#tiny-llama")
                if data is None:
                    raise SystemExit(f"no calibration stored under {key!r}")
                calibration = Calibration.from_dict(data)
                if args.frontend_fifo:
                    calibration = calibration.with_assumption(replace(calibration.assumption, frontend_fifo=True))
            trace = store.get_trace(finding.trace_hash)
            results = [store.get_execution(i) for i in store.execution_ids(trace_hash=finding.trace_hash)]
            victim = finding.verdict.get("request_id")
            verdicts = judge(trace, results, calibration, rng=np.random.default_rng(0))
            now = next((v for v in verdicts if v.request_id == victim and v.kind is not None),
                       next((v for v in verdicts if v.request_id == victim), None))
            before = f"{finding.kind} {finding.reproduced} {finding.verdict.get('effect') or 0:.2f}x"
            after = "no verdict" if now is None else (
                f"{now.kind or 'nothing'} {now.decision} {now.reproduction}"
                + (f" {now.effect:.2f}x" if now.effect is not None else "")
                + (f" (observed {now.observed_s:.2f} s, bound {now.expected_s:.2f} s)" if now.expected_s else ""))
            print(f"finding {finding.id} on {victim} of {trace.name or finding.trace_hash[:12]}, {len(results)} runs: "
                  f"stored {before}; now {after}")


if __name__ == "__main__":
    main()
