"""One writer per campaign database: an OS-level lock on a file next to it.

SQLite's own locks serialize transactions, not campaigns: two campaigns on one
``--db`` would interleave executions, checkpoints and corpora and resume each
other's state. So ``fuzz campaign`` takes an exclusive ``flock`` on
``<db>.lock`` for as long as it runs. The kernel drops the lock when the process
ends, however it ends (SIGKILL, OOM, power loss of a container): a dead campaign
never leaves the database locked. The file holds the owner's PID for the
message only; a stale PID in it means nothing once the lock is free.

``fuzz minimize`` takes its own lock per finding (``<db>.minimize-<id>.lock``,
:func:`minimization_lock`): two minimizations of one finding would interleave their
checkpoints, while a minimization beside a campaign, or of another finding, only
adds rows. Readers (``fuzz status``, ``findings``, ``show``) take no lock: WAL lets
them read while the campaign writes.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from fuzzer.errors import StoreError

LOCK_SUFFIX = ".lock"


class CampaignLock:
    """``with CampaignLock(db_path):`` -- raises StoreError when another process holds it."""

    def __init__(self, db_path: str | Path, *, purpose: str = "campaign", tag: str = "",
                 hint: str = "wait for it to finish, stop it (Ctrl-C saves everything), or use another --db"):
        self.db_path = Path(db_path)
        self.path = self.db_path.with_name(self.db_path.name + (f".{tag}" if tag else "") + LOCK_SUFFIX)
        self.purpose = purpose
        self.hint = hint
        self._fd: int | None = None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StoreError(f"cannot create lock file {self.path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(fd)
            os.close(fd)
            who = f" (pid {owner})" if owner else ""
            raise StoreError(f"another {self.purpose}{who} is running on {self.db_path}; {self.hint}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {self.purpose}\n".encode())
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock; the file may stay

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "CampaignLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def minimization_lock(db_path: str | Path, finding_id: int) -> CampaignLock:
    """The lock ``fuzz minimize`` holds on one finding of one database while it runs."""
    return CampaignLock(
        db_path, purpose=f"minimization of finding {finding_id}", tag=f"minimize-{finding_id}",
        hint=f"wait for it to finish or stop it (Ctrl-C saves its progress; `fuzz minimize {finding_id}` resumes)",
    )


def _read_owner(fd: int) -> str | None:
    try:
        text = os.pread(fd, 64, 0).decode(errors="replace").split()
    except OSError:
        return None
    return text[0] if text and text[0].isdigit() else None
