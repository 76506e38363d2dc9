"""Runs batch jobs in the background: each request is sent to this gateway itself over
loopback HTTP, so it takes the same path as an interactive one (translation, the owner's
key, its rate limits and token budgets, the usage ledger), marked as batch work by a
per-process secret header: it then runs at background priority (after every interactive
request in a worker, and preempted first), and the ledger records its API as batch:<api>.

A few requests per batch are in flight at once (BATCH_CONCURRENCY); a refusal for load (429,
503) waits and retries the same request, since nothing was answered. Each result is recorded
as it arrives (batch_store.record), so a batch interrupted by a restart resumes with the
requests that have no result yet."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import time

import aiohttp
from aiohttp import web

from .batch_store import BatchStore, new_id

log = logging.getLogger("mlxgw.batches")

BATCH_STORE = web.AppKey("batch_store", BatchStore)
BATCH_TOKEN = web.AppKey("batch_token", str)
SELF_URL = web.AppKey("self_url", dict)  # {"url": ...} once the gateway listens (server.py)
BATCH_WAKE = web.AppKey("batch_wake", asyncio.Event)  # set by POST /v1/batches: start it now
TOKEN_HEADER, OWNER_HEADER = "x-mlxgw-batch-token", "x-mlxgw-batch-owner"
# Requests of one batch in flight at once: they run at background priority, so interactive
# requests still go first in the worker; this only bounds the batch's share of its queue.
BATCH_CONCURRENCY = 8
TICK_S = 0.5
PURGE_S = 600.0  # how often files past their retention are deleted
RETRY_S = (0.5, 30.0)  # the wait after a load refusal: Retry-After, within these bounds
REQUEST_TIMEOUT_S = 3600.0
LEASE_STALE_S = 30.0  # another live gateway on this home that renewed its claim since holds it
LEASE_S = 5.0  # how often a running batch's claim is renewed


def batch_owner(request: web.Request) -> tuple[bool, str | None]:
    """(True, owner) for a request the batch runner sent (its secret header matches)."""
    given = request.headers.get(TOKEN_HEADER)
    token = request.app.get(BATCH_TOKEN)
    if not given or not token or not hmac.compare_digest(given.encode(), token.encode()):
        return False, None
    return True, request.headers.get(OWNER_HEADER) or None


class BatchRunner:
    def __init__(self, app: web.Application):
        self.app = app
        self.store: BatchStore = app[BATCH_STORE]
        self._tasks: dict[str, asyncio.Task] = {}
        self._session: aiohttp.ClientSession | None = None
        self._purged_at = -PURGE_S
        self._claimed: dict[str, float] = {}  # batch id -> when this process last renewed its claim
        self._lost: set[str] = set()
        self._closing = False  # a graceful stop: no new request starts, none is finalized

    async def quiesce(self, timeout: float) -> None:
        """A graceful stop, before the server stops listening: no batch starts another request,
        and the requests in flight finish and are recorded, so the next gateway sends only the
        ones never sent. Past the timeout the rest are cancelled (and sent again next start)."""
        self._closing = True
        self.app[BATCH_WAKE].set()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=timeout)

    async def run(self) -> None:
        while SELF_URL not in self.app or "url" not in self.app[SELF_URL]:
            await asyncio.sleep(TICK_S)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))
        try:
            wake = self.app[BATCH_WAKE]
            while not (self._closing and not self._tasks):  # closing: those in flight finish first
                if not self._closing:
                    await self._tick()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), TICK_S)
                wake.clear()
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            await self._session.close()

    async def _tick(self) -> None:
        if time.monotonic() - self._purged_at > PURGE_S:
            self._purged_at = time.monotonic()
            await asyncio.to_thread(self.store.purge_expired)
        for row in await asyncio.to_thread(self.store.active):
            if row["id"] not in self._tasks and await asyncio.to_thread(
                self.store.claim, row["id"], os.getpid(), LEASE_STALE_S
            ):
                task = asyncio.create_task(self._run_batch(row["id"], row["owner"], row["endpoint"]))
                self._tasks[row["id"]] = task
                task.add_done_callback(lambda _t, bid=row["id"]: self._forget(bid))

    def _forget(self, batch_id: str) -> None:
        self._tasks.pop(batch_id, None)
        self._claimed.pop(batch_id, None)

    async def _run_batch(self, batch_id: str, owner: str | None, endpoint: str) -> None:
        store = self.store
        try:
            if await asyncio.to_thread(store.status, batch_id) == "validating":
                await asyncio.to_thread(store.set_status, batch_id, "in_progress", "in_progress_at")
            lines = await asyncio.to_thread(store.pending_lines, batch_id)
            queue: asyncio.Queue = asyncio.Queue()
            for line in lines:
                queue.put_nowait(line)
            workers = [self._drain(batch_id, owner, endpoint, queue) for _ in range(BATCH_CONCURRENCY)]
            await asyncio.gather(*workers)
            if self._closing:
                return  # the gateway stops: the batch resumes at the next start
            if batch_id in self._lost:
                self._lost.discard(batch_id)
                return
            status = await asyncio.to_thread(store.status, batch_id)
            final = {"cancelling": "cancelled", "expiring": "expired"}.get(status or "", "completed")
            await asyncio.to_thread(store.finalize, batch_id, final)
            log.info("batch %s %s", batch_id, final)
        except asyncio.CancelledError:
            raise  # the gateway stops: the batch resumes at the next start
        except Exception:
            log.exception("batch %s failed", batch_id)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.store.set_status, batch_id, "failed", "failed_at")

    async def _drain(self, batch_id: str, owner: str | None, endpoint: str, queue: asyncio.Queue) -> None:
        while not await self._stopping(batch_id):
            try:
                idx, custom_id, body = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            ok, result = await self._call(batch_id, idx, custom_id, owner, endpoint, body)
            await asyncio.to_thread(self.store.record, batch_id, idx, ok, result)

    async def _stopping(self, batch_id: str) -> bool:
        """Cancelled, past its completion window, claimed by another gateway, or this gateway
        stops (no new request starts then); renews this gateway's claim."""
        if self._closing:
            return True
        if time.monotonic() - self._claimed.get(batch_id, -LEASE_S) > LEASE_S:
            if not await asyncio.to_thread(self.store.claim, batch_id, os.getpid(), LEASE_STALE_S):
                self._lost.add(batch_id)  # another gateway runs it now: it finalizes it too
                return True
            self._claimed[batch_id] = time.monotonic()
        rows = await asyncio.to_thread(
            self.store._q, "SELECT status, expires_at FROM batches WHERE id = ?", (batch_id,)
        )
        if not rows:
            return True
        if rows[0]["status"] == "in_progress" and time.time() > rows[0]["expires_at"]:
            await asyncio.to_thread(self.store.set_status, batch_id, "expiring")
        return rows[0]["status"] != "in_progress"

    async def _call(self, batch_id, idx, custom_id, owner, endpoint, body) -> tuple[bool, dict]:
        """One request, retried while it is refused for load; the output or error line."""
        assert self._session is not None
        rid = f"{batch_id}-{idx}-{secrets.token_hex(3)}"  # per try: a worker may still hold an older one
        headers = {TOKEN_HEADER: self.app[BATCH_TOKEN], "x-request-id": rid, "content-type": "application/json"}
        if owner:
            headers[OWNER_HEADER] = owner
        body = {**body, "stream": False}
        wait = RETRY_S[0]
        while True:
            try:
                async with self._session.post(self.app[SELF_URL]["url"] + endpoint, json=body, headers=headers) as r:
                    status, payload = r.status, await _json_or_text(r)
                    retry_after = r.headers.get("retry-after")
            except aiohttp.ClientError as e:
                status, payload, retry_after = 503, {"error": {"message": str(e)}}, None
            if status not in (429, 503) or await self._stopping(batch_id):
                break
            await asyncio.sleep(_retry_wait(retry_after, wait))
            wait = min(RETRY_S[1], wait * 2)
        line = {
            "id": new_id("batch_req_"),
            "custom_id": custom_id,
            "response": {"status_code": status, "request_id": rid, "body": payload},
            "error": None,
        }
        return status < 400, line


async def _json_or_text(response: aiohttp.ClientResponse):
    try:
        return await response.json(content_type=None)
    except ValueError:
        return {"error": {"message": (await response.text())[:2000]}}


def _retry_wait(retry_after: str | None, fallback: float) -> float:
    try:
        given = float(retry_after) if retry_after else fallback
    except ValueError:
        given = fallback
    return min(RETRY_S[1], max(RETRY_S[0], given))


def install(app: web.Application) -> None:
    """In make_app: the store, the secret the runner's requests carry, the runner's task."""
    app[BATCH_STORE] = BatchStore()
    app[BATCH_TOKEN] = secrets.token_urlsafe(32)
    app[SELF_URL] = {}
    app[BATCH_WAKE] = asyncio.Event()
    app.cleanup_ctx.append(_lifecycle)


BATCH_RUNNER = web.AppKey("batch_runner", BatchRunner)  # set by _lifecycle, for quiesce_batches


async def quiesce_batches(app: web.Application, timeout: float) -> None:
    """serve() calls this on SIGTERM/SIGINT while the gateway still listens (BatchRunner.quiesce)."""
    if BATCH_RUNNER in app:
        await app[BATCH_RUNNER].quiesce(timeout)


async def _lifecycle(app: web.Application):
    app[BATCH_RUNNER] = runner = BatchRunner(app)
    task = asyncio.create_task(runner.run())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    app[BATCH_STORE].close()
