"""The OpenID provider as the gateway talks to it: discovery from the issuer's
/.well-known/openid-configuration, its signing keys (JWKS, fetched again when a token names
a key not seen yet, at most once a minute), the authorization code exchange, and JWT
verification with PyJWT: signature by the provider's key, issuer, audience, expiry.

Nothing here logs a token, a code or the client secret."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import secrets
import time
from typing import Any

import aiohttp
import jwt

# Asymmetric algorithms only: an HS256 token "signed" with a public key is refused.
ALGORITHMS = ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"]
JWKS_REFRESH_S = 60.0
HTTP_TIMEOUT_S = 10.0
LEEWAY_S = 30  # clock skew between the provider and the gateway
# After a failed discovery, calls fail at once for this long: a flood of JWT-shaped tokens
# while the provider is down must not become a flood of requests to it.
RETRY_AFTER_S = 10.0


class ProviderError(Exception):
    """The provider could not be reached or answered something unusable (a 502 to the user)."""


class TokenRejected(Exception):
    """A token that does not verify; the message says why, never the token."""


def pkce_pair() -> tuple[str, str]:
    """(code_verifier, S256 code_challenge), RFC 7636."""
    verifier = secrets.token_urlsafe(48)
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).decode().rstrip("=")
    return verifier, challenge


class Provider:
    def __init__(self, issuer: str, client_id: str, client_secret: str | None) -> None:
        self.issuer = issuer.rstrip("/")
        self.client_id, self._secret = client_id, client_secret
        self._meta: dict | None = None
        self._failed_at = -RETRY_AFTER_S
        self._keys: dict[str, jwt.PyJWK] = {}
        self._keys_at = -JWKS_REFRESH_S
        self._lock = asyncio.Lock()
        self._http: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S))
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def _get_json(self, url: str, **kwargs) -> dict:
        try:
            async with self._client().get(url, **kwargs) as r:
                if r.status != 200:
                    raise ProviderError(f"{url} answered HTTP {r.status}")
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise ProviderError(f"{url}: {type(e).__name__}") from None
        if not isinstance(data, dict):
            raise ProviderError(f"{url} did not answer a JSON object")
        return data

    async def metadata(self) -> dict:
        """The discovery document (fetched once; a failure is retried on the next call)."""
        if self._meta is None:
            if time.monotonic() - self._failed_at < RETRY_AFTER_S:
                raise ProviderError("its discovery failed moments ago; retrying shortly")
            try:
                meta = await self._discover()
            except ProviderError:
                self._failed_at = time.monotonic()
                raise
            self._meta = meta
        return self._meta

    async def _discover(self) -> dict:
        meta = await self._get_json(f"{self.issuer}/.well-known/openid-configuration")
        if str(meta.get("issuer", "")).rstrip("/") != self.issuer:
            raise ProviderError(f"the discovery document names issuer {meta.get('issuer')!r}, not {self.issuer!r}")
        for field in ("authorization_endpoint", "token_endpoint", "jwks_uri"):
            if not isinstance(meta.get(field), str):
                raise ProviderError(f"the discovery document has no {field}")
        return meta

    async def _key(self, kid: str | None) -> jwt.PyJWK:
        async with self._lock:
            # A key id not seen yet (the provider rotated its keys) fetches the set again, at most
            # once a minute whether or not that works: made-up key ids cannot make us hammer it.
            if kid not in self._keys and time.monotonic() - self._keys_at >= JWKS_REFRESH_S:
                self._keys_at = time.monotonic()
                jwks = await self._get_json((await self.metadata())["jwks_uri"])
                keys = {}
                for raw in jwks.get("keys") or []:
                    if raw.get("use", "sig") == "sig":
                        try:
                            keys[raw.get("kid")] = jwt.PyJWK(raw)
                        except (jwt.PyJWKError, jwt.InvalidKeyError):
                            continue  # a key type this PyJWT cannot use: not one we verify with
                self._keys = keys
        if kid in self._keys:
            return self._keys[kid]
        if kid is None and len(self._keys) == 1:
            return next(iter(self._keys.values()))
        raise TokenRejected("the token is not signed by one of the provider's keys")

    async def verify(self, token: str, audience: str, nonce: str | None = None) -> dict:
        """The claims of a JWT the provider signed for this audience, unexpired; else TokenRejected."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise TokenRejected("not a JWT") from None
        if header.get("alg") not in ALGORITHMS:
            raise TokenRejected(f"algorithm {header.get('alg')!r} is not accepted")
        key = await self._key(header.get("kid"))
        try:
            claims = jwt.decode(
                token,
                key=key,
                algorithms=[header["alg"]],
                audience=audience,
                issuer=(await self.metadata())["issuer"],
                leeway=LEEWAY_S,
                options={"require": ["exp", "iss", "sub", "aud"]},
            )
        except jwt.ExpiredSignatureError:
            raise TokenRejected("the token has expired") from None
        except jwt.PyJWTError as e:
            raise TokenRejected(f"the token does not verify: {e}") from None
        given = claims.get("nonce")
        if nonce is not None and not (isinstance(given, str) and hmac.compare_digest(given.encode(), nonce.encode())):
            raise TokenRejected("the ID token's nonce is not this sign-in's")
        return claims

    async def authorization_url(self, redirect_uri: str, scopes: list[str], state: str, nonce: str, challenge: str):
        from urllib.parse import urlencode

        query = {
            "response_type": "code",
            "client_id": self.client_id,
            "redirect_uri": redirect_uri,
            "scope": " ".join(scopes),
            "state": state,
            "nonce": nonce,
            "code_challenge": challenge,
            "code_challenge_method": "S256",
        }
        endpoint = (await self.metadata())["authorization_endpoint"]
        return f"{endpoint}{'&' if '?' in endpoint else '?'}{urlencode(query)}"

    async def exchange(self, code: str, redirect_uri: str, verifier: str) -> dict:
        """The token response for an authorization code (the client authenticates with its secret)."""
        form = {"grant_type": "authorization_code", "code": code, "redirect_uri": redirect_uri}
        form["code_verifier"] = verifier
        auth = aiohttp.BasicAuth(self.client_id, self._secret) if self._secret else None
        if auth is None:
            form["client_id"] = self.client_id  # a public client: PKCE alone
        url = (await self.metadata())["token_endpoint"]
        try:
            async with self._client().post(url, data=form, auth=auth) as r:
                data: Any = await r.json(content_type=None)
                status = r.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise ProviderError(f"the token endpoint: {type(e).__name__}") from None
        if status != 200 or not isinstance(data, dict) or not isinstance(data.get("id_token"), str):
            error = data.get("error") if isinstance(data, dict) else None
            raise ProviderError(f"the token endpoint refused the code (HTTP {status}, {error or 'no id_token'})")
        return data

    async def userinfo(self, access_token: str) -> dict:
        """The userinfo endpoint's claims ({} when the provider has none): where providers put
        scope claims such as groups that the ID token leaves out."""
        url = (await self.metadata()).get("userinfo_endpoint")
        if not isinstance(url, str) or not access_token:
            return {}
        return await self._get_json(url, headers={"Authorization": f"Bearer {access_token}"})
