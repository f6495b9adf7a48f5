"""One calibration key for every command: `fuzz calibrate` measures, the others reuse it."""

from __future__ import annotations

import json
import random
import sqlite3

from click.testing import CliRunner

from fuzzer.cli import cli
from fuzzer.cli._target import DEFAULT_SIM_PATHOLOGIES, sim_key
from fuzzer.oracle.calibration import (
    SIM_CALIBRATION_KEY,
    calibration_key,
    calibration_keys,
)

URL = "http://127.0.0.1:8000"


def test_a_server_is_keyed_by_url_and_model_and_its_older_keys_are_still_read():
    assert calibration_keys(URL + "/", "qwen") == (f"{URL}#qwen", URL + "/", URL)
    assert calibration_key(URL, "qwen") == calibration_key(URL + "/", "qwen") != calibration_key(URL, "llama")


def test_every_command_names_the_simulator_by_what_changes_its_idle_latencies():
    # calibrate (no --target), replay (--pathologies), campaign (planted, faults, seed) of one
    # simulator speed share the key: probes never trigger a pathology or meet a fault.
    replay = sim_key(("logprobs-batch-cost",))
    campaign = sim_key(DEFAULT_SIM_PATHOLOGIES, {"faults": ("crash",), "fault_rate": 0.1}, 7)
    assert calibration_key(None) == calibration_key(replay) == calibration_key(campaign) == SIM_CALIBRATION_KEY
    # Where earlier versions stored them is still read.
    assert calibration_keys(replay)[1:] == (replay,) and calibration_keys(campaign)[1:] == (campaign,)
    # --speed divides every time: another calibration.
    fast = calibration_key(sim_key(DEFAULT_SIM_PATHOLOGIES, {"speed": 20.0}, 3))
    assert fast == f"{SIM_CALIBRATION_KEY};speed=20" and fast != calibration_key(None)


def test_the_newest_calibration_under_any_key_of_the_target_is_read(store):
    keys = calibration_keys(URL, "qwen")
    store.save_calibration(URL, {"v": "old campaign"}, created_at=10.0)
    assert store.latest_calibration(*keys) == {"v": "old campaign"}
    store.save_calibration(keys[0], {"v": "fuzz calibrate"}, created_at=20.0)
    store.save_calibration(f"{URL}#llama", {"v": "another model"}, created_at=30.0)
    assert store.latest_calibration(*keys) == {"v": "fuzz calibrate"}
    assert store.latest_calibration(*calibration_keys("http://elsewhere:1", "qwen")) is None


def test_fuzz_calibrate_then_replay_and_campaign_on_the_same_db_reuse_it(tmp_path):
    from fuzzer.sim.process import SimProcess

    db = tmp_path / "c.db"
    corpus = tmp_path / "seeds"
    corpus.mkdir()
    trace = corpus / "one.json"
    trace.write_text(json.dumps({"format": 1, "name": "one", "requests": [
        {"id": "a", "at_ms": 0, "prompt_tokens": 16, "max_tokens": 4},
        {"id": "b", "at_ms": 5, "prompt_tokens": 32, "max_tokens": 4},
    ]}))
    runner = CliRunner()
    with SimProcess(speed=10.0) as sim:
        calibrated = runner.invoke(cli, ["calibrate", "--target", sim.url, "--db", str(db), "--repeats", "1", "--json"])
        assert calibrated.exit_code == 0, calibrated.output
        key = json.loads(calibrated.stdout)["target_key"]
        assert key == f"{sim.url}#sim-qwen2.5-0.5b"

        replay = runner.invoke(cli, ["replay", str(trace), "--target", sim.url, "--db", str(db), "--runs", "1"])
        assert replay.exit_code in (0, 1), replay.output
        assert "calibrating" not in replay.stderr

        campaign = runner.invoke(cli, ["campaign", "--target", sim.url, "--db", str(db), "--corpus", str(corpus),
                                       "--max-execs", "1", "--seed", "1"])
        assert campaign.exit_code == 0, campaign.output
    with sqlite3.connect(db) as conn:
        rows = conn.execute("select target_key from calibrations").fetchall()
        executions = conn.execute("select count(*) from executions").fetchone()[0]
    assert rows == [(key,)]  # measured once, by fuzz calibrate
    assert executions >= 2  # the replay's run and the campaign's



async def test_replay_and_minimize_measure_again_a_stale_calibration_and_store_it_under_the_first_key(store, capsys):
    from paper_target import PaperTarget

    from fuzzer.cli._calibration import calibration_for
    from fuzzer.oracle.calibrate import calibrate
    from fuzzer.oracle.calibration import REFRESH_AFTER_S

    keys = calibration_keys(URL, "qwen")
    old = await calibrate(PaperTarget(), rng=random.Random(0), clock=lambda: 0.0)
    store.save_calibration(URL, old.to_dict(), created_at=old.created_at)  # an older version's key
    fresh_enough = await calibration_for(PaperTarget(), store, keys, seed=0, clock=lambda: REFRESH_AFTER_S)
    assert fresh_enough == old and "calibrating" not in capsys.readouterr().err

    later = 2 * REFRESH_AFTER_S
    again = await calibration_for(PaperTarget(), store, keys, seed=0, clock=lambda: later)
    assert again.created_at == later
    assert f"calibrating {keys[0]} first (its stored one is 2.0 h old)" in capsys.readouterr().err
    assert store.latest_calibration(keys[0]) == again.to_dict()
