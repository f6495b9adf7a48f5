"""The targets file of a fleet campaign (``--targets FILE``, TOML): which servers, where.

    [[target]]
    name = "h100-vllm"                    # unique; how findings and status name the target
    url = "http://10.0.0.5:8000"          # a running server ...
    node = "10.0.0.5"                     # ... and the Ray node its worker must run on
    kind = "vllm-0.6"                     # optional: targets of one kind re-check each other's findings

    [[target]]
    name = "a10-vllm"
    launch = "vllm serve m --port {port}" # or a managed launch, started by the worker on its node
    resources = { a10 = 1 }               # or custom Ray resources that pin the worker

``launch`` may also be a table with the keys of a ``--target-file`` (command, env, timeout, ...).
A bad file raises :class:`FleetError`, one line naming the entry and the key.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from fuzzer.errors import ConfigError
from fuzzer.execute.launch import LaunchError, LaunchSpec
from fuzzer.execute.targetfile import parse as parse_target_file

KEYS = {"name", "url", "launch", "kind", "node", "resources", "server", "model", "timeout"}
#: The share of a node's ``node:IP`` resource one worker asks for: pins it there, and leaves room.
NODE_SHARE = 0.001


class FleetError(ConfigError):
    """A fleet campaign cannot start as asked: a bad targets file, no Ray, an unreachable cluster."""


@dataclass(frozen=True)
class FleetTarget:
    """One server of a fleet and where its worker runs."""

    name: str
    url: str | None = None
    launch: LaunchSpec | None = None
    #: Targets of the same kind re-check each other's findings (same engine, version, configuration).
    kind: str = ""
    #: Ray resources the worker actor asks for (``node:IP`` for a node, or custom ones).
    resources: Mapping[str, float] = field(default_factory=dict)
    server: str = "auto"
    model: str | None = None
    timeout_s: float | None = None

    @property
    def identity(self) -> str:
        """The target's name in the store's targets table: its URL or its launch command."""
        return self.url if self.launch is None else self.launch.identity


def load(path: str | Path) -> list[FleetTarget]:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as e:
        raise FleetError(f"cannot read the targets file {p}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise FleetError(f"{p}: not valid TOML: {e}") from None
    return parse(data, source=str(p))


def parse(data: Mapping[str, Any], source: str = "targets file") -> list[FleetTarget]:
    entries = data.get("target")
    unknown = sorted(set(data) - {"target"})
    if unknown:
        raise FleetError(f"{source}: unknown key {unknown[0]!r}; each server is a [[target]] table")
    if not isinstance(entries, list) or not entries:
        raise FleetError(f"{source}: no [[target]] entries (each needs a name and a url or a launch command)")
    targets = [_target(entry, i, source) for i, entry in enumerate(entries)]
    names = [t.name for t in targets]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise FleetError(f"{source}: two targets are named {duplicate!r}; names must be unique")
    return targets


def _target(entry: Any, index: int, source: str) -> FleetTarget:
    where = f"{source}: target {index + 1}"
    if not isinstance(entry, Mapping):
        raise FleetError(f"{where}: must be a [[target]] table")
    unknown = sorted(set(entry) - KEYS)
    if unknown:
        raise FleetError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(KEYS))})")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise FleetError(f"{where}: 'name' is missing or empty")
    where = f"{source}: target {name!r}"
    url, launch = entry.get("url"), entry.get("launch")
    if (url is None) == (launch is None):
        raise FleetError(f"{where}: give exactly one of 'url' (a running server) and 'launch' (a command with {{port}})")
    if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
        raise FleetError(f"{where}: 'url' must be an http:// or https:// URL, got {url!r}")
    spec = None
    if launch is not None:
        try:
            if isinstance(launch, str):
                spec = LaunchSpec.parse(launch)
            elif isinstance(launch, Mapping):
                spec = parse_target_file(launch, source=f"{where}, launch").spec
            else:
                raise FleetError(f"{where}: 'launch' must be a command line or a table, got {launch!r}")
        except LaunchError as e:
            raise FleetError(f"{where}: {e}") from None
    resources = dict(_resources(entry.get("resources", {}), where))
    node = entry.get("node")
    if node is not None:
        if not isinstance(node, str) or not node:
            raise FleetError(f"{where}: 'node' must be a Ray node's IP address, got {node!r}")
        resources[f"node:{node}"] = NODE_SHARE
    timeout = entry.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise FleetError(f"{where}: 'timeout' must be a number of seconds > 0, got {timeout!r}")
    for key in ("kind", "server", "model"):
        if key in entry and not isinstance(entry[key], str):
            raise FleetError(f"{where}: {key!r} must be a string, got {entry[key]!r}")
    return FleetTarget(
        name=name, url=url, launch=spec, kind=entry.get("kind", name), resources=resources,
        server=entry.get("server", "auto"), model=entry.get("model"),
        timeout_s=None if timeout is None else float(timeout),
    )


def _resources(value: Any, where: str) -> Mapping[str, float]:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
        for k, v in value.items()
    ):
        raise FleetError(f"{where}: 'resources' must be a table of resource names to amounts > 0, got {value!r}")
    return {k: float(v) for k, v in value.items()}
