"""API keys: a YAML file of key *hashes* with per-key limits, re-read when it changes.

window_seconds: 60            # the rate-limit window (requests and tokens per window)
keys:
  - name: alice
    sha256: 9f86d0...           # SHA-256 of the key; the key itself is never stored
    models: ["smollm2-*"]       # names or globs; default: every model
    rpm: 60                     # requests per window
    tpm: 100000                 # prompt + completion tokens per window
    tpd: 2000000                # token budget per UTC day, counted by the usage ledger
    tpmo: 40000000              # token budget per UTC calendar month
    aspm: 600                   # seconds of audio transcribed per window
    max_concurrent: 4
    expires: "2027-01-01T00:00:00Z"
    created: "2026-11-29T10:00:00Z"
    admin: false                # admin keys may cancel anyone's request and clear caches
    residency: false            # may its Ollama keep_alive load, pin or unload models (admins may)
    manage_models: false        # may it pull, create, copy and delete models (Ollama's /api/pull,
                                # /api/create, /api/copy, /api/delete; admins may), named by its
                                # `models` patterns only
    mcp: [files]                # MCP servers it may use (default: those with allowed_tools)
    weight: 1                   # fair share of a busy worker's rows against other keys (default 1)
    min_priority: 0             # the most urgent `priority` it may ask (-100..100; default 0:
                                # none below 0); a request asking for more is clamped to it
    cache_group: team-a         # keys of one group share prefix-cache hits (default: the
                                # gateway's default_cache_group, else each key its own)
    latency_class: agent        # the most urgent latency class its requests run in (editor,
                                # chat, agent, background; default: any): an agent harness's
                                # key runs as agent, a batch key as background
    owner: alice@example.com    # a personal key: the signed-in person who made it (access/signin/)
    owner_sub: 24400320         # ... and their subject at the identity provider, which revokes it
"""

from __future__ import annotations

import datetime as dt
import fcntl
import fnmatch
import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ...shared.atomic_file import write_atomically

log = logging.getLogger(__name__)

KEY_PREFIX = "mlxgw-"


class KeysFileError(ValueError):
    pass


@dataclass(frozen=True)
class ApiKey:
    name: str
    sha256: str
    models: tuple[str, ...] = ()
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    expires: dt.datetime | None = None
    created: str | None = None
    admin: bool = False
    tpd: int | None = None  # tokens per UTC day (usage ledger)
    tpmo: int | None = None  # tokens per UTC month (usage ledger)
    aspm: int | None = None  # seconds of uploaded audio per window (speech to text)
    residency: bool = False  # Ollama keep_alive may keep or unload models for everyone
    manage_models: bool = False  # may change the registry (Ollama's model management), within `models`
    mcp: tuple[str, ...] | None = None  # MCP server labels/globs; None: gateway/mcp/access.py's default
    weight: float = 1.0  # its share of a busy worker against other keys (worker/schedule/fair_share.py)
    min_priority: int = 0  # the most urgent priority it may ask; lower asks are clamped to it
    cache_group: str | None = None  # keys of one group share prefix-cache hits (access/cache_scope.py)
    latency_class: str | None = None  # its most urgent latency class (pipeline/latency_class.py)
    owner: str | None = None  # a personal key's (or a signed-in session's) person, by name
    owner_sub: str | None = None  # ... and by their stable subject at the identity provider

    @property
    def tenant(self) -> str:
        """Who the worker shares rows between: a stable hash of the key's hash, never its name."""
        return hashlib.sha256(b"mlxgw-tenant:" + self.sha256.encode()).hexdigest()[:16]

    def granted_priority(self, requested: int) -> int:
        """The priority a request runs at: what it asked, but never more urgent than granted."""
        return max(requested, self.min_priority)

    def allows(self, *model_names: str) -> bool:
        if not self.models:
            return True
        return any(fnmatch.fnmatchcase(n, pattern) for n in model_names for pattern in self.models)

    def expired(self, now: dt.datetime | None = None) -> bool:
        return self.expires is not None and (now or dt.datetime.now(dt.timezone.utc)) >= self.expires


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _parse_time(value, where: str) -> dt.datetime | None:
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    try:
        parsed = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        raise KeysFileError(f"{where}: 'expires' must be an ISO time such as 2027-01-01T00:00:00Z") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)


_FIELDS = {
    "name",
    "sha256",
    "models",
    "rpm",
    "tpm",
    "max_concurrent",
    "expires",
    "created",
    "admin",
    "tpd",
    "tpmo",
    "aspm",
    "residency",
    "manage_models",
    "mcp",
    "weight",
    "min_priority",
    "cache_group",
    "latency_class",
    "owner",
    "owner_sub",
}


def check_weight(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.01 <= value <= 100:
        raise ValueError("'weight' must be a number from 0.01 to 100")
    return float(value)


CACHE_GROUP_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")


def check_cache_group(value) -> str:
    if not isinstance(value, str) or not CACHE_GROUP_RE.match(value):
        raise ValueError("'cache_group' must be 1-64 letters, digits or ._@- and start with a letter or digit")
    return value


LATENCY_CLASSES = ("editor", "chat", "agent", "background")


def check_latency_class(value) -> str:
    if value not in LATENCY_CLASSES:
        raise ValueError("'latency_class' must be one of editor, chat, agent, background")
    return value


def check_min_priority(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -100 <= value <= 100:
        raise ValueError("'min_priority' must be an integer from -100 to 100")
    return value


def parse_keys(data, source: str) -> tuple[list[ApiKey], float]:
    data = data or {}
    if not isinstance(data, dict):
        raise KeysFileError(f"{source}: expected a mapping with 'keys'")
    window = data.get("window_seconds", 60)
    if isinstance(window, bool) or not isinstance(window, (int, float)) or window <= 0:
        raise KeysFileError(f"{source}: 'window_seconds' must be a positive number")
    keys = []
    for i, raw in enumerate(data.get("keys") or []):
        where = f"{source}: keys[{i}]"
        if not isinstance(raw, dict):
            raise KeysFileError(f"{where}: expected a mapping")
        unknown = set(raw) - _FIELDS
        if unknown:
            raise KeysFileError(f"{where}: unknown field {sorted(unknown)[0]!r}")
        name, digest = raw.get("name"), str(raw.get("sha256", "")).lower()
        if not isinstance(name, str) or not name:
            raise KeysFileError(f"{where}: 'name' is required")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise KeysFileError(f"{where} ({name}): 'sha256' must be 64 hex digits")
        limits = {}
        for f in ("rpm", "tpm", "max_concurrent", "tpd", "tpmo", "aspm"):
            value = raw.get(f)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise KeysFileError(f"{where} ({name}): '{f}' must be a non-negative integer")
            limits[f] = value
        models = raw.get("models") or []
        if isinstance(models, str):
            models = [models]
        admin = raw.get("admin", False)
        if not isinstance(admin, bool):
            raise KeysFileError(f"{where} ({name}): 'admin' must be true or false")
        residency, manage_models = raw.get("residency", False), raw.get("manage_models", False)
        for flag, value in (("residency", residency), ("manage_models", manage_models)):
            if not isinstance(value, bool):
                raise KeysFileError(f"{where} ({name}): '{flag}' must be true or false")
        mcp = raw.get("mcp")
        if isinstance(mcp, str):
            mcp = [mcp]
        if mcp is not None and (not isinstance(mcp, list) or not all(isinstance(m, str) and m for m in mcp)):
            raise KeysFileError(f"{where} ({name}): 'mcp' must be a list of MCP server labels or globs")
        try:
            share = {
                "weight": check_weight(raw.get("weight", 1.0)),
                "min_priority": check_min_priority(raw.get("min_priority", 0)),
            }
            if raw.get("cache_group") is not None:
                share["cache_group"] = check_cache_group(raw["cache_group"])
            if raw.get("latency_class") is not None:
                share["latency_class"] = check_latency_class(raw["latency_class"])
        except ValueError as e:
            raise KeysFileError(f"{where} ({name}): {e}") from None
        owner = {f: raw[f] for f in ("owner", "owner_sub") if raw.get(f) is not None}
        if not all(isinstance(v, str) for v in owner.values()):
            raise KeysFileError(f"{where} ({name}): 'owner' and 'owner_sub' must be strings")
        keys.append(
            ApiKey(
                name=name,
                sha256=digest,
                models=tuple(models),
                expires=_parse_time(raw.get("expires"), where),
                created=raw.get("created"),
                admin=admin,
                residency=residency,
                manage_models=manage_models,
                mcp=tuple(mcp) if mcp is not None else None,
                **limits,
                **share,
                **owner,
            )
        )
    return keys, float(window)


@dataclass
class KeyStore:
    """Keys from a file, reloaded when its modification time changes."""

    path: Path
    keys: list[ApiKey] = field(default_factory=list)
    window_s: float = 60.0
    _mtime: tuple | None = None

    def __post_init__(self) -> None:
        swept = sweep_stale_temp(Path(self.path))
        if swept:
            log.info("removed %d temporary keys files that interrupted edits left", swept)

    def refresh(self, force: bool = False) -> None:
        try:
            st = os.stat(self.path)
            # Nanosecond mtime, size and inode: two writes within one coarse mtime tick (an
            # atomic rename gives a new inode) still count as a change.
            mtime = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            if self._mtime is not None:
                log.warning("keys file %s disappeared; keeping the keys loaded before", self.path)
            return
        if mtime == self._mtime and not force:
            return
        try:
            self.keys, self.window_s = parse_keys(yaml.safe_load(self.path.read_text()), str(self.path))
            log.info("loaded %d API keys from %s", len(self.keys), self.path)
        except (KeysFileError, yaml.YAMLError, OSError) as e:
            log.error("keys file rejected, keeping the previous keys: %s", e)
        self._mtime = mtime

    def lookup(self, presented: str) -> ApiKey | None:
        """The key whose hash matches, comparing against every key in constant time."""
        self.refresh()
        digest = hash_key(presented)
        found = None
        for key in self.keys:
            if hmac.compare_digest(digest, key.sha256):
                found = key
        return found


# -- the file, for `mlxgw keys` -----------------------------------------------------------------
def load_file(path: Path) -> dict:
    if not path.exists():
        return {"window_seconds": 60, "keys": []}
    data = yaml.safe_load(path.read_text()) or {}
    parse_keys(data, str(path))  # validate before editing
    return data


STALE_TEMP_S = 60.0  # a temporary keys file this old belongs to no edit still running


def sweep_stale_temp(path: Path, now: float | None = None) -> int:
    """The `.NAME.*.tmp` files save_file leaves when it is killed between creating and
    renaming one (kill -9 during a key edit); a live edit's file is seconds old."""
    swept = 0
    cutoff = (now or time.time()) - STALE_TEMP_S
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        try:
            if tmp.stat().st_mtime < cutoff:
                tmp.unlink()
                swept += 1
        except OSError:
            continue  # gone meanwhile, or not ours to remove
    return swept


def save_file(path: Path, data: dict) -> None:
    """Atomic: a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, yaml.safe_dump(data, sort_keys=False))


@contextmanager
def locked_file(path: Path) -> Iterator[dict]:
    """Read, edit and write the keys file under an exclusive lock on a side file, so that
    `mlxgw keys` and the gateway's /v1/keys never lose each other's edits. The caller edits
    the yielded mapping; it is written only when the block ends without an exception."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = load_file(path)
        yield data
        parse_keys(data, str(path))  # never write a file the gateway would reject
        save_file(path, data)
