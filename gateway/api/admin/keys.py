"""Admin routes: API keys over HTTP, usage reports from the ledger, loading, unloading and
pinning models, and the console's live feeds (requests in flight, tokens/s history).

Every route here needs an admin key when the gateway runs with keys (403 otherwise); a
gateway without keys is open on its loopback address, as its other routes are. Responses
carry key names, never keys or their hashes; the one exception is the key POST /v1/keys
creates, returned once."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from aiohttp import web

from ....shared.errors import ErrorCode, ServiceError
from ...access.key_admin import KeyEditError, create_key, list_entries, revoke_key, update_key
from ...access.ledger import LEDGER, connect
from ...access.usage import UsageQueryError, key_activity, parse_since, totals
from ...models.model_report import describe_slot
from ...models.throughput import THROUGHPUT
from ...pipeline.body import read_json
from ...web.state import BROKER, KEYS, MANAGER, SETTINGS

routes = web.RouteTableDef()
_EDIT_ERRORS = {
    "invalid": ErrorCode.INVALID_REQUEST,
    "exists": ErrorCode.INVALID_REQUEST,
    "not_found": ErrorCode.NOT_FOUND,
}
REVOKE_WATCH_S = 600.0  # how long a revoked key's request still waiting for its model is watched


def require_admin(request: web.Request) -> None:
    if request.app[KEYS] is None:
        return
    key = request.get("key")
    if key is None or not key.admin:
        raise ServiceError(ErrorCode.PERMISSION, f"{request.method} {request.path} needs an admin key")


def _keys_path(request: web.Request):
    path = request.app[SETTINGS].keys_path
    if path is None:
        raise ServiceError(
            ErrorCode.INVALID_REQUEST,
            "this gateway runs without API keys; start it with --keys FILE (or create one with `mlxgw keys create`)",
        )
    return path


async def _json_object(request: web.Request) -> dict:
    # read_json, not request.json(): deep nesting, NaN and huge numbers are a 400, never a 500
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ServiceError(ErrorCode.INVALID_REQUEST, "the body must be a JSON object")
    return body


async def _edit(request: web.Request, fn, *args):
    """Run a keys-file edit off the loop (it takes a file lock), then reload the keys at once."""
    try:
        result = await asyncio.to_thread(fn, *args)
    except KeyEditError as e:
        raise ServiceError(_EDIT_ERRORS[e.kind], str(e)) from None
    request.app[KEYS].refresh(force=True)
    return result


# -- keys -------------------------------------------------------------------------------------------
@routes.post("/v1/keys")
async def create(request: web.Request) -> web.Response:
    require_admin(request)
    path = _keys_path(request)
    body = await _json_object(request)
    name = body.pop("name", None)
    key, entry = await _edit(request, create_key, path, name, body)
    return web.json_response({"object": "api_key", **entry, "key": key}, status=201)


async def _activity(request: web.Request) -> dict[str, dict]:
    ledger = request.app[LEDGER]
    if ledger.path is None:
        return {}
    await ledger.flush()

    def read() -> dict[str, dict]:
        conn = connect(ledger.path)
        try:
            return key_activity(conn)
        finally:
            conn.close()

    return await asyncio.to_thread(read)


@routes.get("/v1/keys")
async def list_keys(request: web.Request) -> web.Response:
    require_admin(request)
    entries = await asyncio.to_thread(list_entries, _keys_path(request))
    activity = await _activity(request)
    ledger, store = request.app[LEDGER], request.app[KEYS]
    tenants = {k.name: k.tenant for k in store.keys} if store is not None else {}
    for entry in entries:
        seen = activity.get(entry["name"], {})
        day, month = ledger.budgets.used(tenants.get(entry["name"], ""))
        entry.update(
            last_used=seen.get("last_used"),
            usage={
                "today": seen.get("today", {"requests": 0, "tokens": 0}),
                "7d": seen.get("7d", {"requests": 0, "tokens": 0}),
                "budget_tokens_today": day,
                "budget_tokens_month": month,
            },
            in_flight=len(ledger.inflight.of(entry["name"])),
        )
    return web.json_response({"object": "list", "data": entries})


@routes.patch("/v1/keys/{name}")
async def patch(request: web.Request) -> web.Response:
    require_admin(request)
    path = _keys_path(request)
    body = await _json_object(request)
    entry = await _edit(request, update_key, path, request.match_info["name"], body)
    return web.json_response({"object": "api_key", **entry})


@routes.delete("/v1/keys/{name}")
async def revoke(request: web.Request) -> web.Response:
    require_admin(request)
    name = request.match_info["name"]
    await _edit(request, revoke_key, _keys_path(request), name)
    ended = end_queued_requests(request.app, name)
    return web.json_response({"object": "api_key.deleted", "name": name, "deleted": True, "queued_ended": ended})


def end_queued_requests(app: web.Application, name: str) -> int:
    """A revoked key's requests that have produced nothing yet (waiting for a model to load,
    queued in a worker, prefilling) are cancelled; those already generating finish."""
    ledger, broker = app[LEDGER], app[BROKER]
    queued = [r for r in ledger.inflight.of(name) if not _generating(r)]
    for req in queued:
        task = asyncio.create_task(_cancel_once_submitted(ledger, broker, name, req))
        _watchers.add(task)
        task.add_done_callback(_watchers.discard)
    return len(queued)


_watchers: set[asyncio.Task] = set()


def _generating(request: web.Request) -> bool:
    gen = request.get("generation")
    return gen is not None and gen.first_token_at is not None


async def _cancel_once_submitted(ledger, broker, name: str, request: web.Request) -> None:
    deadline = time.monotonic() + REVOKE_WATCH_S
    while time.monotonic() < deadline and ledger.inflight.holds(name, request) and not _generating(request):
        gen = request.get("generation")
        if gen is not None and gen.stream is not None:
            if not gen.stream.done:
                try:
                    await broker.cancel(gen.stream)
                except ServiceError:
                    pass  # its worker is gone: the request ends with that error anyway
            return
        await asyncio.sleep(0.05)


# -- usage ------------------------------------------------------------------------------------------
@routes.get("/v1/usage")
async def usage(request: web.Request) -> web.Response:
    require_admin(request)
    ledger = request.app[LEDGER]
    if ledger.path is None:
        raise ServiceError(ErrorCode.NOT_FOUND, "the usage ledger is off (usage_ledger: false in models.yaml)")
    by = request.query.get("by", "key")
    try:
        since = parse_since(request.query.get("since"))
    except UsageQueryError as e:
        raise ServiceError(ErrorCode.INVALID_REQUEST, str(e), param="since") from None
    await ledger.flush()  # what has finished is counted, not only what was committed

    def read() -> list[dict]:
        conn = connect(ledger.path)
        try:
            return totals(conn, since, by)
        finally:
            conn.close()

    try:
        rows = await asyncio.to_thread(read)
    except UsageQueryError as e:
        raise ServiceError(ErrorCode.INVALID_REQUEST, str(e), param="by") from None
    return web.json_response({"object": "usage", "since": since, "by": by, "data": rows})


# -- models -----------------------------------------------------------------------------------------
def _slot(request: web.Request):
    require_admin(request)
    return request.app[MANAGER].resolve(request.match_info["name"])


@routes.post("/v1/models/{name:.+}/load")
async def load(request: web.Request) -> web.Response:
    """Load a model (or find it loaded); answers when it is ready or failed."""
    slot = _slot(request)
    manager = request.app[MANAGER]
    await manager.acquire(slot)
    return web.json_response({"object": "model.load", **_model_state(manager, slot)})


@routes.post("/v1/models/{name:.+}/unload")
async def unload(request: web.Request) -> web.Response:
    """Unload a model: its worker finishes the requests in flight, then exits."""
    slot = _slot(request)
    manager = request.app[MANAGER]
    await manager.unload(slot, "unloaded by an admin over HTTP")
    return web.json_response({"object": "model.unload", **_model_state(manager, slot)})


@routes.post("/v1/models/{name:.+}/pin")
async def pin(request: web.Request) -> web.Response:
    """Pin (or with {"pinned": false} unpin) a model: a pinned model is never evicted or idle-
    unloaded. Held in memory until the gateway restarts; models.yaml's `pin` is the lasting one."""
    slot = _slot(request)
    body = await _json_object(request) if request.can_read_body else {}
    pinned = body.get("pinned", True)
    if not isinstance(pinned, bool):
        raise ServiceError(ErrorCode.INVALID_REQUEST, "'pinned' must be true or false", param="pinned")
    slot.entry = dataclasses.replace(slot.entry, pin=pinned)
    return web.json_response({"object": "model.pin", **_model_state(request.app[MANAGER], slot)})


def _model_state(manager, slot) -> dict:
    d = describe_slot(manager, slot)
    return {"model": slot.name, "state": d["state"], "loaded": d["loaded"], "pinned": d["pinned"]}


# -- the console's live feeds ----------------------------------------------------------------------
@routes.get("/v1/status/throughput")
async def throughput(request: web.Request) -> web.Response:
    """Tokens/s per model over the last hour (samples every 10 s): every user's traffic,
    admin only (as /v1/status)."""
    require_admin(request)
    return web.json_response(request.app[THROUGHPUT].snapshot())


@routes.get("/v1/status/requests")
async def requests_feed(request: web.Request) -> web.Response:
    """Requests in flight and the last finished ones, with key names: admin only."""
    require_admin(request)
    ledger = request.app[LEDGER]
    now = time.time()
    running = []
    for req in ledger.inflight.all():
        key = req.get("key")
        running.append(
            {
                "request_id": req.get("rid"),
                "key": key.name if key is not None else "-",
                "model": req.get("model") or "-",
                "path": req.path,
                "state": "generating" if _generating(req) else "waiting",
                "age_s": round(now - req.get("started_at", now), 2),
            }
        )
    running.sort(key=lambda r: -r["age_s"])
    limit = request.query.get("limit", "50")
    limit = min(int(limit), 200) if limit.isdigit() else 50
    recent = list(ledger.recent)[-limit:][::-1] if limit else []
    return web.json_response({"running": running[:200], "running_total": len(running), "recent": recent})
