"""A launched server that dies (issue 17): the ``crash`` finding quotes its log, the server is
started again with backoff, and a crash loop stops the campaign with one clear line."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import pytest
from conftest import CORPUS
from launch_support import dying_command, marker, servers_with
from test_launch import FUZZ

from fuzzer.execute.managed import CrashLoop, ManagedTarget
from fuzzer.execute.recovery import HEALTH_PROBE
from fuzzer.execution import ExecutionResult
from fuzzer.store import Store
from fuzzer.trace import Request, Trace

FATAL = "FATAL: EngineCore died: CUDA error"


class _FakeServer:
    """Dies whenever told; counts restarts."""

    def __init__(self, max_restarts: int = 2):
        self.alive = True
        self.died_with: int | None = None
        self.restarts = 0
        self.log_path = "/tmp/server.log"
        self.spec = type("Spec", (), {"max_restarts": max_restarts})()

    def die(self) -> None:
        self.alive, self.died_with = False, -9

    def tail(self, n: int = 20) -> list[str]:
        return ["loading", FATAL][-n:]

    def last_error(self) -> str | None:
        return FATAL

    async def restart(self) -> str:
        self.restarts += 1
        self.alive, self.died_with = True, None
        return "http://127.0.0.1:1"


class _KillingTarget:
    name = "http://127.0.0.1:1"
    info = None

    def __init__(self, server: _FakeServer):
        self.server = server

    async def execute(self, trace: Trace, *, cut_s: float | None = None) -> ExecutionResult:
        self.server.die()
        return ExecutionResult(trace_hash=trace.content_hash(), target=self.name, started_at=0.0, duration_s=0.1,
                               requests=())


class _WedgingTarget:
    """Serves until ``wedge`` is set, then every request times out without a byte until the server restarts;
    ``hang`` makes only the given trace's requests time out (the server itself still answers)."""

    name = "http://127.0.0.1:1"
    info = None

    def __init__(self, server: _FakeServer):
        self.server, self.wedge, self.hang, self.probes = server, False, None, 0

    async def execute(self, trace: Trace, *, cut_s: float | None = None) -> ExecutionResult:
        from fuzzer.execution import Outcome, RequestResult

        self.probes += trace.name == HEALTH_PROBE.name
        if self.server.restarts and self.wedge == "until-restart":
            self.wedge = False
        stuck = bool(self.wedge) or trace == self.hang
        requests = tuple(RequestResult(
            request_id=r.id, x_request_id=r.id, scheduled_s=0.0, sent_s=0.0,
            outcome=(Outcome.CUT if trace.name == HEALTH_PROBE.name else Outcome.TIMEOUT) if stuck else Outcome.OK,
            ttft_s=None if stuck else 0.1, first_event_s=None if stuck else 0.1, token_times_s=() if stuck else (0.1,),
            e2e_s=None if stuck else 0.1, prompt_tokens=r.prompt_tokens, completion_tokens=0 if stuck else 1,
            http_status=None if stuck else 200) for r in trace.requests)
        return ExecutionResult(trace_hash=trace.content_hash(), target=self.name, started_at=0.0, duration_s=60.0,
                               requests=requests)


def test_a_server_that_lives_but_serves_nothing_is_started_again_and_a_hang_of_one_trace_is_not():
    server = _FakeServer(max_restarts=2)
    inner = _WedgingTarget(server)

    async def sleep(s: float) -> None:
        pass

    target = ManagedTarget(inner, server, sleep=sleep, clock=lambda: 0.0)
    trace = Trace(requests=(Request(id="a", at_ms=0, prompt_tokens=8, max_tokens=2),
                            Request(id="b", at_ms=5, prompt_tokens=8, max_tokens=2)))

    async def main() -> None:
        inner.hang = trace  # this trace hangs; a probe is served: no restart
        result = await target.execute(trace)
        assert inner.probes == 1 and not any("wedged" in w for w in result.warnings) and server.restarts == 0
        inner.hang, inner.wedge = None, "until-restart"
        result = await target.execute(trace)
        assert inner.probes == 2 and result.warnings[-1].startswith("server wedged: no request of this execution")
        assert server.restarts == 0  # started again before the next execution
        result = await target.execute(trace)
        assert server.restarts == 1 and [r.outcome.value for r in result.requests] == ["ok", "ok"]
        assert inner.probes == 2  # a served execution costs no probe
        inner.wedge = True  # wedges again and again: a crash loop, one clear message
        for _ in range(2):
            await target.execute(trace)
        with pytest.raises(CrashLoop, match="died 3 times"):
            await target.execute(trace)

    asyncio.run(main())


def test_a_deaths_error_line_is_quoted_when_exit_noise_buried_it():
    from fuzzer.execute.launch import last_error_line

    # vLLM's CPU build, stop 33: the engine's RuntimeError, then ~40 lines of nanobind's leak report at exit.
    log = "\n".join(["INFO ready", "(Worker pid=1) ERROR [x.py:1]     gen.set_offset(gen.get_offset() - 4)",
                     "(Worker pid=1) ERROR [x.py:1] RuntimeError: CPU Generator does not use offset",
                     *[f' - leaked function "f{i}"' for i in range(40)], "nanobind: leaked 514 functions!"])
    assert last_error_line(log) == "(Worker pid=1) ERROR [x.py:1] RuntimeError: CPU Generator does not use offset"
    assert last_error_line("INFO ready\nINFO serving") is None
    assert last_error_line("FATAL: EngineCore died") == "FATAL: EngineCore died"
    server = _FakeServer()
    server.tail = lambda n=20: [' - leaked function "f"', "nanobind: leaked 514 functions!"][-n:]
    server.last_error = lambda: "RuntimeError: CPU Generator does not use offset"
    server.die()
    note = ManagedTarget(_KillingTarget(server), server, sleep=asyncio.sleep).death_note()
    assert note.endswith("its last error line, above them: RuntimeError: CPU Generator does not use offset")
    # An error already among the last lines is not quoted twice.
    assert "above them" not in ManagedTarget(_KillingTarget(_FakeServer()), _FakeServer(), sleep=asyncio.sleep).death_note()


def test_a_death_is_noted_with_the_log_then_restarted_with_backoff_until_a_crash_loop():
    server = _FakeServer(max_restarts=2)
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    target = ManagedTarget(_KillingTarget(server), server, sleep=sleep, clock=lambda: 0.0)
    trace = Trace(requests=(Request(id="a", at_ms=0, prompt_tokens=8, max_tokens=2),))

    async def main() -> None:
        result = await target.execute(trace)
        assert result.warnings[-1].startswith("server died: the launched server was killed by signal 9")
        assert FATAL in result.warnings[-1] and "/tmp/server.log" in result.warnings[-1]
        await target.execute(trace)
        await target.execute(trace)
        assert server.restarts == 2 and waits == [1.0, 2.0]
        with pytest.raises(CrashLoop, match=r"died 3 times within 600 s; stopping \(last log line: FATAL"):
            await target.execute(trace)

    asyncio.run(main())


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A database holding a calibration of the dying server's command (healthy: no DIE_ON)."""
    folder = tmp_path_factory.mktemp("crash")
    mark = marker()
    command = dying_command(mark)
    healthy = folder / "ok.toml"
    healthy.write_text(f"command = {command!r}\n")
    db = folder / "base.db"
    proc = subprocess.run([FUZZ, "calibrate", "--target-file", str(healthy), "--db", str(db), "--repeats", "1"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return command, db, mark


def _dying_file(path, command: str, max_restarts: int) -> str:
    path.write_text(f"command = {command!r}\nmax_restarts = {max_restarts}\n[env]\nDIE_ON = \"r05\"\n")
    return str(path)


def test_replay_names_the_crash_and_quotes_the_servers_log(calibrated, tmp_path):
    command, base, mark = calibrated
    db = tmp_path / "r.db"
    shutil.copy(base, db)
    tf = _dying_file(tmp_path / "die.toml", command, 5)
    proc = subprocess.run([FUZZ, "replay", str(CORPUS / "vllm-37308.json"), "--target-file", tf, "--runs", "3",
                           "--db", str(db)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stderr
    assert "FINDING crash on the execution, reproduced 3/3" in proc.stdout
    assert "exited with status 134 during this execution" in proc.stdout and FATAL in proc.stdout
    assert "FINDING leak" not in proc.stdout  # a dead server cannot return to idle: that is the crash, not a leak
    with Store.open(str(db)) as store:
        killers = [store.get_execution(i) for i in store.execution_ids()]
        # Every run killed the server (replay's three, and any confirmation re-runs after them).
        died = [any(w.startswith("server died") for w in x.warnings) for x in killers]
        assert len(died) >= 3 and all(died), [x.warnings for x in killers]
    assert not servers_with(mark)


def _campaign_on_a_dying_server(calibrated, tmp_path, die_after: int, duration: str):
    """A campaign (seeded with the 37308 trace) on a simulator that dies after ``die_after`` requests."""
    command, base, mark = calibrated
    db = tmp_path / "c.db"
    shutil.copy(base, db)
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    shutil.copy(CORPUS / "vllm-37308.json", seeds)
    tf = _dying_file(tmp_path / "die.toml", command, die_after)
    proc = subprocess.run([FUZZ, "campaign", "--target-file", tf, "--db", str(db), "--duration", duration,
                           "--corpus", str(seeds), "--seed", "1"], capture_output=True, text=True, timeout=240)
    return proc, db, mark


def test_the_campaign_restarts_the_server_and_records_the_crash(calibrated, tmp_path):
    proc, db, mark = _campaign_on_a_dying_server(calibrated, tmp_path, 50, "25s")
    assert proc.returncode == 0, proc.stderr
    assert "note: the launched server died (status 134); starting it again in 1 s" in proc.stderr
    found = json.loads(subprocess.run([FUZZ, "findings", "--db", str(db), "--json"], capture_output=True,
                                      text=True, timeout=60).stdout)
    crash = [f for f in found if f["kind"] == "crash"]
    assert crash, found
    show = subprocess.run([FUZZ, "show", str(crash[0]["id"]), "--db", str(db), "--json"], capture_output=True,
                          text=True, timeout=60).stdout
    assert FATAL in show and "server died" in show
    assert not servers_with(mark)


def test_a_crash_loop_stops_the_campaign_with_one_line(calibrated, tmp_path):
    proc, db, mark = _campaign_on_a_dying_server(calibrated, tmp_path, 1, "2m")
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert errors[0].startswith("error: the launched server died 2 times within 600 s; stopping (last log line: FATAL")
    with Store.open(str(db)) as store:
        assert store.count_executions() > 0  # what ran is kept; the same command resumes
    assert not servers_with(mark)
