"""Which prefix-cache namespace a request's prompt belongs to.

A prefix cache shared by every key tells any key, through `cached_tokens` or its time to first
token, what another key sent; so a key's prompts are cached for that key alone unless the
operator puts keys in one cache group (`cache_group` on the key, or the gateway's
`default_cache_group`), and a request may narrow its namespace further with vLLM's
`cache_salt`. Without keys (the local quick start) every request is in one namespace.

The worker sees an opaque digest only (worker/model/cache/scopes.py): an HMAC under a secret
kept in MLXGW_HOME, so a group's name or a key's identity cannot be turned into another
namespace's digest off the machine, and the disk tier's blocks stay reachable across restarts."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from .keys import ApiKey

SECRET_FILE = "cache-namespace.key"


def load_secret(home: Path) -> bytes:
    """The gateway's namespace secret, made once (0600) and kept."""
    path = home / SECRET_FILE
    try:
        return bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError):
        pass
    home.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return bytes.fromhex(path.read_text().strip())


def cache_group(key: ApiKey | None, default_group: str | None) -> str | None:
    """The key's cache group as the operator set it; None: the key's own (or, keyless, the base)."""
    if key is None:
        return None
    return key.cache_group or default_group


def cache_namespace(secret: bytes, key: ApiKey | None, default_group: str | None, salt: str | None) -> str | None:
    """The request's namespace digest; None: the base namespace (no keys, no salt)."""
    group = cache_group(key, default_group)
    if key is None:
        label = ""
    elif group is not None:
        label = "group:" + group
    else:
        label = "key:" + key.tenant
    if salt is not None:
        label += "\0salt:" + salt
    if not label:
        return None
    return hmac.new(secret, label.encode(), hashlib.sha256).hexdigest()[:32]
