"""Where mlxgw keeps its files. One place, so tests can point everything at a temporary home."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """MLXGW_HOME, else ~/.cache/mlxgw."""
    env = os.environ.get("MLXGW_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mlxgw"


def models_dir() -> Path:
    return home() / "models"


def run_dir() -> Path:
    """Sockets and pid files. Short on purpose: ipc:// paths are limited to ~100 bytes."""
    return home() / "run"


def keys_file() -> Path:
    return home() / "keys.yaml"
