"""The models directory: what is imported there, readable without MLX (the gateway lists it)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from . import paths

IMPORT_RECORD = "mlxgw.json"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class InvalidModelName(ValueError):
    pass


def models_dir() -> Path:
    return paths.models_dir()


def validate_model_name(name: str) -> None:
    # Names become folder names: no separators, no leading dot, nothing a path could escape with.
    if not _NAME_RE.match(name) or ".." in name:
        raise InvalidModelName(f"invalid model name {name!r}: use letters, digits, '.', '_' and '-' (max 128)")


def read_import_record(folder: Path) -> dict | None:
    try:
        return json.loads((folder / IMPORT_RECORD).read_text())
    except (OSError, ValueError):
        return None


def folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


@dataclass
class StoredModel:
    name: str
    path: Path
    architecture: str
    parameters: int | None
    dtype: str
    size_bytes: int
    source: str
    context_length: int | None


def _describe(folder: Path) -> StoredModel | None:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    record = read_import_record(folder) or {}
    return StoredModel(
        name=folder.name,
        path=folder,
        architecture=record.get("architecture") or config.get("model_type", "?"),
        parameters=record.get("parameters"),
        dtype=record.get("dtype") or config.get("torch_dtype", "?"),
        size_bytes=folder_size(folder),
        source=record.get("source_spec") or record.get("source", ""),
        context_length=config.get("max_position_embeddings"),
    )


def list_models(directory: Path | None = None) -> list[StoredModel]:
    directory = directory or models_dir()
    if not directory.is_dir():
        return []
    found = (_describe(d) for d in sorted(directory.iterdir()) if d.is_dir() and not d.name.startswith("."))
    return [m for m in found if m is not None]
