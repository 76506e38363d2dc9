"""Authentication and per-key limits, as an aiohttp middleware, plus the model check.

Keys are accepted as `Authorization: Bearer KEY` (OpenAI) and `x-api-key: KEY`
(Anthropic). Keys are never logged: only their names travel further."""

from __future__ import annotations

from aiohttp import web
from mlxgw.shared.config import CHAT_KINDS
from mlxgw.shared.errors import ErrorCode, ServiceError

from .keys import KeyStore
from .limits import RateLimiter
from .state import KEYS, LIMITER, MANAGER

# Routes anyone may call: liveness for load balancers and service managers.
PUBLIC_PATHS = {"/health"}
# Control routes need a key but do not count against its rate and concurrency limits: a key
# at its concurrency cap must still be able to cancel its own request.
UNMETERED_PREFIXES = ("/v1/requests/", "/v1/cache", "/v1/status", "/v1/models", "/api/tags", "/api/ps", "/api/version")


def presented_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return auth[7:].strip()
    return request.headers.get("x-api-key") or None


@web.middleware
async def auth_middleware(request: web.Request, handler):
    store: KeyStore | None = request.app[KEYS]
    if store is None or request.path in PUBLIC_PATHS or request.path == "/metrics" or request.method == "OPTIONS":
        return await handler(request)
    given = presented_key(request)
    if not given:
        raise ServiceError(
            ErrorCode.AUTHENTICATION, "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
        )
    key = store.lookup(given)
    if key is None:
        raise ServiceError(ErrorCode.AUTHENTICATION, "invalid API key")
    if key.expired():
        raise ServiceError(ErrorCode.AUTHENTICATION, f"API key '{key.name}' has expired")
    request["key"] = key
    if request.path.startswith(UNMETERED_PREFIXES):
        return await handler(request)
    limiter: RateLimiter = request.app[LIMITER]
    request["ratelimit_headers"] = lambda: limiter.headers(key, store.window_s)
    limiter.start(key, store.window_s)
    tokens = 0
    try:
        return await handler(request)
    finally:
        gen = request.get("generation")
        if gen is not None:
            tokens = gen.usage.total_tokens
        limiter.finish(key, tokens)


# Where each kind of model is served, for the error a wrong route gets.
_ROUTE_FOR_KIND = {
    "chat": "/v1/chat/completions",
    "vision": "/v1/chat/completions",
    "embedding": "/v1/embeddings",
    "rerank": "/v1/rerank",
}


def resolve_model(request: web.Request, requested: str, kinds: tuple[str, ...] = CHAT_KINDS):
    """The model slot for a requested name, if the caller's key may use it and the model is
    of a kind this route serves."""
    slot = request.app[MANAGER].resolve(requested)
    key = request.get("key")
    if key is not None and not key.allows(requested, slot.name):
        raise ServiceError(ErrorCode.PERMISSION, f"API key '{key.name}' may not use model '{requested}'", param="model")
    kind = slot.entry.kind
    if kind not in kinds:
        raise ServiceError(
            ErrorCode.INVALID_REQUEST,
            f"model '{requested}' is {'an' if kind[0] in 'ae' else 'a'} {kind} model and is not served here; "
            f"use {_ROUTE_FOR_KIND.get(kind, 'another route')}",
            param="model",
        )
    request["model"] = slot.name
    return slot
