"""One `fuzz minimize` of a finding at a time; a campaign on the same database may run beside it."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner
from reliability_support import lock_holder

from fuzzer.cli import cli
from fuzzer.cli import minimize as minimize_cli
from fuzzer.errors import ConfigError, StoreError
from fuzzer.store import CampaignLock, Store, minimization_lock


@pytest.fixture
def db(tmp_path, seed_trace):
    path = tmp_path / "m.db"
    with Store.open(path) as store:
        for signature in ("first", "second"):
            store.add_finding(kind="ttft-outlier", signature=signature, trace=seed_trace, verdict={"p_value": 0.001},
                              slowdown=10.0, reproduced="3/3")
    return path


def test_a_second_minimization_of_a_finding_is_refused_in_one_line_and_a_killed_one_leaves_no_lock(db):
    with lock_holder("minimization_lock(db, 1)", db) as holder:
        before = db.read_bytes()
        refused = CliRunner().invoke(cli, ["minimize", "1", "--db", str(db)])
        assert refused.exit_code == 2
        assert refused.stderr.strip().splitlines() == [
            f"error: another minimization of finding 1 (pid {holder.pid}) is running on {db}; wait for it to finish "
            "or stop it (Ctrl-C saves its progress; `fuzz minimize 1` resumes)"
        ]
        assert db.read_bytes() == before
        # Another finding of the same database, and a campaign, are not held up.
        with minimization_lock(db, 2) as other, CampaignLock(db) as campaign:
            assert other.held and campaign.held
    with minimization_lock(db, 1) as lock:  # the kernel dropped the dead holder's lock
        assert lock.held


def test_fuzz_minimize_holds_the_lock_while_it_runs_and_releases_it(db, monkeypatch):
    seen = []

    async def run(store, finding, *args, **kwargs):
        with pytest.raises(StoreError, match=rf"another minimization of finding 1 \(pid {os.getpid()}\)"):
            minimization_lock(db, finding.id).acquire()
        with CampaignLock(db) as campaign:  # a campaign may start meanwhile
            seen.append(campaign.held)
        raise ConfigError("stopped by the test")

    monkeypatch.setattr(minimize_cli, "_run", run)
    result = CliRunner().invoke(cli, ["minimize", "1", "--db", str(db)])
    assert result.exit_code == 2 and result.stderr.strip() == "error: stopped by the test"
    assert seen == [True]
    with minimization_lock(db, 1) as lock:
        assert lock.held
