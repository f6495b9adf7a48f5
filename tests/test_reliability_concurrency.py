"""Readers while a campaign writes (WAL), and one campaign per database (issue 8)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from reliability_support import (
    calibrated_template,
    campaign_args,
    copy_db,
    db_facts,
    lock_holder,
    run_fuzz,
    start_campaign,
)

from fuzzer.errors import StoreError
from fuzzer.store import CampaignLock

#: How many rounds of readers run against the writing campaign.
READER_ROUNDS = 3


def test_a_second_lock_on_one_database_is_refused_with_the_owner(tmp_path):
    db = tmp_path / "one.db"
    with CampaignLock(db):
        with pytest.raises(StoreError, match=rf"another campaign \(pid {os.getpid()}\) is running on .*one.db"):
            CampaignLock(db).acquire()
    with CampaignLock(db) as again:  # released on exit
        assert again.held


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    db = tmp_path / "stale.db"
    with lock_holder("CampaignLock(db)", db) as holder:
        with pytest.raises(StoreError, match=rf"pid {holder.pid}"):
            CampaignLock(db).acquire()
    # The PID is still written in the lock file, but the kernel dropped the lock with the process.
    assert str(holder.pid) in (tmp_path / "stale.db.lock").read_text()
    with CampaignLock(db) as lock:
        assert lock.held


@pytest.mark.slow
def test_readers_work_while_a_campaign_writes_and_a_second_campaign_is_refused(tmp_path_factory, tmp_path):
    db = copy_db(calibrated_template(tmp_path_factory.mktemp("calibrated")), tmp_path / "busy.db")
    start = db_facts(db)
    finding = min(start["findings"]) if start["findings"] else None
    writer = start_campaign(db, "--duration", "60s", cwd=tmp_path)
    try:
        deadline = time.monotonic() + 30
        while db_facts(db)["executions"] == start["executions"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert writer.poll() is None
        for _ in range(READER_ROUNDS):
            status = run_fuzz("status", "--db", str(db), cwd=tmp_path)
            assert status.returncode == 0, status.stderr
            listed = run_fuzz("findings", "--db", str(db), "--json", cwd=tmp_path)
            assert listed.returncode == 0, listed.stderr
            assert isinstance(json.loads(listed.stdout), list)
            if finding is not None:
                shown = run_fuzz("show", str(finding), "--db", str(db), cwd=tmp_path)
                assert shown.returncode == 0, shown.stderr
            second = run_fuzz(*campaign_args(db, "--max-execs", "1000"), cwd=tmp_path)
            assert second.returncode == 2
            lines = second.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: another campaign (pid ")
            assert str(writer.pid) in lines[0] and "Traceback" not in second.stderr
        assert writer.poll() is None, "the refused campaign disturbed the running one"
    finally:
        writer.send_signal(signal.SIGINT)  # Ctrl-C: finish the execution, save, exit
        out, err = writer.communicate(timeout=90)
    assert writer.returncode == 0, err
    assert "interrupted; everything is saved" in out
    end = db_facts(db)
    assert end["integrity"] == "ok" and end["executions"] > start["executions"]
