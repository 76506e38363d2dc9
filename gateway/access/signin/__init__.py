"""Sign-in with the team's OpenID Connect provider.

The console signs a person in with the authorization code flow and PKCE (`begin`, then
`finish` on the redirect back); the session that follows is a cookie (sessions.py). The
person's groups give their roles and cache group (people.py); to the rest of the gateway a
session, or an accepted access token, is an ApiKey that carries the person (`owner`), so
limits, the ledger and the audit trail name them. Configured by the gateway: section's
oidc_* fields; without an issuer nothing here runs and keys work as before."""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from ....shared.gateway_config import GatewayConfig
from ..cache_scope import load_secret
from ..keys import ApiKey
from .people import Person, person_from_claims
from .provider import Provider, ProviderError, TokenRejected, pkce_pair
from .sessions import COOKIE, Sessions

log = logging.getLogger(__name__)

__all__ = ["SIGNIN", "COOKIE", "LOGIN_COOKIE", "SignIn", "ProviderError", "TokenRejected", "signin_lifecycle"]

LOGIN_COOKIE = "mlxgw_login"  # binds a sign-in's redirect back to the browser that started it
LOGIN_TTL_S = 600.0
MAX_PENDING = 1000
SECRET_ENV = "MLXGW_OIDC_CLIENT_SECRET"


@dataclass
class _Pending:
    verifier: str
    nonce: str
    redirect_uri: str
    started: float


class SignIn:
    def __init__(self, config: GatewayConfig, home: Path) -> None:
        self.config = config
        secret = os.environ.get(SECRET_ENV) or config.oidc_client_secret
        self.provider = Provider(config.oidc_issuer or "", config.oidc_client_id or "", secret)
        self.audience = config.oidc_audience or config.oidc_client_id or ""
        cookie_secret = load_secret(home) + b"\0sessions"  # the namespace secret, used for another purpose
        self.sessions = Sessions(cookie_secret, config.oidc_session_hours * 3600, home / "sessions.json")
        self._pending: dict[str, _Pending] = {}

    def base_url(self, request: web.Request) -> str:
        """The gateway as browsers reach it (public_url, else the request's own host)."""
        return (self.config.public_url or f"{request.scheme}://{request.host}").rstrip("/")

    def origin(self, request: web.Request) -> str:
        parts = urlsplit(self.base_url(request))
        return f"{parts.scheme}://{parts.netloc}"

    def redirect_uri(self, request: web.Request) -> str:
        return self.base_url(request) + "/auth/callback"

    async def begin(self, request: web.Request) -> tuple[str, str]:
        """(the provider's authorization URL, the state to bind to the browser)."""
        now = time.time()
        for state in [s for s, p in self._pending.items() if now - p.started > LOGIN_TTL_S]:
            del self._pending[state]
        while len(self._pending) >= MAX_PENDING:
            self._pending.pop(next(iter(self._pending)))
        state, nonce = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        verifier, challenge = pkce_pair()
        pending = _Pending(verifier, nonce, self.redirect_uri(request), now)
        scopes = self.config.oidc_scopes
        url = await self.provider.authorization_url(pending.redirect_uri, scopes, state, nonce, challenge)
        self._pending[state] = pending
        return url, state

    async def finish(self, state: str, code: str) -> Person:
        """The person a redirect back names, checked end to end: the state this gateway
        issued (once), the code exchanged with the PKCE verifier, the ID token verified (and
        its nonce), the userinfo's claims for the same subject merged in."""
        pending = self._pending.pop(state, None)
        if pending is None or time.time() - pending.started > LOGIN_TTL_S:
            raise TokenRejected("this sign-in is unknown or too old; start again")
        tokens = await self.provider.exchange(code, pending.redirect_uri, pending.verifier)
        claims = await self.provider.verify(tokens["id_token"], self.provider.client_id, nonce=pending.nonce)
        extra = await self.provider.userinfo(str(tokens.get("access_token") or ""))
        if extra and extra.get("sub") != claims["sub"]:
            raise TokenRejected("the userinfo names another subject than the ID token")
        try:
            return person_from_claims({**extra, **claims, **_groups(extra, claims, self.config)}, self.config)
        except ValueError as e:
            raise TokenRejected(str(e)) from None

    def session_key(self, cookie: str | None) -> ApiKey | None:
        session = self.sessions.lookup(cookie)
        return session.person.as_key(self.provider.issuer) if session is not None else None

    async def token_key(self, token: str) -> ApiKey:
        """The identity an access token carries, if the provider signed it for this gateway."""
        claims = await self.provider.verify(token, self.audience)
        try:
            return person_from_claims(claims, self.config).as_key(self.provider.issuer)
        except ValueError as e:
            raise TokenRejected(str(e)) from None


def _groups(extra: dict, claims: dict, config: GatewayConfig) -> dict:
    """The groups claim from whichever of the ID token and the userinfo has it."""
    name = config.oidc_groups_claim
    value = claims.get(name, extra.get(name))
    return {} if value is None else {name: value}


SIGNIN = web.AppKey("signin", object)  # SignIn | None


async def signin_lifecycle(app: web.Application):
    yield
    signin = app.get(SIGNIN)
    if signin is not None:
        await signin.provider.close()
