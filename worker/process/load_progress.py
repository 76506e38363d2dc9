"""How far a model load has got, for the heartbeats the link thread sends while the engine
thread is inside the load: bytes of weight files read so far (the process's read counter
where the OS keeps one: Linux; else the resident memory grown since the load began), the
weight files' total, the process's RSS and the seconds elapsed."""

from __future__ import annotations

import time
from pathlib import Path

import psutil

WEIGHT_SUFFIXES = {".safetensors", ".gguf", ".npz", ".bin", ".onnx"}


def weight_bytes(model_path: Path) -> int:
    """What the load has to read: the weight files in the model folder (0 when there are none,
    e.g. the null and echo engines)."""
    try:
        return sum(f.stat().st_size for f in model_path.rglob("*") if f.suffix in WEIGHT_SUFFIXES and f.is_file())
    except OSError:
        return 0


class LoadProgress:
    def __init__(self, model_path: Path):
        self.started = time.monotonic()
        self.expected_bytes = weight_bytes(model_path)
        self._proc = psutil.Process()
        self._base_rss = self._proc.memory_info().rss
        self._base_read = self._read_chars()

    def _read_chars(self) -> int | None:
        try:
            return int(self._proc.io_counters().read_chars)  # Linux: every byte read(), pread()
        except (AttributeError, psutil.Error, NotImplementedError):
            return None  # macOS keeps no such counter

    def snapshot(self) -> dict:
        rss = self._proc.memory_info().rss
        read = self._read_chars()
        if read is not None and self._base_read is not None:
            loaded = read - self._base_read
        else:
            loaded = rss - self._base_rss
        loaded = max(0, loaded)
        if self.expected_bytes:
            loaded = min(loaded, self.expected_bytes)  # other reads (imports) must not pass 100%
        return {
            "loaded_bytes": loaded,
            "expected_bytes": self.expected_bytes,
            "rss_bytes": rss,
            "elapsed_s": round(time.monotonic() - self.started, 1),
        }
