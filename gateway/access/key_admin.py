"""Creating, changing and revoking API keys in the keys file: one implementation shared by
`mlxgw keys` and the gateway's /v1/keys, each edit under the file's lock (keys.locked_file).

Entries handed out by `public_entry` never carry the hash; the key itself exists only in the
return value of `create_key`, shown once."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

from .keys import (
    KeysFileError,
    check_cache_group,
    check_latency_class,
    check_min_priority,
    check_weight,
    hash_key,
    locked_file,
    new_key,
)

LIMIT_FIELDS = ("rpm", "tpm", "tpd", "tpmo", "aspm", "max_concurrent")
SHARE_FIELDS = ("weight", "min_priority")  # fair share and granted priority (None: the defaults)
GRANT_FIELDS = ("admin", "manage_models")  # true or absent
EDITABLE_FIELDS = (*LIMIT_FIELDS, *SHARE_FIELDS, "models", "expires", *GRANT_FIELDS, "cache_group", "latency_class")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")


class KeyEditError(ValueError):
    """A refused edit; `kind` is "invalid", "exists" or "not_found"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _check_value(field: str, value):
    if value is None:
        return None
    if field in LIMIT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise KeyEditError("invalid", f"'{field}' must be a non-negative integer or null")
        return value
    if field in SHARE_FIELDS:
        try:
            return check_weight(value) if field == "weight" else check_min_priority(value)
        except ValueError as e:
            raise KeyEditError("invalid", str(e)) from None
    if field == "models":
        if isinstance(value, str):
            value = [m.strip() for m in value.split(",") if m.strip()]
        if not isinstance(value, list) or not all(isinstance(m, str) and m for m in value):
            raise KeyEditError("invalid", "'models' must be a list of model names or globs")
        return value or None
    if field == "expires":
        try:
            parsed = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        except ValueError:
            raise KeyEditError("invalid", "'expires' must be an ISO time such as 2027-01-01T00:00:00Z") from None
        parsed = parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)
        return parsed.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    if field == "cache_group":
        try:
            return check_cache_group(value)
        except ValueError as e:
            raise KeyEditError("invalid", str(e)) from None
    if field == "latency_class":
        try:
            return check_latency_class(value)
        except ValueError as e:
            raise KeyEditError("invalid", str(e)) from None
    if field in GRANT_FIELDS:
        if not isinstance(value, bool):
            raise KeyEditError("invalid", f"'{field}' must be true or false")
        return value or None
    raise KeyEditError("invalid", f"unknown field {field!r} (known: {', '.join(EDITABLE_FIELDS)})")


def _apply(entry: dict, changes: dict) -> None:
    for field, value in changes.items():
        checked = _check_value(field, value)
        if checked is None:
            entry.pop(field, None)
        else:
            entry[field] = checked


def public_entry(entry: dict) -> dict:
    """What may be shown about a key: everything but its hash."""
    out = {"name": entry["name"], **{grant: bool(entry.get(grant, False)) for grant in GRANT_FIELDS}}
    for field in (*LIMIT_FIELDS, "models", "expires", "created", "cache_group", "latency_class", "owner"):
        out[field] = entry.get(field)
    for field, default in (("weight", 1.0), ("min_priority", 0)):
        out[field] = entry.get(field, default)
    return out


def create_key(
    path: Path, name: str, changes: dict, owner: dict | None = None, max_owned: int | None = None
) -> tuple[str, dict]:
    """A new key (returned once) stored as its hash, with the given limits; `owner` (owner,
    owner_sub) makes it a signed-in person's personal key, of which they hold at most max_owned."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise KeyEditError("invalid", "'name' must be 1-64 letters, digits or ._@- and start with a letter or digit")
    key = new_key()
    entry = {
        "name": name,
        "sha256": hash_key(key),
        "created": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    _apply(entry, changes)
    entry.update(owner or {})
    try:
        with locked_file(path) as data:
            if any(k.get("name") == name for k in data.get("keys") or []):
                raise KeyEditError("exists", f"a key named {name!r} exists; revoke it first")
            if owner and max_owned is not None and len(_owned(data, owner["owner_sub"])) >= max_owned:
                raise KeyEditError("invalid", f"you hold {max_owned} personal keys already; revoke one first")
            data.setdefault("keys", []).append(entry)
    except KeysFileError as e:
        raise KeyEditError("invalid", str(e)) from None
    return key, public_entry(entry)


def update_key(path: Path, name: str, changes: dict) -> dict:
    """Change a key's limits, models, expiry or admin flag; null clears a field."""
    try:
        with locked_file(path) as data:
            entry = next((k for k in data.get("keys") or [] if k.get("name") == name), None)
            if entry is None:
                raise KeyEditError("not_found", f"no key named {name!r}")
            _apply(entry, changes)
    except KeysFileError as e:
        raise KeyEditError("invalid", str(e)) from None
    return public_entry(entry)


def revoke_key(path: Path, name: str, owner_sub: str | None = None) -> None:
    """Remove a key; with owner_sub, only a personal key of that person (another's is not found)."""
    with locked_file(path) as data:
        before = len(data.get("keys") or [])
        data["keys"] = [
            k
            for k in data.get("keys") or []
            if k.get("name") != name or (owner_sub is not None and k.get("owner_sub") != owner_sub)
        ]
        if len(data["keys"]) == before:
            raise KeyEditError("not_found", f"no key named {name!r}" + (" of yours" if owner_sub else ""))


def _owned(data: dict, owner_sub: str) -> list[dict]:
    return [k for k in data.get("keys") or [] if k.get("owner_sub") == owner_sub]


def list_entries(path: Path, owner_sub: str | None = None) -> list[dict]:
    """Every key, or with owner_sub one person's personal keys."""
    from .keys import load_file

    data = load_file(path)
    return [public_entry(k) for k in (data.get("keys") or [] if owner_sub is None else _owned(data, owner_sub))]
