"""Small helpers the real-server fixtures share (llama.cpp, vLLM): a free loopback port,
JSON over HTTP with the standard library, the tail of a server's log."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

HTTP_TIMEOUT_S = 60.0  # a loaded CI host answers slowly


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout_s: float = HTTP_TIMEOUT_S):
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def post_json(url: str, body: dict, timeout_s: float = HTTP_TIMEOUT_S):
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def log_tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
