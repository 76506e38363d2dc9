"""`mlxgw models import` for model folders (Hugging Face / sentence-transformers layout):
copied as they are into the models dir, with an import record that says what they are.

Used for encoders (embedding and reranking models, which ship as safetensors folders, e.g.
the all-MiniLM-L6-v2 package) and for MLX chat model folders."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

from ...shared import model_store
from .import_progress import ImportProgress
from .import_result import ImportError_, ImportResult, begin_import

# Files a serving copy does not need.
SKIP = {".gitattributes", "README.md", "mlxgw.json"}


def _containment_root(folder: Path) -> Path:
    """Where a symlink in the folder may point. The folder itself, except for a snapshot in a
    Hugging Face hub cache (models--org--name/snapshots/<rev>/), whose files are symlinks to
    ../../blobs/: there the repository's cache folder."""
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent
    return folder


def _resolve_link(link: Path, root: Path, rel: str) -> Path:
    try:
        target = link.resolve(strict=True)
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop on Python < 3.13
        raise ImportError_(f"{rel}: broken or looping symlink ({type(e).__name__})") from None
    if not target.is_relative_to(root):
        raise ImportError_(f"{rel}: symlink points outside the model folder; only files inside it are imported")
    return target


def safe_manifest(folder: Path) -> dict[str, Path]:
    """Relative path -> the regular file to read, for every file a model folder import copies.

    Only regular files inside the folder are taken: directory symlinks are never followed
    (no loops), file symlinks only when they resolve inside the folder, and anything else
    (devices, FIFOs, sockets, hard-linked files) is refused, so an import can never read outside the folder."""
    folder = folder.resolve()
    root = _containment_root(folder)
    files: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        here = Path(dirpath)
        for d in list(dirnames):
            if (here / d).is_symlink():
                rel = (here / d).relative_to(folder)
                raise ImportError_(f"{rel}: directory symlinks are not followed; copy the files into the folder")
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            path = here / name
            rel = str(path.relative_to(folder))
            if name in SKIP:
                continue
            target = _resolve_link(path, root, rel) if path.is_symlink() else path
            info = target.stat()
            if not stat.S_ISREG(info.st_mode):
                raise ImportError_(f"{rel}: not a regular file")
            if info.st_nlink > 1:  # another name for the same file, perhaps outside the folder (/etc/shadow)
                raise ImportError_(f"{rel}: a hard-linked file is not imported; copy it into the folder")
            files[rel] = target
    return files


def _digest(files: dict[str, Path], progress: ImportProgress) -> str:
    """One SHA-256 over every file's name and bytes, in a stable order."""
    h = hashlib.sha256()
    with progress.phase("hashing source", sum(f.stat().st_size for f in files.values()), "MB"):
        for rel in sorted(files):
            h.update(rel.encode() + b"\0")
            with open(files[rel], "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
                    progress.advance(len(block))
    return h.hexdigest()


def _copy_files(files: dict[str, Path], dest: Path) -> None:
    for rel, source in files.items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target, follow_symlinks=False)


def describe(folder: Path, config_file: Path | None = None) -> tuple[str, str]:
    """(architecture, kind) from config.json: encoders serve embeddings (or reranking when they
    are sequence classifiers), models with a vision tower take images, the rest chat."""
    from ..model.encoder.encoder import SUPPORTED, is_cross_encoder

    config = json.loads((config_file or folder / "config.json").read_text())
    arch = str(config.get("model_type", "?"))
    if arch in SUPPORTED:
        return arch, "rerank" if is_cross_encoder(config) else "embedding"
    if "vision_config" in config:  # Hugging Face's layout for vision-language models
        return arch, "vision"
    return arch, "chat"


def _weights_summary(files: dict[str, Path]) -> tuple[int, str]:
    """Parameter count (buffers like position_ids left out) and the floating dtypes, from
    one read of the weight files."""
    import mlx.core as mx

    total, dtypes = 0, set()
    for f in (p for rel, p in files.items() if "/" not in rel and rel.endswith(".safetensors")):
        try:
            tensors = mx.load(str(f), format="safetensors")  # hub cache blobs have no extension
        except Exception as e:  # MLX raises plain RuntimeError/ValueError on a corrupt file
            raise ImportError_(f"{f.name}: unreadable safetensors file: {e}") from None
        for name, t in tensors.items():
            if not name.endswith("position_ids"):
                total += int(t.size)
            if t.dtype in (mx.float32, mx.float16, mx.bfloat16):
                dtypes.add(str(t.dtype).removeprefix("mlx.core."))
    return total, ",".join(sorted(dtypes)) or "?"


def import_folder(
    path: Path,
    source: str,
    name: str,
    *,
    force: bool = False,
    models_dir: Path | None = None,
    progress: ImportProgress | None = None,
) -> ImportResult:
    start = begin_import(name, models_dir, progress)
    progress = start.progress
    files = safe_manifest(path)
    if "config.json" not in files:
        raise ImportError_(f"{path}: no config.json")
    try:
        arch, kind = describe(path, files["config.json"])
    except (OSError, ValueError) as e:
        raise ImportError_(f"{path}: unreadable config.json: {e}") from None
    digest = _digest(files, progress)
    existing = model_store.read_import_record(start.dest)
    if not force and existing and existing.get("sha256") == digest:
        return start.result(True, existing.get("dtype", "?"), arch)

    def fill(tmp: Path) -> dict:
        with progress.watch_folder("copying files", tmp, sum(f.stat().st_size for f in files.values())):
            _copy_files(files, tmp)
        with progress.phase("checking weights"):
            parameters, dtype = _weights_summary(files)
        return {
            "source": str(path),
            "source_spec": source,
            "sha256": digest,
            "size_bytes": sum(f.stat().st_size for f in files.values()),
            "architecture": arch,
            "kind": kind,
            "parameters": parameters,
            "options": {},
            "dtype": dtype,
        }

    record = model_store.publish(start.models_dir, name, fill)
    return start.result(False, record["dtype"], arch)
