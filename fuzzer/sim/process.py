"""The simulator in a child process: ``python -m fuzzer sim --port 0`` behind a context manager.

Campaigns and replays without ``--target`` measure the simulator through the
HTTP executor. Running it in its own process keeps the measuring client's event
loop and GIL free of the simulator's work, as with a real server.
"""

from __future__ import annotations

import asyncio
import os
import re
import select
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from fuzzer.errors import TargetError
from fuzzer.sim.faults import DEFAULT_RATE, check_rate
from fuzzer.sim.faults import validate as validate_faults
from fuzzer.sim.pathologies import validate

#: Python start-up, imports and binding a port take ~1 s; a loaded CI machine can take many more.
STARTUP_TIMEOUT_S = 30.0
#: How long the child may take to exit after SIGTERM before it is killed.
STOP_TIMEOUT_S = 5.0
_READY = re.compile(r"ready on (http://\S+)")


class SimProcess:
    """Starts the simulated server as a child process; ``.url`` once started.

    Use it with ``with`` or ``async with``; it stops the child on exit
    (SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT_S`).
    """

    def __init__(
        self,
        pathologies: Sequence[str] | str = (),
        seed: int = 0,
        speed: float = 1.0,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        faults: Sequence[str] | str = (),
        fault_rate: float = DEFAULT_RATE,
        fault_grace: int = 0,
    ) -> None:
        self.pathologies = validate(pathologies if isinstance(pathologies, str) else tuple(pathologies))
        self.faults = validate_faults(faults if isinstance(faults, str) else tuple(faults))
        self.fault_rate = check_rate(fault_rate)
        self.fault_grace = fault_grace
        self.seed = seed
        self.speed = speed
        self.extra_args = tuple(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.url: str | None = None
        self._proc: subprocess.Popen | None = None
        self._stderr = None

    @property
    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "fuzzer", "sim", "--host", "127.0.0.1", "--port", "0",
            "--pathologies", ",".join(self.pathologies) or "none",
            "--speed", repr(float(self.speed)), "--seed", str(self.seed),
            "--faults", ",".join(self.faults) or "none", "--fault-rate", repr(float(self.fault_rate)),
            "--fault-grace", str(self.fault_grace),
            # The child exits when we do, even when we are SIGKILLed and cannot stop it.
            "--parent-pid", str(os.getpid()), *self.extra_args,
        ]

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> str:
        if self._proc is not None:
            raise TargetError("this simulator process is already started")
        self._stderr = tempfile.TemporaryFile()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        try:
            self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=self._stderr, env=env)
        except OSError as e:
            raise TargetError(f"cannot start the simulator ({e.strerror})") from None
        try:
            self.url = self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.url

    def _wait_ready(self) -> str:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + self.startup_timeout_s
        seen = b""
        while True:
            match = _READY.search(seen.decode(errors="replace"))
            if match:
                return match.group(1)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TargetError(
                    f"the simulator did not say 'ready on URL' within {self.startup_timeout_s:g} s{self._why()}"
                )
            readable, _, _ = select.select([fd], [], [], min(remaining, 0.5))
            if readable:
                data = os.read(fd, 4096)
                if not data:
                    self._proc.wait(timeout=STOP_TIMEOUT_S)
                    raise TargetError(f"the simulator exited with status {self._proc.returncode}{self._why()}")
                seen += data

    def _why(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        lines = [ln for ln in self._stderr.read().decode(errors="replace").splitlines() if ln.strip()]
        return f": {lines[-1].strip()}" if lines else ""

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def __enter__(self) -> "SimProcess":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> "SimProcess":
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)
