"""Sign-in routes (gateway/access/signin/): the console's redirect to the identity provider
and back, signing out, who the caller is, a signed-in person's own personal keys, and the
admins' list and revocation of console sessions.

A browser route answers with a redirect or a short plain-text page; the others in the
OpenAI error shape. No token, code or cookie value is ever logged or echoed."""

from __future__ import annotations

import asyncio
import re

from aiohttp import web

from ....shared.errors import ErrorCode, ServiceError
from ...access.audit import note, record_event
from ...access.auth import CONSOLE_HEADER
from ...access.key_admin import create_key, list_entries, revoke_key
from ...access.signin import COOKIE, LOGIN_COOKIE, LOGIN_TTL_S, SIGNIN, ProviderError, SignIn, TokenRejected
from ...access.signin.people import is_person
from .keys import _edit, _json_object, _keys_path, end_queued_requests, require_admin

routes = web.RouteTableDef()
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,14}$")
MAX_PERSONAL_KEYS = 20


def _signin(request: web.Request) -> SignIn:
    signin = request.app.get(SIGNIN)
    if signin is None:
        raise ServiceError(ErrorCode.NOT_FOUND, "sign-in is not configured (gateway: oidc_issuer in models.yaml)")
    return signin


def _page(status: int, text: str) -> web.Response:
    return web.Response(
        status=status,
        text=text + "\n\nBack to the console: /ui/\n",
        content_type="text/plain",
        headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"},
    )


def _secure(request: web.Request, signin: SignIn) -> bool:
    return (signin.config.public_url or f"{request.scheme}://").startswith("https://")


@routes.get("/auth/info")
async def info(request: web.Request) -> web.Response:
    """What the console's sign-in page offers (public: the page shows it before anyone signs in)."""
    signin = request.app.get(SIGNIN)
    return web.json_response({"oidc": signin is not None, "login_url": "/auth/login" if signin else None})


@routes.get("/auth/login")
async def login(request: web.Request) -> web.Response:
    signin = _signin(request)
    try:
        url, state = await signin.begin(request)
    except ProviderError as e:
        return _page(502, f"The identity provider could not be reached: {e}")
    response = web.HTTPFound(url)
    # Lax: the provider's redirect back is a top-level navigation from its site, which must carry it.
    response.set_cookie(
        LOGIN_COOKIE,
        state,
        max_age=int(LOGIN_TTL_S),
        path="/auth",
        httponly=True,
        samesite="Lax",
        secure=_secure(request, signin),
    )
    return response


@routes.get("/auth/callback")
async def callback(request: web.Request) -> web.Response:
    signin = _signin(request)
    if "error" in request.query:
        return _page(400, f"The identity provider refused the sign-in: {request.query['error'][:100]}")
    state, code = request.query.get("state", ""), request.query.get("code", "")
    if not state or not code or request.cookies.get(LOGIN_COOKIE) != state:
        return _page(400, "This sign-in was not started in this browser, or it is incomplete; start again.")
    try:
        person = await signin.finish(state, code)
    except TokenRejected as e:
        return _page(401, f"Sign-in refused: {e}")
    except ProviderError as e:
        return _page(502, f"The identity provider could not complete the sign-in: {e}")
    cookie = signin.sessions.create(person)
    await asyncio.to_thread(signin.sessions.save)
    actor = {"kind": "person", "name": person.handle, "subject": person.subject}
    await record_event(request.app, "signin", person.handle, person.public(), actor=actor)
    response = web.HTTPFound("/ui/")
    response.set_cookie(
        COOKIE,
        cookie,
        max_age=int(signin.sessions.ttl_s),
        path="/",
        httponly=True,
        samesite="Strict",
        secure=_secure(request, signin),
    )
    response.del_cookie(LOGIN_COOKIE, path="/auth")
    return response


@routes.post("/auth/logout")
async def logout(request: web.Request) -> web.Response:
    """Ends the session at once (the cookie no longer opens anything, even if kept)."""
    signin = _signin(request)
    if request.headers.get(CONSOLE_HEADER) != "1":
        raise ServiceError(ErrorCode.PERMISSION, f"signing out needs {CONSOLE_HEADER}: 1")
    ended = signin.sessions.revoke_cookie(request.cookies.get(COOKIE))
    if ended:
        await asyncio.to_thread(signin.sessions.save)
    response = web.json_response({"object": "session.deleted", "deleted": ended})
    response.del_cookie(COOKIE, path="/")
    return response


@routes.get("/v1/me")
async def me(request: web.Request) -> web.Response:
    """Who the caller is: a signed-in person (with their groups and roles) or a key."""
    key = request.get("key")
    if key is None:
        return web.json_response({"object": "identity", "kind": "open", "admin": True})
    out = {"object": "identity", "kind": "person" if is_person(key) else "key", "name": key.name}
    out |= {"admin": key.admin, "manage_models": key.manage_models, "cache_group": key.cache_group}
    if key.owner_sub is not None:
        out |= {"person": key.owner, "subject": key.owner_sub}
    return web.json_response(out)


def _person(request: web.Request):
    """The signed-in person (auth checked it, Access.PERSON); a keyless gateway has none."""
    key = request.get("key")
    if key is None or not is_person(key):
        raise ServiceError(ErrorCode.PERMISSION, "personal keys are for a signed-in person; this gateway has no keys")
    return key


@routes.get("/v1/me/keys")
async def my_keys(request: web.Request) -> web.Response:
    key = _person(request)
    entries = await asyncio.to_thread(list_entries, _keys_path(request), key.owner_sub)
    return web.json_response({"object": "list", "data": entries})


@routes.post("/v1/me/keys")
async def create_mine(request: web.Request) -> web.Response:
    """A personal key: plain (no admin, no model management), the person's cache group,
    named `LABEL.PERSON` and owned by their subject; shown once."""
    key = _person(request)
    body = await _json_object(request)
    label = body.get("label")
    if not isinstance(label, str) or not _LABEL_RE.match(label):
        raise ServiceError(
            ErrorCode.INVALID_REQUEST, "'label' must be 1-15 letters, digits, _ or - and start with one", param="label"
        )
    name = f"{label}.{key.owner}"
    changes = {"cache_group": key.cache_group} if key.cache_group else {}
    owner = {"owner": key.owner, "owner_sub": key.owner_sub}
    note(request, target=name, label=label)
    new, entry = await _edit(request, create_key, _keys_path(request), name, changes, owner, MAX_PERSONAL_KEYS)
    return web.json_response({"object": "api_key", **entry, "key": new}, status=201)


@routes.delete("/v1/me/keys/{name}")
async def revoke_mine(request: web.Request) -> web.Response:
    key = _person(request)
    name = request.match_info["name"]
    await _edit(request, revoke_key, _keys_path(request), name, key.owner_sub)
    ended = end_queued_requests(request.app, name)
    return web.json_response({"object": "api_key.deleted", "name": name, "deleted": True, "queued_ended": ended})


@routes.get("/v1/sessions")
async def sessions(request: web.Request) -> web.Response:
    require_admin(request)
    signin = _signin(request)
    return web.json_response({"object": "list", "data": [s.public() for s in signin.sessions.live()]})


@routes.delete("/v1/sessions/{session_id}")
async def revoke_session(request: web.Request) -> web.Response:
    require_admin(request)
    signin = _signin(request)
    session_id = request.match_info["session_id"]
    note(request, target=session_id)
    if not signin.sessions.revoke(session_id):
        raise ServiceError(ErrorCode.NOT_FOUND, f"no live session {session_id!r}")
    await asyncio.to_thread(signin.sessions.save)
    return web.json_response({"object": "session.deleted", "id": session_id, "deleted": True})
