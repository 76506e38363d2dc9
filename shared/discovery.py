"""Models users already have: MLX folders in the Hugging Face hub cache and in LM Studio's
models folder, served in place (nothing copied) under the names the hub gives them, org/name.

Readable without MLX (the gateway calls it): a folder qualifies by its files and its
config.json; one that cannot be served is kept with the reason, so listings can say why."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path


@dataclass(frozen=True)
class FoundModel:
    name: str  # org/name, as the hub names it
    path: Path
    source: str  # "hf-cache" or "lmstudio"
    kind: str = "chat"
    error: str | None = None  # why it cannot be served; None when it can


def default_discover_paths() -> list[Path]:
    """The hub cache (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub) and LM Studio's
    models folder (~/.lmstudio/models; ~/.cache/lm-studio/models on older versions)."""
    if os.environ.get("HF_HUB_CACHE"):
        hub = Path(os.environ["HF_HUB_CACHE"])
    else:
        hub = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    paths = [hub, Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]
    if sys.platform == "win32":  # pragma: no cover - mlxgw serves from macOS and Linux
        paths.append(Path.home() / "AppData" / "Local" / "LM Studio" / "models")
    return paths


def _mlx_lm_models_dir() -> Path | None:
    spec = find_spec("mlx_lm")  # locates the package without importing it (and MLX)
    return Path(spec.origin).parent / "models" if spec and spec.origin else None


def _check_folder(path: Path) -> tuple[str, str | None]:
    """(kind, error) for a candidate model folder."""
    if not (path / "config.json").exists() and any(path.glob("*.gguf")):
        return "chat", "GGUF only: import it with `mlxgw models import`"
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        return "chat", f"unreadable config.json ({type(e).__name__})"
    if not isinstance(config, dict):
        return "chat", "config.json is not an object"
    if not any(path.glob("*.safetensors")):
        return "chat", "no .safetensors weights"
    model_type = str(config.get("model_type", ""))
    kind = "vision" if "vision_config" in config else "chat"
    models = _mlx_lm_models_dir()
    if kind == "chat" and models and not (models / f"{model_type}.py").is_file():
        return kind, f"mlx-lm has no model for model_type {model_type!r}"
    return kind, None


def _link_outside(snapshot: Path, repo: Path) -> str | None:
    """Why a snapshot cannot be served if one of its files links outside its repository's
    cache folder (`model.safetensors -> /etc/shadow`), as `mlxgw models import` refuses it."""
    root = repo.resolve()
    for path in snapshot.rglob("*"):
        if not path.is_symlink():
            continue
        try:
            target = path.resolve(strict=True)
        except (OSError, RuntimeError):
            return f"{path.relative_to(snapshot)}: broken or looping symlink"
        if not target.is_relative_to(root):
            return f"{path.relative_to(snapshot)} links outside the hub cache's folder for this model"
    return None


def _latest_snapshot(repo: Path) -> Path | None:
    """The snapshot refs/main points at, else the newest one."""
    snapshots = repo / "snapshots"
    try:
        ref = (repo / "refs" / "main").read_text().strip()
        if ref and (snapshots / ref).is_dir():
            return snapshots / ref
    except OSError:
        pass
    candidates = [p for p in snapshots.iterdir() if p.is_dir()] if snapshots.is_dir() else []
    return max(candidates, key=lambda p: p.stat().st_mtime, default=None)


def _hub_cache(root: Path) -> list[FoundModel]:
    found = []
    for repo in sorted(root.glob("models--*--*")):
        org, _, name = repo.name.removeprefix("models--").partition("--")
        snapshot = _latest_snapshot(repo)
        if snapshot is None:
            found.append(FoundModel(f"{org}/{name}", repo, "hf-cache", error="no snapshot"))
            continue
        if not (snapshot / "config.json").exists() and not any(snapshot.glob("*.safetensors")):
            continue  # not a model repository (datasets, GGUF-only repos are listed by LM Studio's scan)
        kind, error = _check_folder(snapshot)
        error = _link_outside(snapshot, repo) or error
        found.append(FoundModel(f"{org}/{name}", snapshot, "hf-cache", kind, error))
    return found


def _lm_studio(root: Path) -> list[FoundModel]:
    found = []
    for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
        if not ((folder / "config.json").exists() or any(folder.glob("*.safetensors")) or any(folder.glob("*.gguf"))):
            continue
        kind, error = _check_folder(folder)
        found.append(FoundModel(f"{folder.parent.name}/{folder.name}", folder, "lmstudio", kind, error))
    return found


def discover(paths: list[Path] | None = None) -> list[FoundModel]:
    """Every model folder under the paths (hub cache layout or LM Studio's org/name layout);
    a name found twice keeps its first place."""
    seen: dict[str, FoundModel] = {}
    for root in paths if paths is not None else default_discover_paths():
        root = Path(root).expanduser()
        if not root.is_dir():
            continue
        is_hub = any(root.glob("models--*"))
        for model in _hub_cache(root) if is_hub else _lm_studio(root):
            seen.setdefault(model.name, model)
    return list(seen.values())


def found_models(discover_paths: list[str] | None, taken: set[str]) -> list[FoundModel]:
    """The discovered models whose names models.yaml and the models dir do not already
    take, servable or not (config.py calls this for manager.auto_discover)."""
    paths = None if discover_paths is None else [Path(p).expanduser() for p in discover_paths]
    return [m for m in discover(paths) if m.name not in taken]
