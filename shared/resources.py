"""Files that ship inside the package (default config, service templates), found the same way
from a source checkout, an editable install and a wheel."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def shipped_file(package: str, name: str) -> Path:
    """`package` is "config" or "deploy"; returns a real path (both are plain folders on disk)."""
    return Path(str(files(f"mlxgw.{package}") / name))


def default_config() -> Path:
    return shipped_file("config", "models.yaml")
