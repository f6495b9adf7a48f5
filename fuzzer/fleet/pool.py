"""The worker actors on Ray: the only module of the fuzzer that imports ``ray`` (lazily).

:class:`RayPool` connects to a cluster (or starts a local one), places one
:class:`~fuzzer.fleet.worker.Worker` actor per target with the target's resources (a node's
``node:IP`` resource pins it to that node), submits typed tasks and waits for the first to
finish. A worker that died (its process, or its node) surfaces as :class:`WorkerLost` when
its task is collected; the coordinator marks the target down.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from fuzzer.fleet.targets import FleetError, FleetTarget
from fuzzer.fleet.worker import Worker

#: How long a cluster address may take to accept a connection before it counts as unreachable.
CONNECT_TIMEOUT_S = 5.0
INSTALL_HINT = "Ray is not installed: pip install -e '.[ray]' (or pip install 'ray>=2.9')"


class WorkerLost(Exception):
    """A worker actor (or its node) died; ``reason`` says what Ray reported."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


def import_ray():
    try:
        import ray  # noqa: PLC0415 - an optional extra
    except ImportError:
        raise FleetError(INSTALL_HINT) from None
    return ray


class RayPool:
    """Worker actors on a Ray cluster; handles are Ray object refs."""

    def __init__(self, address: str | None, *, num_cpus: int | None = None):
        """``address``: a cluster's (``ray://...`` or ``host:port``), ``auto`` for the running one,
        None or ``local`` to start a local Ray for this process."""
        self.ray = import_ray()
        self._started_here = False
        self.actors: dict[str, Any] = {}
        #: Killed workers' handles: a task sent to one fails as on a lost node (WorkerLost at get).
        self._dead: dict[str, Any] = {}
        if self.ray.is_initialized():
            return  # the caller (a test, a notebook) connected already
        kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": "ERROR", "log_to_driver": False}
        if address in (None, "local"):
            if num_cpus is not None:
                kwargs["num_cpus"] = num_cpus
        else:
            _check_reachable(address)
            kwargs["address"] = address
        try:
            self.ray.init(**kwargs)
        except Exception as e:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError ...
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise FleetError(f"cannot connect to Ray at {address}: {first}") from None
        self._started_here = True

    def spawn(self, target: FleetTarget, **options: Any):
        """Place a worker for ``target`` (with its resources); returns its actor handle."""
        remote = self.ray.remote(Worker).options(
            name=None, num_cpus=0, resources=dict(target.resources) or None, max_restarts=0, max_task_retries=0,
        )
        actor = remote.remote(target, **options)
        self.actors[target.name] = actor
        self._dead.pop(target.name, None)
        return actor

    def submit(self, name: str, method: str, *args: Any):
        actor = self.actors.get(name) or self._dead[name]  # a killed worker's task fails at get, not here
        return getattr(actor, method).remote(*args)

    def wait(self, refs: Sequence[Any], timeout_s: float | None) -> list[Any]:
        """The refs of ``refs`` that finished (at least one, unless ``timeout_s`` passed first)."""
        if not refs:
            return []
        ready, _ = self.ray.wait(list(refs), num_returns=1, timeout=timeout_s)
        return ready

    def get(self, ref: Any, name: str, timeout_s: float | None = None) -> Any:
        """The task's value; a dead worker or node raises WorkerLost, a failed task its own error."""
        exceptions = self.ray.exceptions
        try:
            return self.ray.get(ref, timeout=timeout_s)
        except (exceptions.RayActorError, exceptions.WorkerCrashedError, exceptions.NodeDiedError,
                exceptions.ObjectLostError, exceptions.GetTimeoutError) as e:
            raise WorkerLost(name, _first_line(e)) from None
        except exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            raise (cause if isinstance(cause, Exception) else RuntimeError(str(e))) from None

    def kill(self, name: str) -> None:
        actor = self.actors.pop(name, None)
        if actor is not None:
            self.ray.kill(actor, no_restart=True)
            self._dead[name] = actor

    def close(self) -> None:
        for name in list(self.actors):
            try:
                self.get(self.actors[name].stop.remote(), name, timeout_s=30.0)
            except Exception:  # noqa: BLE001 - a dead worker has nothing to stop
                pass
            self.kill(name)
        if self._started_here:
            self.ray.shutdown()


def _check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail fast on a cluster address nothing listens on (Ray itself retries for minutes)."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise FleetError(f"--ray {address}: give a cluster address as HOST:PORT or ray://HOST:PORT, or 'auto'")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise FleetError(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
