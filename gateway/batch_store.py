"""Files and batch jobs (the OpenAI Files and Batch APIs) in SQLite at $MLXGW_HOME/batches.db,
beside the usage ledger, with file contents under $MLXGW_HOME/files/.

A batch's requests are rows of `batch_lines`; a request's result is written in the same
transaction that marks it done, so after a crash (kill -9 included) a resumed batch sends
only the requests whose result was never recorded: none is answered twice. Outputs become
files (purpose batch_output) when the batch ends. Everything is owned by the key name that
made it (None without keys) and only that owner sees it.

Methods are synchronous (sqlite3); the gateway calls them through asyncio.to_thread."""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from pathlib import Path

from mlxgw.shared import paths

FILE_RETENTION_S = float(os.environ.get("MLXGW_FILES_RETENTION_DAYS") or 30) * 86400
TERMINAL = ("completed", "failed", "cancelled", "expired")

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    owner TEXT,                      -- the key's name; NULL without keys
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
    errors TEXT,                     -- JSON list of {code, message, line} (validation)
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
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    body TEXT NOT NULL,              -- the request body (JSON)
    state TEXT NOT NULL,             -- pending | done | failed
    result TEXT,                     -- the output or error line (JSON), with the state
    PRIMARY KEY (batch_id, idx)
);
"""


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


class BatchStore:
    def __init__(self, root: Path | None = None):
        self.root = root or paths.home()
        self.files_dir = self.root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.root / "batches.db", check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # A commit survives the gateway's crash (kill -9) without an fsync each; a power cut
        # may lose the last results, which are then sent again.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _q(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _tx(self, statements: list[tuple[str, tuple]]) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, args in statements:
                    self._db.execute(sql, args)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    # -- files -----------------------------------------------------------------------------
    def file_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    def add_file(self, file_id: str, owner: str | None, purpose: str, filename: str, size: int) -> dict:
        now = int(time.time())
        self._tx(
            [
                (
                    "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (file_id, owner, purpose, filename, size, now, now + int(FILE_RETENTION_S)),
                )
            ]
        )
        return self.get_file(file_id, owner)  # type: ignore[return-value]

    def get_file(self, file_id: str, owner: str | None) -> dict | None:
        rows = self._q("SELECT * FROM files WHERE id = ? AND owner IS ?", (file_id, owner))
        return _file_object(rows[0]) if rows else None

    def list_files(self, owner: str | None, purpose: str | None = None) -> list[dict]:
        sql, args = "SELECT * FROM files WHERE owner IS ?", [owner]
        if purpose:
            sql, args = sql + " AND purpose = ?", [*args, purpose]
        return [_file_object(r) for r in self._q(sql + " ORDER BY created_at DESC, id", tuple(args))]

    def delete_file(self, file_id: str, owner: str | None) -> bool:
        if self.get_file(file_id, owner) is None:
            return False
        self._tx([("DELETE FROM files WHERE id = ?", (file_id,))])
        self.file_path(file_id).unlink(missing_ok=True)
        return True

    def purge_expired(self, now: float | None = None) -> int:
        """Files past their retention, with their contents."""
        expired = [r["id"] for r in self._q("SELECT id FROM files WHERE expires_at < ?", (now or time.time(),))]
        for file_id in expired:
            self._tx([("DELETE FROM files WHERE id = ?", (file_id,))])
            self.file_path(file_id).unlink(missing_ok=True)
        return len(expired)

    # -- batches ---------------------------------------------------------------------------
    def create_batch(self, owner: str | None, endpoint: str, input_file_id: str, lines: list, errors: list, meta):
        """A batch with its request lines, or failed at once with the validation errors."""
        batch_id, now = new_id("batch_"), int(time.time())
        status = "failed" if errors else "validating"
        statements = [
            (
                "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, errors,"
                " metadata, created_at, failed_at, expires_at) VALUES (?, ?, ?, ?, '24h', ?, ?, ?, ?, ?, ?)",
                (
                    *(batch_id, owner, endpoint, input_file_id, status),
                    *(json.dumps(errors) if errors else None, json.dumps(meta) if meta else None),
                    *(now, now if errors else None, now + 86400),
                ),
            )
        ]
        if not errors:
            statements += [
                ("INSERT INTO batch_lines VALUES (?, ?, ?, ?, 'pending', NULL)", (batch_id, i, cid, json.dumps(body)))
                for i, (cid, body) in enumerate(lines)
            ]
        self._tx(statements)
        return self.get_batch(batch_id, owner)

    def get_batch(self, batch_id: str, owner: str | None) -> dict | None:
        rows = self._q("SELECT * FROM batches WHERE id = ? AND owner IS ?", (batch_id, owner))
        return self._batch_object(rows[0]) if rows else None

    def list_batches(self, owner: str | None, everyone: bool = False) -> list[dict]:
        if everyone:  # the console, for admins: with each batch's owner
            rows = self._q("SELECT * FROM batches ORDER BY created_at DESC, id DESC LIMIT 200")
            return [{**self._batch_object(r), "owner": r["owner"]} for r in rows]
        else:
            rows = self._q("SELECT * FROM batches WHERE owner IS ? ORDER BY created_at DESC, id DESC", (owner,))
        return [self._batch_object(r) for r in rows]

    def _counts(self, batch_id: str) -> dict:
        rows = self._q("SELECT state, COUNT(*) AS n FROM batch_lines WHERE batch_id = ? GROUP BY state", (batch_id,))
        by_state = {r["state"]: r["n"] for r in rows}
        return {
            "total": sum(by_state.values()),
            "completed": by_state.get("done", 0),
            "failed": by_state.get("failed", 0),
        }

    def _batch_object(self, row: sqlite3.Row) -> dict:
        errors = json.loads(row["errors"]) if row["errors"] else None
        obj = {k: row[k] for k in row.keys() if k not in ("owner", "errors", "metadata", "runner_pid", "lease_at")}
        obj.update(
            object="batch",
            errors={"object": "list", "data": errors} if errors else None,
            metadata=json.loads(row["metadata"]) if row["metadata"] else None,
            request_counts=self._counts(row["id"]),
        )
        return obj

    def active(self) -> list[sqlite3.Row]:
        """Batches to run (or finish cancelling), oldest first: resumed after a restart too."""
        return self._q(
            "SELECT id, owner, endpoint, status, expires_at FROM batches"
            " WHERE status IN ('validating', 'in_progress', 'cancelling', 'expiring') ORDER BY created_at, id"
        )

    def claim(self, batch_id: str, pid: int, stale_s: float) -> bool:
        """Whether this gateway process may run the batch: nobody else holds it, or its
        holder has died or stopped renewing (two gateways on one MLXGW_HOME run each batch
        once). Renewed by every call while it runs."""
        now = time.time()
        with self._lock:
            row = self._db.execute("SELECT runner_pid, lease_at FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                return False
            holder = row["runner_pid"]
            if holder not in (None, pid) and now - (row["lease_at"] or 0) < stale_s and _alive(holder):
                return False
            cur = self._db.execute(
                "UPDATE batches SET runner_pid = ?, lease_at = ? WHERE id = ? AND runner_pid IS ?",
                (pid, now, batch_id, holder),
            )
            return cur.rowcount == 1

    def set_status(self, batch_id: str, status: str, stamp: str | None = None) -> None:
        sql = "UPDATE batches SET status = ?" + (f", {stamp} = COALESCE({stamp}, ?)" if stamp else "")
        args = (status, int(time.time())) if stamp else (status,)
        self._tx([(sql + " WHERE id = ?", (*args, batch_id))])

    def status(self, batch_id: str) -> str | None:
        rows = self._q("SELECT status FROM batches WHERE id = ?", (batch_id,))
        return rows[0]["status"] if rows else None

    def cancel(self, batch_id: str, owner: str | None) -> dict | None:
        batch = self.get_batch(batch_id, owner)
        if batch is None:
            return None
        if batch["status"] not in TERMINAL and batch["status"] != "cancelling":
            self.set_status(batch_id, "cancelling", "cancelling_at")
        return self.get_batch(batch_id, owner)

    def pending_lines(self, batch_id: str) -> list[tuple[int, str, dict]]:
        rows = self._q(
            "SELECT idx, custom_id, body FROM batch_lines WHERE batch_id = ? AND state = 'pending' ORDER BY idx",
            (batch_id,),
        )
        return [(r["idx"], r["custom_id"], json.loads(r["body"])) for r in rows]

    def record(self, batch_id: str, idx: int, ok: bool, result: dict) -> None:
        """A request's result, in the transaction that marks it answered."""
        self._tx(
            [
                (
                    "UPDATE batch_lines SET state = ?, result = ? WHERE batch_id = ? AND idx = ? AND state = 'pending'",
                    ("done" if ok else "failed", json.dumps(result), batch_id, idx),
                )
            ]
        )

    def finalize(self, batch_id: str, status: str) -> None:
        """The output and error files from the recorded results, then the final status.
        Requests never sent (cancelled, expired) appear in neither, as with OpenAI."""
        owner = self._q("SELECT owner FROM batches WHERE id = ?", (batch_id,))[0]["owner"]
        self._tx(
            [
                (
                    "UPDATE batches SET finalizing_at = COALESCE(finalizing_at, ?) WHERE id = ?",
                    (int(time.time()), batch_id),
                )
            ]
        )
        ids: dict[str, str | None] = {}
        for state, column in (("done", "output_file_id"), ("failed", "error_file_id")):
            rows = self._q(
                "SELECT result FROM batch_lines WHERE batch_id = ? AND state = ? ORDER BY idx", (batch_id, state)
            )
            if not rows:
                ids[column] = None
                continue
            file_id = new_id("file-")
            data = "".join(r["result"] + "\n" for r in rows).encode()
            _write_atomic(self.file_path(file_id), data)
            self.add_file(file_id, owner, "batch_output", f"{batch_id}_{state}.jsonl", len(data))
            ids[column] = file_id
        stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[status]
        self._tx(
            [
                (
                    f"UPDATE batches SET status = ?, output_file_id = ?, error_file_id = ?, {stamp} = ? WHERE id = ?",
                    (status, ids["output_file_id"], ids["error_file_id"], int(time.time()), batch_id),
                )
            ]
        )


SUMMARY_SQL = (
    "SELECT b.owner AS owner, b.status AS status, COUNT(DISTINCT b.id) AS batches,"
    " SUM(l.state = 'done') AS completed, SUM(l.state = 'failed') AS failed, COUNT(l.idx) AS total"
    " FROM batches b LEFT JOIN batch_lines l ON l.batch_id = b.id GROUP BY b.owner, b.status ORDER BY b.owner"
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


def _file_object(row: sqlite3.Row) -> dict:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "expires_at": row["expires_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "status_details": None,
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
