"""What an import returns, and the error a user can act on: shared by the GGUF importer
(worker/importers/gguf/importer.py) and the folder import (worker/importers/folder_import.py), which each call
the other's side only through these."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ...shared import model_store
from .import_progress import ImportProgress, NoProgress


class ImportError_(Exception):
    """A problem the user can act on (bad source, unsupported model); the CLI exits 2."""


@dataclass
class ImportResult:
    name: str
    path: Path
    skipped: bool
    seconds: float
    size_bytes: int
    dtype: str
    architecture: str


@dataclass
class ImportStart:
    """What an import that writes one folder begins with: its name (checked), where it goes,
    where it shows progress and when it began, so its result is told the same way each time."""

    name: str
    models_dir: Path
    progress: ImportProgress
    started: float = field(default_factory=time.perf_counter)

    @property
    def dest(self) -> Path:
        return self.models_dir / self.name

    def result(self, skipped: bool, dtype: str, architecture: str) -> ImportResult:
        """The import's result: skipped (the same source was imported already) or written."""
        seconds, size = time.perf_counter() - self.started, model_store.folder_size(self.dest)
        return ImportResult(self.name, self.dest, skipped, seconds, size, dtype, architecture)


def begin_import(name: str, models_dir: Path | None, progress: ImportProgress | None) -> ImportStart:
    """Check the name and fill in the defaults (the models dir, no progress shown)."""
    model_store.validate_model_name(name)
    return ImportStart(name, models_dir or model_store.models_dir(), progress or NoProgress())
