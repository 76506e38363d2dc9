"""The audit trail: who changed what (keys, models, adapters, caches, the registry), when, and
whether it was done or refused, written before the change is answered.

A route whose entry in gateway/web/routes.py names an `audit` action is recorded by
`on_prepare` as its answer is about to be sent, whatever it is (done, refused with a 403 by
auth, a 400, a failure): the entry is fsynced first, then the status line goes out. Handlers
add what only they know with `note` (the target, the change); a handler that streams its
answer records its outcome itself with `record` before its last line. The CLI writes its
entries with `record_local`. The file is store.AuditFile; who may read it: GET /v1/audit
(admins), `mlxgw audit`."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import logging
import math
import time
from pathlib import Path

from aiohttp import web

from ...web.routes import route_of
from .store import AuditFile

log = logging.getLogger(__name__)

AUDIT = web.AppKey("audit", AuditFile)
_DONE = "audit_done"
_NOTES = "audit_notes"
# Never in an entry, at any depth: a change records fields, not the secrets that open them.
SECRET_FIELDS = frozenset({"key", "sha256", "secret", "token", "password", "api_key", "authorization", "insecure_key"})
REFUSALS_PER_MINUTE = 60  # per actor: a key hammering a route it may not use cannot flood out the trail
PRUNE_EVERY_S = 3600.0
MAX_REFUSED_BODY = 64 * 1024


def audit_path() -> Path:
    from ....shared import paths

    return paths.home() / "audit.jsonl"


def bounded(value, depth: int = 0):
    """A change as recorded: secrets dropped, strings, lists and mappings cut to a size that
    keeps each entry a line (a Modelfile's system prompt is not the trail's to keep)."""
    if isinstance(value, dict):
        if depth >= 3:
            return "{...}"
        items = [(str(k), v) for k, v in value.items() if str(k).lower() not in SECRET_FIELDS][:30]
        return {k: bounded(v, depth + 1) for k, v in items}
    if isinstance(value, (list, tuple)):
        return [bounded(v, depth + 1) for v in list(value)[:20]] if depth < 3 else "[...]"
    if isinstance(value, str) and len(value) > 200:
        return value[:200] + f"...({len(value)} chars)"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # keep_alive -1 is forever: JSON has no Infinity
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)[:200]


def cli_actor(via: str | None = None) -> dict:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return {"kind": "cli", "user": user, **({"via": via} if via else {})}


def actor_of(request: web.Request) -> dict:
    """The acting key by name and stable id (ApiKey.tenant: a re-created name is another id),
    and the signed-in person a session, an access token or a personal key stands for; with
    keys off, the address the change came from."""
    key = request.get("key")
    if key is not None:
        person = {"person": key.owner, "subject": key.owner_sub} if key.owner_sub else {}  # access/signin/
        return {"kind": "key", "name": key.name, "id": key.tenant, **person}
    return {"kind": "open", "address": request.remote or "?"}


def note(request: web.Request, *, target: str | None = None, **change) -> None:
    """What the handler knows best about its change (which model a copy made, ...)."""
    notes = request.setdefault(_NOTES, {})
    if target is not None:
        notes["target"] = target
    notes.setdefault("change", {}).update(change)


def _default_target(request: web.Request, body: dict) -> str | None:
    named = (request.match_info.get("name"), request.get("model"), body.get("destination"), body.get("name"))
    for value in (*named, body.get("model")):
        if isinstance(value, str) and value:
            return value
    return request.query.get("model") or None


async def _unread_body(request: web.Request):
    """A refused request's body (auth refuses before its handler reads it): what it asked for
    is the entry's target and change. Small bodies only, within a second: a refusal never
    waits on a slow sender."""
    if not 0 < (request.content_length or 0) <= MAX_REFUSED_BODY:
        return None
    try:
        async with asyncio.timeout(1.0):
            return json.loads(await request.read())
    except (TimeoutError, ValueError, ConnectionError, web.HTTPException):
        return None


def _reason(response: web.StreamResponse) -> str | None:
    body = getattr(response, "body", None)
    if not isinstance(body, bytes):
        return None
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return str(err.get("message") if isinstance(err, dict) else err)[:500] if err else None


def outcome_of(status: int) -> str:
    return "ok" if status < 400 else "refused" if status < 500 else "failed"


class _Refusals:
    """Refused entries per actor and minute, and how many past the bound went unrecorded."""

    def __init__(self) -> None:
        self.window: dict[str, tuple[float, int, int]] = {}

    def admit(self, who: str) -> tuple[bool, int]:
        start, n, dropped = self.window.get(who, (0.0, 0, 0))
        now = time.monotonic()
        if now - start >= 60:
            start, n = now, 0
        if n >= REFUSALS_PER_MINUTE:
            self.window[who] = (start, n, dropped + 1)
            return False, 0
        self.window[who] = (start, n + 1, 0)
        return True, dropped


_REFUSALS = _Refusals()


async def record(
    request: web.Request,
    action: str | None = None,
    *,
    target: str | None = None,
    change: dict | None = None,
    outcome: str | None = None,
    status: int | None = None,
    reason: str | None = None,
) -> None:
    """Write the request's entry now (once): off the event loop, and done before this returns."""
    audit = request.app.get(AUDIT)
    action = action or route_of(request).audit
    if audit is None or action is None or request.get(_DONE):
        return
    request[_DONE] = True
    notes = request.get(_NOTES, {})
    if "json_body" not in request and request.can_read_body:
        request["json_body"] = await _unread_body(request)
    body = request.get("json_body") if isinstance(request.get("json_body"), dict) else {}
    outcome = outcome or outcome_of(status or 200)
    who = actor_of(request)
    entry = {
        "actor": who,
        "action": action,
        "target": target or notes.get("target") or _default_target(request, body),
        "change": bounded(change if change is not None else {**body, **notes.get("change", {})}),
        "outcome": outcome,
        "status": status,
        "reason": reason,
        "request_id": request.get("rid"),
    }
    if outcome != "ok":
        admitted, dropped = _REFUSALS.admit(who.get("id") or who.get("address", "?"))
        if not admitted:
            return
        if dropped:
            entry["unrecorded_refusals_before"] = dropped
    await write(audit, entry)


async def write(audit: AuditFile, entry: dict) -> None:
    try:
        # shielded: a client that hangs up does not take back an entry its change already made
        await asyncio.shield(asyncio.to_thread(audit.append, entry))
    except OSError as e:
        log.error("audit: could not write %s on %s: %s", entry.get("action"), entry.get("target"), e)


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """An audited route's answer is about to go out: its entry goes first. A stream that is
    still running (its status says nothing of the outcome) records its own end."""
    if route_of(request).audit is None or request.get(_DONE) or response.status == 401:
        return  # a 401 has no identity to record; the access log has it
    if not isinstance(response, web.Response) and response.status < 400:
        return
    await record(request, status=response.status, reason=_reason(response) if response.status >= 400 else None)


@web.middleware
async def audit_middleware(request: web.Request, handler):
    """What on_prepare cannot see: a client that hangs up mid-change (the change may have
    been made), and a stream that ended without recording its outcome."""
    try:
        response = await handler(request)
    except asyncio.CancelledError:
        if route_of(request).audit is not None and not request.get(_DONE):
            await record(request, outcome="cancelled", reason="the client closed the connection")
        raise
    if route_of(request).audit is not None and not request.get(_DONE):
        await record(request, status=response.status)
    return response


_KEPT: dict[tuple[int, str], float] = {}  # (app, model) -> the keep_alive last recorded
_TASKS: set[asyncio.Task] = set()


def residency(request: web.Request, model: str, keep_alive: float) -> None:
    """An Ollama keep_alive that changes how long a model stays loaded (only keys that may
    set residency get here). Recorded when it differs from the model's last recorded value:
    a client sending the same keep_alive with every request is one entry, not one a request."""
    audit = request.app.get(AUDIT)
    if audit is None or _KEPT.get((id(request.app), model)) == keep_alive:
        return
    _KEPT[(id(request.app), model)] = keep_alive
    entry = {"actor": actor_of(request), "action": "models.keep_alive", "target": model}
    entry |= {"change": bounded({"keep_alive_s": keep_alive}), "outcome": "ok", "status": None, "reason": None}
    task = asyncio.get_running_loop().create_task(write(audit, {**entry, "request_id": request.get("rid")}))
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


def record_local(action: str, target: str, change: dict | None = None, *, reason: str | None = None, via=None) -> None:
    """An entry for a change made from the command line (`mlxgw keys`, `mlxgw launch`)."""
    entry = {
        "actor": cli_actor(via),
        "action": action,
        "target": target,
        "change": bounded(change or {}),
        "outcome": "ok" if reason is None else "refused",
        "status": None,
        "reason": reason,
        "request_id": None,
    }
    try:
        AuditFile(audit_path()).append(entry)
    except OSError as e:
        log.error("audit: could not write %s on %s: %s", action, target, e)


async def record_event(app: web.Application, action: str, target: str, change: dict, *, actor: dict, reason=None):
    """An entry for a change no request made (a registry reload on SIGHUP)."""
    audit = app.get(AUDIT)
    if audit is not None:
        outcome = "ok" if reason is None else "failed"
        entry = {"actor": actor, "action": action, "target": target, "change": bounded(change)}
        await write(audit, {**entry, "outcome": outcome, "status": None, "reason": reason, "request_id": None})


async def audit_lifecycle(app: web.Application):
    """Retention: old entries are dropped at start and every hour (and past the size bound on
    the append that crosses it)."""
    audit = app[AUDIT]

    async def prune_forever() -> None:
        while True:
            try:
                await asyncio.to_thread(audit.prune)
            except (OSError, ValueError, KeyError) as e:
                log.error("audit: retention could not prune %s: %s", audit.path, e)
            await asyncio.sleep(PRUNE_EVERY_S)

    task = asyncio.create_task(prune_forever())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
