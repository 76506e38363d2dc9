"""Runs batch jobs in the background: each request is sent to this gateway itself over
loopback HTTP, so it takes the same path as an interactive one (translation, the owner's
key, its limits and budgets, the usage ledger), marked as batch work by a per-process secret
header: it then runs at background priority and the ledger records its API as batch:<api>.

Bounds (docs/operations.md "Batch and file bounds"): at most BACKGROUND_IN_FLIGHT
requests of all batches together are in flight, and at most a quarter of a model's queue
places; a batch reads its requests a page at a time from the input file; a refusal for load
(429, 503) waits and is retried, but one that can never pass (max_tokens above the key's
limits) is the request's answer, in the error file. A full disk pauses the batch instead of
failing it. Each result is recorded as it arrives (batch_store.record), so a batch
interrupted by a restart resumes with the requests that have no result yet."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time

import aiohttp
from aiohttp import web

from ...shared.errors import ErrorCode, ServiceError
from ..access.batch_caller import BATCH_TOKEN, LINE_HEADER, OWNER_HEADER, TOKEN_HEADER
from ..web.state import KEYS, MANAGER
from ..web.work_pools import THREAD_POOLS
from .files import MAX_STORED_BYTES, is_storage_error, new_id, read_line, sweep_partial
from .line_cost import ParsedBudget, line_values
from .output import finalize
from .store import BatchStore

log = logging.getLogger(__name__)

BATCH_STORE = web.AppKey("batch_store", BatchStore)
SELF_URL = web.AppKey("self_url", dict)  # {"url": ...} once the gateway listens (server.py)
BATCH_WAKE = web.AppKey("batch_wake", asyncio.Event)  # set by POST /v1/batches: start it now
# Requests of all batches in flight at once, and of one batch: background priority lets
# interactive requests go first in the worker, and this bound keeps batch work from taking
# more than these few of a model's queue places (an interactive request is never refused
# for a place a batch holds beyond them).
BACKGROUND_IN_FLIGHT = int(os.environ.get("MLXGW_BATCH_IN_FLIGHT") or 4)
BATCH_CONCURRENCY = BACKGROUND_IN_FLIGHT
PAGE = 64  # requests read from the store at a time
TICK_S = 0.5
PURGE_S = 600.0  # how often files past their retention are deleted
RETRY_S = (0.5, 30.0)  # the wait after a load refusal: Retry-After, within these bounds
DISK_RETRY_S = 2.0  # a full disk: how often a paused batch tries to record again
REQUEST_TIMEOUT_S = 3600.0
LEASE_STALE_S = 30.0  # another live gateway on this home that renewed its claim since holds it
LEASE_S = 5.0  # how often a running batch's claim is renewed


async def _store_call(fn, *args):
    """A store call on the batch I/O pool, waiting for a place when clients' calls fill it
    (a busy pool must not fail a batch)."""
    while True:
        try:
            return await THREAD_POOLS["batch_io"].run(fn, *args)
        except ServiceError as e:
            if e.code is not ErrorCode.OVERLOADED:
                raise
        await asyncio.sleep(0.2)


class _Stop(Exception):
    """A batch ends early with an error on the batch object (quota, revoked key)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message
        self.recorded = False  # on the batch's errors already


class BatchRunner:
    def __init__(self, app: web.Application):
        self.app = app
        self.store: BatchStore = app[BATCH_STORE]
        self._tasks: dict[str, asyncio.Task] = {}
        self._session: aiohttp.ClientSession | None = None
        self._purged_at = -PURGE_S
        self._claimed: dict[str, float] = {}  # batch id -> when this process last renewed its claim
        self._lost: set[str] = set()
        self._stopped: dict[str, _Stop] = {}
        self._not_before: dict[str, float] = {}  # batch id -> when to try a failed finalize again
        self._slots = asyncio.Semaphore(BACKGROUND_IN_FLIGHT)
        self._parsed = ParsedBudget()  # the JSON values of the lines in flight, parsed by their handlers
        self._per_model: dict[str, tuple[int, asyncio.Semaphore]] = {}  # model -> (places, slots)
        self._closing = False  # a graceful stop: no new request starts, none is finalized
        self.owner_exists = lambda owner: True  # set by install when the gateway has keys

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
                    try:
                        await self._tick()
                    except Exception as e:  # a full disk, a busy pool: the next tick tries again
                        log.warning("batch runner: %s", e)
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
            await _store_call(self.store.purge_expired)
        for row in await _store_call(self.store.active):
            bid = row["id"]
            if bid in self._tasks or time.monotonic() < self._not_before.get(bid, 0):
                continue
            if await _store_call(self.store.claim, bid, os.getpid(), LEASE_STALE_S):
                task = asyncio.create_task(self._run_batch(bid, row["owner"], row["endpoint"], row["input_file_id"]))
                self._tasks[bid] = task
                task.add_done_callback(lambda _t, b=bid: self._forget(b))

    def _forget(self, batch_id: str) -> None:
        self._tasks.pop(batch_id, None)
        self._claimed.pop(batch_id, None)

    async def _run_batch(self, batch_id: str, owner: str | None, endpoint: str, input_file_id: str) -> None:
        store = self.store
        try:
            if await _store_call(store.status, batch_id) == "validating":
                await _store_call(store.set_status, batch_id, "in_progress", "in_progress_at")
            stored = (await _store_call(store.usage_of, owner))[1]
            run = _Run(batch_id, owner, endpoint, self.store.file_path(input_file_id), stored)
            await asyncio.gather(*(self._drain(run) for _ in range(BATCH_CONCURRENCY)))
            if self._closing:
                return  # the gateway stops: the batch resumes at the next start
            if batch_id in self._lost:
                self._lost.discard(batch_id)
                return
            status = await _store_call(store.status, batch_id)
            final = {"cancelling": "cancelled", "expiring": "expired"}.get(status or "", "completed")
            stop = self._stopped.get(batch_id)  # kept until the end is written: a retry stops too
            if stop is not None:
                if not stop.recorded:
                    await _store_call(store.add_error, batch_id, stop.code, stop.message)
                    stop.recorded = True
                final = "failed"
            await _store_call(finalize, store, batch_id, final)
            self._stopped.pop(batch_id, None)
            log.info("batch %s %s", batch_id, final)
        except asyncio.CancelledError:
            raise  # the gateway stops: the batch resumes at the next start
        except Exception as e:
            if is_storage_error(e):  # no room for its output yet: it stays as it is, tried again
                log.warning("batch %s waits for disk space: %s", batch_id, e)
                self._not_before[batch_id] = time.monotonic() + DISK_RETRY_S
                return
            log.exception("batch %s failed", batch_id)
            with contextlib.suppress(Exception):
                await _store_call(self.store.set_status, batch_id, "failed", "failed_at")

    async def _drain(self, run: _Run) -> None:
        while not await self._stopping(run):
            line = await run.next_line(self.store)
            if line is None:
                return
            answer = await self._call(run, line)
            if answer is None:
                return
            ok, result = answer
            size = await self._record(run, line["idx"], ok, result)
            if size is None:
                return  # the gateway stops while the disk is full: sent again next start
            run.stored += size
            if run.stored > MAX_STORED_BYTES and run.batch_id not in self._stopped:
                self._stopped[run.batch_id] = _Stop(
                    "quota_exceeded",
                    f"the key's files and results passed {MAX_STORED_BYTES // (1 << 20)} MB; "
                    "the batch ended with what was answered (delete files to make room)",
                )

    async def _record(self, run: _Run, idx: int, ok: bool, result: dict) -> int | None:
        """Record one answer; on a full disk keep it and try again until there is room."""
        while True:
            try:
                return await _store_call(self.store.record, run.batch_id, idx, ok, result)
            except Exception as e:
                if not is_storage_error(e):
                    raise
                log.warning("batch %s paused: %s; retrying in %g s", run.batch_id, e, DISK_RETRY_S)
            if self._closing:
                return None
            await asyncio.sleep(DISK_RETRY_S)

    async def _stopping(self, run: _Run) -> bool:
        """Cancelled, past its completion window, its key revoked, over its key's storage,
        claimed by another gateway, or this gateway stops (no new request starts then);
        renews this gateway's claim."""
        batch_id = run.batch_id
        if self._closing or batch_id in self._stopped:
            return True
        if time.monotonic() - self._claimed.get(batch_id, -LEASE_S) > LEASE_S:
            if not await _store_call(self.store.claim, batch_id, os.getpid(), LEASE_STALE_S):
                self._lost.add(batch_id)  # another gateway runs it now: it finalizes it too
                return True
            self._claimed[batch_id] = time.monotonic()
            if not self.owner_exists(run.owner):
                self._stopped[batch_id] = _Stop("key_revoked", "the batch's API key was revoked")
                return True
        rows = await _store_call(self.store._q, "SELECT status, expires_at FROM batches WHERE id = ?", (batch_id,))
        if not rows:
            return True
        if rows[0]["status"] == "in_progress" and time.time() > rows[0]["expires_at"]:
            await _store_call(self.store.set_status, batch_id, "expiring")
        return rows[0]["status"] != "in_progress"

    async def _call(self, run: _Run, line: dict) -> tuple[bool, dict] | None:
        """One request, retried while it is refused for load; the output or error line (None:
        the batch stopped before it was answered, so it stays to send)."""
        idx, custom_id = line["idx"], line["custom_id"]
        rid = f"{run.batch_id}-{idx}-{secrets.token_hex(3)}"  # per try: a worker may still hold an older one
        headers = {TOKEN_HEADER: self.app[BATCH_TOKEN], LINE_HEADER: "1", "x-request-id": rid}
        headers["content-type"] = "application/json"
        if run.owner:
            headers[OWNER_HEADER] = run.owner
        wait = RETRY_S[0]
        while True:
            # A slot per try (its model's, then all batches'), and the line read from the input
            # file inside it: a request waiting out a refusal holds none, so at most
            # BACKGROUND_IN_FLIGHT lines are in memory. The line is sent as it is (the handler
            # parses it once and takes its body), within the values batches may hold parsed.
            async with self._model_slots(line["model"]), self._slots:
                try:
                    raw = await _store_call(read_line, run.input_path, line["offset"], line["length"])
                except OSError as e:  # the input is gone from disk
                    return False, _line(custom_id, 400, rid, {"error": {"message": f"line {line['line']}: {e}"}})
                async with self._parsed.hold(line_values(raw)):
                    status, payload, retry_after = await self._post(run, raw, headers)
                del raw
            if status == 401 and not self.owner_exists(run.owner):  # revoked while it ran: stop now
                self._stopped.setdefault(run.batch_id, _Stop("key_revoked", "the batch's API key was revoked"))
            if status not in (429, 503) or _never_admitted(payload):
                break
            if await self._stopping(run) or not await self._wait_unless_stopped(run, _retry_wait(retry_after, wait)):
                return None  # refused for load and then stopped: never answered, so not recorded
            wait = min(RETRY_S[1], wait * 2)
        return status < 400, _line(custom_id, status, rid, payload)

    def _model_slots(self, model: str | None) -> asyncio.Semaphore | contextlib.nullcontext:
        """Batch requests in flight to one model: at most a quarter of its queue places
        (max_queue), so a model with a short queue keeps most of it for interactive requests."""
        try:
            slot = self.app[MANAGER].resolve(model or "")
        except ServiceError:
            return contextlib.nullcontext()  # an unknown model: refused at once, holds no place
        places = max(1, min(BACKGROUND_IN_FLIGHT, slot.entry.max_queue // 4))
        held = self._per_model.get(slot.name)
        if held is None or held[0] != places:  # a reload may change max_queue
            held = self._per_model[slot.name] = (places, asyncio.Semaphore(places))
        return held[1]

    async def _post(self, run: _Run, line: bytes, headers: dict) -> tuple[int, object, str | None]:
        assert self._session is not None
        try:
            async with self._session.post(self.app[SELF_URL]["url"] + run.endpoint, data=line, headers=headers) as r:
                return r.status, await _json_or_text(r), r.headers.get("retry-after")
        except aiohttp.ClientError as e:
            return 503, {"error": {"message": str(e)}}, None

    async def _wait_unless_stopped(self, run: _Run, seconds: float) -> bool:
        """Wait before a retry, a second at a time, so a cancel is not kept waiting behind a
        long Retry-After (a spent daily budget says midnight); False when the batch stops."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(1.0, left))
            if await self._stopping(run):
                return False
        return True


class _Run:
    """One batch's run in this process: where it reads, and the next page of its requests."""

    def __init__(self, batch_id: str, owner: str | None, endpoint: str, input_path, stored: int):
        self.batch_id, self.owner, self.endpoint, self.input_path = batch_id, owner, endpoint, input_path
        self.stored = stored  # bytes the owner stores, this batch's results included
        self._page: list[dict] = []
        self._after = -1
        self._done = False
        self._lock = asyncio.Lock()

    async def next_line(self, store: BatchStore) -> dict | None:
        async with self._lock:
            if not self._page and not self._done:
                rows = await _store_call(store.pending_after, self.batch_id, self._after, PAGE)
                self._page = [dict(r) for r in rows]
                self._done = not rows
                if rows:
                    self._after = rows[-1]["idx"]
            return self._page.pop(0) if self._page else None


def _line(custom_id: str, status: int, rid: str, payload) -> dict:
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": rid, "body": payload},
        "error": None,
    }


def _never_admitted(payload) -> bool:
    """A 429 that retrying cannot change: the request asks more than the key may ever use
    (auth.reserve_tokens names max_tokens for these)."""
    error = payload.get("error") if isinstance(payload, dict) else None
    return isinstance(error, dict) and error.get("param") == "max_tokens"


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
    app[BATCH_STORE] = store = BatchStore()
    keys = app.get(KEYS)
    store.adopt_names({k.name: k.tenant for k in keys.keys} if keys is not None else {})
    swept = sweep_partial(store.files_dir)
    if swept:
        log.info("removed %d partial files a stopped gateway left in %s", swept, store.files_dir)
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
    keys = app.get(KEYS)
    if keys is not None:

        def owner_exists(owner: str | None) -> bool:
            keys.refresh()
            return any(k.tenant == owner and not k.expired() for k in keys.keys)

        runner.owner_exists = owner_exists
    task = asyncio.create_task(runner.run())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    app[BATCH_STORE].close()
