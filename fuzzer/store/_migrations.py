"""Schema migrations of the campaign database: append a step, never edit a released one."""

from __future__ import annotations

from typing import Callable

import sqlite_utils


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


def _m2_corpus(db: sqlite_utils.Database) -> None:
    db["corpus"].create(
        {
            "campaign_id": int,
            "entry_id": int,
            "trace_hash": str,
            "parent_id": int,
            "operators": str,
            "features": str,
            "scores": str,
            "found_at_exec": int,
            "n_fuzz": int,
            "finds": int,
            "since_find": int,
            "favoured": int,
        },
        pk=("campaign_id", "entry_id"),
        foreign_keys=[("trace_hash", "traces", "hash"), ("campaign_id", "campaigns", "id")],
    )
    db["coverage_features"].create(
        {"campaign_id": int, "feature": str, "first_entry": int, "entries": int},
        pk=("campaign_id", "feature"),
    )
    db["executions"].add_column("number", int)


def _m3_minimizations(db: sqlite_utils.Database) -> None:
    db["minimizations"].create(
        {"finding_id": int, "status": str, "updated_at": float, "state": str},
        pk="finding_id",
        foreign_keys=[("finding_id", "findings", "id")],
    )


def _m4_client_lag(db: sqlite_utils.Database) -> None:
    db["executions"].add_column("client_lag_s", float)


def _m5_speed_check(db: sqlite_utils.Database) -> None:
    db["executions"].add_column("speed_check_itl_s", float)


def _m6_choice_gap(db: sqlite_utils.Database) -> None:
    db["request_results"].add_column("choice_gap_s", float)


def _m7_choice_gap_end(db: sqlite_utils.Database) -> None:
    db["request_results"].add_column("choice_gap_end_s", float)


#: Schema history: append, never edit a released step. Index i brings a database to version i + 1.
MIGRATIONS: tuple[Callable[[sqlite_utils.Database], None], ...] = (
    _m1_initial, _m2_corpus, _m3_minimizations, _m4_client_lag, _m5_speed_check, _m6_choice_gap,
    _m7_choice_gap_end,
)
SCHEMA_VERSION = len(MIGRATIONS)


