"""Write the planted-bug traces timed for this machine: `python timed_traces.py URL OUT_DIR`.

The committed planted-*.json were timed for a machine where a 2048-token prefill step took
seconds (arrivals 100 ms apart land inside the blocker's first step); on a machine where it takes
70 ms they arrive after it, and the requests no longer wait together. This measures the stock
server's step and decode times and writes planted-hol.json, planted-lifo.json and
planted-starvation.json to OUT_DIR from tests/vllm_cpu/schedules.py, the schedules the tests use.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from vllm_cpu import schedules  # noqa: E402


def main() -> None:
    url, out = sys.argv[1], Path(sys.argv[2])
    speed = schedules.measure(url, "tiny-llama")
    print(f"full-budget prefill {speed.step_s * 1000:.0f} ms, decode {speed.decode_s * 1000:.1f} ms a token", file=sys.stderr)
    for name, schedule in (("hol", schedules.hol), ("lifo", schedules.lifo), ("starvation", schedules.starvation)):
        trace = schedules.as_trace(f"planted-{name}", schedule(speed, 0))
        (out / f"planted-{name}.json").write_text(json.dumps(trace, indent=1))


if __name__ == "__main__":
    main()
