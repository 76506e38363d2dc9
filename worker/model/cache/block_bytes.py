"""A block file's bytes parsed and checked without MLX, so that the disk tier's reader thread
can do it (worker/model/cache/block_reader.py) and the engine thread only copies arrays.

A block file is safetensors (an 8-byte little-endian header length, a JSON header naming
each array's dtype, shape and byte range, then the bytes). Read back on the engine thread
with `mx.load` and its digest computed there, a block of SmolLM2-135M's KV (32 positions, 60
arrays, 1.5 MB) took ~17 ms of that thread; 24 agent sessions whose warm turns read ~17
blocks each from disk spent 14% of the engine thread there, while every decoding row waited
(py-spy over the warm turns of `mlxgw bench team sessions --sessions 24`). Here the header
is parsed with `json`, the digest (block_file.digest's, byte for byte the same value, so files
already written still pass) hashed with `hashlib` (which releases the GIL), and the engine
thread builds each array from its bytes with numpy: 0.34 ms a block against 3.6 ms for
`mx.load` alone.

The format is parsed by hand, not with the `safetensors` package: its reader returns no
metadata from bytes and its numpy side has no bfloat16, which a bfloat16 model's KV is."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass

import numpy as np

# safetensors dtype -> (mlx.core's name for it, numpy's dtype of its bytes): bfloat16 travels
# as uint16 and is viewed back; float64 is absent (mx.save_safetensors refuses it).
DTYPES = {
    "F32": ("float32", np.float32),
    "F16": ("float16", np.float16),
    "BF16": ("bfloat16", np.uint16),
    "U8": ("uint8", np.uint8),
    "I8": ("int8", np.int8),
    "U16": ("uint16", np.uint16),
    "I16": ("int16", np.int16),
    "U32": ("uint32", np.uint32),
    "I32": ("int32", np.int32),
    "U64": ("uint64", np.uint64),
    "I64": ("int64", np.int64),
    "BOOL": ("bool", np.bool_),
    "C64": ("complex64", np.complex64),
}
MAX_HEADER_BYTES = 16 << 20  # a block's header is a few KB (its tokens and layouts)


@dataclass(frozen=True)
class Tensor:
    dtype: str  # mlx.core's name: "float32", "bfloat16", ...
    shape: tuple[int, ...]
    data: memoryview  # its bytes, C order


@dataclass(frozen=True)
class BlockBytes:
    """A block file's metadata and arrays, still bytes."""

    meta: dict[str, str]
    tensors: dict[str, Tensor]


def parse(data: bytes) -> BlockBytes:
    """The header and each array's bytes; ValueError for anything not a well-formed file
    (a torn write, a header pointing outside the file, a size its shape disagrees with)."""
    view = memoryview(data)
    if len(view) < 8:
        raise ValueError("shorter than a safetensors header")
    (size,) = struct.unpack("<Q", view[:8])
    if size > min(MAX_HEADER_BYTES, len(view) - 8):
        raise ValueError("its header runs past the file")
    header = json.loads(bytes(view[8 : 8 + size]))
    if not isinstance(header, dict):
        raise ValueError("its header is not a map")
    body = view[8 + size :]
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("its metadata is not a map of strings")
    tensors = {name: _tensor(name, entry, body) for name, entry in header.items()}
    return BlockBytes(meta, tensors)


def _tensor(name: str, entry: object, body: memoryview) -> Tensor:
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        raise ValueError(f"array {name!r}: no dtype this file can hold")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"array {name!r}: malformed shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise ValueError(f"array {name!r}: malformed byte range")
    start, end = offsets
    mx_name, np_dtype = DTYPES[entry["dtype"]]
    if not 0 <= start <= end <= len(body) or end - start != math.prod(shape) * np.dtype(np_dtype).itemsize:
        raise ValueError(f"array {name!r}: its byte range disagrees with its shape or the file")
    return Tensor(mx_name, tuple(shape), body[start:end])


def digest(block: BlockBytes) -> str:
    """block_file.digest of the arrays these bytes hold, without making them."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(block.tensors):
        t = block.tensors[name]
        h.update(f"{name}:mlx.core.{t.dtype}:{t.shape};".encode())
        h.update(t.data)
    return h.hexdigest()


def checked(data: bytes) -> BlockBytes:
    """Parsed, and its arrays those its digest was written for (no MLX call: the reader
    thread runs it)."""
    block = parse(data)
    if block.meta.get("digest") != digest(block):
        raise ValueError("its arrays do not match the digest written with them")
    return block


def arrays(block: BlockBytes) -> dict:
    """The arrays, made on the calling (engine) thread: each a copy of its bytes."""
    import mlx.core as mx

    out = {}
    for name, t in block.tensors.items():
        np_dtype = DTYPES_BY_MX[t.dtype]
        a = mx.array(np.frombuffer(t.data, dtype=np_dtype).reshape(t.shape))
        out[name] = a.view(mx.bfloat16) if t.dtype == "bfloat16" else a
    return out


DTYPES_BY_MX = {mx_name: np_dtype for mx_name, np_dtype in DTYPES.values()}
