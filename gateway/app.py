"""The aiohttp application: middlewares, routes, and the broker/manager lifecycle."""

from __future__ import annotations

import logging
import os
import re
import secrets
from collections import OrderedDict
from pathlib import Path

from aiohttp import web

from ..shared import paths
from ..shared.config import Registry
from ..shared.errors import ErrorCode, ServiceError
from .access.audit import AUDIT, audit_lifecycle, audit_middleware, audit_path, on_prepare
from .access.audit.store import AuditFile
from .access.auth import auth_middleware
from .access.cache_scope import load_secret
from .access.keys import KeyStore
from .access.ledger import LEDGER, Ledger, ledger_lifecycle, usage_middleware
from .access.limits import RateLimiter
from .access.signin import SIGNIN, SignIn, signin_lifecycle
from .api.admin import adapters, audit, signin, system
from .api.admin import keys as admin
from .api.anthropic import messages as anthropic
from .api.llamacpp import infill, rerank, tokenize
from .api.ollama import chat as ollama
from .api.ollama import create as ollama_create
from .api.ollama import manage as ollama_manage
from .api.ollama import models as ollama_models
from .api.openai import audio, batches, files, images
from .api.openai import chat as openai_chat
from .api.openai import completions as openai_completions
from .api.openai import embeddings as openai_embeddings
from .api.responses import output as responses_output
from .api.responses import responses
from .batches.runner import install as install_batches
from .console import routes as console_routes
from .link.broker import Broker
from .mcp import routes as mcp_routes
from .mcp.hub import MCP, McpHub, mcp_lifecycle
from .models.manager import ModelManager
from .models.metrics import Metrics
from .models.throughput import THROUGHPUT, Throughput, throughput_lifecycle
from .pipeline import observe
from .pipeline.body import body_too_large
from .pipeline.observe import ACTIVE, add_response_headers, capacity_middleware, cors_middleware, observe_middleware
from .pipeline.tracing import TRACING, from_env, tracing_lifecycle
from .web.edge import EDGE_STATS, EdgeStats, edge_middleware
from .web.errors import error_response
from .web.routes import lookup, route_of
from .web.state import BROKER, CACHE_SECRET, KEYS, LIMITER, MANAGER, METRICS, SETTINGS, GatewaySettings

log = logging.getLogger(__name__)

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@web.middleware
async def request_id_middleware(request: web.Request, handler):
    given = request.headers.get("x-request-id", "")
    request["rid"] = given if _REQUEST_ID_RE.match(given) else f"req_{secrets.token_hex(12)}"
    return await handler(request)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every failure leaves in the called API's error shape; nothing escapes as a bare 500."""
    family = route_of(request).family
    try:
        return await handler(request)
    except ServiceError as err:
        return error_response(err, family)
    except web.HTTPRequestEntityTooLarge:
        return error_response(body_too_large(request), family)
    except web.HTTPNotFound:
        return error_response(ServiceError(ErrorCode.NOT_FOUND, f"no route {request.path}"), family)
    except web.HTTPMethodNotAllowed as e:
        return error_response(
            ServiceError(
                ErrorCode.METHOD_NOT_ALLOWED,
                f"{request.method} is not allowed on {request.path}; use {', '.join(sorted(e.allowed_methods))}",
            ),
            family,
        )
    except web.HTTPException:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(ServiceError(ErrorCode.INTERNAL, "internal server error"), family)


def default_endpoint(run_dir: Path) -> str:
    run_dir.mkdir(parents=True, exist_ok=True)
    # The owner's pid in the name: another gateway on the same MLXGW_HOME never takes it for stale.
    return f"ipc://{run_dir / f'gateway-{os.getpid()}-{secrets.token_hex(4)}.sock'}"


def make_app(
    registry: Registry,
    settings: GatewaySettings,
    endpoint: str,
    secret: str = "",
    extra_endpoints: tuple[str, ...] = (),
) -> web.Application:
    app = web.Application(
        # Outermost first: the access log and metrics see the final status of every request,
        # and auth/limit errors are rendered in the called API's shape.
        middlewares=[
            edge_middleware,
            request_id_middleware,
            observe_middleware,
            cors_middleware,
            error_middleware,
            audit_middleware,
            capacity_middleware,
            auth_middleware,
            usage_middleware,
        ],
        client_max_size=settings.max_body_bytes,
    )
    m = registry.manager
    broker = Broker(
        endpoint,
        heartbeat_s=m.heartbeat_s,
        liveness=m.liveness,
        hang_timeout_s=m.hang_timeout_s,
        secret=secret,
        extra_endpoints=extra_endpoints,
    )
    manager = ModelManager(registry, broker)
    app[SETTINGS] = settings
    app[BROKER] = broker
    app[MANAGER] = manager
    app[KEYS] = KeyStore(settings.keys_path) if settings.keys_path else None
    app[CACHE_SECRET] = load_secret(paths.home())
    app[LIMITER] = RateLimiter()
    app[EDGE_STATS] = EdgeStats()
    app[METRICS] = Metrics(manager, app[EDGE_STATS])
    app[ACTIVE] = {"n": 0}
    app[LEDGER] = Ledger(paths.home() / "usage.db" if m.usage_ledger else None, m.usage_retention_days)
    app[THROUGHPUT] = Throughput()
    app[MCP] = McpHub(registry.mcp)
    app[TRACING] = from_env()  # None unless the OTEL_EXPORTER_OTLP_* variables ask for traces
    app[SIGNIN] = SignIn(settings, paths.home()) if settings.oidc_issuer else None
    app[AUDIT] = AuditFile(audit_path(), settings.audit_retention_days, settings.audit_max_bytes)
    app.on_response_prepare.append(add_response_headers)
    app.on_response_prepare.append(on_prepare)  # an audited change's entry is written before its answer
    if app[KEYS] is not None:
        app[KEYS].refresh()

    async def lifecycle(app: web.Application):
        await broker.start()
        await manager.start()
        yield
        await manager.close()
        await broker.close()

    app.cleanup_ctx.append(audit_lifecycle)
    app.cleanup_ctx.append(tracing_lifecycle)  # first in, last out: the last requests' spans are exported
    app.cleanup_ctx.append(ledger_lifecycle)  # before the workers' lifecycle: it closes after them
    app.cleanup_ctx.append(lifecycle)
    app.cleanup_ctx.append(throughput_lifecycle)
    app.cleanup_ctx.append(signin_lifecycle)
    app.cleanup_ctx.append(mcp_lifecycle)  # connects in the background: never delays start-up
    install_batches(app)  # the batch runner: after the workers' lifecycle, so it stops first
    app[responses_output.STORE] = OrderedDict()
    for table in route_tables():
        app.add_routes(table)
    for method, path in unlisted_routes(app):
        log.warning("route %s %s has no entry in gateway/web/routes.py: it gets the default policy", method, path)
    return app


def unlisted_routes(app: web.Application) -> list[tuple[str, str]]:
    """App routes with no policy entry (tests/e2e/test_routes.py requires none)."""
    return [
        (r.method, r.resource.canonical)
        for r in app.router.routes()
        if r.resource is not None and r.method != "HEAD" and lookup(r.method, r.resource.canonical) is None
    ]


def route_tables() -> list:
    """Every route table the app serves (tests walk them to reach every route)."""
    modules = (openai_chat, openai_completions, openai_embeddings, rerank, audio, images, anthropic, responses, system)
    modules += (
        observe,
        ollama,
        ollama_models,
        ollama_manage,
        ollama_create,
        tokenize,
        admin,
        audit,
        signin,
        adapters,
        mcp_routes,
        files,
        batches,
        infill,
    )
    return [m.routes for m in modules] + [console_routes]
