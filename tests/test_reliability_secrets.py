"""Secrets (issue 8): a planted API key reaches the server and nothing else.

The key is set in OPENAI_API_KEY for a campaign, a replay, a minimization, an export
and a report; then the database (with its WAL), every exported file, the HTML report
and everything the commands printed are searched for it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from misbehaving_server import running
from reliability_support import (
    calibrated_template,
    campaign_args,
    copy_db,
    db_facts,
    run_fuzz,
)

PLANTED = "sk-planted-0123456789abcdefRELIABILITY"

pytestmark = pytest.mark.slow


@pytest.fixture
def live_server():
    """tests/misbehaving_server.py on 127.0.0.1 in a thread of its own (the fuzz commands are subprocesses)."""
    loop = asyncio.new_event_loop()
    ready: dict = {}
    started = threading.Event()
    stop = asyncio.Event()

    async def serve() -> None:
        async with running() as (url, state):
            ready.update(url=url, state=state)
            started.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10)
    yield ready["url"], ready["state"]
    loop.call_soon_threadsafe(stop.set)
    thread.join(timeout=10)
    loop.close()


def test_planted_api_key_never_leaves_the_process(tmp_path_factory, tmp_path, live_server):
    db = copy_db(calibrated_template(tmp_path_factory.mktemp("calibrated")), tmp_path / "secret.db")
    key = {"OPENAI_API_KEY": PLANTED}
    outputs = []

    def fuzz(*args: str, ok: tuple[int, ...] = (0,)):
        done = run_fuzz(*args, cwd=tmp_path, extra_env=key)
        assert done.returncode in ok, done.stderr
        outputs.append(done.stdout + done.stderr)
        return done

    fuzz(*campaign_args(db, "--max-execs", str(db_facts(db)["executions"] + 10)))
    findings = json.loads(fuzz("findings", "--db", str(db), "--json").stdout)
    assert findings
    finding = max(f["id"] for f in findings)
    fuzz("show", str(finding), "--db", str(db))
    fuzz("minimize", str(finding), "--db", str(db), "--timeout", "1.0", "--max-execs", "8")
    out = tmp_path / "findings"
    fuzz("export", str(finding), "--db", str(db), "--out", str(out))
    fuzz("report", "--db", str(db), "--out", str(tmp_path / "report.html"))
    trace = next(out.rglob("trace.json"))
    url, state = live_server
    fuzz("replay", str(trace), "--runs", "1", "--target", url, "--db", str(tmp_path / "replay.db"), ok=(0, 1))
    # Positive control: the key did reach the server, as a bearer token.
    assert {entry.authorization for entry in state.log.values()} == {f"Bearer {PLANTED}"}
    fuzz("status", "--db", str(db))

    searched = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".html" for p in searched) and any(p.name == "repro.py" for p in searched)
    assert any(p.name.endswith(".db") for p in searched)
    needle = PLANTED.encode()
    leaks = [str(p) for p in searched if needle in p.read_bytes()]
    leaks += [f"output of command {i}" for i, text in enumerate(outputs) if PLANTED in text]
    assert leaks == []
    # The search can fail: the same key written into one of these files would be found.
    probe = tmp_path / "probe.txt"
    probe.write_text(f"Authorization: Bearer {PLANTED}")
    assert needle in Path(probe).read_bytes()
