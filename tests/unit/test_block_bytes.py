"""A block file's bytes parsed and checked without MLX (worker/model/cache/block_bytes.py):
every dtype the KV or a recurrent state can have comes back equal, the digest is the one
block_file.digest wrote (files already on disk still pass), and a malformed or altered file
is refused with a ValueError, never read out of bounds."""

import io
import json
import struct

import mlx.core as mx
import pytest

from mlxgw.worker.model.cache import block_bytes as bb
from mlxgw.worker.model.cache import block_file as bf

DTYPES = [
    "float32", "float16", "bfloat16", "uint8", "int8", "uint16", "int16",
    "uint32", "int32", "uint64", "int64", "bool_",
]  # fmt: skip


def _arrays() -> dict:
    out = {f"x.{n}": (mx.random.normal((2, 3, 5)) * 10).astype(getattr(mx, n)) for n in DTYPES}
    out["complex"] = mx.random.normal((2, 3)) + 1j * mx.random.normal((2, 3))
    out["scalar"] = mx.array(3.0)
    out["strided"] = mx.random.normal((4, 6))[1:3, ::2]  # a view: the digest reads it contiguous
    return out


def _file(arrays: dict, **meta) -> bytes:
    data = io.BytesIO()
    mx.save_safetensors(data, arrays, {"digest": bf.digest(arrays), **meta})
    return data.getvalue()


def _header(data: bytes) -> tuple[dict, bytes]:
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def _with_header(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def test_every_dtype_comes_back_equal_under_the_digest_it_was_written_with():
    arrays = _arrays()
    parsed = bb.checked(_file(arrays, note="kept"))
    assert parsed.meta["note"] == "kept"
    assert bb.digest(parsed) == bf.digest(arrays)
    back = bb.arrays(parsed)
    assert set(back) == set(arrays)
    for name, a in arrays.items():
        assert back[name].dtype == a.dtype and back[name].shape == a.shape, name
        assert mx.array_equal(back[name], a).item(), name


def test_changed_bytes_fail_the_digest():
    data = bytearray(_file(_arrays()))
    data[-3] ^= 0xFF
    with pytest.raises(ValueError, match="digest"):
        bb.checked(bytes(data))


@pytest.mark.parametrize(
    "spoil",
    [
        lambda h, body: (h | {"x.float32": {**h["x.float32"], "data_offsets": [0, len(body) + 4]}}, body),
        lambda h, body: (h | {"x.float32": {**h["x.float32"], "shape": [2, 3, 6]}}, body),
        lambda h, body: (h | {"x.float32": {**h["x.float32"], "dtype": "F64"}}, body),
        lambda h, body: (h | {"x.float32": {**h["x.float32"], "shape": [-2, 3, 5]}}, body),
        lambda h, body: (h | {"__metadata__": {"digest": 5}}, body),
        lambda h, body: (h, body[:-8]),
    ],
    ids=["range past the file", "shape against its bytes", "dtype", "negative shape", "metadata", "torn"],
)
def test_a_malformed_file_is_refused(spoil):
    header, body = _header(_file(_arrays()))
    with pytest.raises(ValueError):
        bb.checked(_with_header(*spoil(header, body)))


def test_a_header_longer_than_the_file_is_refused():
    data = _file(_arrays())
    with pytest.raises(ValueError, match="header"):
        bb.parse(struct.pack("<Q", len(data)) + data[8:])
    with pytest.raises(ValueError):
        bb.parse(b"\x01\x02")
