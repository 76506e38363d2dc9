"""Cross-cutting HTTP concerns: access log, metrics, connection cap, CORS, /metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ...shared.errors import HTTP_STATUS, ErrorCode, ServiceError
from ..access.ledger import record_request
from ..web.edge import make_room
from ..web.routes import route_of
from ..web.state import METRICS, SETTINGS
from .tracing import start_span

access_log = logging.getLogger("mlxgw.access")  # by a stable name: operators route the access log by it
routes = web.RouteTableDef()
ACTIVE = web.AppKey("active_requests", dict)


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def observe_middleware(request: web.Request, handler):
    """One access-log line and the request metrics for every request, errors included."""
    started = time.monotonic()
    tracing, span = start_span(request)  # (None, None) unless OTLP traces are configured
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:
        status = e.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client went away
        raise
    finally:
        duration = time.monotonic() - started
        gen = request.get("generation")
        sent, status = status, effective_status(status, gen)
        key = request["key"].name if request.get("key") is not None else "-"
        model = request.get("model") or "-"
        route = _route(request)
        request.app[METRICS].observe(route, model, key, status, duration, gen)
        _log(request, route, (status, sent), key, model, duration, gen)
        record_request(request, status, duration)
        if span is not None:
            tracing.end(span, request, route, status, gen)


def effective_status(sent: int, gen) -> int:
    """The status that tells the truth about a stream: a 200 whose stream then ended in an
    error or a cancellation is logged and counted with that error's status."""
    if sent != 200 or gen is None or not gen.outcome:
        return sent
    if gen.outcome == "cancelled":
        return 499
    if gen.outcome.startswith("error:"):
        try:
            return HTTP_STATUS[ErrorCode(gen.outcome[6:])]
        except (ValueError, KeyError):
            return 500
    return sent


def _log(request: web.Request, route: str, statuses: tuple, key: str, model: str, duration: float, gen) -> None:
    settings = request.app[SETTINGS]
    status, sent = statuses
    entry = {
        "request_id": request.get("rid"),
        "method": request.method,
        "path": request.path,
        "status": status,
        "http_status": sent if sent != status else None,  # what the headers said, when they differ
        "key": key,
        "model": model,
        "duration_s": round(duration, 4),
    }
    if gen is not None:
        u = gen.usage
        entry.update(
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            cached_tokens=u.cached_tokens,
            outcome=gen.outcome,
            time_limited=True if getattr(gen, "time_limited", False) else None,  # cut by request_timeout_s
            ttft_s=round(gen.first_token_at - gen.started, 4) if gen.first_token_at else None,
        )
        if settings.log_prompts:
            entry["prompt"] = gen.req.messages if gen.req.messages is not None else gen.req.prompt
    if settings.log_format == "json":
        access_log.info(json.dumps(entry, ensure_ascii=False, default=str))
    else:
        access_log.info(" ".join(f"{k}={v}" for k, v in entry.items() if v is not None))


@web.middleware
async def capacity_middleware(request: web.Request, handler):
    """A ceiling on concurrent HTTP requests: past it, 429 with Retry-After."""
    if not route_of(request).capped:  # cheap routes an operator needs most when the server is full
        return await handler(request)
    active = request.app[ACTIVE]
    if active["n"] >= request.app[SETTINGS].max_connections and not make_room(request):
        raise ServiceError(
            ErrorCode.OVERLOADED, "the server is handling too many requests; retry shortly", retry_after=1
        )
    active["n"] += 1
    try:
        return await handler(request)
    finally:
        active["n"] -= 1


def _cors_headers(request: web.Request) -> dict[str, str]:
    origin = request.headers.get("Origin")
    if not origin or origin not in request.app[SETTINGS].cors_origins:
        return {}
    return {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Headers": "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta, "
        "x-request-id",
        "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
        "Vary": "Origin",
    }


@web.middleware
async def cors_middleware(request: web.Request, handler):
    """CORS is off unless --cors-origins lists origins; preflights for those are answered here."""
    if request.method == "OPTIONS" and request.headers.get("Access-Control-Request-Method"):
        headers = _cors_headers(request)
        if headers:
            return web.Response(status=204, headers=headers)
    return await handler(request)


async def add_response_headers(request: web.Request, response: web.StreamResponse) -> None:
    if "rid" in request:
        response.headers["x-request-id"] = request["rid"]
    if "ratelimit_headers" in request:
        response.headers.update(request["ratelimit_headers"]())
    if request.app[SETTINGS].cors_origins:
        response.headers.update(_cors_headers(request))


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    # Who may scrape is decided in auth_middleware (metrics token, or an admin key).
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
