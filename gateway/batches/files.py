"""The files behind the Files and Batch APIs on disk: private (0600 files in a 0700 folder,
since they hold prompts and answers), written without a whole file in memory, and a line read
back by its offset when its request is sent."""

from __future__ import annotations

import errno
import os
import secrets
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path

FILE_RETENTION_S = float(os.environ.get("MLXGW_FILES_RETENTION_DAYS") or 30) * 86400
# Per key: what its files and its batches' results may hold on disk together, and how many files.
MAX_STORED_BYTES = int(os.environ.get("MLXGW_FILES_MAX_MB_PER_KEY") or 2048) * 1024 * 1024
MAX_FILES = int(os.environ.get("MLXGW_FILES_MAX_PER_KEY") or 100)
_WRITE_CHUNK = 1 << 20


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)


def private_file(path: Path, create: bool) -> None:
    """0600 for a file that exists (one made before this release was 0644), created empty
    with that mode when `create`."""
    if create and not path.exists():
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    if path.exists():
        os.chmod(path, 0o600)


def open_private(path: Path):
    """A new file opened for writing, 0600 from its first byte."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")


def write_results(path: Path, lines: Iterable[str]) -> int:
    """The result lines, one JSON object a line, written through a temporary file (a reader
    sees no half file), buffered a megabyte at a time; the bytes written."""
    tmp = path.with_suffix(".tmp")
    size = 0
    try:
        with open_private(tmp) as f:
            buffered: list[bytes] = []
            pending = 0
            for line in lines:
                data = line.encode() + b"\n"
                buffered.append(data)
                pending += len(data)
                if pending >= _WRITE_CHUNK:
                    f.write(b"".join(buffered))
                    size, buffered, pending = size + pending, [], 0
            f.write(b"".join(buffered))
            size += pending
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def read_line(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def sweep_partial(files_dir: Path, older_than_s: float = 3600.0) -> int:
    """Uploads and outputs a killed gateway left half written (*.part, *.tmp); only old ones,
    since another gateway on this home may be writing one now."""
    swept, cutoff = 0, time.time() - older_than_s
    for pattern in ("*.part", "*.tmp"):
        for path in files_dir.glob(pattern):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    swept += 1
            except OSError:
                continue
    return swept


def is_storage_error(e: BaseException) -> bool:
    """A full disk, a quota or a file-size limit, from a file write or from SQLite."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # EFBIG: RLIMIT_FSIZE
    if isinstance(e, sqlite3.DatabaseError):
        text = str(e).lower()
        return "full" in text or "disk i/o" in text
    return False


def file_object(row) -> dict:
    """A files row in the API's shape."""
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "expires_at": row["expires_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "status_details": None,
    }


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
