"""Files replaced whole: a reader, or a crash, sees the old file or the new one, never a part.

One writer for every file mlxgw rewrites (keys, the model registry, clients' configs, the
audit head, prefix-cache blocks): a uniquely named temporary file in the same folder, created
exclusively (a planted link is never followed), owner-only unless told otherwise, synced, renamed
over the target; an error (a full disk) leaves no temporary file behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(
    path: Path,
    data: bytes | bytearray | memoryview | str,
    *,
    mode: int = 0o600,
    prefix: str | None = None,
    sync_folder: bool = True,
) -> None:
    """`data` under `path`. `prefix` names the temporary file (a cleaner that removes what a
    killed write left finds it by that prefix); `sync_folder=False` skips syncing the rename,
    for files whose loss after a crash costs only a recomputation."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix or f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if sync_folder:
        fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    """Sync a file or a folder (a folder's sync makes its renames survive a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
