"""A campaign against a real llama.cpp llama-server, and the oracle's verdict on short-behind-long queueing.

    .venv/bin/python benchmarks/real_server.py                       # 10 minutes, as in benchmarks/README.md
    .venv/bin/python benchmarks/real_server.py --duration 2m --out /tmp/rs   # a shorter look

What it does, in order (everything on 127.0.0.1, the server stopped at the end):

1. starts llama-server (binary from $FUZZ_LLAMA_SERVER or the cache of `.ci/llama-server.sh`)
   on a random-weight llama GGUF (tests/llamacpp/make_model.py, seed 0) with the arguments of
   tests/llamacpp/conftest.py: `-np 4 -c 16384 --metrics -t $FUZZ_LLAMA_THREADS (2)`;
2. calibrates the oracle under llama.cpp's scheduler assumption (n_batch 2048 tokens per step,
   max_num_seqs = the slots /props reports) as `fuzz calibrate` does (half the repeats first, the
   rest only while the fit is unsettled; one repeat per probe is too few for the batch fit) and
   stores it in the --db under the key every command reads (`URL#model`), so the campaign reuses it;
3. runs `fuzz campaign --target URL --server llamacpp --duration D --db DB --seed S`;
4. replays a short-behind-long trace (four 3700-token prompts, then a 32-token one 50 ms
   later) with `fuzz replay --runs 3 --json` and keeps the oracle's verdicts;
5. writes summary.json (executions, coverage, findings by kind with slowdown and excess over
   the FCFS bound, the replay's verdict on the short request) and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests/llamacpp/conftest.py imports its helpers as pytest puts them: top-level

from fuzzer.cli._target import parse_duration
from fuzzer.execute.http import HttpTarget
from fuzzer.oracle.calibrate import calibrate, scheduler_assumption
from fuzzer.oracle.calibration import calibration_key
from fuzzer.store import Store
from tests.llamacpp.conftest import (
    find_llama_server,
    start_llama_server,
    stop_llama_server,
)
from tests.llamacpp.make_model import ModelShape, write_model

# The queueing fact of issue 9: four long prompts fill the four slots' prefill, a short
# request arrives just after them.
LONG_PROMPT_TOKENS = 3700
SHORT_PROMPT_TOKENS = 32
SHORT_AT_MS = 50
SHORT_BEHIND_LONG = {
    "format": 1,
    "name": "short-behind-long",
    "requests": [
        *({"id": f"L{i}", "at_ms": i, "prompt_tokens": LONG_PROMPT_TOKENS, "max_tokens": 16, "stream": True} for i in range(4)),
        {"id": "short", "at_ms": SHORT_AT_MS, "prompt_tokens": SHORT_PROMPT_TOKENS, "max_tokens": 16, "stream": True},
    ],
}


async def _calibrate(url: str, db: Path, seed: int) -> dict:
    async with HttpTarget(url, server="llamacpp", rng=random.Random(seed)) as target:
        info = target.info
        assert info is not None
        assumption = scheduler_assumption(info)
        cal = await calibrate(
            target, assumption=assumption, rng=random.Random(seed), max_model_len=info.max_model_len,
        )
    with Store.open(db) as store:
        store.save_calibration(calibration_key(url, info.model), cal.to_dict(), created_at=cal.created_at)
    return {"assumption": assumption.describe(), "model": cal.model.to_dict(), "noise": {m.value: v for m, v in cal.noise.items()}}


def _fuzz(*args: str, log: Path, timeout_s: float) -> subprocess.CompletedProcess:
    with open(log, "w") as sink:
        return subprocess.run(
            [sys.executable, "-m", "fuzzer", *args], stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT,
            timeout=timeout_s, check=False,
        )


def _load() -> list[float]:
    return list(os.getloadavg())


def _findings(db: Path) -> list[dict]:
    with Store.open(db, create=False) as store:
        found = store.list_findings()
    rows = []
    for f in found:
        v = f.verdict
        observed, expected, idle = v.get("observed_s"), v.get("expected_s"), v.get("idle_s")
        rows.append({
            "id": f.id, "kind": f.kind, "request": v.get("request_id"), "metric": v.get("metric"),
            "reproduced": f.reproduced, "p_value": v.get("p_value"),
            "observed_s": observed, "fcfs_bound_s": expected, "idle_s": idle,
            "slowdown": f.slowdown,
            "excess_s": None if observed is None or expected is None else observed - expected,
            "requests": f.requests, "detail": v.get("detail"),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", default="10m")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="folder for the db, logs and summary.json")
    parser.add_argument("--url", default=None, help="use this running llama-server instead of starting one")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="real-server-"))
    out.mkdir(parents=True, exist_ok=True)
    db = out / "campaign.db"
    duration_s = parse_duration(args.duration)
    summary: dict = {"duration": args.duration, "seed": args.seed, "load_before": _load(), "out": str(out)}

    server = None
    url = args.url
    if url is None:
        binary, reason = find_llama_server()
        if binary is None:
            print(f"real_server.py: {reason}", file=sys.stderr)
            return 2
        model = write_model(out / "random-llama.gguf", seed=0, shape=ModelShape())
        server = start_llama_server(binary, model, out / "llama-server.log")
        url = server.base_url
        summary["server"] = {"binary": str(binary), "ready_s": server.ready_s, "threads": os.environ.get("FUZZ_LLAMA_THREADS", "2")}
    summary["url"] = url
    try:
        started = time.time()
        summary["calibration"] = asyncio.run(_calibrate(url, db, args.seed))
        summary["calibration_s"] = time.time() - started

        started = time.time()
        log = out / "campaign.log"
        campaign = _fuzz(
            "campaign", "--target", url, "--server", "llamacpp", "--duration", f"{duration_s:.0f}s",
            "--corpus", str(ROOT / "corpus"), "--db", str(db), "--seed", str(args.seed),
            log=log, timeout_s=duration_s + 900,
        )
        lines = log.read_text().splitlines()
        stops = [{"exit": campaign.returncode, "at_s": time.time() - started,
                  "error": next((ln for ln in lines if ln.startswith("error:")), None)}]
        summary["campaign"] = {"runs": stops, "wall_s": time.time() - started, "load_after": _load()}
        status = _fuzz("status", "--db", str(db), log=out / "status.txt", timeout_s=60)
        summary["campaign"]["status_exit"] = status.returncode
        with Store.open(db, create=False) as store:
            summary["campaign"]["stats"] = store.latest_campaign()
        summary["findings"] = _findings(db)
        summary["findings_by_kind"] = dict(Counter(f["kind"] for f in summary["findings"]))

        trace_path = out / "short-behind-long.json"
        trace_path.write_text(json.dumps(SHORT_BEHIND_LONG, indent=1))
        replay = _fuzz(
            "replay", str(trace_path), "--target", url, "--server", "llamacpp", "--db", str(db), "--runs", "3",
            "--json", "--seed", str(args.seed), log=out / "replay.json", timeout_s=900,
        )
        summary["replay_exit"] = replay.returncode
        try:
            text = (out / "replay.json").read_text()
            data = json.loads(text[text.index("{"):])
            summary["replay_verdicts"] = data.get("verdicts")
            summary["replay_findings"] = data.get("findings")
        except ValueError as e:
            summary["replay_error"] = f"could not read fuzz replay --json: {e}"
    finally:
        if server is not None:
            stop_llama_server(server)
        summary["load_after"] = _load()
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
