"""`mlxgw models import` for model folders (Hugging Face / sentence-transformers layout):
copied as they are into the models dir, with an import record that says what they are.

Used for encoders (embedding and reranking models, which ship as safetensors folders, e.g.
the all-MiniLM-L6-v2 package) and for MLX chat model folders."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

from mlxgw.shared import model_store

from .gguf.importer import ImportError_, ImportResult

# Files a serving copy does not need.
SKIP = {".gitattributes", "README.md", "mlxgw.json"}


def _digest(folder: Path) -> str:
    """One SHA-256 over every file's name and bytes, in a stable order."""
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in SKIP):
        h.update(str(f.relative_to(folder)).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def describe(folder: Path) -> tuple[str, str]:
    """(architecture, kind) from config.json: encoders serve embeddings (or reranking when they
    are sequence classifiers), models with a vision tower take images, the rest chat."""
    from .embedding.encoder import SUPPORTED, is_cross_encoder

    config = json.loads((folder / "config.json").read_text())
    arch = str(config.get("model_type", "?"))
    if arch in SUPPORTED:
        return arch, "rerank" if is_cross_encoder(config) else "embedding"
    if "vision_config" in config:  # Hugging Face's layout for vision-language models
        return arch, "vision"
    return arch, "chat"


def _weights_summary(folder: Path) -> tuple[int, str]:
    """Parameter count (buffers like position_ids left out) and the floating dtypes, from
    one read of the weight files."""
    import mlx.core as mx

    total, dtypes = 0, set()
    for f in folder.glob("*.safetensors"):
        for name, t in mx.load(str(f)).items():
            if not name.endswith("position_ids"):
                total += int(t.size)
            if t.dtype in (mx.float32, mx.float16, mx.bfloat16):
                dtypes.add(str(t.dtype).removeprefix("mlx.core."))
    return total, ",".join(sorted(dtypes)) or "?"


def import_folder(
    path: Path, source: str, name: str, *, force: bool = False, models_dir: Path | None = None
) -> ImportResult:
    model_store.validate_model_name(name)
    started = time.perf_counter()
    models_dir = models_dir or model_store.models_dir()
    dest = models_dir / name
    try:
        arch, kind = describe(path)
    except (OSError, ValueError) as e:
        raise ImportError_(f"{path}: unreadable config.json: {e}") from None
    digest = _digest(path)
    existing = model_store.read_import_record(dest)
    if not force and existing and existing.get("sha256") == digest:
        size = model_store.folder_size(dest)
        return ImportResult(name, dest, True, time.perf_counter() - started, size, existing.get("dtype", "?"), arch)

    def fill(tmp: Path) -> dict:
        shutil.copytree(path, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*SKIP, "__pycache__"))
        parameters, dtype = _weights_summary(path)
        return {
            "source": str(path),
            "source_spec": source,
            "sha256": digest,
            "size_bytes": model_store.folder_size(path),
            "architecture": arch,
            "kind": kind,
            "parameters": parameters,
            "options": {},
            "dtype": dtype,
        }

    record = model_store.publish(models_dir, name, fill)
    size = model_store.folder_size(dest)
    return ImportResult(name, dest, False, time.perf_counter() - started, size, record["dtype"], arch)
