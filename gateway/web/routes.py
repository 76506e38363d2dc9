"""Every HTTP route the gateway serves, listed once with its policy.

Each entry says, for one path and its methods: the API family whose error shape its
errors take, who may call it (public, any key, an admin key, or an admin key or the
metrics token), whether the concurrent-request ceiling applies to it, whether it counts
against its key's rate and concurrency limits, its name in the usage ledger (None: not a
usage row), and which model kinds it is the route for. The middlewares read their policy
here (app.error_middleware, auth, ledger, observe.capacity_middleware): a route has no
policy of its own anywhere else. tests/e2e/test_routes.py fails when an app route has no entry,
or an entry no route; a request no route matches (a 404, a 405) gets `unlisted`'s policy.

Paths are aiohttp's canonical form (`/v1/models/{name}`: the variable's regex left out);
GET entries cover HEAD, as aiohttp's GET routes do.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from aiohttp import web

from ...shared.model_sections import ModelKind


class Family(str, Enum):
    """The error shape of an API (gateway/web/errors.py renders each)."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"
    OLLAMA = "ollama"


class Access(str, Enum):
    """Who may call a route when the gateway runs with keys (without keys everything is open,
    except that /metrics asks for the metrics token when one is set)."""

    PUBLIC = "public"  # anyone: liveness checks, the console's static files
    KEY = "key"  # any valid key
    ADMIN = "admin"  # an admin key
    MANAGE = "manage"  # an admin key or one granted `manage_models` (the registry's model management)
    OBSERVER = "observer"  # an admin key or the metrics token: these show every user's traffic
    PERSON = "person"  # a signed-in person (a console session, an access token): their own keys


@dataclass(frozen=True)
class Route:
    methods: tuple[str, ...]
    path: str
    family: Family = Family.OPENAI
    access: Access = Access.KEY
    capped: bool = True  # under the concurrent-request ceiling (429 past it)
    metered: bool = True  # counts against its key's rate and concurrency limits
    usage: str | None = None  # its API's name in the usage ledger; None: not recorded there
    serves_kinds: tuple[ModelKind, ...] = ()  # model kinds this is *the* route for (named in errors)
    audit: str | None = None  # its action in the audit trail (gateway/access/audit): every answer recorded


# Control routes: a key at its concurrency cap must still be able to see models, cancel its
# own request or read the cache, and an operator must reach them when the server is full.
_CONTROL = {"capped": False, "metered": False}
_OLLAMA = Family.OLLAMA
_ANTHROPIC = Family.ANTHROPIC
_MANAGE = {"access": Access.MANAGE, "metered": False}  # the registry's model management

ROUTES: tuple[Route, ...] = (
    # generation and encoders: usage rows, capped, metered
    Route(("POST",), "/v1/chat/completions", usage="chat", serves_kinds=(ModelKind.CHAT, ModelKind.VISION)),
    Route(("POST",), "/v1/completions", usage="completions"),
    Route(("POST",), "/v1/responses", usage="responses"),
    Route(("POST",), "/v1/messages", _ANTHROPIC, usage="messages"),
    Route(("POST",), "/v1/messages/count_tokens", _ANTHROPIC, usage="count_tokens"),
    Route(("POST",), "/v1/embeddings", usage="embeddings", serves_kinds=(ModelKind.EMBEDDING,)),
    Route(("POST",), "/v1/rerank", usage="rerank", serves_kinds=(ModelKind.RERANK,)),
    Route(("POST",), "/v2/rerank", usage="/v2/rerank"),
    Route(("POST",), "/v1/audio/transcriptions", usage="/v1/audio/transcriptions", serves_kinds=(ModelKind.AUDIO,)),
    Route(("POST",), "/v1/audio/translations", usage="/v1/audio/translations"),
    Route(("POST",), "/v1/audio/speech", usage="/v1/audio/speech", serves_kinds=(ModelKind.SPEECH,)),
    Route(("POST",), "/v1/images/generations", usage="/v1/images/generations", serves_kinds=(ModelKind.IMAGE,)),
    Route(("POST",), "/v1/images/edits", usage="/v1/images/edits"),
    Route(("POST",), "/tokenize", usage="/tokenize"),
    Route(("POST",), "/detokenize", usage="/detokenize"),
    # llama.cpp's server API for editors (llama.vscode, llama.vim): fill in the middle, plain prompt
    Route(("POST",), "/infill", usage="/infill"),
    Route(("POST",), "/completion", usage="/completion"),
    # the Ollama API
    Route(("POST",), "/api/chat", _OLLAMA, usage="/api/chat"),
    Route(("POST",), "/api/generate", _OLLAMA, usage="/api/generate"),
    Route(("POST",), "/api/embed", _OLLAMA, usage="/api/embed"),
    Route(("POST",), "/api/embeddings", _OLLAMA, usage="/api/embeddings"),
    Route(("POST",), "/api/show", _OLLAMA, usage="/api/show"),
    Route(("GET",), "/api/tags", _OLLAMA, metered=False),  # Ollama clients poll these
    Route(("GET",), "/api/ps", _OLLAMA, metered=False),
    Route(("GET",), "/api/version", _OLLAMA, metered=False),
    # Ollama's model management (gateway/api/ollama/manage.py): the operator's, recorded
    Route(("POST",), "/api/pull", _OLLAMA, **_MANAGE, usage="/api/pull", audit="models.pull"),
    Route(("DELETE",), "/api/delete", _OLLAMA, **_MANAGE, usage="/api/delete", audit="models.delete"),
    Route(("POST",), "/api/copy", _OLLAMA, **_MANAGE, usage="/api/copy", audit="models.copy"),
    Route(("POST",), "/api/create", _OLLAMA, **_MANAGE, usage="/api/create", audit="models.create"),
    # models, requests, caches
    Route(("GET",), "/"),  # Claude Code checks the server is there
    Route(("GET",), "/v1/models", **_CONTROL),
    Route(("GET",), "/v1/models/{model_id}", **_CONTROL),
    Route(("POST",), "/v1/requests/{rid}/cancel", **_CONTROL),  # the handler checks whose request
    Route(("GET",), "/v1/cache/stats", access=Access.ADMIN, **_CONTROL),  # every model's reuse
    Route(("DELETE",), "/v1/cache", access=Access.ADMIN, audit="cache.clear", **_CONTROL),
    # liveness and what every user's traffic looks like
    Route(("GET",), "/health", access=Access.PUBLIC, capped=False),
    Route(("GET",), "/metrics", access=Access.OBSERVER, **_CONTROL),
    Route(("GET",), "/v1/status", access=Access.OBSERVER, **_CONTROL),
    Route(("GET",), "/v1/status/throughput", access=Access.ADMIN, **_CONTROL),  # every model's tokens/s
    Route(("GET",), "/v1/status/requests", access=Access.ADMIN, **_CONTROL),
    # administration
    Route(("GET",), "/v1/keys", access=Access.ADMIN, metered=False),
    Route(("POST",), "/v1/keys", access=Access.ADMIN, metered=False, audit="keys.create"),
    Route(("PATCH",), "/v1/keys/{name}", access=Access.ADMIN, metered=False, audit="keys.update"),
    Route(("DELETE",), "/v1/keys/{name}", access=Access.ADMIN, metered=False, audit="keys.revoke"),
    Route(("GET",), "/v1/usage", access=Access.ADMIN, metered=False),
    Route(("GET",), "/v1/audit", access=Access.ADMIN, **_CONTROL),  # who changed what (gateway/api/admin/audit.py)
    Route(("POST",), "/v1/models/{name}/load", access=Access.ADMIN, audit="models.load", **_CONTROL),
    Route(("POST",), "/v1/models/{name}/unload", access=Access.ADMIN, audit="models.unload", **_CONTROL),
    Route(("POST",), "/v1/models/{name}/pin", access=Access.ADMIN, audit="models.pin", **_CONTROL),
    # LoRA adapters (gateway/api/admin/adapters.py)
    Route(("POST",), "/v1/adapters", access=Access.ADMIN, audit="adapters.add", **_CONTROL),
    Route(("DELETE",), "/v1/adapters/{name}", access=Access.ADMIN, audit="adapters.remove", **_CONTROL),
    # the Batch and Files API: the jobs' requests are metered one by one as the runner sends them;
    # an upload and a batch's creation are metered as requests too (rpm, concurrency)
    Route(("POST",), "/v1/files"),
    Route(("GET",), "/v1/files", metered=False),
    Route(("GET", "DELETE"), "/v1/files/{file_id}", metered=False),
    Route(("GET",), "/v1/files/{file_id}/content", metered=False),
    Route(("POST",), "/v1/batches"),
    Route(("GET",), "/v1/batches", metered=False),
    Route(("GET",), "/v1/batches/{batch_id}", metered=False),
    Route(("POST",), "/v1/batches/{batch_id}/cancel", metered=False),
    # MCP servers run by the gateway
    Route(("GET",), "/v1/mcp/servers"),
    Route(("GET",), "/v1/mcp/tools"),
    Route(("POST",), "/v1/mcp/execute", access=Access.ADMIN, usage="/v1/mcp/execute"),  # runs a tool, no model
    # sign-in with the team's identity provider (gateway/api/admin/signin.py): the redirects are
    # public; a person's own keys need a signed-in person, the sessions an admin
    Route(("GET",), "/auth/info", access=Access.PUBLIC, **_CONTROL),
    Route(("GET",), "/auth/login", access=Access.PUBLIC, **_CONTROL),
    Route(("GET",), "/auth/callback", access=Access.PUBLIC, **_CONTROL),
    Route(("POST",), "/auth/logout", access=Access.PUBLIC, **_CONTROL),
    Route(("GET",), "/v1/me", **_CONTROL),
    Route(("GET",), "/v1/me/keys", access=Access.PERSON, metered=False),
    Route(("POST",), "/v1/me/keys", access=Access.PERSON, metered=False, audit="keys.create"),
    Route(("DELETE",), "/v1/me/keys/{name}", access=Access.PERSON, metered=False, audit="keys.revoke"),
    Route(("GET",), "/v1/sessions", access=Access.ADMIN, metered=False),
    Route(("DELETE",), "/v1/sessions/{session_id}", access=Access.ADMIN, metered=False, audit="sessions.revoke"),
    # the console: the page is public, what it shows comes from admin routes
    Route(("GET",), "/ui", access=Access.PUBLIC),
    Route(("GET",), "/ui/{name}", access=Access.PUBLIC),
)

# Paths no route matches answer in the shape of the API their prefix belongs to (an Anthropic
# client's typo gets an Anthropic error); tests/e2e/test_routes.py checks every entry agrees.
_FAMILY_PREFIXES = (("/api/", Family.OLLAMA), ("/v1/messages", Family.ANTHROPIC))

_BY_METHOD_PATH: dict[tuple[str, str], Route] = {(m, r.path): r for r in ROUTES for m in r.methods}
ROUTE_FOR_KIND: dict[ModelKind, str] = {kind: r.path for r in ROUTES for kind in r.serves_kinds}
_REQUEST_KEY = "route_policy"


def family_of(path: str) -> Family:
    """The error shape for a path, before or without routing (the HTTP edge, 404s)."""
    for prefix, family in _FAMILY_PREFIXES:
        if path.startswith(prefix):
            return family
    return Family.OPENAI


def unlisted(path: str, method: str) -> Route:
    """The policy of a request no route matches: a key when keys are on, capped and metered
    like any API call, not a usage row."""
    return Route((method,), path, family_of(path))


def lookup(method: str, canonical: str) -> Route | None:
    return _BY_METHOD_PATH.get(("GET" if method == "HEAD" else method, canonical))


def route_of(request: web.Request) -> Route:
    """The policy of the route that matched this request (looked up once per request)."""
    route = request.get(_REQUEST_KEY)
    if route is None:
        resource = request.match_info.route.resource
        route = lookup(request.method, resource.canonical) if resource is not None else None
        request[_REQUEST_KEY] = route = route or unlisted(request.path, request.method)
    return route
