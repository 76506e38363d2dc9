"""The models directory: what is imported there, readable without MLX (the gateway lists it)."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
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


def _clean_stale_temp_dirs(directory: Path) -> None:
    """Remove temp folders of imports, and folders set aside to be removed, whose process is
    gone (killed mid-write or mid-delete): `.import-NAME-...-PID`, `.trash-NAME-PID`."""
    import psutil

    for tmp in [*directory.glob(".import-*"), *directory.glob(".trash-*")]:
        try:
            pid = int(tmp.name.rsplit("-", 1)[-1])
        except ValueError:
            continue
        if not psutil.pid_exists(pid):
            shutil.rmtree(tmp, ignore_errors=True)


def clean_stale_temp_dirs(directory: Path) -> None:
    """At a gateway's start: what a killed import or delete left in a models directory."""
    if directory.is_dir():
        _clean_stale_temp_dirs(directory)


def publish(directory: Path, name: str, fill: Callable[[Path], dict]) -> dict:
    """Write a model folder atomically: `fill` writes its files into a temp folder and returns
    the import record; the folder then replaces directory/name in one rename, so a killed
    import never leaves a half-written model behind. Returns the record."""
    directory.mkdir(parents=True, exist_ok=True)
    _clean_stale_temp_dirs(directory)
    tmp = Path(tempfile.mkdtemp(prefix=f".import-{name}-", suffix=f"-{os.getpid()}", dir=directory))
    tmp.chmod(0o755)
    dest = directory / name
    try:
        record = fill(tmp)
        record["imported_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        (tmp / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        trash = None
        if dest.exists():
            trash = directory / f".trash-{name}-{os.getpid()}"
            dest.rename(trash)
        tmp.rename(dest)
        if trash:
            shutil.rmtree(trash, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


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
    kind: str = "chat"


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
        kind=record.get("kind", "chat"),
    )


def list_models(directory: Path | None = None) -> list[StoredModel]:
    directory = directory or models_dir()
    if not directory.is_dir():
        return []
    found = (_describe(d) for d in sorted(directory.iterdir()) if d.is_dir() and not d.name.startswith("."))
    return [m for m in found if m is not None]


def serving_pids(folder: Path) -> list[int]:
    """Worker processes (of any running gateway) that serve the model in folder: a model
    must not be removed under a live worker."""
    import psutil

    target = folder.resolve()
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if "mlxgw.worker" not in cmd or "--model-path" not in cmd:
            continue
        i = cmd.index("--model-path")
        if i + 1 < len(cmd) and Path(cmd[i + 1]).resolve() == target:
            found.append(proc.info["pid"])
    return found


def template_features(folder: Path) -> list[str]:
    """What the model's chat template handles: tools, thinking (by what the template mentions)."""
    template = ""
    try:
        template = str(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template") or "")
    except (OSError, ValueError):
        pass
    if (folder / "chat_template.jinja").is_file():
        template += (folder / "chat_template.jinja").read_text(errors="replace")
    features = []
    if "tools" in template:
        features.append("tools")
    if "<think>" in template or "enable_thinking" in template:
        features.append("thinking")
    return features or (["chat"] if template else [])
