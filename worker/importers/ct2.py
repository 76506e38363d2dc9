"""Reader for CTranslate2's model.bin (the format faster-whisper runs): named tensors.

Layout (CTranslate2 src/models/model.cc, binary version >= 4): uint32 version, spec name,
uint32 spec revision, uint32 variable count, then per variable: name, uint8 rank, uint32
dims[rank], uint8 dtype id, uint32 byte count, data; then uint32 alias count and
(alias, target) name pairs. Strings are uint16 length + bytes including a trailing NUL."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

# CTranslate2's DataType enum.
DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
SUPPORTED_VERSIONS = range(4, 7)


class CT2FormatError(ValueError):
    pass


class _Cursor:
    def __init__(self, data: memoryview):
        self.data = data
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.data):
            raise CT2FormatError(f"truncated model.bin: wanted {n} bytes at offset {self.pos}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def uint(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        return struct.unpack("<" + fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.uint("H")
        return bytes(self.take(n)).rstrip(b"\0").decode()


def read_model_bin(data: bytes) -> tuple[str, dict[str, np.ndarray]]:
    """(spec name, {variable name: array}); aliases resolve to their targets' arrays."""
    cur = _Cursor(memoryview(data))
    version = cur.uint("I")
    if version not in SUPPORTED_VERSIONS:
        raise CT2FormatError(f"unsupported CTranslate2 binary version {version}")
    spec = cur.string()
    cur.uint("I")  # spec revision
    tensors: dict[str, np.ndarray] = {}
    for _ in range(cur.uint("I")):
        name = cur.string()
        rank = cur.uint("B")
        dims = [cur.uint("I") for _ in range(rank)]
        dtype_id = cur.uint("B")
        nbytes = cur.uint("I")
        if dtype_id not in DTYPES:
            raise CT2FormatError(f"{name}: unsupported dtype id {dtype_id}")
        raw = cur.take(nbytes)
        arr = np.frombuffer(raw, dtype=DTYPES[dtype_id])
        if arr.size != int(np.prod(dims)):
            raise CT2FormatError(f"{name}: {arr.size} values for shape {dims}")
        tensors[name] = arr.reshape(dims)
    if cur.pos < len(data):
        for _ in range(cur.uint("I")):
            alias, target = cur.string(), cur.string()
            if target in tensors:
                tensors[alias] = tensors[target]
    return spec, tensors


def read_model_files(parts: list[Path]) -> tuple[str, dict[str, np.ndarray]]:
    """One model.bin, or the parts of one split in order (joined in memory)."""
    data = b"".join(p.read_bytes() for p in parts)
    return read_model_bin(data)
