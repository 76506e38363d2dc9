"""Write GGUF files byte by byte, so tests can state exactly which field lies (a key length
of 2^62, 100 dimensions, an unknown tensor type) without any library refusing to write it."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

U32, I32, F32, STRING, ARRAY, U64 = 4, 5, 6, 8, 9, 10
_FORMATS = {U32: "<I", I32: "<i", F32: "<f", U64: "<Q"}


def gguf_string(text: str, claimed_length: int | None = None) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw) if claimed_length is None else claimed_length) + raw


def _value(kind: int, value) -> bytes:
    if kind == STRING:
        return gguf_string(value)
    if kind == ARRAY:
        item_kind, items = value
        body = b"".join(_value(item_kind, v) for v in items)
        return struct.pack("<IQ", item_kind, len(items)) + body
    return struct.pack(_FORMATS[kind], value)


@dataclass
class RawTensor:
    name: str
    dims: list[int]  # GGUF order: the contiguous dimension first
    type_id: int = 0  # F32
    data: bytes = b""
    offset: int | None = None  # None: laid out after the previous tensor


@dataclass
class RawGGUF:
    metadata: list[tuple[str, int, object]] = field(default_factory=list)
    tensors: list[RawTensor] = field(default_factory=list)
    version: int = 3

    def to_bytes(self) -> bytes:
        out = [b"GGUF", struct.pack("<IQQ", self.version, len(self.tensors), len(self.metadata))]
        out += [gguf_string(key) + struct.pack("<I", kind) + _value(kind, value) for key, kind, value in self.metadata]
        offset, blobs = 0, []
        for t in self.tensors:
            at = offset if t.offset is None else t.offset
            out.append(gguf_string(t.name) + struct.pack("<I", len(t.dims)))
            out.append(struct.pack(f"<{len(t.dims)}Q", *t.dims) + struct.pack("<IQ", t.type_id, at))
            blobs.append(t.data + b"\0" * (-len(t.data) % 32))
            offset += len(blobs[-1])
        head = b"".join(out)
        return head + b"\0" * (-len(head) % 32) + b"".join(blobs)

    def write(self, path: Path) -> Path:
        path.write_bytes(self.to_bytes())
        return path


def tiny_llama_metadata(block_count: int = 1, hidden: int = 8, n_tokens: int = 4) -> list:
    return [
        ("general.architecture", STRING, "llama"),
        ("llama.block_count", U32, block_count),
        ("llama.embedding_length", U32, hidden),
        ("llama.feed_forward_length", U32, 16),
        ("llama.attention.head_count", U32, 2),
        ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
        ("tokenizer.ggml.model", STRING, "gpt2"),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, [chr(ord("a") + i) for i in range(n_tokens)])),
    ]


def f32_tensor(name: str, dims: list[int]) -> RawTensor:
    count = 1
    for d in dims:
        count *= d
    return RawTensor(name, dims, 0, struct.pack(f"<{count}f", *([0.5] * count)))
