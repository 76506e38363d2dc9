"""What an import returns, and the error a user can act on: shared by the GGUF importer
(worker/importers/gguf/importer.py) and the folder import (worker/importers/folder_import.py), which each call
the other's side only through these."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
