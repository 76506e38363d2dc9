"""The tables of $MLXGW_HOME/batches.db (gateway/batches/store.py) and the read-only summary
that `mlxgw usage` reads from them whether or not a gateway runs."""

from __future__ import annotations

import sqlite3
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    owner TEXT,                      -- the key's identity (ApiKey.tenant); NULL without keys
    purpose TEXT NOT NULL,           -- batch | batch_output
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    owner TEXT,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,            -- validating, in_progress, cancelling, + TERMINAL
    errors TEXT,                     -- JSON list of {code, message, line}
    metadata TEXT,
    output_file_id TEXT,
    error_file_id TEXT,
    created_at INTEGER NOT NULL,
    in_progress_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    expires_at INTEGER NOT NULL,
    runner_pid INTEGER,              -- the gateway process running it (one per batch)
    lease_at REAL                    -- when that process last showed it is at work
);
CREATE TABLE IF NOT EXISTS batch_requests (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    line INTEGER NOT NULL,           -- its line number in the input file (errors name it)
    offset INTEGER NOT NULL,         -- where its line starts in the input file
    length INTEGER NOT NULL,
    model TEXT,                      -- its body's model: batch work is bounded per model too
    state TEXT NOT NULL,             -- pending | done | failed
    result TEXT,                     -- the output or error line (JSON), with the state
    PRIMARY KEY (batch_id, idx)
);
CREATE TABLE IF NOT EXISTS upload_reservations (
    id TEXT PRIMARY KEY,             -- the file id the upload will have
    owner TEXT,
    bytes INTEGER NOT NULL,          -- the most it may write: counted as stored while it streams
    created_at INTEGER NOT NULL
);
"""
# Columns added to `batches` since the first release: the counts kept once its rows are gone.
ADDED_COLUMNS = ("owner_name TEXT", "total_n INTEGER", "completed_n INTEGER", "failed_n INTEGER")


_LIVE = "(SELECT COUNT(*) FROM batch_requests r WHERE r.batch_id = b.id{})"  # a running batch's rows
_DONE, _FAILED = _LIVE.format(" AND r.state = 'done'"), _LIVE.format(" AND r.state = 'failed'")
SUMMARY_SQL = (
    "SELECT COALESCE(owner_name, owner) AS owner, status, COUNT(*) AS batches,"
    f" SUM(COALESCE(completed_n, {_DONE})) AS completed, SUM(COALESCE(failed_n, {_FAILED})) AS failed,"
    f" SUM(COALESCE(total_n, {_LIVE.format('')})) AS total FROM batches b GROUP BY 1, status ORDER BY 1"
)


def summary_of(path: Path) -> list[dict]:
    """Per key and status: batches and their requests (`mlxgw usage`, gateway running or not)."""
    if not path.exists():
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute(SUMMARY_SQL)]
    except sqlite3.Error:
        return []
    finally:
        db.close()
