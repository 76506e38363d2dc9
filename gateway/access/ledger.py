"""The usage ledger: one row per finished API request, in SQLite at $MLXGW_HOME/usage.db.

The event loop only builds a tuple and puts it on a bounded queue; a writer thread commits
what has queued every FLUSH_S seconds, in one transaction, in WAL mode. So the hot path
never waits on disk, and a crash of the gateway (kill -9) loses at most the rows queued
since the last commit: the requests that finished in the last FLUSH_S seconds. Rows older
than `usage_retention_days` are deleted by the same thread, at start and hourly.

Rows hold the key's *name*, never the key, and its identity (ApiKey.tenant, a hash of its
hash): reports group by name, the per-key token budgets (budgets.py) count by identity, so a
name given to a new key does not carry the old key's spending. The same records feed the
console's list of recent requests."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import sqlite3
import threading
import time
from collections import deque
from pathlib import Path

from aiohttp import web

from ...shared import protocol as p
from ..web.routes import route_of
from ..web.state import KEYS
from .budgets import InFlight, TokenBudgets

log = logging.getLogger(__name__)

FLUSH_S = 1.0  # the crash window: rows are committed at least this often
MAX_QUEUED = 100_000  # rows waiting for the writer; past this they are counted and dropped
RETENTION_CHECK_S = 3600.0
GATHER_NAP_S = 0.05  # while gathering a batch: how late a flush() request may be seen
# Rows a commit could not write (a full disk, a locked file) are kept and retried this often,
# up to MAX_QUEUED of them: a disk that fills for a while loses no row of the ledger.
RETRY_S = 2.0
_NOTHING = object()  # a nap that found no row
RECENT = 200  # finished requests kept in memory for the console

COLUMNS = (
    "ts",
    "request_id",
    "key",
    "model",
    "api",
    "status",
    "outcome",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "embedding_inputs",
    "audio_seconds",
    "latency_s",
    "ttft_s",
    "tenant",
    "images",
)
SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,                 -- Unix time the request finished
    request_id TEXT,
    key TEXT NOT NULL,                -- the key's name ('-' without keys); never the key
    model TEXT NOT NULL,
    api TEXT NOT NULL,                -- chat, completions, embeddings, rerank, messages, responses, ...
    status INTEGER NOT NULL,          -- HTTP status
    outcome TEXT,                     -- finish reason or error:CODE (a stream can fail after its 200)
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    embedding_inputs INTEGER NOT NULL DEFAULT 0,
    audio_seconds REAL NOT NULL DEFAULT 0,
    latency_s REAL NOT NULL,
    ttft_s REAL,
    tenant TEXT,                      -- the key's identity (ApiKey.tenant); NULL without keys
    images INTEGER NOT NULL DEFAULT 0 -- images delivered (/v1/images)
);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
CREATE INDEX IF NOT EXISTS requests_key_ts ON requests (key, ts);
"""
_INSERT = f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"

# The public API routes: what the ledger records (control routes such as /v1/status are not usage).


def connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Key names and everyone's usage, like keys.yaml: the owner only. SQLite gives its -wal
    # and -shm files the database file's mode, so creating that one 0600 covers all three.
    if not path.exists():
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    elif path.stat().st_mode & 0o077 and path.stat().st_uid == os.getuid():
        path.chmod(0o600)  # made before this check, with the umask
    conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    # NORMAL: a commit survives a crash of the process; only a power loss can undo the last ones.
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.executescript(SCHEMA)
    have = {r[1] for r in conn.execute("PRAGMA table_info(requests)")}
    for column, declared in (("tenant", "TEXT"), ("images", "INTEGER NOT NULL DEFAULT 0")):
        if column not in have:  # a ledger made before the column
            conn.execute(f"ALTER TABLE requests ADD COLUMN {column} {declared}")
    return conn


class _Writer(threading.Thread):
    """Commits queued rows in batches; a threading.Event in the queue asks for a flush now."""

    def __init__(self, path: Path, retention_days: float):
        super().__init__(name="usage-ledger", daemon=True)
        self.path = path
        self.retention_days = retention_days
        self.rows: queue.Queue = queue.Queue(MAX_QUEUED)
        self.written = 0
        self.dropped = 0  # rows held past MAX_QUEUED while commits kept failing
        self.cpu_s = 0.0  # the thread's CPU time, reported when it stops
        self._next_prune = 0.0
        self._unwritten: list[tuple] = []  # rows whose commit failed, retried first

    def run(self) -> None:
        conn = connect(self.path)
        try:
            while self._cycle(conn):
                pass
        finally:
            if self._unwritten:
                lost = len(self._unwritten)
                log.error("usage ledger: %d rows never written (the disk stayed full to shutdown)", lost)
            conn.close()
            self.cpu_s = time.thread_time()

    def _cycle(self, conn: sqlite3.Connection) -> bool:
        """One batch: wait for a row, gather for FLUSH_S, commit. False when told to stop.
        While gathering, the thread sleeps in short naps and takes what queued meanwhile: a
        thread blocked in get() would be woken (and take the GIL from the event loop) by
        every row the loop puts."""
        self._maybe_prune(conn)
        try:
            item = self.rows.get(timeout=RETRY_S if self._unwritten else RETENTION_CHECK_S)
        except queue.Empty:
            self._commit(conn, [])  # retry what a failed commit left
            return True
        batch, waiters, stop = [], [], False
        deadline = time.monotonic() + FLUSH_S
        while True:
            if item is _NOTHING:
                pass
            elif item is None:
                stop = True
            elif isinstance(item, threading.Event):
                waiters.append(item)
            else:
                batch.append(item)
            try:
                item = self.rows.get_nowait()
                continue
            except queue.Empty:
                pass
            remaining = deadline - time.monotonic()
            if stop or waiters or remaining <= 0:
                break
            time.sleep(min(remaining, GATHER_NAP_S))
            try:
                item = self.rows.get_nowait()
            except queue.Empty:
                item = _NOTHING
        self._commit(conn, batch)
        for w in waiters:
            w.set()
        return not stop

    def _commit(self, conn: sqlite3.Connection, batch: list[tuple]) -> None:
        batch = self._unwritten + batch
        if not batch:
            return
        try:
            with conn:
                conn.execute("BEGIN")
                conn.executemany(_INSERT, batch)
        except sqlite3.Error as e:
            if not self._unwritten:
                log.error("usage ledger: could not write %d rows (kept, retried every %gs): %s", len(batch), RETRY_S, e)
            overflow = max(0, len(batch) - MAX_QUEUED)
            if overflow:
                self.dropped += overflow
                log.error("usage ledger: %d rows dropped: commits keep failing (%s)", overflow, e)
            self._unwritten = batch[overflow:]
            return
        if self._unwritten:
            log.info("usage ledger: wrote %d rows held since a failed commit", len(self._unwritten))
        self._unwritten = []
        self.written += len(batch)

    def _maybe_prune(self, conn: sqlite3.Connection) -> None:
        now = time.time()
        if now < self._next_prune or self.retention_days <= 0:
            return
        self._next_prune = now + RETENTION_CHECK_S
        try:
            cur = conn.execute("DELETE FROM requests WHERE ts < ?", (now - self.retention_days * 86400,))
            if cur.rowcount:
                log.info("usage ledger: deleted %d rows older than %g days", cur.rowcount, self.retention_days)
        except sqlite3.Error as e:
            log.error("usage ledger: retention cleanup failed: %s", e)


class Ledger:
    """Records finished requests: to SQLite (when a path is given), to the token budgets and
    to the in-memory list of recent requests."""

    def __init__(self, path: Path | None, retention_days: float = 90.0):
        self.path = path
        self.retention_days = retention_days
        self.budgets = TokenBudgets()
        self.inflight = InFlight()
        self.recent: deque[dict] = deque(maxlen=RECENT)
        self.dropped = 0
        self.written = 0
        self.writer_cpu_s = 0.0
        self._writer: _Writer | None = None

    def start(self, tenants: dict[str, str] | None = None) -> None:
        """Open the database and seed the budgets with today's and this month's totals; rows
        an older release wrote without an identity pass to the key of their name now
        (`tenants`: name -> identity), once."""
        if self.path is None:
            return
        from .usage import budget_seed

        try:
            conn = connect(self.path)
            try:
                for name, tenant in (tenants or {}).items():
                    conn.execute("UPDATE requests SET tenant = ? WHERE tenant IS NULL AND key = ?", (tenant, name))
                self.budgets.seed(*budget_seed(conn))
            finally:
                conn.close()
        except sqlite3.Error as e:
            raise RuntimeError(
                f"usage ledger {self.path}: {e} (move the file away, or set usage_ledger: false in models.yaml)"
            ) from e
        self._writer = _Writer(self.path, self.retention_days)
        self._writer.start()

    def record(self, row: tuple) -> None:
        """Called on the event loop for every finished API request: no I/O here."""
        ts, rid, key, model, api, status, outcome, prompt, cached, completion = row[:10]
        self.budgets.add(row[14] or key, prompt + completion, ts)
        self.recent.append(
            {
                "ts": ts,
                "request_id": rid,
                "key": key,
                "model": model,
                "api": api,
                "status": status,
                "outcome": outcome,
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "latency_s": row[12],
                "ttft_s": row[13],
            }
        )
        if self._writer is None:
            return
        try:
            self._writer.rows.put_nowait(row)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.error("usage ledger: the writer is behind; %d rows dropped so far", self.dropped)

    async def flush(self) -> None:
        """Wait until every row recorded so far is committed (for reports that must be exact)."""
        if self._writer is None or not self._writer.is_alive():
            return
        done = threading.Event()
        await asyncio.to_thread(self._writer.rows.put, done)
        await asyncio.to_thread(done.wait, 30)

    def close(self) -> None:
        """Commit what is queued and stop the writer (graceful shutdown loses nothing)."""
        if self._writer is None:
            return
        self._writer.rows.put(None)
        self._writer.join(timeout=30)
        self.writer_cpu_s, self.written = self._writer.cpu_s, self._writer.written
        self._writer = None


LEDGER = web.AppKey("ledger", Ledger)


def usage_row(request: web.Request, status: int, duration: float) -> tuple | None:
    """The ledger row of a finished request, or None for routes that are not usage."""
    api = route_of(request).usage  # which routes are usage, and their names: gateway/web/routes.py
    if api is None:
        return None
    key = request.get("key")
    gen = request.get("generation")
    prompt = cached = completion = inputs = 0
    ttft = outcome = None
    if gen is not None:
        u = gen.usage
        prompt, cached, completion = u.prompt_tokens, u.cached_tokens, u.completion_tokens
        if isinstance(gen.req, p.EmbedRequest):
            inputs = len(gen.req.inputs)
        if gen.first_token_at is not None:
            ttft = round(gen.first_token_at - gen.started, 4)
        outcome = gen.outcome
    if outcome is None and status >= 400:
        outcome = f"http:{status}"
    return (
        round(time.time(), 3),
        request.get("rid"),
        key.name if key is not None else "-",
        request.get("model") or "-",
        ("batch:" if request.get("background") else "") + api,  # batch jobs' requests
        status,
        outcome,
        prompt,
        cached,
        completion,
        inputs,
        float(request.get("audio_seconds", 0.0)),
        round(duration, 4),
        ttft,
        key.tenant if key is not None else None,
        int(request.get("images", 0)),
    )


def record_request(request: web.Request, status: int, duration: float) -> None:
    """The access log's hook: one ledger row per finished API request."""
    ledger = request.app.get(LEDGER)
    if ledger is None:
        return
    row = usage_row(request, status, duration)
    if row is not None:
        ledger.record(row)


async def ledger_lifecycle(app: web.Application):
    """A cleanup_ctx: the writer runs while the app does and commits what is queued on shutdown.
    Register it before the workers' lifecycle so that it stops after them."""
    ledger, keys = app[LEDGER], app.get(KEYS)
    await asyncio.to_thread(ledger.start, {k.name: k.tenant for k in keys.keys} if keys is not None else None)
    yield
    await asyncio.to_thread(ledger.close)


@web.middleware
async def usage_middleware(request: web.Request, handler):
    """Inside auth: refuses a key whose daily or monthly token budget is spent (before any
    work), adds the budget headers, and tracks the API requests in flight."""
    ledger = request.app.get(LEDGER)
    if ledger is None or route_of(request).usage is None:
        return await handler(request)
    key = request.get("key")
    if key is not None and "ratelimit_headers" in request:
        rate_headers = request["ratelimit_headers"]
        request["ratelimit_headers"] = lambda: {**rate_headers(), **ledger.budgets.headers(key)}
        ledger.budgets.check(key)
    name = key.name if key is not None else "-"
    request["started_at"] = time.time()
    ledger.inflight.add(name, request)
    try:
        return await handler(request)
    finally:
        ledger.inflight.remove(name, request)
