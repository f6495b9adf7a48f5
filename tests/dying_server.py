"""A server that crashes, for the managed-target tests: ``python tests/dying_server.py SIM-ARGS``.

Runs the built-in simulator (``fuzz sim SIM-ARGS``) as its child and, once the simulator has
finished a request whose id starts with ``$DIE_ON`` (a request id of the trace; unset: never),
prints a fatal line the way an engine does and kills the simulator and itself, as a CUDA error
or the OOM killer would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def main() -> int:
    die_on = os.environ.get("DIE_ON", "")
    fd, truth = tempfile.mkstemp(prefix="dying-server-", suffix=".jsonl")
    os.close(fd)
    try:
        child = subprocess.Popen([sys.executable, "-m", "fuzzer", "sim", *sys.argv[1:], "--ground-truth", truth])
        while child.poll() is None:
            time.sleep(0.01)
            if die_on and _finished(truth, die_on):
                print(f"FATAL: EngineCore died: CUDA error: an illegal memory access (request {die_on})", flush=True)
                child.kill()
                child.wait()
                return 134
        return child.returncode
    finally:
        os.remove(truth)


def _finished(truth: str, prefix: str) -> bool:
    with open(truth, encoding="utf-8") as f:
        for line in f:
            try:
                if json.loads(line)["request_id"].startswith(prefix + "-"):
                    return True
            except (ValueError, KeyError):
                continue
    return False


if __name__ == "__main__":
    sys.exit(main())
