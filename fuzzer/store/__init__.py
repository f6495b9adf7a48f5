"""The campaign database (ARCHITECTURE.md, "Store and CLI"): the only module that touches SQLite.

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
from pathlib import Path
from typing import Any, Callable, Mapping

import sqlite_utils

from fuzzer import trace as trace_format
from fuzzer.errors import NotFoundError, StoreError
from fuzzer.execution import ExecutionResult, MetricSample
from fuzzer.store._lock import CampaignLock, minimization_lock
from fuzzer.store._migrations import MIGRATIONS, SCHEMA_VERSION
from fuzzer.store._rows import (
    StoredFinding,
    Transaction,
    finding_from_row,
    finding_key,
    request_from_row,
    request_row,
    to_json,
)
from fuzzer.trace import Trace

__all__ = ["SCHEMA_VERSION", "CampaignLock", "Store", "StoredFinding", "minimization_lock"]

# A writer holding the lock for longer than this is stuck or dead; a reader waits
# this long before reporting the database as busy.
BUSY_TIMEOUT_MS = 10_000


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
                "capabilities": to_json(capabilities),
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
                    "data": to_json(data),
                }
            ).last_pk

    def latest_calibration(self, target_key: str, *other_keys: str) -> dict[str, Any] | None:
        """The newest calibration stored under any of the keys (one target's current and older keys)."""
        keys = list(dict.fromkeys((target_key, *other_keys)))
        rows = list(
            self._db.query(
                f"select data from calibrations where target_key in ({', '.join('?' for _ in keys)}) "
                "order by created_at desc, id desc limit 1",
                keys,
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
        number: int | None = None,
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
                    "warnings": to_json(list(result.warnings)),
                    "client_lag_s": result.client_lag_s,
                    "speed_check_itl_s": result.speed_check_itl_s,
                    "ground_truth": to_json({k: list(v) for k, v in result.ground_truth.items()}),
                    "number": number,
                }
            ).last_pk
            self._db["request_results"].insert_all(
                (request_row(execution_id, i, r) for i, r in enumerate(result.requests)),
                batch_size=500,
            )
            self._db["metric_samples"].insert_all(
                (
                    {"execution_id": execution_id, "position": i, "t_s": s.t_s, "metrics": to_json(dict(s.values))}
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
            request_from_row(r)
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
            client_lag_s=row.get("client_lag_s"),
            speed_check_itl_s=row.get("speed_check_itl_s"),
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

    def purposes(self, *, campaign_id: int) -> dict[str, int]:
        """Executions of a campaign by purpose (fuzz, stability, confirm, calibrate, ...)."""
        rows = self._db.execute(
            "select purpose, count(*) from executions where campaign_id = ? group by purpose", [campaign_id]
        )
        return {purpose: n for purpose, n in rows}

    def execution_rows(self, *, campaign_id: int | None = None) -> list[dict[str, Any]]:
        """Read-only: id, number, purpose, trace_hash, started_at, duration_s of every execution (of a campaign), by id.

        For reports (``fuzz report``): the campaign's progress over time without loading requests.
        """
        query = "select id, campaign_id, number, purpose, trace_hash, started_at, duration_s from executions"
        if campaign_id is None:
            return list(self._db.query(query + " order by id"))
        return list(self._db.query(query + " where campaign_id = ? order by id", [campaign_id]))

    def executions_by_target(self, campaign_id: int) -> dict[int | None, dict[str, Any]]:
        """Read-only, per target id of a campaign: executions, their summed duration, first and last start."""
        rows = self._db.query(
            "select target_id, count(*) as executions, sum(duration_s) as busy_s, min(started_at) as first, "
            "max(started_at + duration_s) as last from executions where campaign_id = ? group by target_id",
            [campaign_id],
        )
        return {row.pop("target_id"): row for row in rows}

    def campaigns(self) -> list[dict[str, Any]]:
        """Read-only: every campaign (id, started_at, updated_at, seed, target, status), oldest first."""
        return list(self._db.query(
            "select id, started_at, updated_at, seed, target, status from campaigns order by id"
        ))

    # --- campaigns ----------------------------------------------------------------------

    def start_campaign(self, *, seed: int, target: str, settings: Mapping[str, Any]) -> int:
        now = self._clock()
        with self._transaction():
            return self._db["campaigns"].insert(
                {
                    "started_at": now,
                    "updated_at": now,
                    "seed": seed,
                    "target": target,
                    "status": "running",
                    "settings": to_json(settings),
                    "state": to_json({}),
                }
            ).last_pk

    def latest_campaign(self) -> dict[str, Any] | None:
        rows = list(self._db.query("select * from campaigns order by id desc limit 1"))
        if not rows:
            return None
        row = rows[0]
        row["settings"] = json.loads(row["settings"] or "{}")
        row["state"] = json.loads(row["state"] or "{}")
        return row

    def save_campaign(
        self,
        campaign_id: int,
        *,
        state: Mapping[str, Any],
        status: str,
        corpus_rows: list[Mapping[str, Any]] = (),
        new_features: Mapping[str, int] | None = None,
    ) -> None:
        """Checkpoint a campaign: its state, changed corpus entries and newly covered features, atomically."""
        with self._transaction():
            self._db["campaigns"].update(
                campaign_id, {"state": to_json(state), "status": status, "updated_at": self._clock()}
            )
            for row in corpus_rows:
                self._db["corpus"].upsert(
                    {
                        "campaign_id": campaign_id,
                        "entry_id": row["id"],
                        "trace_hash": row["trace_hash"],
                        "parent_id": row["parent"],
                        "operators": to_json(list(row["operators"])),
                        "features": to_json(sorted(row["features"])),
                        "scores": to_json(row["scores"]),
                        "found_at_exec": row["found_at_exec"],
                        "n_fuzz": row["n_fuzz"],
                        "finds": row["finds"],
                        "since_find": row["since_find"],
                        "favoured": int(bool(row.get("favoured"))),
                    },
                    pk=("campaign_id", "entry_id"),
                )
            # Sorted: the rows' order must not follow a set's (hash-seeded) iteration order.
            for feature, entry_id in sorted((new_features or {}).items()):
                self._db.execute(
                    "insert into coverage_features (campaign_id, feature, first_entry, entries) values (?, ?, ?, 1) "
                    "on conflict (campaign_id, feature) do update set entries = entries + 1",
                    [campaign_id, feature, entry_id],
                )

    def corpus_rows(self, campaign_id: int) -> list[dict[str, Any]]:
        out = []
        for row in self._db.query("select * from corpus where campaign_id = ? order by entry_id", [campaign_id]):
            out.append(
                {
                    "id": row["entry_id"],
                    "trace_hash": row["trace_hash"],
                    "parent": row["parent_id"],
                    "operators": json.loads(row["operators"]),
                    "features": json.loads(row["features"]),
                    "scores": json.loads(row["scores"]),
                    "found_at_exec": row["found_at_exec"],
                    "n_fuzz": row["n_fuzz"],
                    "finds": row["finds"],
                    "since_find": row["since_find"],
                }
            )
        return out

    def count_features(self, campaign_id: int) -> int:
        return self._db.execute("select count(*) from coverage_features where campaign_id = ?", [campaign_id]).fetchone()[0]

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
                    "verdict": to_json(verdict),
                    "details": to_json(details or {}),
                }
            ).last_pk
        return finding_id, True

    def set_finding_target(self, finding_id: int, target: str, outcome: str) -> None:
        """Record how a finding fared on one target of a fleet (its details' ``targets``: name -> outcome)."""
        self._change_details(finding_id, lambda details: details.setdefault("targets", {}).update({target: outcome}))

    def update_finding_details(self, finding_id: int, details: Mapping[str, Any]) -> None:
        """Add ``details`` to a finding's (a key it has is replaced)."""
        self._change_details(finding_id, lambda current: current.update(details))

    def _change_details(self, finding_id: int, change: Callable[[dict[str, Any]], None]) -> None:
        with self._transaction():
            rows = list(self._db.query("select details from findings where id = ?", [finding_id]))
            if not rows:
                raise NotFoundError(f"no finding with id {finding_id}")
            details = json.loads(rows[0]["details"] or "{}")
            change(details)
            self._db["findings"].update(finding_id, {"details": to_json(details)})

    def get_finding(self, finding_id: int | str) -> StoredFinding:
        key = finding_key(finding_id)
        rows = list(self._db.query("select * from findings where id = ?", [key]))
        if not rows:
            raise NotFoundError(f"no finding with id {finding_id} (see `fuzz findings` for the ids)")
        return finding_from_row(rows[0])

    def list_findings(self, *, campaign_id: int | None = None) -> list[StoredFinding]:
        if campaign_id is None:
            rows = self._db.query("select * from findings order by id")
        else:
            rows = self._db.query("select * from findings where campaign_id = ? order by id", [campaign_id])
        return [finding_from_row(r) for r in rows]

    def set_minimized(
        self,
        finding_id: int,
        minimized: Trace,
        *,
        repro_script: str | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        """Link a finding to its minimized trace; a repro script or details are stored when given."""
        digest = minimized.content_hash()
        with self._transaction():
            finding = self.get_finding(finding_id)
            self._put_trace(minimized, digest)
            update: dict[str, Any] = {"minimized_trace_hash": digest}
            if repro_script is not None:
                update["repro_script"] = repro_script
            if details:
                update["details"] = to_json({**finding.details, **details})
            self._db["findings"].update(finding.id, update)

    # --- minimizations ------------------------------------------------------------------

    def minimization_state(self, finding_id: int) -> dict[str, Any] | None:
        """The checkpoint of an unfinished minimization, None when there is none to resume."""
        rows = list(self._db.query("select state, status from minimizations where finding_id = ?", [finding_id]))
        if not rows or rows[0]["status"] == "done":
            return None
        return json.loads(rows[0]["state"])

    def save_minimization(self, finding_id: int, state: Mapping[str, Any], *, status: str) -> None:
        with self._transaction():
            self._db["minimizations"].upsert(
                {"finding_id": finding_id, "status": status, "updated_at": self._clock(), "state": to_json(state)},
                pk="finding_id",
            )

    # --- plumbing -----------------------------------------------------------------------

    def _transaction(self):
        return Transaction(self._db.conn)


