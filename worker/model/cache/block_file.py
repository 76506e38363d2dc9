"""The pieces of a disk-tier block file (worker/model/cache/block_disk.py) that are plain data:
a block's KV pieces as named arrays and back, the blocks' use kept beside their files
(`uses.json`), the fsync that makes a rename survive a crash, and what a file read back must
pass: a regular file of the size indexed (never a link out of the folder, a FIFO, or a file
that grew), arrays that match the digest written with them (a planted file with a copied
header and other contents), and each layer's shapes and dtypes those of this model's KV."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from pathlib import Path

from ....shared.atomic_file import write_atomically
from . import kv_blocks as kb
from . import state_checkpoints as sc

log = logging.getLogger(__name__)

USES = "uses.json"  # blocks' last use and hits, newer than their headers (a graceful stop writes it)
TEMP_PREFIX = "tmp-"  # a name a start removes: left by a write that was killed


def encode_piece(piece, name: str, arrays: dict):
    """A piece's arrays into `arrays` under names from `name`; its layout (JSON) returned."""
    if piece is None:
        return None
    if isinstance(piece, tuple):
        return [encode_piece(p, f"{name}.{i}", arrays) for i, p in enumerate(piece)]
    arrays.update({f"{name}.k{i}": a for i, a in enumerate(piece.keys)})
    arrays.update({f"{name}.v{i}": a for i, a in enumerate(piece.values)})
    return {"k": len(piece.keys), "v": len(piece.values)}


def decode_piece(layout, name: str, arrays: dict):
    if layout is None:
        return None
    if isinstance(layout, list):
        return tuple(decode_piece(p, f"{name}.{i}", arrays) for i, p in enumerate(layout))
    keys = tuple(arrays[f"{name}.k{i}"] for i in range(layout["k"]))
    return kb.KVPiece(keys, tuple(arrays[f"{name}.v{i}"] for i in range(layout["v"])))


def snapshot_arrays(snap: list) -> list:
    return [a for item in snap for a in sc._arrays(item)]


def regular_file(path: Path) -> bool:
    """A link, FIFO, socket or device can block a read or lead out of the folder."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def read_regular(path: Path, max_bytes: int | None = None) -> bytes:
    """A block file's bytes: refused when it is a link, not a regular file, or longer than
    max_bytes (the size it was indexed with)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if max_bytes is not None and info.st_size != max_bytes:
            raise ValueError(f"{info.st_size} bytes where {max_bytes} were indexed")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(info.st_size + 1)
    finally:
        os.close(fd)
    if max_bytes is not None and len(data) != max_bytes:
        raise ValueError("it changed while it was read")
    return data


def digest(arrays: dict) -> str:
    """Of every array's name, dtype, shape and bytes, in name order (block_bytes.digest
    computes the same from a file's bytes)."""
    import mlx.core as mx

    names = sorted(arrays)
    dense = [mx.contiguous(arrays[name]) for name in names]
    mx.eval(dense)  # at once: one evaluation per array was half of the write's time
    h = hashlib.blake2b(digest_size=16)
    for name, a in zip(names, dense):
        h.update(f"{name}:{a.dtype}:{tuple(a.shape)};".encode())
        h.update(memoryview(a))
    return h.hexdigest()


def layout_of(pieces: list) -> list:
    """Per layer, each array's dtype and shape less its positions axis: what every block of
    one model shares."""

    def one(piece):
        if piece is None:
            return None
        if isinstance(piece, tuple):
            return [one(p) for p in piece]
        return [(str(a.dtype), tuple(a.shape[:-2]) + tuple(a.shape[-1:])) for a in (*piece.keys, *piece.values)]

    return [one(p) for p in pieces]


def check_like(block, reference: list | None) -> None:
    """Refuse a block read back whose layers differ from this model's (reference: layout_of
    a block memory holds; None when none is known yet)."""
    if reference is not None and layout_of(block.pieces) != reference:
        raise ValueError("its layers' shapes or dtypes are not this model's")


def read_uses(folder: Path, fingerprint: str) -> dict[str, tuple[float, int]]:
    """uses.json's last use and hits per block key (hex); {} when absent or unusable."""
    path = folder / USES
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        if not regular_file(path):  # a FIFO would block the starting worker
            raise ValueError("not a regular file")
        data = json.loads(path.read_text())
        if data.get("fingerprint") != fingerprint:
            return {}
        return {k: (float(u), int(h)) for k, (u, h) in data["blocks"].items()}
    except Exception as e:  # the headers' own use is the fallback
        log.warning("prefix cache: %s is unusable (%s); blocks keep the use their files hold", path, e)
        return {}


def write_uses(folder: Path, fmt: str, fingerprint: str, blocks: dict[str, list]) -> None:
    """uses.json written crash-safe; the folder synced, so the stop's renames (blocks and uses)
    survive a crash after it."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = json.dumps({"format": fmt, "fingerprint": fingerprint, "blocks": blocks})
    write_atomically(folder / USES, data, prefix=f"{TEMP_PREFIX}{USES}-")
