"""Which model folders an entry owns, and which entries serve from a folder: what Ollama's
/api/delete may remove and what a FROM may start from.

A delete removes only the folder the entry's own pull or import produced (its `owns`, written
then), never one another entry serves from; a copy or a create FROM a model or a folder
shares that folder and owns nothing. Paths are compared resolved (links followed), so a
link or a `..` spelling of a folder is the folder."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ...shared import model_store
from ...shared.config import Registry
from ...shared.model_sections import ModelEntry


def real(path: Path | str) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def served_paths(entry: ModelEntry, models_dir: Path) -> list[Path]:
    """Every folder the entry's worker reads here: its weights (none for the test engines and
    a model served only by remote workers), its draft model, its adapters."""
    reads_weights = entry.engine not in ("echo", "null") and not entry.remote_only
    paths = [entry.model_path(models_dir)] if reads_weights else []
    draft = entry.speculative.draft_model_path(models_dir)
    if draft is not None:
        paths.append(draft)
    paths += [a.folder() for a in entry.adapters]
    return [real(p) for p in paths]


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def users(entries: Iterable[ModelEntry], models_dir: Path, folder: Path) -> list[ModelEntry]:
    """The entries that read from `folder` (resolved), or from a folder inside it or around it."""
    target = real(folder)
    return [e for e in entries if any(_overlaps(p, target) for p in served_paths(e, models_dir))]


def owned_folder(raw: dict, models_dir: Path) -> Path | None:
    """The folder a models.yaml entry (raw mapping) owns: its `owns`; for an entry from before
    `owns` was recorded, the models-dir folder of its own name when it names no other source
    and an mlxgw pull or import wrote it (its import record is there)."""
    if isinstance(raw.get("owns"), str):
        return real(raw["owns"])
    name = raw.get("name")
    if raw.get("source") not in (None, name) or not isinstance(name, str):
        return None
    folder = models_dir / name
    return real(folder) if model_store.read_import_record(folder) is not None else None


def other_entries(registry: Registry, listed: Iterable[ModelEntry], listed_before: set[str], name: str) -> list:
    """The entries that serve once `name` is gone: models.yaml's (as changed) and those the
    running registry found outside it (models-dir folders, the hub cache) but not `name`."""
    listed = list(listed)
    return [*listed, *(e for e in registry.models if e.name not in listed_before and e.name != name)]
