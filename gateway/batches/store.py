"""Files and batch jobs (the OpenAI Files and Batch APIs) in SQLite at $MLXGW_HOME/batches.db,
beside the usage ledger, with file contents under $MLXGW_HOME/files/ (all 0600, the folder 0700:
they hold every key's prompts and answers).

A batch's requests are rows of `batch_requests` that point into the input file (byte offset and
length): the bodies are read from it lazily, one line at a time, never copied into memory or the
database whole. A request's result is written in the same transaction that marks it
done, so after a crash (kill -9 included) a resumed batch sends only the requests whose result
was never recorded: none is answered twice. When the batch ends its results are streamed into
its output and error files (purpose batch_output) and its rows are deleted: what stays in the
database is the batch object and its counts, and the files expire with their retention.

Everything is owned by the *identity* of the key that made it (`ApiKey.tenant`, a hash of the
key's hash; None without keys), never its name: a new key given a revoked key's name sees none
of the old key's files. `owner_name` is kept only for the admin's console.

Methods are synchronous (sqlite3); the gateway calls them on the `batch` thread pool."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from pathlib import Path

from ...shared import paths
from .files import FILE_RETENTION_S, file_object, pid_alive, private_dir, private_file
from .schema import ADDED_COLUMNS, SCHEMA

TERMINAL = ("completed", "failed", "cancelled", "expired")
ACTIVE = ("validating", "in_progress", "cancelling", "expiring")


class BatchStore:
    def __init__(self, root: Path | None = None):
        self.root = root or paths.home()
        self.files_dir = self.root / "files"
        private_dir(self.files_dir)
        db_path = self.root / "batches.db"
        for suffix in ("", "-wal", "-shm"):  # SQLite gives -wal/-shm the database file's mode
            private_file(Path(f"{db_path}{suffix}"), create=not suffix)
        self._db = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # A commit survives the gateway's crash (kill -9) without an fsync each; a power cut
        # may lose the last results, which are then sent again.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()
        self._migrate()

    def _migrate(self) -> None:
        have = {r["name"] for r in self._db.execute("PRAGMA table_info(batches)")}
        for column in ADDED_COLUMNS:
            if column.split()[0] not in have:
                self._db.execute(f"ALTER TABLE batches ADD COLUMN {column}")
        old = self._db.execute("SELECT name FROM sqlite_master WHERE name = 'batch_lines'").fetchone()
        if old is not None:  # the first release copied every body into the database
            self._db.execute(
                "UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE status IN (?, ?, ?, ?)",
                (int(time.time()), json.dumps([_error("upgraded", "mlxgw was upgraded; create the batch again")]))
                + ACTIVE,
            )
            self._db.execute(
                "UPDATE batches SET"
                " total_n = (SELECT COUNT(*) FROM batch_lines l WHERE l.batch_id = batches.id),"
                " completed_n = (SELECT COUNT(*) FROM batch_lines l WHERE l.batch_id = batches.id AND state = 'done'),"
                " failed_n = (SELECT COUNT(*) FROM batch_lines l WHERE l.batch_id = batches.id AND state = 'failed')"
            )
            self._db.execute("DROP TABLE batch_lines")
        # Creations a killed gateway left midway (another gateway on this home may be creating
        # one right now: only those older than any creation takes).
        stale = "SELECT id FROM batches WHERE status = 'creating' AND created_at < ?"
        cutoff = (int(time.time()) - 3600,)
        self._db.execute(f"DELETE FROM batch_requests WHERE batch_id IN ({stale})", cutoff)
        self._db.execute(f"DELETE FROM batches WHERE id IN ({stale})", cutoff)
        self._db.execute("DELETE FROM upload_reservations WHERE created_at < ?", cutoff)  # a killed upload's

    def adopt_names(self, tenants: dict[str, str]) -> None:
        """Once, on the first start of this release: files and batches an older one stored
        under a key's name pass to the key of that name now (by its identity from then on)."""
        with self._lock:
            if self._db.execute("PRAGMA user_version").fetchone()[0] >= 2:
                return
            self._db.execute("BEGIN IMMEDIATE")
            for name, tenant in tenants.items():
                self._db.execute("UPDATE files SET owner = ? WHERE owner = ?", (tenant, name))
                self._db.execute("UPDATE batches SET owner = ?, owner_name = ? WHERE owner = ?", (tenant, name, name))
            self._db.execute("PRAGMA user_version = 2")
            self._db.execute("COMMIT")

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
                # A failed ROLLBACK (the transaction already gone, a full disk) must not hide
                # the error that caused it.
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise

    # -- files -----------------------------------------------------------------------------
    def file_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    def add_file(self, file_id: str, owner: str | None, purpose: str, filename: str, size: int) -> dict:
        """A stored file, its upload's reservation released in the same transaction."""
        now = int(time.time())
        row = (file_id, owner, purpose, filename, size, now, now + int(FILE_RETENTION_S))
        self._tx(
            [
                ("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)", row),
                ("DELETE FROM upload_reservations WHERE id = ?", (file_id,)),
            ]
        )
        return self.get_file(file_id, owner)  # type: ignore[return-value]

    def reserve_upload(self, file_id: str, owner: str | None, most: int, max_files: int, max_bytes: int):
        """In one transaction: the owner's (files, stored bytes), uploads in progress counted
        at what they reserved, and unless that is `max_files` files, a reservation for this
        upload of `most` bytes or what is left of `max_bytes` (its limit, the third value).
        Checking and reserving at once is what keeps two uploads at the same time, in this
        gateway or another on this home, from each passing the key's cap."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                files, stored = self._usage(owner)
                limit = max(0, min(most, max_bytes - stored))
                if files < max_files:
                    self._db.execute(
                        "INSERT INTO upload_reservations VALUES (?, ?, ?, ?)", (file_id, owner, limit, int(time.time()))
                    )
                self._db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise
        return files, stored, limit

    def release_upload(self, file_id: str) -> None:
        self._tx([("DELETE FROM upload_reservations WHERE id = ?", (file_id,))])

    def get_file(self, file_id: str, owner: str | None) -> dict | None:
        rows = self._q("SELECT * FROM files WHERE id = ? AND owner IS ?", (file_id, owner))
        return file_object(rows[0]) if rows else None

    def list_files(self, owner: str | None, purpose: str | None = None) -> list[dict]:
        sql, args = "SELECT * FROM files WHERE owner IS ?", [owner]
        if purpose:
            sql, args = sql + " AND purpose = ?", [*args, purpose]
        return [file_object(r) for r in self._q(sql + " ORDER BY created_at DESC, id", tuple(args))]

    def usage_of(self, owner: str | None) -> tuple[int, int]:
        """(files, bytes) the owner stores, the results of its running batches and the
        reservations of its uploads in progress included."""
        with self._lock:
            return self._usage(owner)

    def _usage(self, owner: str | None) -> tuple[int, int]:
        count = "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM {} WHERE owner IS ?"
        files, stored = self._db.execute(count.format("files"), (owner,)).fetchone()
        uploads, reserved = self._db.execute(count.format("upload_reservations"), (owner,)).fetchone()
        pending = self._db.execute(
            "SELECT COALESCE(SUM(LENGTH(r.result)), 0) FROM batch_requests r JOIN batches b"
            " ON b.id = r.batch_id WHERE b.owner IS ? AND r.result IS NOT NULL",
            (owner,),
        ).fetchone()[0]
        return files + uploads, stored + reserved + pending

    def delete_file(self, file_id: str, owner: str | None) -> bool:
        if self.get_file(file_id, owner) is None:
            return False
        self._tx([("DELETE FROM files WHERE id = ?", (file_id,))])
        self._unlink_unused(file_id)
        return True

    def _unlink_unused(self, file_id: str) -> None:
        """A deleted file's content, unless a running batch still reads its lines (then the
        batch's end deletes it)."""
        busy = self._q(f"SELECT 1 FROM batches WHERE input_file_id = ? AND status IN {ACTIVE}", (file_id,))
        if not busy:
            self.file_path(file_id).unlink(missing_ok=True)

    def purge_expired(self, now: float | None = None) -> int:
        """Files past their retention, with their contents."""
        expired = [r["id"] for r in self._q("SELECT id FROM files WHERE expires_at < ?", (now or time.time(),))]
        for file_id in expired:
            self._tx([("DELETE FROM files WHERE id = ?", (file_id,))])
            self._unlink_unused(file_id)
        return len(expired)

    # -- batches ---------------------------------------------------------------------------
    def active_count(self, owner: str | None) -> int:
        rows = self._q(
            f"SELECT COUNT(*) AS n FROM batches WHERE owner IS ? AND status IN {(*ACTIVE, 'creating')}", (owner,)
        )
        return rows[0]["n"]

    def add_requests(self, batch_id: str, rows: list[tuple[int, str, int, int, int, str | None]]) -> None:
        """A chunk of a new batch's requests: (idx, custom_id, line, offset, length, model)."""
        self._tx(
            [
                ("INSERT INTO batch_requests VALUES (?, ?, ?, ?, ?, ?, ?, 'pending', NULL)", (batch_id, *row))
                for row in rows
            ]
        )

    def begin_batch(self, batch_id: str, owner, owner_name, endpoint: str, input_file_id: str, meta) -> None:
        """A batch being created: its row first, status `creating` (shown as validating, not
        run), then its requests (add_requests), then end_creation."""
        now = int(time.time())
        self._tx(
            [
                (
                    "INSERT INTO batches (id, owner, owner_name, endpoint, input_file_id, completion_window, status,"
                    " metadata, created_at, expires_at) VALUES (?, ?, ?, ?, ?, '24h', 'creating', ?, ?, ?)",
                    (batch_id, owner, owner_name, endpoint, input_file_id, json.dumps(meta) if meta else None)
                    + (now, now + 86400),
                )
            ]
        )

    def end_creation(self, batch_id: str, owner, errors: list) -> dict | None:
        """Ready to run, or failed with the validation errors (its requests dropped)."""
        if errors:
            self._tx(
                [
                    ("DELETE FROM batch_requests WHERE batch_id = ?", (batch_id,)),
                    (
                        "UPDATE batches SET status = 'failed', errors = ?, failed_at = ?, total_n = 0 WHERE id = ?",
                        (json.dumps(errors), int(time.time()), batch_id),
                    ),
                ]
            )
        else:
            self.set_status(batch_id, "validating")
        return self.get_batch(batch_id, owner)

    def abandon(self, batch_id: str) -> None:
        """A creation that failed midway (a full disk, the file gone): nothing of it stays."""
        self._tx(
            [
                ("DELETE FROM batch_requests WHERE batch_id = ?", (batch_id,)),
                ("DELETE FROM batches WHERE id = ? AND status = 'creating'", (batch_id,)),
            ]
        )

    def get_batch(self, batch_id: str, owner: str | None) -> dict | None:
        rows = self._q("SELECT * FROM batches WHERE id = ? AND owner IS ?", (batch_id, owner))
        return self._batch_object(rows[0]) if rows else None

    def list_batches(self, owner: str | None, everyone: bool = False) -> list[dict]:
        if everyone:  # the console, for admins: with each batch's owner's name
            rows = self._q("SELECT * FROM batches ORDER BY created_at DESC, id DESC LIMIT 200")
            return [{**self._batch_object(r), "owner": r["owner_name"] or r["owner"]} for r in rows]
        rows = self._q("SELECT * FROM batches WHERE owner IS ? ORDER BY created_at DESC, id DESC", (owner,))
        return [self._batch_object(r) for r in rows]

    def _counts(self, row: sqlite3.Row) -> dict:
        if row["total_n"] is not None:  # ended: its rows are gone
            return {"total": row["total_n"], "completed": row["completed_n"] or 0, "failed": row["failed_n"] or 0}
        rows = self._q(
            "SELECT state, COUNT(*) AS n FROM batch_requests WHERE batch_id = ? GROUP BY state", (row["id"],)
        )
        by_state = {r["state"]: r["n"] for r in rows}
        return {
            "total": sum(by_state.values()),
            "completed": by_state.get("done", 0),
            "failed": by_state.get("failed", 0),
        }

    def _batch_object(self, row: sqlite3.Row) -> dict:
        errors = json.loads(row["errors"]) if row["errors"] else None
        hidden = ("owner", "owner_name", "errors", "metadata", "runner_pid", "lease_at", "total_n")
        obj = {k: row[k] for k in row.keys() if k not in hidden and not k.endswith("_n")}
        obj.update(
            object="batch",
            status="validating" if row["status"] == "creating" else row["status"],
            errors={"object": "list", "data": errors} if errors else None,
            metadata=json.loads(row["metadata"]) if row["metadata"] else None,
            request_counts=self._counts(row),
        )
        return obj

    def active(self) -> list[sqlite3.Row]:
        """Batches to run (or finish cancelling), oldest first: resumed after a restart too."""
        return self._q(
            f"SELECT id, owner, endpoint, input_file_id, status, expires_at FROM batches WHERE status IN {ACTIVE}"
            " ORDER BY created_at, id"
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
            if holder not in (None, pid) and now - (row["lease_at"] or 0) < stale_s and pid_alive(holder):
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

    def add_error(self, batch_id: str, code: str, message: str) -> None:
        rows = self._q("SELECT errors FROM batches WHERE id = ?", (batch_id,))
        errors = json.loads(rows[0]["errors"]) if rows and rows[0]["errors"] else []
        errors.append(_error(code, message))
        self._tx([("UPDATE batches SET errors = ? WHERE id = ?", (json.dumps(errors), batch_id))])

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

    def pending_after(self, batch_id: str, after_idx: int, limit: int) -> list[sqlite3.Row]:
        """The next page of requests without a result: a run holds one page, never the batch."""
        return self._q(
            "SELECT idx, custom_id, line, offset, length, model FROM batch_requests"
            " WHERE batch_id = ? AND state = 'pending' AND idx > ? ORDER BY idx LIMIT ?",
            (batch_id, after_idx, limit),
        )

    def record(self, batch_id: str, idx: int, ok: bool, result: dict) -> int:
        """A request's result, in the transaction that marks it answered; its size."""
        text = json.dumps(result)
        self._tx(
            [
                (
                    "UPDATE batch_requests SET state = ?, result = ?"
                    " WHERE batch_id = ? AND idx = ? AND state = 'pending'",
                    ("done" if ok else "failed", text, batch_id, idx),
                )
            ]
        )
        return len(text)


def _error(code: str, message: str, line: int | None = None) -> dict:
    return {"code": code, "message": message, "param": None, "line": line}
