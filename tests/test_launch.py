"""Managed targets (issue 17): ``--launch`` and ``--target-file`` start the server, own its
process group, stop it on every way out, and say in one line why a launch failed."""

from __future__ import annotations

import asyncio
import shlex
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest
from click.testing import CliRunner
from conftest import CORPUS, ROOT
from launch_support import marker, servers_with, sim_command, wait_until

from fuzzer.cli import cli
from fuzzer.execute.launch import LaunchError, LaunchSpec, ManagedServer
from fuzzer.execute.targetfile import load, parse

PY = shlex.quote(sys.executable)
FUZZ = str(ROOT / ".venv" / "bin" / "fuzz") if (ROOT / ".venv" / "bin" / "fuzz").exists() else "fuzz"


def _one_line_error(result, start: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: " + start), result.output
    assert "Traceback" not in result.output


def test_a_launched_server_answers_and_is_stopped_with_its_children():
    mark = marker()
    sleeper = f"{PY} -c 'import time; time.sleep(300)' {mark}"
    spec = LaunchSpec(command=("sh", "-c", f"{sleeper} & exec {sim_command(mark)}"))

    async def main() -> None:
        async with ManagedServer(spec) as server:
            assert server.url == f"http://127.0.0.1:{server.port}"
            with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                assert r.status == 200
            assert len(servers_with(mark)) == 2  # the simulator and the sleeper it was started beside

    asyncio.run(main())
    assert wait_until(lambda: not servers_with(mark), 5.0), servers_with(mark)


def test_the_port_placeholder_is_required():
    with pytest.raises(LaunchError, match=r"must contain \{port\}"):
        LaunchSpec.parse("llama-server -m x.gguf --port 8080")


@pytest.mark.parametrize(
    "command, start",
    [
        ("no-such-server-xyz --port {port}", "cannot launch the server: command not found: no-such-server-xyz"),
        (f"{PY} -c 'import sys; print(\"boom: bad flag\"); sys.exit(3)' {{port}}",
         "the launched server exited with status 3 before it was ready; its log ends: boom: bad flag"),
        ("llama-server --port 8080", "the launch command must contain {port}"),
        ("'unclosed {port}", "cannot read the launch command"),
    ],
)
def test_a_bad_launch_command_is_one_line_and_exit_2(command, start, tmp_path):
    result = CliRunner().invoke(cli, ["calibrate", "--db", str(tmp_path / "x.db"), "--launch", command])
    _one_line_error(result, start)


def test_a_server_never_ready_is_one_line_and_is_stopped(tmp_path):
    mark = marker()
    tf = tmp_path / "t.toml"
    tf.write_text(f'command = "{sys.executable} -c \'import time; time.sleep(300)\' {mark} {{port}}"\ntimeout = 1\n')
    result = CliRunner().invoke(cli, ["replay", str(CORPUS / "vllm-37308.json"), "--target-file", str(tf)])
    _one_line_error(result, "the launched server was not ready at http://127.0.0.1:")
    assert "within 1 s" in result.output
    assert not servers_with(mark)


def test_a_port_in_use_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        tf = tmp_path / "t.toml"
        tf.write_text(f'command = ["{sys.executable}", "-m", "fuzzer", "sim", "--port", "{port}"]\nport = {port}\n')
        result = CliRunner().invoke(cli, ["calibrate", "--db", str(tmp_path / "x.db"), "--target-file", str(tf)])
    _one_line_error(result, f"port {port} is already in use on 127.0.0.1")


def test_a_chosen_port_taken_before_the_server_binds_it_is_chosen_again(monkeypatch):
    # The race two campaigns on one machine run: the port was free when chosen and another
    # process holds it when the server binds. A bound socket that does not listen is such a holder:
    # the pre-check's connect finds nothing there, the server's bind fails.
    import fuzzer.execute.launch as launch

    mark = marker()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        taken = holder.getsockname()[1]
        chosen = iter([taken])
        real = launch.free_port
        monkeypatch.setattr(launch, "free_port", lambda: next(chosen, None) or real())

        async def main() -> int:
            async with ManagedServer(LaunchSpec.parse(sim_command(mark))) as server:
                with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                    assert r.status == 200
                assert server.starts == 2  # the first start failed to bind, the second is up
                return server.port

        port = asyncio.run(main())
    assert port != taken
    assert wait_until(lambda: not servers_with(mark), 5.0), servers_with(mark)


def test_a_chosen_port_always_taken_is_one_clear_error(monkeypatch):
    import fuzzer.execute.launch as launch

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        taken = holder.getsockname()[1]
        monkeypatch.setattr(launch, "free_port", lambda: taken)
        with pytest.raises(LaunchError, match=f"port {taken} is already in use: the launched server could not"):
            asyncio.run(ManagedServer(LaunchSpec.parse(sim_command(marker()))).start())


NO_HEALTH = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_server_without_a_health_route_is_ready_once_it_lists_its_models(tmp_path):
    script = tmp_path / "no_health.py"
    script.write_text(NO_HEALTH)
    mark = marker()

    async def main() -> None:
        spec = LaunchSpec.parse(f"{PY} {script} {{port}} {mark}", timeout_s=20)
        async with ManagedServer(spec) as server:
            with urllib.request.urlopen(server.url + "/v1/models", timeout=5) as r:
                assert r.status == 200
        # A ready URL the user named is theirs: a 404 there is not ready.
        named = LaunchSpec.parse(f"{PY} {script} {{port}} {mark}", ready_url="http://127.0.0.1:{port}/ready",
                                 timeout_s=2)
        with pytest.raises(LaunchError, match="was not ready at http://127.0.0.1:[0-9]+/ready within 2 s"):
            await ManagedServer(named).start()

    asyncio.run(main())
    assert wait_until(lambda: not servers_with(mark), 5.0), servers_with(mark)


def test_target_and_launch_exclude_each_other(tmp_path):
    result = CliRunner().invoke(cli, ["calibrate", "--target", "http://127.0.0.1:1", "--launch", "x {port}"])
    _one_line_error(result, "--target and --launch each say which server to use")


@pytest.mark.parametrize(
    "text, start",
    [
        ('command = "x {port}"\nwhat = 1\n', "unknown key 'what'"),
        ("timeout = 3\n", "'command' is missing"),
        ('command = "x {port}"\ntimeout = -1\n', "'timeout' must be a number of seconds > 0"),
        ('command = "x {port}"\nport = 70000\n', "'port' must be a port number"),
        ('command = 5\n', "'command' must be a string or a list of strings"),
        ('command = "x {port}"\n[env]\nA = 1\n', "env.A must be a string"),
        ("command = \n", "not valid TOML"),
    ],
)
def test_a_bad_target_file_is_one_line(text, start, tmp_path):
    tf = tmp_path / "t.toml"
    tf.write_text(text)
    result = CliRunner().invoke(cli, ["calibrate", "--db", str(tmp_path / "x.db"), "--target-file", str(tf)])
    _one_line_error(result, f"{tf}: {start}")


def test_a_missing_target_file_is_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["calibrate", "--target-file", str(tmp_path / "none.toml")])
    _one_line_error(result, "cannot read the target file")


def test_the_target_file_reads_every_key(tmp_path):
    tf = tmp_path / "t.toml"
    tf.write_text(
        'command = ["srv", "--port", "{port}"]\nready_url = "http://127.0.0.1:{port}/ready"\ntimeout = 5\n'
        f'log_file = "{tmp_path / "s.log"}"\n[env]\nOMP_NUM_THREADS = "1"\n[variants]\nnp1 = "-np 1"\n'
    )
    got = load(tf)
    assert got.spec.command == ("srv", "--port", "{port}")
    assert got.spec.ready_url.endswith("/ready") and got.spec.timeout_s == 5.0
    assert got.spec.env == {"OMP_NUM_THREADS": "1"} and got.variants == {"np1": "-np 1"}
    assert got.spec.log_file == str(tmp_path / "s.log")
    assert parse({"command": "srv {port}"}).spec.identity == "launch:srv '{port}'"


def test_replay_on_a_launched_simulator_leaves_no_server(tmp_path):
    mark = marker()
    log = tmp_path / "server.log"
    tf = tmp_path / "t.toml"
    tf.write_text(f"command = {sim_command(mark)!r}\nlog_file = {str(log)!r}\ntimeout = 60\n")
    proc = subprocess.run(
        [FUZZ, "replay", str(CORPUS / "vllm-37308.json"), "--target-file", str(tf), "--runs", "1",
         "--db", str(tmp_path / "r.db")],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )
    assert proc.returncode in (0, 1), proc.stderr
    assert "run 1/" in proc.stdout and "on http://127.0.0.1:" in proc.stdout
    assert "ready on http://127.0.0.1:" in log.read_text()  # the server's own output went to its log
    assert not servers_with(mark)


@pytest.mark.parametrize("sig, command", [
    (signal.SIGTERM, "replay"), (signal.SIGINT, "replay"), (signal.SIGTERM, "campaign"),
])
def test_a_signal_stops_the_launched_server(sig, command, tmp_path):
    mark = marker()
    args = ([FUZZ, "replay", str(CORPUS / "vllm-37308.json"), "--runs", "20"] if command == "replay"
            else [FUZZ, "campaign", "--duration", "10m"])
    proc = subprocess.Popen([*args, "--db", str(tmp_path / "s.db"), "--launch", sim_command(mark)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert wait_until(lambda: servers_with(mark), 60.0)
        _wait_ready(servers_with(mark)[0])
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
    assert "Traceback" not in err, err
    assert proc.returncode in (0, 130), err
    assert not servers_with(mark)


def _wait_ready(pid: int) -> None:
    """Until the server ``pid`` listens (its fuzz parent then waits for /health or runs)."""
    def listening() -> bool:
        try:
            out = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
        except OSError:
            return True
        return f"pid={pid}," in out
    wait_until(listening, 30.0)


@pytest.mark.parametrize("sig, command", [
    (signal.SIGTERM, "campaign"), (signal.SIGINT, "replay"), (signal.SIGTERM, "calibrate"),
])
def test_a_signal_while_waiting_for_ready_stops_the_server_at_once(sig, command, tmp_path):
    mark = marker()
    never = f"{PY} -c 'import time; time.sleep(300)' {mark} {{port}}"
    args = {"campaign": [FUZZ, "campaign", "--duration", "10m"],
            "replay": [FUZZ, "replay", str(CORPUS / "vllm-37308.json")],
            "calibrate": [FUZZ, "calibrate"]}[command]
    proc = subprocess.Popen([*args, "--db", str(tmp_path / "s.db"), "--launch", never],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert wait_until(lambda: servers_with(mark), 60.0)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=90)  # not the 600 s the ready wait allows (90: a loaded CI host)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
    assert "Traceback" not in err, err
    assert wait_until(lambda: not servers_with(mark), 5.0)


def test_a_server_whose_fuzzer_is_killed_outright_goes_too(tmp_path):
    mark = marker()
    proc = subprocess.Popen([FUZZ, "calibrate", "--db", str(tmp_path / "k.db"), "--launch", sim_command(mark)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        assert wait_until(lambda: servers_with(mark), 60.0)
        _wait_ready(servers_with(mark)[0])
    finally:
        proc.kill()  # SIGKILL: no cleanup of ours runs; the kernel's parent-death signal does
        proc.wait()
    assert wait_until(lambda: not servers_with(mark), 15.0), servers_with(mark)


def test_the_scheduler_settings_a_server_was_started_with_are_read_from_its_command_and_log():
    from fuzzer.execute.launch import told_scheduler

    assert told_scheduler(["vllm", "serve", "m", "--max-num-batched-tokens", "4096", "--max-num-seqs=64"]) == {
        "max_num_batched_tokens": 4096, "max_num_seqs": 64}
    # vLLM states the budget it settled on (after its hardware-dependent defaults) in its startup log.
    log = ("INFO 11-30 01:02:03 [utils.py:253] non-default args: {'model': 'm', 'max_num_seqs': 32}\n"
           "INFO 11-30 01:02:04 [scheduler.py:205] Chunked prefill is enabled with max_num_batched_tokens=8192.\n")
    assert told_scheduler(["vllm", "serve", "m", "--max-num-batched-tokens", "4096"], log) == {
        "max_num_batched_tokens": 8192, "max_num_seqs": 32}
    # Nothing stated, a flag without a value, zero or a word: nothing told.
    assert told_scheduler(["server.py", "--max-num-seqs"], "max_num_batched_tokens=0 max_num_seqs=auto") == {}


def test_a_launched_servers_stated_budget_is_its_configuration_not_a_default_to_probe(tmp_path):
    from fuzzer.cli._launch import open_launched
    from fuzzer.oracle.calibrate import scheduler_assumption

    mark = marker()
    line = "INFO [scheduler.py:205] Chunked prefill is enabled with max_num_batched_tokens=4096."
    spec = LaunchSpec(command=("sh", "-c", f"echo {shlex.quote(line)} >&2; exec {sim_command(mark)}"),
                      log_file=str(tmp_path / "server.log"))

    async def main():
        async with open_launched(spec, server="vllm") as target:
            return target.info

    info = asyncio.run(main())
    assert info.scheduler["max_num_batched_tokens"] == 4096
    assumption = scheduler_assumption(info)
    assert assumption.token_budget == 4096 and "server-reported token_budget" in assumption.source
    assert wait_until(lambda: not servers_with(mark), 5.0)
