"""Managed targets on vLLM's CPU build (issue 17): ``--target-file`` starts the API server,
which starts its engine core; SIGTERM to fuzz stops the whole process group."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from launch_support import marker, servers_with, wait_until
from test_launch import FUZZ

from .conftest import SERVER_ARGS, _server_env, group_members

pytestmark = pytest.mark.vllm


@pytest.mark.timeout(900)  # vLLM's start-up takes minutes on a loaded machine
def test_a_launched_vllm_is_ready_and_its_whole_group_stopped_on_sigterm(vllm_python, vllm_model, tmp_path):
    mark = marker()
    model = tmp_path / f"model-{mark}"
    model.symlink_to(vllm_model, target_is_directory=True)
    log = tmp_path / "vllm.log"
    env = {k: v for k, v in _server_env().items() if k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                              "VLLM_NO_USAGE_STATS", "PYTHONPATH")}
    command = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", "{port}", *SERVER_ARGS]
    tf = tmp_path / "vllm.toml"
    tf.write_text(f"command = {command!r}\ntimeout = 300\nlog_file = {str(log)!r}\n[env]\n"
                  + "".join(f"{k} = {v!r}\n" for k, v in env.items()))
    proc = subprocess.Popen([FUZZ, "calibrate", "--target-file", str(tf), "--db", str(tmp_path / "v.db")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # Ready: the fuzzer met /health and began calibrating (the API server logs the requests).
        assert wait_until(lambda: log.exists() and "/v1/models" in log.read_text(errors="replace"), 300.0, 0.5), \
            log.read_text(errors="replace")[-2000:] if log.exists() else "no log"
        (server,) = servers_with(mark)
        pgid = os.getpgid(server)
        assert pgid != os.getpgid(proc.pid)  # a process group of its own
        assert len(group_members(pgid)) >= 2  # the API server and its engine core
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.terminate()  # SIGTERM: fuzz stops its server (SIGKILL would leave that to the kernel)
            proc.wait(60)
    assert "Traceback" not in err, err
    assert wait_until(lambda: not group_members(pgid), 30.0), group_members(pgid)
