"""timeline.png: one bar per request of a measured execution."""

from __future__ import annotations

import struct

import pytest

from fuzzer.errors import OutputError
from fuzzer.execution import ExecutionResult, Outcome, RequestResult
from fuzzer.report import timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _result() -> ExecutionResult:
    return ExecutionResult(
        trace_hash="x" * 64, target="http://127.0.0.1:1", started_at=0.0, duration_s=1.0,
        requests=(
            RequestResult("s", "s-1", 0.0, 0.001, Outcome.OK, ttft_s=0.05, token_times_s=(0.05, 0.06, 0.3),
                          e2e_s=0.31),
            RequestResult("whole", "w-1", 0.01, 0.011, Outcome.OK, e2e_s=0.4),
            RequestResult("bad", "b-1", 0.02, 0.021, Outcome.HTTP_ERROR, e2e_s=0.01, http_status=500),
            RequestResult("lost", "l-1", 0.03, 0.031, Outcome.TIMEOUT),
        ),
    )


def test_renders_every_kind_of_request():
    png = timeline.render(_result(), victim="s", title="t")
    assert png.startswith(PNG_MAGIC) and len(png) > 5000


def _height(png: bytes) -> int:
    return struct.unpack(">I", png[20:24])[0]  # the IHDR chunk's height


def test_more_requests_make_a_taller_picture():
    rows = tuple(RequestResult(f"r{i}", f"r{i}-1", 0.0, 0.0, Outcome.OK, e2e_s=0.1) for i in range(30))
    tall = timeline.render(ExecutionResult(**{**_result().__dict__, "requests": rows}))
    assert _height(tall) > _height(timeline.render(_result()))


def test_without_matplotlib_it_is_an_output_error(monkeypatch):
    monkeypatch.setattr(timeline, "available", lambda: False)
    with pytest.raises(OutputError, match="matplotlib"):
        timeline.render(_result())


def test_unwritable_path(tmp_path):
    with pytest.raises(OutputError, match="cannot write"):
        timeline.write(tmp_path / "missing" / "t.png", _result())
