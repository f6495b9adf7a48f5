"""Bad input (issue 8): one clear line, a non-zero exit, no traceback, and nothing lost in the database."""

from __future__ import annotations

import json
import sqlite3
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner
from reliability_support import CORPUS, calibrated_template, copy_db, db_facts

from fuzzer.cli import EXIT_ERROR, cli

GOOD = {"id": "a", "at_ms": 0, "prompt_tokens": 8, "max_tokens": 2}

#: One broken value per trace field: (JSON path in the message, request or trace patch).
BAD_FIELDS = [
    ("format", {"format": 99}),
    ("requests", {"requests": "many"}),
    ("prefixes", {"prefixes": {"p0": -3}}),
    ("requests[0].id", {"request": {"id": 7}}),
    ("requests[0].at_ms", {"request": {"at_ms": -1}}),
    ("requests[0].prompt_tokens", {"request": {"prompt_tokens": 0}}),
    ("requests[0].max_tokens", {"request": {"max_tokens": "x"}}),
    ("requests[0].prefix", {"request": {"prefix": "nowhere"}}),
    ("requests[0].stream", {"request": {"stream": "yes"}}),
    ("requests[0].api", {"request": {"api": "embeddings"}}),
    ("requests[0].ignore_eos", {"request": {"ignore_eos": "no"}}),
    ("requests[0].cancel_after_tokens", {"request": {"cancel_after_tokens": -1}}),
    ("requests[0].n", {"request": {"n": 0}}),
    ("requests[0].logprobs", {"request": {"logprobs": -2}}),
    ("requests[0].temperature", {"request": {"temperature": -1}}),
    ("requests[0]", {"request": {"bogus": 1}}),
    ("requests[1].id", {"extra": dict(GOOD)}),  # a duplicate id
]


def _invoke(*args: str, env: dict | None = None):
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=True)
    return result


def _assert_one_line_error(result, *needles: str) -> str:
    assert result.exit_code == EXIT_ERROR, (result.exit_code, result.output, result.exception)
    # A FuzzError becomes SystemExit(2) through click; anything else is a bug escaping.
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _trace_with(patch: dict) -> dict:
    request = {**GOOD, **patch.get("request", {})}
    trace = {"format": 1, "requests": [request]}
    if "extra" in patch:
        trace["requests"].append(patch["extra"])
    trace.update({k: v for k, v in patch.items() if k not in ("request", "extra")})
    return trace


@pytest.mark.parametrize(("path", "patch"), BAD_FIELDS, ids=[p for p, _ in BAD_FIELDS])
def test_invalid_trace_field_names_its_json_path(tmp_path, path, patch):
    trace = tmp_path / "bad.json"
    trace.write_text(json.dumps(_trace_with(patch)))
    # No server is contacted: the trace is refused before anything starts.
    _assert_one_line_error(_invoke("replay", str(trace), "--target", "http://127.0.0.1:9"), "bad.json", path)


def test_trace_that_is_not_json(tmp_path):
    trace = tmp_path / "broken.json"
    trace.write_text('{"format": 1, "requests": [')
    _assert_one_line_error(_invoke("replay", str(trace), "--target", "http://127.0.0.1:9"), "broken.json")


def test_unreachable_target(tmp_path):
    trace = tmp_path / "ok.json"
    trace.write_text(json.dumps(_trace_with({})))
    db = tmp_path / "u.db"
    _assert_one_line_error(_invoke("replay", str(trace), "--target", "http://127.0.0.1:9"), "cannot reach")
    _assert_one_line_error(
        _invoke("campaign", "--target", "http://127.0.0.1:9", "--db", str(db), "--corpus", str(CORPUS),
                "--max-execs", "1"),
        "cannot reach",
    )


class _NotAnLlm(BaseHTTPRequestHandler):
    def _html(self) -> None:
        body = b"<html><body><h1>404 Not Found</h1></body></html>"
        self.send_response(404)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _html

    def log_message(self, *args) -> None:  # quiet
        return None


@pytest.fixture
def web_server():
    """A plain web server on 127.0.0.1 that answers 404 HTML to everything."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotAnLlm)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_target_that_is_not_an_openai_server(tmp_path, web_server):
    trace = tmp_path / "ok.json"
    trace.write_text(json.dumps(_trace_with({})))
    _assert_one_line_error(_invoke("replay", str(trace), "--target", web_server), web_server)
    _assert_one_line_error(
        _invoke("campaign", "--target", web_server, "--db", str(tmp_path / "w.db"), "--corpus", str(CORPUS),
                "--max-execs", "1"),
        web_server,
    )


@pytest.mark.slow
def test_wrong_model_name(tmp_path):
    trace = tmp_path / "ok.json"
    trace.write_text(json.dumps(_trace_with({})))
    _assert_one_line_error(_invoke("replay", str(trace), "--model", "no-such-model"), "no-such-model")


@pytest.fixture(scope="module")
def finding_db(tmp_path_factory):
    template = calibrated_template(tmp_path_factory.mktemp("calibrated"))
    assert db_facts(template)["findings"], "the template campaign found nothing"
    return template


def test_unknown_finding_id_and_nothing_lost(finding_db, tmp_path):
    db = copy_db(finding_db, tmp_path / "f.db")
    before = db_facts(db)
    for command in ("show", "minimize", "export"):
        _assert_one_line_error(_invoke(command, "999", "--db", str(db)), "no finding with id 999")
        _assert_one_line_error(_invoke(command, "abc", "--db", str(db)), "'abc'")
    assert db_facts(db) == before


def test_database_from_a_newer_schema_is_refused_untouched(finding_db, tmp_path):
    db = copy_db(finding_db, tmp_path / "new.db")
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA user_version = 99")
    conn.commit()
    conn.close()
    before = db_facts(db)
    for args in (("findings",), ("status",), ("show", "1"), ("export", "1", "--out", str(tmp_path / "out")),
                 ("campaign", "--corpus", str(CORPUS), "--max-execs", "1")):
        _assert_one_line_error(_invoke(*args, "--db", str(db)), "schema version 99", "upgrade the fuzzer")
    assert db_facts(db) == before
    assert not (tmp_path / "out").exists()


def test_unwritable_out_folder(finding_db, tmp_path):
    db = copy_db(finding_db, tmp_path / "o.db")
    before = db_facts(db)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    # Running as root ignores permission bits, so the folder is made impossible instead: under a file.
    _assert_one_line_error(_invoke("export", "1", "--db", str(db), "--out", str(blocker / "findings")), "a-file")
    _assert_one_line_error(_invoke("report", "--db", str(db), "--out", str(blocker / "report.html")), "a-file")
    assert db_facts(db) == before
    assert blocker.read_text() == "not a folder"
