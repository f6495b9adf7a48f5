"""The campaign database (SPEC §9): the only module that touches SQLite.

One file per campaign database, WAL mode so readers (``fuzz status``,
``fuzz findings``) work while a campaign writes. The schema is built by numbered
migrations recorded in ``PRAGMA user_version``; a database written by a newer
fuzzer is refused rather than misread. Every write is its own transaction, so
a killed process loses at most the execution it was running.

Rows leave this module as frozen value types or plain dicts, never as cursors.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import sqlite_utils

from fuzzer import trace as trace_format
from fuzzer.errors import NotFoundError, StoreError
from fuzzer.execution import ExecutionResult, MetricSample, Outcome, RequestResult
from fuzzer.trace import Trace

# A writer holding the lock for longer than this is stuck or dead; a reader waits
# this long before reporting the database as busy.
BUSY_TIMEOUT_MS = 10_000


@dataclass(frozen=True)
class StoredFinding:
    """A confirmed finding as the database holds it."""

    id: int
    kind: str
    signature: str
    trace_hash: str
    created_at: float
    slowdown: float | None
    reproduced: str | None
    requests: int
    verdict: Mapping[str, Any]
    details: Mapping[str, Any]
    campaign_id: int | None = None
    target_id: int | None = None
    minimized_trace_hash: str | None = None
    repro_script: str | None = None

    @property
    def minimized(self) -> bool:
        return self.minimized_trace_hash is not None


# --- migrations ---------------------------------------------------------------------


def _m1_initial(db: sqlite_utils.Database) -> None:
    db["targets"].create(
        {
            "id": int,
            "url": str,
            "kind": str,
            "model": str,
            "version": str,
            "capabilities": str,
            "first_seen": float,
            "last_seen": float,
        },
        pk="id",
    )
    db["targets"].create_index(["url", "model"], unique=True)
    db["calibrations"].create(
        {"id": int, "target_key": str, "created_at": float, "data": str},
        pk="id",
    )
    db["calibrations"].create_index(["target_key", "created_at"])
    db["traces"].create(
        {"hash": str, "name": str, "json": str, "requests": int, "created_at": float},
        pk="hash",
    )
    db["campaigns"].create(
        {
            "id": int,
            "started_at": float,
            "updated_at": float,
            "seed": int,
            "target": str,
            "status": str,
            "settings": str,
            "state": str,
        },
        pk="id",
    )
    db["executions"].create(
        {
            "id": int,
            "trace_hash": str,
            "target_id": int,
            "campaign_id": int,
            "purpose": str,
            "target": str,
            "started_at": float,
            "duration_s": float,
            "idle_before_s": float,
            "idle_after": int,
            "warnings": str,
            "ground_truth": str,
        },
        pk="id",
        foreign_keys=[("trace_hash", "traces", "hash")],
    )
    db["executions"].create_index(["campaign_id"])
    db["executions"].create_index(["trace_hash"])
    db["request_results"].create(
        {
            "execution_id": int,
            "position": int,
            "request_id": str,
            "x_request_id": str,
            "scheduled_s": float,
            "sent_s": float,
            "outcome": str,
            "ttft_s": float,
            "first_event_s": float,
            "token_times_s": str,
            "e2e_s": float,
            "finish_reason": str,
            "prompt_tokens": int,
            "completion_tokens": int,
            "cached_tokens": int,
            "http_status": int,
            "detail": str,
        },
        pk=("execution_id", "position"),
        foreign_keys=[("execution_id", "executions", "id")],
    )
    db["metric_samples"].create(
        {"execution_id": int, "position": int, "t_s": float, "metrics": str},
        pk=("execution_id", "position"),
        foreign_keys=[("execution_id", "executions", "id")],
    )
    db["findings"].create(
        {
            "id": int,
            "campaign_id": int,
            "target_id": int,
            "kind": str,
            "signature": str,
            "trace_hash": str,
            "minimized_trace_hash": str,
            "created_at": float,
            "slowdown": float,
            "reproduced": str,
            "requests": int,
            "verdict": str,
            "details": str,
            "repro_script": str,
        },
        pk="id",
        foreign_keys=[("trace_hash", "traces", "hash")],
    )
    db["findings"].create_index(["signature"], unique=True)


#: Schema history: append, never edit a released step. Index i brings a database to version i + 1.
MIGRATIONS: tuple[Callable[[sqlite_utils.Database], None], ...] = (_m1_initial,)
SCHEMA_VERSION = len(MIGRATIONS)


class Store:
    """A campaign database. Use :meth:`open` or :meth:`memory`."""

    def __init__(self, db: sqlite_utils.Database, *, path: str | None, clock: Callable[[], float] = time.time):
        self._db = db
        self.path = path
        self._clock = clock

    # --- opening ----------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path, *, create: bool = True, clock: Callable[[], float] = time.time) -> "Store":
        """Open (and migrate) the database at ``path``.

        With ``create=False`` a missing file is an error: readers such as ``fuzz findings``
        must not leave an empty database behind a mistyped path.
        """
        p = Path(path)
        if not create and not p.exists():
            raise StoreError(f"no database at {p} (run `fuzz campaign --db {p}` first, or pass --db)")
        if p.exists() and p.is_dir():
            raise StoreError(f"{p} is a folder, not a database file")
        if not p.parent.exists():
            raise StoreError(f"cannot create database {p}: folder {p.parent} does not exist")
        try:
            conn = sqlite3.connect(str(p), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA foreign_keys = ON")
        except sqlite3.DatabaseError as e:
            raise StoreError(f"cannot open database {p}: {e}") from None
        store = cls(sqlite_utils.Database(conn), path=str(p), clock=clock)
        store.migrate()
        return store

    @classmethod
    def memory(cls, *, clock: Callable[[], float] = time.time) -> "Store":
        """A private in-memory database, for tests."""
        conn = sqlite3.connect(":memory:", isolation_level=None)
        conn.execute("PRAGMA foreign_keys = ON")
        store = cls(sqlite_utils.Database(conn), path=None, clock=clock)
        store.migrate()
        return store

    def close(self) -> None:
        self._db.conn.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- schema -----------------------------------------------------------------------

    @property
    def schema_version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    def migrate(self) -> int:
        """Bring the schema to :data:`SCHEMA_VERSION`; a no-op when it is there already."""
        where = self.path or ":memory:"
        try:
            version = self.schema_version
        except sqlite3.DatabaseError as e:
            raise StoreError(f"{where} is not a fuzzer database ({e})") from None
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{where} has schema version {version}, newer than this fuzzer's {SCHEMA_VERSION}; "
                "upgrade the fuzzer to read it"
            )
        if version == 0 and self._db.table_names():
            raise StoreError(f"{where} is an SQLite database of another program, not a fuzzer database")
        for number in range(version, SCHEMA_VERSION):
            with self._transaction():
                MIGRATIONS[number](self._db)
                self._db.execute(f"PRAGMA user_version = {number + 1}")
        return self.schema_version

    def integrity_check(self) -> str:
        return self._db.execute("PRAGMA integrity_check").fetchone()[0]

    # --- traces -----------------------------------------------------------------------

    def put_trace(self, trace: Trace) -> str:
        """Store a trace (idempotent) and return its content hash."""
        digest = trace.content_hash()
        with self._transaction():
            self._put_trace(trace, digest)
        return digest

    def _put_trace(self, trace: Trace, digest: str) -> None:
        self._db["traces"].insert(
            {
                "hash": digest,
                "name": trace.name,
                "json": trace_format.dumps(trace, indent=None),
                "requests": len(trace.requests),
                "created_at": self._clock(),
            },
            ignore=True,
        )

    def get_trace(self, digest: str) -> Trace:
        rows = list(self._db.query("select json from traces where hash = ?", [digest]))
        if not rows:
            raise NotFoundError(f"no trace with hash {digest}")
        return trace_format.loads(rows[0]["json"])

    # --- targets ------------------------------------------------------------------------

    def upsert_target(
        self,
        url: str,
        kind: str,
        model: str | None,
        version: str | None,
        capabilities: Mapping[str, Any],
    ) -> int:
        """Record a server as met now; returns its id. URLs are stored as given (no credentials)."""
        now = self._clock()
        with self._transaction():
            rows = list(
                self._db.query(
                    "select id from targets where url = ? and model is ?",
                    [url, model],
                )
            )
            record = {
                "kind": kind,
                "version": version,
                "capabilities": _json(capabilities),
                "last_seen": now,
            }
            if rows:
                self._db["targets"].update(rows[0]["id"], record)
                return rows[0]["id"]
            return self._db["targets"].insert({"url": url, "model": model, "first_seen": now, **record}).last_pk

    def get_target(self, target_id: int) -> dict[str, Any]:
        rows = list(self._db.query("select * from targets where id = ?", [target_id]))
        if not rows:
            raise NotFoundError(f"no target with id {target_id}")
        row = rows[0]
        row["capabilities"] = json.loads(row["capabilities"] or "{}")
        return row

    # --- calibrations -------------------------------------------------------------------

    def save_calibration(self, target_key: str, data: Mapping[str, Any], *, created_at: float | None = None) -> int:
        with self._transaction():
            return self._db["calibrations"].insert(
                {
                    "target_key": target_key,
                    "created_at": self._clock() if created_at is None else created_at,
                    "data": _json(data),
                }
            ).last_pk

    def latest_calibration(self, target_key: str) -> dict[str, Any] | None:
        rows = list(
            self._db.query(
                "select data from calibrations where target_key = ? order by created_at desc, id desc limit 1",
                [target_key],
            )
        )
        return json.loads(rows[0]["data"]) if rows else None

    # --- executions ---------------------------------------------------------------------

    def record_execution(
        self,
        result: ExecutionResult,
        trace: Trace,
        *,
        target_id: int | None = None,
        campaign_id: int | None = None,
        purpose: str = "replay",
    ) -> int:
        """Store one execution, its requests and metric samples in one transaction."""
        digest = trace.content_hash()
        if digest != result.trace_hash:
            raise StoreError(f"execution is of trace {result.trace_hash[:12]}, not of the trace given ({digest[:12]})")
        with self._transaction():
            self._put_trace(trace, digest)
            execution_id = self._db["executions"].insert(
                {
                    "trace_hash": digest,
                    "target_id": target_id,
                    "campaign_id": campaign_id,
                    "purpose": purpose,
                    "target": result.target,
                    "started_at": result.started_at,
                    "duration_s": result.duration_s,
                    "idle_before_s": result.idle_before_s,
                    "idle_after": None if result.idle_after is None else int(result.idle_after),
                    "warnings": _json(list(result.warnings)),
                    "ground_truth": _json({k: list(v) for k, v in result.ground_truth.items()}),
                }
            ).last_pk
            self._db["request_results"].insert_all(
                (_request_row(execution_id, i, r) for i, r in enumerate(result.requests)),
                batch_size=500,
            )
            self._db["metric_samples"].insert_all(
                (
                    {"execution_id": execution_id, "position": i, "t_s": s.t_s, "metrics": _json(dict(s.values))}
                    for i, s in enumerate(result.samples)
                ),
                batch_size=500,
            )
        return execution_id

    def get_execution(self, execution_id: int) -> ExecutionResult:
        rows = list(self._db.query("select * from executions where id = ?", [execution_id]))
        if not rows:
            raise NotFoundError(f"no execution with id {execution_id}")
        row = rows[0]
        requests = tuple(
            _request_from_row(r)
            for r in self._db.query(
                "select * from request_results where execution_id = ? order by position", [execution_id]
            )
        )
        samples = tuple(
            MetricSample(t_s=s["t_s"], values=json.loads(s["metrics"]))
            for s in self._db.query(
                "select t_s, metrics from metric_samples where execution_id = ? order by position", [execution_id]
            )
        )
        return ExecutionResult(
            trace_hash=row["trace_hash"],
            target=row["target"],
            started_at=row["started_at"],
            duration_s=row["duration_s"],
            requests=requests,
            samples=samples,
            idle_before_s=row["idle_before_s"],
            idle_after=None if row["idle_after"] is None else bool(row["idle_after"]),
            warnings=tuple(json.loads(row["warnings"] or "[]")),
            ground_truth={k: tuple(v) for k, v in json.loads(row["ground_truth"] or "{}").items()},
        )

    def count_executions(self, *, campaign_id: int | None = None) -> int:
        if campaign_id is None:
            return self._db.execute("select count(*) from executions").fetchone()[0]
        return self._db.execute("select count(*) from executions where campaign_id = ?", [campaign_id]).fetchone()[0]

    def execution_ids(self, *, trace_hash: str | None = None) -> list[int]:
        if trace_hash is None:
            return [r[0] for r in self._db.execute("select id from executions order by id")]
        return [r[0] for r in self._db.execute("select id from executions where trace_hash = ? order by id", [trace_hash])]

    # --- findings -----------------------------------------------------------------------

    def add_finding(
        self,
        *,
        kind: str,
        signature: str,
        trace: Trace,
        verdict: Mapping[str, Any],
        slowdown: float | None,
        reproduced: str | None,
        details: Mapping[str, Any] | None = None,
        campaign_id: int | None = None,
        target_id: int | None = None,
    ) -> tuple[int, bool]:
        """Record a confirmed finding; returns (id, created). A known signature is not duplicated."""
        digest = trace.content_hash()
        with self._transaction():
            existing = list(self._db.query("select id from findings where signature = ?", [signature]))
            if existing:
                return existing[0]["id"], False
            self._put_trace(trace, digest)
            finding_id = self._db["findings"].insert(
                {
                    "campaign_id": campaign_id,
                    "target_id": target_id,
                    "kind": kind,
                    "signature": signature,
                    "trace_hash": digest,
                    "created_at": self._clock(),
                    "slowdown": slowdown,
                    "reproduced": reproduced,
                    "requests": len(trace.requests),
                    "verdict": _json(verdict),
                    "details": _json(details or {}),
                }
            ).last_pk
        return finding_id, True

    def get_finding(self, finding_id: int | str) -> StoredFinding:
        key = _finding_key(finding_id)
        rows = list(self._db.query("select * from findings where id = ?", [key]))
        if not rows:
            raise NotFoundError(f"no finding with id {finding_id} (see `fuzz findings` for the ids)")
        return _finding_from_row(rows[0])

    def list_findings(self, *, campaign_id: int | None = None) -> list[StoredFinding]:
        if campaign_id is None:
            rows = self._db.query("select * from findings order by id")
        else:
            rows = self._db.query("select * from findings where campaign_id = ? order by id", [campaign_id])
        return [_finding_from_row(r) for r in rows]

    def set_minimized(self, finding_id: int, minimized: Trace, *, repro_script: str | None = None) -> None:
        digest = minimized.content_hash()
        with self._transaction():
            self.get_finding(finding_id)
            self._put_trace(minimized, digest)
            self._db["findings"].update(
                finding_id, {"minimized_trace_hash": digest, "repro_script": repro_script}
            )

    # --- plumbing -----------------------------------------------------------------------

    def _transaction(self):
        return _Transaction(self._db.conn)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, re-entrant (an inner use joins the outer transaction)."""

    def __init__(self, conn: sqlite3.Connection):
        self._conn = conn
        self._outer = False

    def __enter__(self) -> None:
        if not self._conn.in_transaction:
            self._conn.execute("BEGIN IMMEDIATE")
            self._outer = True

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._outer:
            return
        if exc_type is None:
            self._conn.execute("COMMIT")
        else:
            self._conn.execute("ROLLBACK")


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _finding_key(finding_id: int | str) -> int:
    try:
        return int(str(finding_id).lstrip("#"))
    except ValueError:
        raise NotFoundError(f"no finding with id {finding_id!r}: ids are numbers (see `fuzz findings`)") from None


def _request_row(execution_id: int, position: int, r: RequestResult) -> dict[str, Any]:
    return {
        "execution_id": execution_id,
        "position": position,
        "request_id": r.request_id,
        "x_request_id": r.x_request_id,
        "scheduled_s": r.scheduled_s,
        "sent_s": r.sent_s,
        "outcome": r.outcome.value,
        "ttft_s": r.ttft_s,
        "first_event_s": r.first_event_s,
        "token_times_s": _json(list(r.token_times_s)),
        "e2e_s": r.e2e_s,
        "finish_reason": r.finish_reason,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
        "http_status": r.http_status,
        "detail": r.detail,
    }


def _request_from_row(row: Mapping[str, Any]) -> RequestResult:
    return RequestResult(
        request_id=row["request_id"],
        x_request_id=row["x_request_id"],
        scheduled_s=row["scheduled_s"],
        sent_s=row["sent_s"],
        outcome=Outcome(row["outcome"]),
        ttft_s=row["ttft_s"],
        first_event_s=row["first_event_s"],
        token_times_s=tuple(json.loads(row["token_times_s"] or "[]")),
        e2e_s=row["e2e_s"],
        finish_reason=row["finish_reason"],
        prompt_tokens=row["prompt_tokens"],
        completion_tokens=row["completion_tokens"],
        cached_tokens=row["cached_tokens"],
        http_status=row["http_status"],
        detail=row["detail"],
    )


def _finding_from_row(row: Mapping[str, Any]) -> StoredFinding:
    return StoredFinding(
        id=row["id"],
        kind=row["kind"],
        signature=row["signature"],
        trace_hash=row["trace_hash"],
        created_at=row["created_at"],
        slowdown=row["slowdown"],
        reproduced=row["reproduced"],
        requests=row["requests"],
        verdict=json.loads(row["verdict"] or "{}"),
        details=json.loads(row["details"] or "{}"),
        campaign_id=row["campaign_id"],
        target_id=row["target_id"],
        minimized_trace_hash=row["minimized_trace_hash"],
        repro_script=row["repro_script"],
    )

