"""Our own small GGUF header reader: every length, count, dimension, type and offset is
checked against the file before anything native (mx.load) sees the file.

A GGUF file is: magic, version, tensor count, metadata count; metadata key/value pairs;
tensor infos (name, dims, type, offset); padding to the alignment; tensor data. A hostile
file can claim a key of 2^62 bytes, 100 dimensions or an array of 2^60 strings; this
reader never allocates more than the bytes that are really in the file, and refuses
anything the spec (or MLX's loader) does not allow, with a message that names it."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_KEY_LENGTH = 65535  # the GGUF spec's limit
MAX_DIMS = 4  # ggml tensors have at most 4 dimensions
# Far above real files (about 40 metadata entries, a few thousand tensors, vocabularies and
# merge lists under 1M): keeps the Python objects built from a header within a small
# multiple of the file size.
MAX_METADATA = 1 << 16
MAX_TENSORS = 1 << 20
MAX_ARRAY = 1 << 22
DEFAULT_ALIGNMENT = 32

# ggml tensor types: id -> (name, elements per block, bytes per block), from ggml.h / gguf-py.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
}

# GGUF metadata value types: id -> (struct format, size); 8 = string, 9 = array.
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF file; the message says where and why."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: ne[0] (the contiguous dimension) first
    type_id: int
    offset: int  # from the start of the data section
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.type_id][0]


@dataclass
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int
    file_size: int
    types: set[str] = field(default_factory=set)

    def tensor(self, name: str) -> TensorInfo | None:
        return next((t for t in self.tensors if t.name == name), None)


class _Cursor:
    """Reads little-endian values from a file, never past its end."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.size, self.pos = f, size, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.size - self.pos:
            raise GGUFFormatError(f"{what} needs {n} bytes at offset {self.pos}, but the file has {self.size} bytes")
        data = self.f.read(n)
        if len(data) != n:
            raise GGUFFormatError(f"file ended while reading {what} at offset {self.pos}")
        self.pos += n
        return data

    def unpack(self, fmt: str, size: int, what: str) -> Any:
        return struct.unpack(fmt, self.take(size, what))[0]

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def remaining(self) -> int:
        return self.size - self.pos

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.u64(f"length of {what}")
        if limit is not None and n > limit:
            raise GGUFFormatError(f"{what} claims {n} bytes (at most {limit} allowed)")
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFFormatError(f"{what} is not valid UTF-8") from None


def _read_value(cur: _Cursor, type_id: int, key: str, in_array: bool = False) -> Any:
    if type_id in _SCALARS:
        fmt, size = _SCALARS[type_id]
        return cur.unpack(fmt, size, f"value of {key!r}")
    if type_id == _STRING:
        return cur.string(f"string value of {key!r}")
    if type_id == _ARRAY and not in_array:
        return _read_array(cur, key)
    if type_id == _ARRAY:
        raise GGUFFormatError(f"metadata {key!r} is an array of arrays, which is not supported")
    raise GGUFFormatError(f"metadata {key!r} has unknown value type {type_id}")


def _read_array(cur: _Cursor, key: str) -> list:
    item_type = cur.u32(f"array type of {key!r}")
    count = cur.u64(f"array length of {key!r}")
    # Every element takes at least one byte (strings at least eight): a count larger than
    # what is left of the file is a lie, refused before any list is built.
    min_size = 8 if item_type == _STRING else _SCALARS.get(item_type, ("", 1))[1]
    if count > MAX_ARRAY:
        raise GGUFFormatError(f"metadata {key!r} claims {count} array elements (at most {MAX_ARRAY} allowed)")
    if count * min_size > cur.remaining():
        raise GGUFFormatError(
            f"metadata {key!r} claims {count} array elements, more than the file's remaining {cur.remaining()} bytes"
        )
    if item_type in _SCALARS:
        fmt, size = _SCALARS[item_type]
        raw = cur.take(count * size, f"array {key!r}")
        return list(struct.unpack(f"<{count}{fmt[1]}", raw))
    return [_read_value(cur, item_type, key, in_array=True) for _ in range(count)]


def _read_tensor_info(cur: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string(f"name of tensor {index}", limit=MAX_KEY_LENGTH)
    n_dims = cur.u32(f"dimension count of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
    shape = tuple(cur.u64(f"dimension of tensor {name!r}") for _ in range(n_dims))
    type_id = cur.u32(f"type of tensor {name!r}")
    offset = cur.u64(f"offset of tensor {name!r}")
    return name, shape, type_id, offset


def _tensor_nbytes(name: str, shape: tuple[int, ...], type_id: int) -> int:
    if type_id not in GGML_TYPES:
        raise GGUFFormatError(f"tensor {name!r} has unknown tensor type {type_id}")
    type_name, block, block_bytes = GGML_TYPES[type_id]
    if any(d <= 0 for d in shape):
        raise GGUFFormatError(f"tensor {name!r} has an empty dimension: {list(shape)}")
    if shape[0] % block:
        raise GGUFFormatError(f"tensor {name!r} ({type_name}) has a row of {shape[0]}, not a multiple of {block}")
    elements = 1
    for d in shape:
        elements *= d  # Python ints: no overflow, compared with the file size below
    return elements // block * block_bytes


def _alignment(metadata: dict) -> int:
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment {alignment!r} is not a power of two")
    return alignment


def _read_counts(cur: _Cursor) -> tuple[int, int, int]:
    if cur.take(4, "magic") != GGUF_MAGIC:
        raise GGUFFormatError("not a GGUF file (bad magic bytes)")
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} is not supported (versions 2 and 3 are)")
    n_tensors, n_kv = cur.u64("tensor count"), cur.u64("metadata count")
    if n_tensors > MAX_TENSORS or n_kv > MAX_METADATA:
        raise GGUFFormatError(
            f"header claims {n_tensors} tensors and {n_kv} metadata entries "
            f"(at most {MAX_TENSORS} and {MAX_METADATA} allowed)"
        )
    # A key/value pair takes at least 13 bytes, a tensor info at least 32.
    if n_kv * 13 > cur.remaining() or n_tensors * 32 > cur.remaining():
        raise GGUFFormatError(f"header claims {n_tensors} tensors and {n_kv} metadata entries; the file is too small")
    return version, n_tensors, n_kv


def read_header(path: Path) -> GGUFHeader:
    """Parse and check a GGUF file's header; raises GGUFFormatError on anything wrong."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        cur = _Cursor(f, size)
        version, n_tensors, n_kv = _read_counts(cur)
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"key of metadata entry {i}", limit=MAX_KEY_LENGTH)
            if key in metadata:
                raise GGUFFormatError(f"metadata key {key!r} appears twice")
            metadata[key] = _read_value(cur, cur.u32(f"type of {key!r}"), key)
        infos = [_read_tensor_info(cur, i) for i in range(n_tensors)]
        alignment = _alignment(metadata)
        data_offset = -(-cur.pos // alignment) * alignment
    tensors = _check_tensors(infos, alignment, data_offset, size)
    header = GGUFHeader(version, metadata, tensors, data_offset, size)
    header.types = {t.type_name for t in tensors}
    return header


def _check_tensors(infos: list, alignment: int, data_offset: int, size: int) -> list[TensorInfo]:
    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for name, shape, type_id, offset in infos:
        if name in seen:
            raise GGUFFormatError(f"tensor {name!r} appears twice")
        seen.add(name)
        nbytes = _tensor_nbytes(name, shape, type_id)
        if offset % alignment:
            raise GGUFFormatError(f"tensor {name!r} offset {offset} is not aligned to {alignment}")
        if data_offset + offset + nbytes > size:
            raise GGUFFormatError(
                f"tensor {name!r} ({nbytes} bytes at data offset {offset}) runs past the end of the file ({size} bytes)"
            )
        tensors.append(TensorInfo(name, shape, type_id, offset, nbytes))
    _check_overlaps(tensors)
    return tensors


def _check_overlaps(tensors: list[TensorInfo]) -> None:
    ordered = sorted(tensors, key=lambda t: t.offset)
    for before, after in zip(ordered, ordered[1:]):
        if before.offset + before.nbytes > after.offset:
            raise GGUFFormatError(f"tensors {before.name!r} and {after.name!r} overlap in the file")


def write_tensor_subset(source: Path, header: GGUFHeader, keep: list[TensorInfo], dest: Path) -> None:
    """A GGUF file with no metadata and only the `keep` tensors, their bytes copied from
    source: lets MLX's reader load the tensors it supports from a file that also holds
    types it does not."""

    def string(text: str) -> bytes:
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw

    infos, offset = [], 0
    for t in keep:
        infos.append(string(t.name) + struct.pack(f"<I{len(t.shape)}QIQ", len(t.shape), *t.shape, t.type_id, offset))
        offset += -(-t.nbytes // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT
    head = GGUF_MAGIC + struct.pack("<IQQ", 3, len(keep), 0) + b"".join(infos)
    with open(source, "rb") as src, open(dest, "wb") as out:
        out.write(head + b"\0" * (-len(head) % DEFAULT_ALIGNMENT))
        for t in keep:
            src.seek(header.data_offset + t.offset)
            remaining = t.nbytes
            while remaining:
                block = src.read(min(remaining, 1 << 20))
                if not block:
                    raise GGUFFormatError(f"{source.name} changed while it was read")
                out.write(block)
                remaining -= len(block)
            out.write(b"\0" * (-t.nbytes % DEFAULT_ALIGNMENT))
