"""Operational routes: model list, health, status, cancellation, prefix-cache control."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone

from aiohttp import web

from ....shared.errors import ErrorCode, ServiceError, redact_paths
from ....shared.model_sections import CHAT_KINDS, KINDS, ModelKind
from ...access.auth import may_use, presented_key
from ...mcp.hub import MCP
from ...models import adapters
from ...models.model_report import describe_slot
from ...pipeline.fim_support import capabilities, fim_format
from ...pipeline.latency_class import classes_status
from ...web.errors import error_response
from ...web.state import BROKER, KEYS, MANAGER, SETTINGS
from .keys import require_admin

routes = web.RouteTableDef()
STARTED = time.time()


def _is_anthropic(request: web.Request) -> bool:
    """Anthropic's SDKs send anthropic-version; they get Anthropic's shapes on /v1/models."""
    return "anthropic-version" in request.headers


def _model(request: web.Request, slot, anthropic: bool) -> dict:
    if anthropic:
        created = datetime.fromtimestamp(STARTED, timezone.utc).isoformat().replace("+00:00", "Z")
        return {"type": "model", "id": slot.name, "display_name": slot.name, "created_at": created}
    manager = request.app[MANAGER]
    d = describe_slot(manager, slot)
    found = _discovered(manager).get(slot.name)
    return {
        "id": slot.name,
        "object": "model",
        "created": int(STARTED),
        "owned_by": "mlxgw",
        **{k: d[k] for k in ("kind", "state", "loaded", "aliases")},
        "last_error": redact_paths(d["last_error"]) if d["last_error"] else None,
        "source": found.source if found else "mlxgw",  # hf-cache, lmstudio, or models.yaml/models dir
        # Ollama's names: completion, tools, insert (fill in the middle), vision, embedding, ...
        "capabilities": capabilities(slot, fim_format(request, slot)),
    }


def _adapter_model(request: web.Request, slot, adapter, anthropic: bool) -> dict:
    """An adapter as a model of its own; `parent` and `root` name its base (as vLLM lists LoRA
    modules); its aliases list `<base>:<adapter>` and the aliases models.yaml gives it."""
    base = _model(request, slot, anthropic)
    if anthropic:
        return {**base, "id": adapter.name, "display_name": adapter.name}
    others = list(adapters.names(slot, adapter)[1:])
    return {**base, "id": adapter.name, "aliases": others, "parent": slot.name, "root": slot.name, "source": "adapter"}


def _discovered(manager) -> dict:
    return {m.name: m for m in manager.registry.discovered}


def _unservable(manager) -> list[dict]:
    """Folders discovery found but cannot serve, listed with the reason instead of hidden."""
    return [
        {
            "id": m.name,
            "object": "model",
            "created": int(STARTED),
            "owned_by": "mlxgw",
            "kind": m.kind,
            "state": "unavailable",
            "loaded": False,
            "aliases": [],
            "last_error": redact_paths(m.error),
            "source": m.source,
        }
        for m in manager.registry.discovered
        if m.error is not None
    ]


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    anthropic = _is_anthropic(request)
    slots = [s for s in request.app[MANAGER].slots.values() if may_use(request, s)]
    # ?kind=chat (or embedding, rerank, audio, speech, vision): for a UI that lists only the
    # models it can use (Open WebUI offers every listed model as a chat model).
    asked = [k for k in request.query.get("kind", "").split(",") if k]
    if asked:  # a kind this version does not know lists nothing
        kinds = {ModelKind(k) for k in asked if k in KINDS}
        wanted = kinds | (set(CHAT_KINDS) if ModelKind.CHAT in kinds else set())
        slots = [s for s in slots if s.entry.kind in wanted]
    data = [_model(request, s, anthropic) for s in slots]
    data += [  # LoRA adapters, each called by its name and listed with its base model
        _adapter_model(request, s, a, anthropic)
        for s, a in adapters.listed(request.app[MANAGER], request.get("key"))
        if not asked or s.entry.kind in wanted
    ]
    if anthropic:
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return web.json_response({"data": data, "has_more": False, "first_id": first, "last_id": last})
    key = request.get("key")
    operator = key is None or key.admin  # unservable folders are the operator's to see
    unservable = _unservable(request.app[MANAGER]) if operator and not asked else []
    return web.json_response({"object": "list", "data": data + unservable})


@routes.get("/v1/models/{model_id:.+}")
async def retrieve_model(request: web.Request) -> web.Response:
    """One model by name or alias (both SDKs' models.retrieve)."""
    anthropic = _is_anthropic(request)
    requested = request.match_info["model_id"]
    try:
        found = adapters.find(request.app[MANAGER], requested)
        if found is not None:
            if not adapters.allowed(request.get("key"), *found):
                raise ServiceError(ErrorCode.PERMISSION, f"API key '{request['key'].name}' may not use '{requested}'")
            return web.json_response(_adapter_model(request, *found, anthropic))
        slot = request.app[MANAGER].resolve(requested)
        key = request.get("key")
        # as for requests: the model the name resolves to decides (its name or an alias)
        if key is not None and not key.allows(slot.name, *slot.entry.aliases):
            raise ServiceError(ErrorCode.PERMISSION, f"API key '{key.name}' may not use model '{requested}'")
    except ServiceError as err:
        if anthropic:  # the error middleware picks the shape by path; this path serves both
            return error_response(err, "anthropic")
        raise
    return web.json_response(_model(request, slot, anthropic))


@routes.get("/")
async def root(request: web.Request) -> web.Response:
    """Claude Code sends HEAD / when it starts (aiohttp answers HEAD from this GET route)."""
    return web.json_response({"name": "mlxgw", "status": "ok"})


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    """Liveness for anyone; the models and MCP servers with their states only for an admin
    key (or with keys off): the list says what runs here and for whom."""
    if not _is_operator(request):
        return web.json_response({"status": "ok"})
    manager = request.app[MANAGER]
    models = {s.name: s.state for s in manager.slots.values()}
    return web.json_response({"status": "ok", "models": models, "mcp": request.app[MCP].health()})


def _is_operator(request: web.Request) -> bool:
    store = request.app[KEYS]
    if store is None:
        return True
    given = presented_key(request)
    key = store.lookup(given) if given else None
    return key is not None and key.admin and not key.expired()


@routes.get("/v1/status")
async def status(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    broker = request.app[BROKER]
    models = [describe_slot(manager, s) for s in manager.slots.values()]
    return web.json_response(
        {
            "uptime_s": round(time.time() - STARTED, 1),
            "workers_connected": len(broker.conns),
            "dropped_messages": broker.dropped_messages,
            "memory": manager.memory_snapshot(),
            "models": models,
            "classes": classes_status(request.app[SETTINGS], models),  # latency classes
            "processes": manager.processes(),
            **manager.health(),
        }
    )


@routes.post("/v1/requests/{rid}/cancel")
async def cancel_request(request: web.Request) -> web.Response:
    rid = request.match_info["rid"]
    broker = request.app[BROKER]
    key = request.get("key")
    # Another key's request is reported as absent: request ids are not secrets (they are in
    # /v1/status), so only the key that made a request, or an admin key, may end it.
    stream = broker.find_stream(rid, lambda s: key is None or key.admin or s.owner == key.name)
    if stream is None:
        raise ServiceError(ErrorCode.NOT_FOUND, f"no request {rid!r} in flight")
    await broker.cancel(stream)
    return web.json_response({"id": rid, "object": "request.cancel", "cancelled": True})


async def _cache_call(request: web.Request, op: str) -> web.Response:
    manager = request.app[MANAGER]
    broker = request.app[BROKER]
    wanted = request.query.get("model")
    slots = [manager.resolve(wanted)] if wanted else list(manager.slots.values())
    calls, names = [], []
    for slot in slots:
        for conn in broker.pool.ready_workers(slot.name):
            calls.append(broker.call(conn, op))
            names.append((slot.name, conn.worker_id))
    results = await asyncio.gather(*calls, return_exceptions=True)
    models: dict[str, list] = {s.name: [] for s in slots}
    for (name, wid), res in zip(names, results):
        entry = {"worker_id": wid}
        entry.update({"error": str(res)} if isinstance(res, Exception) else res)
        models[name].append(entry)
    return web.json_response({"object": "cache.stats", "models": models})


@routes.get("/v1/cache/stats")
async def cache_stats(request: web.Request) -> web.Response:
    """Every model's worker ids, entries and reused tokens: other users' traffic, admin only."""
    require_admin(request)
    return await _cache_call(request, "cache_stats")


@routes.delete("/v1/cache")
async def cache_clear(request: web.Request) -> web.Response:
    key = request.get("key")
    if key is not None and not key.admin:
        raise ServiceError(ErrorCode.PERMISSION, "clearing the prefix cache needs an admin key")
    return await _cache_call(request, "cache_clear")
