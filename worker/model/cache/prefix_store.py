"""The prefix cache across stops: the disk tier of blocks is also the restart tier.

A graceful stop writes the blocks memory holds to the disk tier (worker/model/cache/block_disk.py:
one file per block under `$MLXGW_HOME/prefix-cache/<model>/blocks/`, with its last use and
hits), and the next worker for the model indexes that folder at load: its blocks are known as
on disk and read back on a hit, off the engine thread, like blocks evicted while a worker
runs. One format, one bound (`cache.prefix_disk_mb`), one eviction order
(worker/model/cache/eviction.py) for both.

- Fingerprint (`model_fingerprint`): sha256 over config.json's bytes, the name, size and
  mtime of every weight file, and the mlx-lm version. Cheap (no weight bytes are read) and
  on the safe side: a changed, re-imported or even copied model gets a new one. Block files
  with another fingerprint are deleted when the folder is indexed, with one log line.
- What a stop keeps: stored sequences (a leaf's chain of blocks), hottest first (reused ones,
  then most recent), each written from its first block, while they fit the bound with the
  blocks already on disk; a block already on disk is not written again (its use goes to
  `uses.json`). Blocks on disk that memory did not hold leave first when the bound is short.
- Safety and time: each block file is written to a temporary name, fsynced and renamed
  (a kill mid-write leaves only a temporary file, removed at the next start; a torn file is
  skipped with one log line and deleted); writing stops at SAVE_BUDGET_S, so a stop is never
  held up for long; indexing reads headers only, for at most RESTORE_BUDGET_S.
- The whole-sequence format of earlier versions (`<32 hex>.safetensors` entries and their
  `index.json` in the model's folder) is not read: such files are deleted at load, with one
  log line."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import time
from pathlib import Path

from . import block_file as bf
from . import kv_blocks as kb
from .block_disk import TEMP_PREFIX, BlockDisk
from .prefix_cache import EntryUse, PrefixCache, kb_use
from .prefix_events import ROUTES, PrefixEvents

log = logging.getLogger(__name__)

FINGERPRINT_SALT = "mlxgw-prefix-kv/1"  # part of every fingerprint: kept, so stores stay valid
SAVE_BUDGET_S = 10.0  # a stop waits at most this for the writes (the gateway kills after 30 s)
RESTORE_BUDGET_S = 10.0  # the first request waits at most this for the folder's headers
BLOCKS = "blocks"
OLD_ENTRY = re.compile(r"^(tmp-.*|[0-9a-f]{32}\.safetensors|index\.json)$")  # the whole-sequence format
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz")
DEFAULT_BOUND_MAX_MB = 64 << 10  # the default bound's ceiling (64 GiB) per model


def model_fingerprint(model_path: Path) -> str:
    import mlx_lm

    digest = hashlib.sha256(f"{FINGERPRINT_SALT}\0mlx-lm {mlx_lm.__version__}\0".encode())
    digest.update((model_path / "config.json").read_bytes())
    for f in sorted(model_path.iterdir()):
        if f.name.endswith(WEIGHT_SUFFIXES):
            st = f.stat()  # follows links (hub-cache snapshots): the blob's own size and time
            digest.update(f"\0{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


def hotness(use: EntryUse) -> tuple[bool, float]:
    """The order sequences are saved in, hottest first: reused ones, then most recent."""
    return use.hits > 0, use.last_used


class PrefixStore:
    def __init__(self, directory: Path, fingerprint: str, max_bytes: int):
        self.dir = directory
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.live: BlockDisk | None = None  # the disk tier, once attached to a cache

    def attach(self, cache: PrefixCache, budget_s: float = RESTORE_BUDGET_S) -> BlockDisk:
        """The cache's disk tier in this store's folder, indexed the first time (headers only)."""
        if cache.disk_tier is None or cache.disk_tier.dir != self.dir / BLOCKS:
            cache.disk_tier = BlockDisk(self.dir / BLOCKS, self.fingerprint, self.max_bytes, budget_s)
        cache.disk_tier.on_gone = cache.left
        self.live = cache.disk_tier
        return self.live

    # -- load ------------------------------------------------------------------------------------
    def restore(self, cache: PrefixCache, budget_s: float = RESTORE_BUDGET_S) -> dict:
        """Index the blocks on disk for the cache: a lookup reaching them reads them back."""
        started = time.monotonic()
        self._remove_old_format()
        disk = self.attach(cache, budget_s)
        cache.events = PrefixEvents.load(self.dir, disk.index) or cache.events  # where replicas route by prefix
        report = {
            "indexed_blocks": len(disk.index),
            "indexed_tokens": sum(len(h.tokens) for h in disk.index.values()),
            "indexed_bytes": disk.nbytes,
            "refused": disk.counts["refused"],
            "skipped": disk.counts["skipped"],
        }
        self._report(cache, report, started)
        if disk.index:
            log.info(
                "prefix cache: %d blocks (%d tokens, %.1f MB) on disk in %s, indexed in %.2f s",
                report["indexed_blocks"],
                report["indexed_tokens"],
                report["indexed_bytes"] / 1e6,
                disk.dir,
                report["restore_s"],
            )
        return report

    def _remove_old_format(self) -> None:
        if not self.dir.is_dir():
            return
        old = [p for p in self.dir.iterdir() if OLD_ENTRY.match(p.name)]
        for path in old:
            path.unlink(missing_ok=True)  # a link or FIFO goes too; nothing of it is read
        if old:
            log.warning(
                "prefix cache: deleted %d files of the whole-sequence format in %s (its blocks in %s/ replace them)",
                len(old),
                self.dir,
                BLOCKS,
            )

    # -- stop ------------------------------------------------------------------------------------
    def save(self, cache: PrefixCache, budget_s: float = SAVE_BUDGET_S) -> dict:
        """Write the blocks memory holds to the disk tier, hottest sequences first, until the
        bound is full or the time budget is spent; record every block's use."""
        started = time.monotonic()
        disk = self.attach(cache)
        written = 0
        for block in self._plan(cache, disk):
            if block.key not in disk.index and time.monotonic() - started > budget_s:
                log.warning("prefix cache: writing stopped at its %g s budget", budget_s)
                break
            written += disk.keep(block, bound=False)
        held = set(cache.tree.blocks)
        disk.bound(last=held)  # blocks of earlier stops or evictions leave before these
        disk.save_uses()
        if cache.events is not None:  # the next worker tells a restarted gateway what it holds
            cache.events.save(self.dir, disk.index)
        kept = sum(1 for key in held if key in disk.index)
        report = {"saved_blocks": kept, "written_blocks": written, "saved_bytes": disk.nbytes}
        self._report(cache, report, started, "save_s")
        log.info(
            "prefix cache: %d blocks of memory's %d on disk (%d newly written; %.1f MB in %s), %.2f s",
            kept,
            len(held),
            written,
            disk.nbytes / 1e6,
            disk.dir,
            report["save_s"],
        )
        return report

    def _plan(self, cache: PrefixCache, disk: BlockDisk) -> list[kb.Block]:
        """Memory's blocks to keep, by sequence (hottest first, each from its first block):
        a sequence whose blocks would not fit the bound is left out, a smaller one after it
        may still fit. Blocks on disk already count at their file's size."""
        chains = sorted((leaf.chain() for leaf in cache.tree.leaves()), key=lambda c: hotness(kb_use(c)), reverse=True)
        planned: dict[bytes, kb.Block] = {}
        room = self.max_bytes
        for chain in chains:
            new = [b for b in chain if b.key not in planned]
            size = sum(disk.index[b.key].nbytes if b.key in disk.index else _file_bytes(b) for b in new)
            if size <= room:
                room -= size
                planned.update((b.key, b) for b in new)
        return list(planned.values())

    # -- clear, report ---------------------------------------------------------------------------
    def clear(self) -> None:
        """Forget every stored block (DELETE /v1/cache clears the disk copy too)."""
        if self.live is not None:
            self.live.clear()
        (self.dir / ROUTES).unlink(missing_ok=True)
        folder = self.dir / BLOCKS
        if folder.is_dir():
            for path in folder.iterdir():
                if path.name.endswith(".safetensors") or path.name in (bf.USES,) or path.name.startswith(TEMP_PREFIX):
                    path.unlink(missing_ok=True)

    def _report(self, cache: PrefixCache, report: dict, started: float, took: str = "restore_s") -> dict:
        """report, with the seconds it took under `took`, into the cache's stats (/v1/status)."""
        report[took] = round(time.monotonic() - started, 3)
        cache.disk = {**(cache.disk or {}), **report}
        return report


def _file_bytes(block: kb.Block) -> int:
    """A block's file size, estimated: its arrays and a header with an entry per array (about
    90 bytes), its tokens as JSON and fixed metadata. The bound is checked on the real sizes
    once written; this only keeps a stop from writing files it would delete."""
    arrays = sum(len(kb.piece_arrays(p)) for p in block.pieces) + 4 * len(block.checkpoints)
    return block.nbytes + 512 + 96 * arrays + 12 * len(block.tokens)


def default_bound_mb(home: Path) -> int:
    """cache.prefix_disk_mb when the entry sets none: a tenth of the disk's free space at
    the worker's start (it reads a session back ~60x sooner than it prefills it on a Mac),
    at most DEFAULT_BOUND_MAX_MB; 0 (off) when the free space cannot be read."""
    folder = home
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return 0
    return min(DEFAULT_BOUND_MAX_MB, (free // 10) >> 20)


def store_for(model_name: str, model_path: Path, max_mb: int | None) -> PrefixStore | None:  # None: off
    from ....shared.paths import home

    max_mb = default_bound_mb(home()) if max_mb is None else max_mb  # None: sized from free disk
    if max_mb <= 0:
        return None
    try:
        fingerprint = model_fingerprint(model_path)
    except OSError as e:
        log.warning("prefix cache on disk is off for %s: %s", model_name, e)
        return None
    # Replicas of one model on this host (the gateway's `routing.replicas`) each keep their own.
    replica = os.environ.get("MLXGW_REPLICA")
    folder = f"{model_name}@{replica}" if replica else model_name
    return PrefixStore(home() / "prefix-cache" / folder, fingerprint, max_mb << 20)


def restore_into(runner) -> None:
    """Index a runner's prefix cache's blocks on disk (runners without a store: nothing)."""
    store: PrefixStore | None = getattr(runner, "prefix_store", None)
    try:
        if store is not None:
            store.restore(runner.prefix_cache)
    except Exception:  # the store is an optimisation: a failure here must not stop serving
        log.exception("prefix cache: restore failed; starting cold")


def save_from(runner) -> None:
    store: PrefixStore | None = getattr(runner, "prefix_store", None)
    try:
        if store is not None:
            store.save(runner.prefix_cache)
    except Exception:  # as above: the stop goes on, the next start is cold
        log.exception("prefix cache: save failed")
