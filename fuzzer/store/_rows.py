"""Rows in and out: value types <-> SQLite rows, and the transaction helper."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any, Mapping

from fuzzer.errors import NotFoundError
from fuzzer.execution import Outcome, RequestResult


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

class Transaction:
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


def to_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def finding_key(finding_id: int | str) -> int:
    try:
        return int(str(finding_id).lstrip("#"))
    except ValueError:
        raise NotFoundError(f"no finding with id {finding_id!r}: ids are numbers (see `fuzz findings`)") from None


def request_row(execution_id: int, position: int, r: RequestResult) -> dict[str, Any]:
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
        "token_times_s": to_json(list(r.token_times_s)),
        "choice_gap_s": r.choice_gap_s,
        "choice_gap_end_s": r.choice_gap_end_s,
        "e2e_s": r.e2e_s,
        "finish_reason": r.finish_reason,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
        "http_status": r.http_status,
        "detail": r.detail,
    }


def request_from_row(row: Mapping[str, Any]) -> RequestResult:
    return RequestResult(
        request_id=row["request_id"],
        x_request_id=row["x_request_id"],
        scheduled_s=row["scheduled_s"],
        sent_s=row["sent_s"],
        outcome=Outcome(row["outcome"]),
        ttft_s=row["ttft_s"],
        first_event_s=row["first_event_s"],
        token_times_s=tuple(json.loads(row["token_times_s"] or "[]")),
        choice_gap_s=row["choice_gap_s"],
        choice_gap_end_s=row["choice_gap_end_s"],
        e2e_s=row["e2e_s"],
        finish_reason=row["finish_reason"],
        prompt_tokens=row["prompt_tokens"],
        completion_tokens=row["completion_tokens"],
        cached_tokens=row["cached_tokens"],
        http_status=row["http_status"],
        detail=row["detail"],
    )


def finding_from_row(row: Mapping[str, Any]) -> StoredFinding:
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

