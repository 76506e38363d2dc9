"""Who a signed-in person is to the gateway: their provider's claims, their groups mapped to
roles (admin, manage models) and to a cache group, and the identity the rest of the gateway
(limits, ledger, audit trail) sees, an ApiKey that exists for the session only."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from ....shared.gateway_config import GatewayConfig
from ..keys import CACHE_GROUP_RE, ApiKey

_UNSAFE = re.compile(r"[^A-Za-z0-9._@-]+")
MAX_GROUPS = 200  # a provider's list beyond this is cut: only configured groups matter


@dataclass(frozen=True)
class Person:
    subject: str  # the provider's `sub`: stable, what personal keys are owned by
    handle: str  # a readable name: email, else preferred_username, else sub (letters, digits, ._@-)
    groups: tuple[str, ...]
    admin: bool
    manage_models: bool
    cache_group: str | None

    def as_key(self, issuer: str) -> ApiKey:
        """The identity of a session or an access token: its own limits window and tenant,
        the same for both and across sign-ins, never a stored key's."""
        digest = hashlib.sha256(f"mlxgw-person\0{issuer}\0{self.subject}".encode()).hexdigest()
        return ApiKey(
            name=f"sso:{self.handle}",
            sha256=digest,
            admin=self.admin,
            manage_models=self.manage_models,
            cache_group=self.cache_group,
            owner=self.handle,
            owner_sub=self.subject,
        )

    def public(self) -> dict:
        return {
            "subject": self.subject,
            "name": self.handle,
            "groups": list(self.groups),
            "admin": self.admin,
            "manage_models": self.manage_models,
            "cache_group": self.cache_group,
        }


def groups_of(claims: dict, claim: str) -> tuple[str, ...]:
    value = claims.get(claim)
    if isinstance(value, str):
        value = value.split()
    if not isinstance(value, list):
        return ()
    return tuple(g for g in value[:MAX_GROUPS] if isinstance(g, str) and g)


def handle_of(claims: dict) -> str:
    for claim in ("email", "preferred_username", "sub"):
        value = claims.get(claim)
        if isinstance(value, str) and value.strip():
            return _UNSAFE.sub("-", value.strip())[:48].strip("-") or "person"
    return "person"


def person_from_claims(claims: dict, config: GatewayConfig) -> Person:
    """The person the verified claims name, with the roles their groups give."""
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub:
        raise ValueError("the provider's token names no subject ('sub')")
    groups = groups_of(claims, config.oidc_groups_claim)
    mine = set(groups)
    cache_group = next((g for g in config.oidc_cache_groups if g in mine and CACHE_GROUP_RE.match(g)), None)
    return Person(
        subject=sub,
        handle=handle_of(claims),
        groups=groups,
        admin=bool(mine & set(config.oidc_admin_groups)),
        manage_models=bool(mine & set(config.oidc_manage_models_groups)),
        cache_group=cache_group,
    )


def is_person(key: ApiKey) -> bool:
    """A signed-in person (a session or an access token), not a stored key: stored keys'
    names cannot hold ':' (access/key_admin.py), so no key can pass for one."""
    return key.name.startswith("sso:") and key.owner_sub is not None
