"""Launching the server under test ourselves (``--launch``, ``--target-file``; issue 17).

A :class:`LaunchSpec` says how to start a server: its command line, in which ``{port}``
stands for a loopback port the fuzzer chooses, extra environment, the URL that answers
200 once the server is ready, how long to wait for it and where to keep its log.
A :class:`ManagedServer` starts it in a process group of its own, waits until it is ready,
and stops the whole group (SIGTERM, then SIGKILL) on exit; every server still running
when the interpreter exits is killed too, and on Linux a server whose fuzzer was killed
outright (SIGKILL) gets SIGTERM from the kernel, so no command leaves a server behind.

Every way a launch can go wrong (command not found, exits at once, never ready, port in
use) raises :class:`LaunchError` with one line that says which, and the log's last line.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Mapping

from fuzzer.errors import TargetError

PLACEHOLDER = "{port}"
DEFAULT_READY_PATH = "/health"
#: Where readiness is asked next when a server answers the default ready URL with 404 or 405 (an
#: OpenAI-compatible server without a /health route still lists its models once it can serve).
FALLBACK_READY_PATH = "/v1/models"
#: A large model takes minutes to load.
DEFAULT_READY_TIMEOUT_S = 600.0
#: How long the server may take to exit after SIGTERM before its group is killed.
STOP_TIMEOUT_S = 10.0
READY_POLL_S = 0.25
DEFAULT_READY_URL = "http://127.0.0.1:{port}" + DEFAULT_READY_PATH
LAUNCH_PREFIX = "launch:"


class LaunchError(TargetError):
    """The server the fuzzer was asked to start cannot be started or never became ready."""


class PortTaken(LaunchError):
    """The launched server could not listen on its port: another process holds it."""


#: How many free ports a first start tries when the one it chose is taken before the server
#: binds it (the kernel hands the same ephemeral port to another process's connection or server).
PORT_TRIES = 3


@dataclass(frozen=True)
class LaunchSpec:
    """How to start one server configuration."""

    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    #: Answers 200 once the server can take requests; ``{port}`` allowed.
    ready_url: str = DEFAULT_READY_URL
    timeout_s: float = DEFAULT_READY_TIMEOUT_S
    #: Where the server's stdout and stderr go; a temporary file when None.
    log_file: str | None = None
    #: A fixed port (the command has no ``{port}``); None: a free one is chosen.
    port: int | None = None
    #: Deaths within ten minutes before the server counts as crash-looping (fuzzer.execute.managed).
    max_restarts: int = 5

    @classmethod
    def parse(cls, text: str, **options) -> "LaunchSpec":
        """A spec from a shell-like command line (``--launch "llama-server -m M --port {port}"``)."""
        try:
            argv = tuple(shlex.split(text))
        except ValueError as e:
            raise LaunchError(f"cannot read the launch command {text!r}: {e}") from None
        return cls(command=argv, **options).checked()

    def checked(self) -> "LaunchSpec":
        if not self.command:
            raise LaunchError("the launch command is empty")
        if self.port is None and not any(PLACEHOLDER in a for a in self.command):
            raise LaunchError(
                f"the launch command must contain {PLACEHOLDER} where the port goes (e.g. --port {PLACEHOLDER}), "
                f"or the target file must give a fixed port: {shlex.join(self.command)}"
            )
        if not self.timeout_s > 0:
            raise LaunchError(f"the ready timeout must be > 0 seconds, got {self.timeout_s}")
        return self

    def with_args(self, extra: str) -> "LaunchSpec":
        """The same server with more arguments (a variant: ``--variant np1="-np 1"``)."""
        try:
            more = tuple(shlex.split(extra))
        except ValueError as e:
            raise LaunchError(f"cannot read the extra arguments {extra!r}: {e}") from None
        return replace(self, command=self.command + more)

    @property
    def identity(self) -> str:
        """The target's name in the store: the command line, with its ``{port}`` placeholder."""
        return LAUNCH_PREFIX + shlex.join(self.command)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


_LIVE: dict[int, "ManagedServer"] = {}


@atexit.register
def _kill_leftovers() -> None:  # the last net: whatever is still running when we exit
    for server in list(_LIVE.values()):
        server.stop(timeout_s=1.0)


#: A log line that names what killed a server: a Python exception (``RuntimeError: ...``) or a
#: fatal error line. A dying engine's last lines are often exit noise (vLLM's CPU build: nanobind's
#: leak report), its error some lines above them.
_ERROR_LINE = re.compile(r"\b[A-Z]\w*(Error|Exception): |\bFATAL\b|\bpanicked\b")


#: vLLM's scheduler settings as a launch command gives them, and as its startup log states them
#: (``Chunked prefill is enabled with max_num_batched_tokens=2048.``, ``non-default args: {...
#: 'max_num_seqs': 64}``): the key of :attr:`fuzzer.execute.adapters.ServerInfo.scheduler` for each.
_TOLD_FLAGS = {"--max-num-batched-tokens": "max_num_batched_tokens", "--max-num-seqs": "max_num_seqs"}
_TOLD_LOG = re.compile(r"\b(max_num_batched_tokens|max_num_seqs)['\"]?\s*[=:]\s*(\d+)")
#: How much of a life's log is read for the settings it states (a startup log is a few KB).
_TOLD_LOG_BYTES = 1 << 20


def told_scheduler(argv: list[str] | tuple[str, ...], log_text: str = "") -> dict[str, int]:
    """The scheduler settings a launched server was given on its command line or states in its log.

    What the server was started with is its configuration, as what it reports in /metrics is
    (:func:`fuzzer.oracle.calibrate.scheduler_assumption`); a probe would read a planted bug's
    behaviour as a setting (a budget ignored reads as a larger budget). The log's last statement
    of a setting wins (vLLM logs the value it settled on, after its defaults), then the command's.
    Positive integers only.
    """
    found: dict[str, int] = {}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in _TOLD_FLAGS:
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if value.isdigit() and int(value) > 0:
                found[_TOLD_FLAGS[flag]] = int(value)
    for key, value in _TOLD_LOG.findall(log_text):
        if int(value) > 0:
            found[key] = int(value)
    return found


def last_error_line(text: str) -> str | None:
    """The last line of ``text`` naming an exception or a fatal error, stripped; None when none does."""
    found = [ln.strip() for ln in text.splitlines() if _ERROR_LINE.search(ln)]
    return found[-1] if found else None


class ManagedServer:
    """One launched server: ``await start()``, ``.url``, ``.alive``, ``tail()``, ``stop()``.

    The port is chosen once; a restart reuses it, so clients keep their base URL.
    """

    def __init__(self, spec: LaunchSpec):
        self.spec = spec.checked()
        self.port = spec.port
        self.url: str | None = None
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._log_path: str | None = None
        self._temporary_log = False
        self._log_from = 0
        self._keep_log = False
        #: Exit status of the last server that died on its own (None while none did).
        self.died_with: int | None = None
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> str | None:
        return self._log_path

    @property
    def alive(self) -> bool:
        if self._proc is None:
            return False
        status = self._proc.poll()
        if status is not None and self.died_with is None:
            self.died_with = status
            self._keep_log = True
        return status is None

    def argv(self) -> list[str]:
        return [a.replace(PLACEHOLDER, str(self.port)) for a in self.spec.command]

    async def start(self) -> str:
        """Start the server and wait until its ready URL answers 200; returns its base URL."""
        if self._proc is not None:
            raise LaunchError("this server is already started")
        if self.port is not None:
            if port_in_use(self.port):
                raise LaunchError(f"port {self.port} is already in use on 127.0.0.1 (another server?); "
                                  f"stop it or let the fuzzer choose one with {PLACEHOLDER}")
            return await self._start_once()
        # A port we chose is free when chosen, not when the server binds it: on a taken one, another.
        taken = LaunchError(f"no free port on 127.0.0.1 in {PORT_TRIES} tries")
        for _ in range(PORT_TRIES):
            self.port = free_port()
            if port_in_use(self.port):  # another server took it already; its answer is not ours
                continue
            try:
                return await self._start_once()
            except PortTaken as e:
                taken = e
        raise taken

    async def _start_once(self) -> str:
        self._open_log()
        self._log.flush()
        self._log_from = os.fstat(self._log.fileno()).st_size  # tail() reads this life's lines only
        argv = self.argv()
        env = {**os.environ, **{k: v.replace(PLACEHOLDER, str(self.port)) for k, v in self.spec.env.items()}}
        try:
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,  # its own process group: we stop it and all its children at once
                preexec_fn=_term_with_parent,
            )
        except FileNotFoundError:
            raise LaunchError(f"cannot launch the server: command not found: {argv[0]}") from None
        except OSError as e:
            raise LaunchError(f"cannot launch the server {argv[0]}: {e.strerror}") from None
        _LIVE[self._proc.pid] = self
        self.starts += 1
        self.died_with = None
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            await self._wait_ready()
        except BaseException:
            self._keep_log = True
            self.stop()
            raise
        return self.url

    async def restart(self) -> str:
        await asyncio.to_thread(self.stop)
        return await self.start()

    async def _wait_ready(self) -> None:
        assert self._proc is not None
        ready = self.spec.ready_url.replace(PLACEHOLDER, str(self.port))
        deadline = time.monotonic() + self.spec.timeout_s
        while True:
            status = self._proc.poll()
            if status is not None:
                raise self._exited_early(status)
            if await asyncio.to_thread(self._ready, ready):
                if self._proc.poll() is not None:  # the answer came from another server on this port
                    raise self._exited_early(self._proc.returncode)
                return
            if time.monotonic() >= deadline:
                raise LaunchError(f"the launched server was not ready at {ready} within {self.spec.timeout_s:g} s"
                                  f"{self._last_line()}")
            await asyncio.sleep(READY_POLL_S)

    def _ready(self, url: str) -> bool:
        """Whether ``url`` answers 2xx; at the default ready URL, a server that answers it 404 or 405
        (no /health route) is ready once FALLBACK_READY_PATH answers 2xx."""
        status = _status(url)
        if status in (404, 405) and self.spec.ready_url == DEFAULT_READY_URL:
            status = _status(url.removesuffix(DEFAULT_READY_PATH) + FALLBACK_READY_PATH)
        return status is not None and 200 <= status < 300

    def _exited_early(self, status: int) -> LaunchError:
        lines = self.tail(20)
        if any("address already in use" in ln.lower() or "port" in ln.lower() and "in use" in ln.lower()
               for ln in lines):
            return PortTaken(f"port {self.port} is already in use: the launched server could not listen on it"
                             f"{self._last_line()}")
        how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
        return LaunchError(f"the launched server {how} before it was ready{self._last_line()}")

    def _last_line(self) -> str:
        lines = self.tail(1)
        where = f" (log: {self._log_path})" if self._log_path else ""
        return f"; its log ends: {lines[-1]}{where}" if lines else f"; its log is empty{where}"

    def _open_log(self) -> None:
        if self._log is not None:
            return
        if self.spec.log_file:
            try:
                self._log = open(self.spec.log_file, "ab")  # noqa: SIM115 - closed in stop()
            except OSError as e:
                raise LaunchError(f"cannot write the server log {self.spec.log_file}: {e.strerror}") from None
            self._log_path = self.spec.log_file
        else:
            fd, self._log_path = tempfile.mkstemp(prefix="fuzz-server-", suffix=".log")
            self._log = os.fdopen(fd, "ab")
            self._temporary_log = True

    def told(self) -> dict[str, int]:
        """The scheduler settings this server was started with (:func:`told_scheduler`): its command
        line and what this life's log has stated so far."""
        return told_scheduler(self.argv(), self._log_text(head=True))

    def tail(self, n: int = 20) -> list[str]:
        """The last ``n`` non-empty lines of the server's log."""
        return list(deque((ln.rstrip() for ln in self._log_text().splitlines() if ln.strip()), maxlen=n))

    def last_error(self) -> str | None:
        """The log's last line naming an exception or a fatal error, if any (:func:`last_error_line`)."""
        return last_error_line(self._log_text())

    def _log_text(self, *, head: bool = False) -> str:
        """This life's log, its last 64 KiB at most (``head``: its first _TOLD_LOG_BYTES, where a server
        states its settings)."""
        if self._log_path is None:
            return ""
        try:
            with open(self._log_path, "rb") as f:
                if head:
                    f.seek(self._log_from)
                    return f.read(_TOLD_LOG_BYTES).decode(errors="replace")
                f.seek(max(self._log_from, os.fstat(f.fileno()).st_size - 64 * 1024))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the server's whole process group: SIGTERM, then SIGKILL after ``timeout_s``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        # Children that outlived their leader go too.
        _signal_group(proc.pid, signal.SIGKILL)
        _LIVE.pop(proc.pid, None)

    def close(self) -> None:
        """Stop the server and close its log. A temporary log is removed unless the server failed
        to start or died (an error message or a crash finding cites it)."""
        self.alive  # noqa: B018 - notes a death not yet seen
        self.stop()
        if self._log is not None:
            self._log.close()
            self._log = None
            if self._temporary_log and not self._keep_log and self._log_path:
                with contextlib.suppress(OSError):
                    os.remove(self._log_path)

    async def __aenter__(self) -> "ManagedServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


#: Looked up here, not in the child: between fork and exec the child should do as little as it can.
_PRCTL = _prctl()
_PR_SET_PDEATHSIG = 1


def _term_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the server gets SIGTERM when the fuzzer dies without stopping it (SIGKILL, OOM)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _status(url: str) -> int | None:
    """The HTTP status ``url`` answers with; None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:  # noqa: S310 - a loopback URL we built
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError, ValueError):
        return None
