"""Changing models.yaml from a running gateway (Ollama's /api/pull, /api/copy, /api/create,
/api/delete): one edit at a time under a lock, the new file checked by the same parser as
`mlxgw up` before it is written atomically (synced, then renamed), the last few versions kept
beside it, then the registry reloaded.

The file is rewritten from its parsed YAML, so its comments are in the backup only."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import fcntl
import glob
import shutil
from collections.abc import Callable
from pathlib import Path

import yaml
from aiohttp import web

from ...shared.atomic_file import write_atomically
from ...shared.config import ConfigError, load_registry, parse_registry, with_discovered_models
from ...shared.errors import ErrorCode, ServiceError, invalid
from ...shared.resources import default_config
from ..web.state import MANAGER

_LOCK = asyncio.Lock()  # edits from this gateway, one at a time (the file lock covers other writers)


def registry_file(app: web.Application) -> Path:
    """The models.yaml this gateway runs, if it is the operator's own (the shipped one is
    part of the installation and is never edited)."""
    path = app[MANAGER].registry.path
    if path is None:
        raise ServiceError(ErrorCode.PERMISSION, "this gateway runs without a models.yaml; models cannot be managed")
    if Path(path).resolve() == default_config().resolve():
        raise ServiceError(
            ErrorCode.PERMISSION,
            "this gateway runs the shipped models.yaml: start it with `mlxgw up --config YOUR.yaml` to manage models",
        )
    return Path(path)


KEEP_BACKUPS = 3  # the last edits' backups; older ones are removed (an edit a minute adds up)


def _backup(path: Path) -> Path:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    backup = path.with_name(f"{path.name}.bak-{stamp}")
    shutil.copy2(path, backup)
    for old in sorted(path.parent.glob(f"{glob.escape(path.name)}.bak-*"))[:-KEEP_BACKUPS]:
        old.unlink(missing_ok=True)  # the stamps sort by time
    return backup


def _write_atomically(path: Path, text: str) -> None:
    """A crash or kill leaves the old registry or the new one, never a part; its mode is kept."""
    write_atomically(path, text, mode=path.stat().st_mode & 0o777)


def _locked(path: Path):
    lock = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115 (closed by the caller's with)
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def clean_after_kill(path: Path) -> list[Path]:
    """Temp files an edit killed mid-write left beside models.yaml. Under the edit lock, so
    no live writer's temp file is taken: a writer holds the lock while its temp file exists."""
    if not path.parent.is_dir() or path.resolve() == default_config().resolve():
        return []  # the shipped file is never edited
    with _locked(path):
        stale = list(path.parent.glob(f".{glob.escape(path.name)}.*.tmp"))
        for tmp in stale:
            tmp.unlink(missing_ok=True)
    return stale


def _edit_file(path: Path, change: Callable[[dict], None], after: Callable[[], None] | None) -> Path | None:
    with _locked(path):
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise invalid(f"{path.name} is not a mapping; fix it by hand")
        data.setdefault("models", [])
        before = copy.deepcopy(data)
        change(data)
        if data == before:
            return None  # nothing to write: the file keeps its comments
        try:
            parse_registry(data, path)  # never write a file `mlxgw up` would refuse
        except ConfigError as e:
            raise invalid(f"the change would make models.yaml invalid: {e}") from None
        backup = _backup(path)
        _write_atomically(path, yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
        if after is not None:
            after()  # still under the lock: no other edit sees the file before this runs
        return backup


async def edit_registry(
    app: web.Application, change: Callable[[dict], None], after: Callable[[], None] | None = None
) -> Path | None:
    """Apply `change` to the parsed models.yaml, write it (backup kept), run `after` (once
    written, before any other edit) and reload the registry; returns the backup's path (None:
    nothing changed). `change` raises ServiceError to refuse."""
    path = registry_file(app)
    async with _LOCK:
        backup = await asyncio.to_thread(_edit_file, path, change, after)
        registry = await asyncio.to_thread(lambda: with_discovered_models(load_registry(path)))
        await app[MANAGER].reload(registry)
    return backup


async def reload_registry(app: web.Application) -> None:
    """Re-read models.yaml and the models directory (a model folder appeared or went)."""
    path = registry_file(app)
    async with _LOCK:
        registry = await asyncio.to_thread(lambda: with_discovered_models(load_registry(path)))
        await app[MANAGER].reload(registry)


def listed_entry(data: dict, name: str) -> dict | None:
    """The models.yaml entry (raw mapping) with this exact name."""
    return next((m for m in data.get("models") or [] if isinstance(m, dict) and m.get("name") == name), None)
