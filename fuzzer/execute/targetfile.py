"""The target file (``--target-file FILE``): a repeatable managed-server set-up in TOML.

    command = "llama-server -m tiny.gguf --host 127.0.0.1 --port {port} -np 4 --metrics"
    ready_url = "http://127.0.0.1:{port}/health"   # optional, this is the default
    timeout = 120                                  # seconds to wait for ready (default 600)
    log_file = "server.log"                        # optional, default a temporary file
    port = 8000                                    # optional: a fixed port instead of {port}
    max_restarts = 5                               # deaths in 10 minutes before a crash loop stops
    [env]
    OMP_NUM_THREADS = "1"
    [variants]                                     # optional: configurations for replay --variant
    np1 = "-np 1"

``command`` may also be a list of arguments. A bad file names the key and what it must be.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from fuzzer.execute.launch import DEFAULT_READY_TIMEOUT_S, LaunchError, LaunchSpec

KEYS = {"command", "env", "ready_url", "timeout", "log_file", "port", "max_restarts", "variants"}


@dataclass(frozen=True)
class TargetFile:
    spec: LaunchSpec
    #: Variant name -> extra arguments (``fuzz replay --variant`` adds to these).
    variants: Mapping[str, str] = field(default_factory=dict)


def load(path: str | Path) -> TargetFile:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as e:
        raise LaunchError(f"cannot read the target file {p}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise LaunchError(f"{p}: not valid TOML: {e}") from None
    return parse(data, source=str(p))


def parse(data: Mapping[str, Any], source: str = "target file") -> TargetFile:
    unknown = sorted(set(data) - KEYS)
    if unknown:
        raise LaunchError(f"{source}: unknown key {unknown[0]!r} (known: {', '.join(sorted(KEYS))})")
    if "command" not in data:
        raise LaunchError(f"{source}: 'command' is missing (the server's command line, with {{port}})")
    options: dict[str, Any] = {}
    command = data["command"]
    if "env" in data:
        options["env"] = _strings(data["env"], "env", source)
    if "ready_url" in data:
        options["ready_url"] = _string(data["ready_url"], "ready_url", source)
    timeout = data.get("timeout", DEFAULT_READY_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise LaunchError(f"{source}: 'timeout' must be a number of seconds > 0, got {timeout!r}")
    options["timeout_s"] = float(timeout)
    if "log_file" in data:
        options["log_file"] = _string(data["log_file"], "log_file", source)
    if "port" in data:
        port = data["port"]
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise LaunchError(f"{source}: 'port' must be a port number (1-65535), got {port!r}")
        options["port"] = port
    if "max_restarts" in data:
        n = data["max_restarts"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise LaunchError(f"{source}: 'max_restarts' must be a whole number >= 0, got {n!r}")
        options["max_restarts"] = n
    if isinstance(command, str):
        spec = LaunchSpec.parse(command, **options)
    elif isinstance(command, list) and command and all(isinstance(a, str) for a in command):
        spec = LaunchSpec(command=tuple(command), **options).checked()
    else:
        raise LaunchError(f"{source}: 'command' must be a string or a list of strings, got {command!r}")
    variants = _strings(data.get("variants", {}), "variants", source)
    return TargetFile(spec, variants)


def _string(value: Any, key: str, source: str) -> str:
    if not isinstance(value, str) or not value:
        raise LaunchError(f"{source}: {key!r} must be a non-empty string, got {value!r}")
    return value


def _strings(value: Any, key: str, source: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise LaunchError(f"{source}: [{key}] must be a table of name = \"string\"")
    out = {}
    for name, v in value.items():
        if not isinstance(v, str):
            raise LaunchError(f"{source}: {key}.{name} must be a string, got {v!r}")
        out[str(name)] = v
    return out
