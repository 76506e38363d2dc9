"""The pieces of a disk-tier block file (worker/model/cache/block_disk.py) that are plain data:
a block's KV pieces as named arrays and back, the blocks' use kept beside their files
(`uses.json`), and the fsync that makes a rename survive a crash."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

from mlxgw.worker.model.cache import kv_blocks as kb
from mlxgw.worker.model.cache import state_checkpoints as sc

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
    """uses.json written crash-safe (temporary name, fsync, rename, folder fsync)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    temp = folder / f"{TEMP_PREFIX}{USES}-{os.getpid()}"
    try:
        temp.write_text(json.dumps({"format": fmt, "fingerprint": fingerprint, "blocks": blocks}))
        fsync_path(temp)
        os.chmod(temp, 0o600)
        os.replace(temp, folder / USES)
    finally:
        temp.unlink(missing_ok=True)
    fsync_path(folder)  # the stop's renames (blocks and uses) survive a crash after it


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (after a rename, so the new name survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
