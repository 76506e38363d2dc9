"""Authentication and per-key limits, as an aiohttp middleware, plus the model check.

Keys are accepted as `Authorization: Bearer KEY` (OpenAI) and `x-api-key: KEY`
(Anthropic); with sign-in configured (access/signin/), also the console's session cookie
and, if the operator accepts them, the identity provider's access tokens in their place.
Keys are never logged: only their names travel further. Who may call a route,
and whether it counts against its key's limits, is the route's entry in gateway/web/routes.py."""

from __future__ import annotations

import hmac
import logging

from aiohttp import web

from ...shared.errors import ErrorCode, ServiceError
from ...shared.model_sections import CHAT_KINDS, ModelKind
from ..models import adapters
from ..web.routes import ROUTE_FOR_KIND, Access, route_of
from ..web.state import KEYS, LIMITER, MANAGER, SETTINGS
from .batch_caller import LINE_HEADER, batch_owner
from .keys import ApiKey, KeyStore
from .ledger import LEDGER
from .limits import RateLimiter
from .signin import COOKIE, SIGNIN, ProviderError, SignIn, TokenRejected
from .signin.people import is_person

# A cookie rides along with any request a page on another site makes; this header cannot be
# sent by a form or a plain link, and the console's own fetches send it.
CONSOLE_HEADER = "X-Mlxgw-Console"
log = logging.getLogger(__name__)


def presented_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return auth[7:].strip()
    return request.headers.get("x-api-key") or None


def _metrics_token_ok(request: web.Request) -> bool:
    token = request.app[SETTINGS].metrics_token
    given = request.headers.get("Authorization", "")
    return bool(token) and hmac.compare_digest(given.encode(), f"Bearer {token}".encode())


def authenticate(request: web.Request, store: KeyStore) -> ApiKey:
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
    return key


async def identify(request: web.Request, store: KeyStore) -> ApiKey:
    """The caller: a key, else a signed-in console session, else an accepted access token."""
    signin: SignIn | None = request.app.get(SIGNIN)
    given = presented_key(request)
    if signin is None:
        return authenticate(request, store)
    if given is None and COOKIE in request.cookies:
        key = signin.session_key(request.cookies.get(COOKIE))
        if key is None:
            raise ServiceError(ErrorCode.AUTHENTICATION, "the console session ended (signed out, revoked or expired)")
        origin = request.headers.get("Origin")
        if origin is not None and origin != signin.origin(request):  # another site's page, even a same-site one
            raise ServiceError(ErrorCode.PERMISSION, "a console session is used from the console's own pages only")
        if request.method not in ("GET", "HEAD") and request.headers.get(CONSOLE_HEADER) != "1":
            raise ServiceError(ErrorCode.PERMISSION, f"a change made with a console session needs {CONSOLE_HEADER}: 1")
        return key
    if given and given.count(".") == 2 and signin.config.oidc_accept_access_tokens and store.lookup(given) is None:
        try:
            return await signin.token_key(given)
        except TokenRejected as e:
            raise ServiceError(ErrorCode.AUTHENTICATION, f"access token refused: {e}") from None
        except ProviderError as e:
            log.warning("access token not verified: the identity provider: %s", e)
            raise ServiceError(
                ErrorCode.AUTHENTICATION, "access token not verified: the identity provider is unreachable"
            ) from None
    return authenticate(request, store)


async def _admin_route(request: web.Request, handler, store: KeyStore | None):
    if _metrics_token_ok(request):
        return await handler(request)
    if store is None:
        if request.path == "/metrics" and request.app[SETTINGS].metrics_token:
            raise ServiceError(ErrorCode.AUTHENTICATION, "/metrics needs 'Authorization: Bearer METRICS_TOKEN'")
        return await handler(request)
    key = request["key"] = await identify(request, store)
    if not key.admin:
        raise ServiceError(ErrorCode.PERMISSION, f"{request.path} needs an admin key or the metrics token")
    return await handler(request)


@web.middleware
async def auth_middleware(request: web.Request, handler):
    store: KeyStore | None = request.app[KEYS]
    route = route_of(request)
    if route.access is Access.PUBLIC or request.method == "OPTIONS":  # OPTIONS: CORS preflights
        return await handler(request)
    if route.access is Access.OBSERVER:
        return await _admin_route(request, handler, store)
    from_batch, owner = batch_owner(request)
    if from_batch:
        request["background"] = True  # a batch job's request: background priority, ledger api batch:*
        request["batch_line"] = request.headers.get(LINE_HEADER) == "1"  # body.read_json takes its body
    if store is None:
        return await handler(request)
    key = request["key"] = batch_key(store, owner) if from_batch else await identify(request, store)
    if route.access is Access.ADMIN and not key.admin:
        raise ServiceError(ErrorCode.PERMISSION, f"{request.method} {request.path} needs an admin key")
    if route.access is Access.PERSON and not is_person(key):
        raise ServiceError(
            ErrorCode.PERMISSION, f"{request.path} is for a signed-in person (the console's sign-in or an access token)"
        )
    if route.access is Access.MANAGE and not (key.admin or key.manage_models):
        raise ServiceError(
            ErrorCode.PERMISSION, f"{request.method} {request.path} needs an admin key or one with manage_models"
        )
    if not route.metered:
        return await handler(request)
    limiter: RateLimiter = request.app[LIMITER]
    request["ratelimit_headers"] = lambda: limiter.headers(key, store.window_s)
    limiter.start(key, store.window_s)
    try:
        return await handler(request)
    finally:
        # Settled here, after the whole response (a stream included) is over, whether it
        # finished, failed, or was cut by the client or a crash.
        gen = request.get("generation")
        limiter.finish(
            key,
            gen.usage.total_tokens if gen is not None else 0,
            request.get("tpm_reserved", 0),
            rows=request.get("extra_rows", 0),
        )
        _settle_budgets(request, key, gen)


def _settle_budgets(request: web.Request, key: ApiKey, gen) -> None:
    """Release the request's share of its key's daily and monthly budgets and count what it
    used (budgets.TokenBudgets.settle); only for routes the ledger records, whose row the
    budgets then do not count twice."""
    ledger = request.app.get(LEDGER)
    if ledger is None or route_of(request).usage is None or (key.tpd is None and key.tpmo is None):
        return
    used = gen.usage.prompt_tokens + gen.usage.completion_tokens if gen is not None else 0
    ledger.budgets.settle(key.tenant, request.get("budget_reserved", 0), used)


def batch_key(store: KeyStore, owner: str | None) -> ApiKey:
    """The key that owns a batch request, by its identity (ApiKey.tenant), never its name: it
    must still exist and be valid when it runs."""
    store.refresh()
    key = next((k for k in store.keys if k.tenant == owner), None)
    if key is None:
        raise ServiceError(ErrorCode.AUTHENTICATION, "the batch's API key was revoked")
    if key.expired():
        raise ServiceError(ErrorCode.AUTHENTICATION, f"API key '{key.name}' has expired")
    return key


def reserve_tokens(request: web.Request, slot, max_tokens: int | None, n: int = 1) -> None:
    """At admission, set aside the most tokens the request may use (its max_tokens, else
    the model's context) from its key's token budgets (tpm, tpd, tpmo), and count its n
    choices against its concurrency (they run as n rows); settled when the request ends."""
    key = request.get("key")
    if key is None or "ratelimit_headers" not in request:
        return
    store: KeyStore = request.app[KEYS]
    if n > 1:
        request["extra_rows"] = request.get("extra_rows", 0) + request.app[LIMITER].add_rows(key, n - 1)
    ledger = request.app.get(LEDGER)
    budgets = ledger.budgets if ledger is not None and route_of(request).usage is not None else None
    if key.tpm is None and (budgets is None or (key.tpd is None and key.tpmo is None)):
        return
    if max_tokens is None:
        max_tokens = slot.entry.context_length or next(
            (c.info.get("context_length") for c in request.app[MANAGER].conns(slot) if c.info.get("context_length")),
            None,
        )
    request["tpm_reserved"] = request.get("tpm_reserved", 0) + request.app[LIMITER].reserve(
        key, store.window_s, int(max_tokens or 0)
    )
    if budgets is not None:
        request["budget_reserved"] = request.get("budget_reserved", 0) + budgets.reserve(key, int(max_tokens or 0))


def charge_audio_seconds(request: web.Request, seconds: float) -> None:
    """Count an upload's audio seconds against its key's `aspm` (a 429 past it)."""
    key = request.get("key")
    if key is None or "ratelimit_headers" not in request:
        return
    request.app[LIMITER].charge_audio(key, request.app[KEYS].window_s, seconds)


def may_use(request: web.Request, slot) -> bool:
    """Whether the caller's key may use this model (by its name or an alias): model lists
    show a key only these."""
    key = request.get("key")
    return key is None or key.allows(slot.name, *slot.entry.aliases)


def may_manage(request: web.Request, *names: str) -> None:
    """A key granted `manage_models` changes only the models its `models` patterns name (the
    model a copy or create starts from included); an admin key, or no keys at all, any."""
    key = request.get("key")
    for name in names:
        if key is not None and not key.admin and not key.allows(name):
            raise ServiceError(
                ErrorCode.PERMISSION, f"API key '{key.name}' may not manage model '{name}'", param="model"
            )


def resolve_model(request: web.Request, requested: str, kinds: tuple[ModelKind, ...] = CHAT_KINDS):
    """The model slot for a requested name, if the caller's key may use it and the model is
    of a kind this route serves."""
    manager = request.app[MANAGER]
    # A LoRA adapter is called like a model and runs on its base's worker (gateway/models/adapters.py).
    found = adapters.find(manager, requested)
    slot, adapter = found if found is not None else (manager.resolve(requested), None)
    key = request.get("key")
    # The model it resolves to decides, by its name or one of its aliases: a key limited to
    # "smollm2-*" must not reach another model by asking for a name one of its globs matches.
    if adapter is not None:  # its own rule (gateway/models/adapters.py `allowed`)
        permitted = adapters.allowed(key, slot, adapter)
    else:
        permitted = key is None or key.allows(slot.name, *slot.entry.aliases)
    if not permitted:
        raise ServiceError(ErrorCode.PERMISSION, f"API key '{key.name}' may not use model '{requested}'", param="model")
    kind = slot.entry.kind
    if kind not in kinds:
        raise ServiceError(
            ErrorCode.INVALID_REQUEST,
            f"model '{requested}' is {'an' if kind[0] in 'aeiou' else 'a'} {kind} model and is not served here; "
            f"use {ROUTE_FOR_KIND.get(kind, 'another route')}",
            param="model",
        )
    request["model"] = slot.name if adapter is None else adapter.name  # usage and the ledger name the adapter
    request["adapter"] = adapter.name if adapter is not None else None
    return slot
