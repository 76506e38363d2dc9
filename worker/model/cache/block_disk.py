"""The disk tier of the prefix cache: blocks evicted from memory, read back on a hit; the
blocks memory holds at a graceful stop come here too (worker/model/cache/prefix_store.py), so
one store and one format serve both a running worker and the next one.

A block the in-memory bound evicts (worker/model/cache/prefix_cache.py) is written here, one safetensors
file per block, under `$MLXGW_HOME/prefix-cache/<model>/blocks/`; a lookup whose chain of
block keys reaches a block that is here reads it back into memory before assembling the
row's cache, so a session evicted by others resumes at disk speed instead of prefilling again.
The index of what is here (key, parent, tokens, size, last use) is kept in memory and rebuilt
from the files' headers at start, so blocks written by an earlier worker serve this one.

- Bound: `cache.prefix_disk_mb`; past it blocks are deleted by recency, hits and cost to
  recompute (worker/model/cache/eviction.py), those no other block here continues first.
- Use: each file's header holds its block's last use and hits when written; `uses.json`
  (rewritten at each graceful stop) holds them for blocks written earlier and used since,
  so the eviction order survives a restart. A file with another fingerprint is deleted,
  counted in `refused` and logged once.
- Format: the block's KV pieces by name, its checkpoints' state layers (class and state,
  as mlx-lm's save_prompt_cache writes them), and JSON metadata: format, model
  fingerprint, key, parent key, first position, tokens, layouts. A file with another
  fingerprint is deleted when read.
- Crash safety: written to a temporary name, fsynced, renamed; a torn or inconsistent file
  is skipped with one log line and deleted, never a crash.
- Files changed under a running worker (block_file.py checks each read): a link, a file of
  another size than indexed, arrays that do not match the digest written with them, or
  shapes and dtypes other than the blocks memory holds: skipped, deleted, and the row
  computes what it missed. A full disk (ENOSPC, a quota, a file-size limit) pauses writing
  for FULL_PAUSE_S with one log line; blocks stay in memory's tier until they are evicted."""

from __future__ import annotations

import errno
import heapq
import io
import json
import logging
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ....shared.atomic_file import write_atomically
from . import block_bytes
from . import block_file as bf
from . import kv_blocks as kb
from . import state_checkpoints as sc
from .block_reader import BlockReader
from .eviction import Clock

log = logging.getLogger(__name__)

FORMAT = "mlxgw-prefix-block/2"  # /2: a digest of the arrays (files of /1 are skipped and deleted)
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
FULL_PAUSE_S = 60.0  # after a full disk, no write is tried for this long
SCAN_BUDGET_S = 5.0  # headers read at start at most this long; the files left are deleted
TEMP_PREFIX = bf.TEMP_PREFIX  # a name a start removes: left by a write that was killed
SUFFIX = ".safetensors"


@dataclass
class DiskBlock:
    key: bytes
    parent: bytes
    start: int
    tokens: tuple[int, ...]
    path: Path
    nbytes: int
    used_at: float
    hits: int = 0
    priority: float = 0.0  # eviction order (worker/model/cache/eviction.py): lowest first
    marks: frozenset[int] = frozenset()  # positions of the checkpoints its file holds

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class BlockDisk:
    def __init__(self, directory: Path, fingerprint: str, max_bytes: int, scan_budget_s: float = SCAN_BUDGET_S):
        self.dir = directory
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.index: dict[bytes, DiskBlock] = {}
        self.children: dict[bytes, set[bytes]] = {}  # parent key -> keys here
        self.nbytes = 0
        self.counts = {"written": 0, "read": 0, "skipped": 0, "refused": 0, "deleted": 0, "write_failed": 0}
        self._full_until = 0.0  # monotonic time before which no write is tried (the disk was full)
        self._layout: list | None = None  # this model's layers' dtypes and shapes (block_file.layout_of)
        self.reader = BlockReader(block_bytes.checked)  # reads and checks files off the engine thread (prefetch)
        self.clock = Clock()
        self.on_gone: Callable[[bytes], None] | None = None  # told each key that leaves (prefix_events)
        self._scan(scan_budget_s)

    # -- write -----------------------------------------------------------------------------------
    def keep(self, block: kb.Block, bound: bool = True) -> bool:
        """A block leaving memory (or saved at a stop): written here unless already here
        with its checkpoints (then only its use is updated); whether it was written.
        bound=False: the caller bounds the folder once it has written them all."""
        held = self.index.get(block.key)
        if held is not None:
            held.used_at, held.hits = max(held.used_at, block.used_at), max(held.hits, block.hits)
            held.priority = self.clock.priority(held.end, held.hits)
            if set(block.checkpoints) <= held.marks:
                return False
            self._drop(block.key)  # it took checkpoints since it was written: written again
        if block.nbytes > self.max_bytes or time.monotonic() < self._full_until:
            return False
        try:
            path, size = self._write(block)
        except Exception as e:  # the disk tier saves time later; a failed write costs that block only
            self.counts["write_failed"] += 1
            if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
                self._full_until = time.monotonic() + FULL_PAUSE_S
                log.warning("prefix cache: the disk is full (%s); no block is written for %g s", e, FULL_PAUSE_S)
            else:
                log.exception("prefix cache: writing a block to disk failed")
            return False
        parent = block.parent.key if block.parent is not None else kb.ROOT
        used = max(block.used_at, held.used_at if held is not None else 0.0) or time.time()
        hits = max(block.hits, held.hits if held is not None else 0)
        marks = frozenset(block.checkpoints)
        self._layout = bf.layout_of(block.pieces)
        self._add(DiskBlock(block.key, parent, block.start, block.tokens, path, size, used, hits, marks=marks))
        self.counts["written"] += 1
        if bound:
            self.bound()
        return True

    def _write(self, block: kb.Block) -> tuple[Path, int]:
        arrays: dict[str, mx.array] = {}
        pieces = [bf.encode_piece(p, f"p{i}", arrays) for i, p in enumerate(block.pieces)]
        marks = sc.Checkpoints([], dict(block.checkpoints), set(block.boundaries))
        layout, extra = sc.to_layout(marks, len(block.pieces))
        scalars: dict = {}  # a layer's state holds numbers, strings and None besides arrays
        for j, layer in enumerate(extra):
            for k, v in tree_flatten(layer.state):
                (arrays if isinstance(v, mx.array) else scalars)[f"c{j}.{k}"] = v
        meta = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "key": block.key.hex(),
            "parent": block.parent.key.hex() if block.parent is not None else "",
            "start": str(block.start),
            "tokens": json.dumps(list(block.tokens)),
            "pieces": json.dumps(pieces),
            "checkpoints": json.dumps(layout),
            "classes": json.dumps([type(layer).__name__ for layer in extra]),
            "scalars": json.dumps(scalars),
            "used_at": repr(block.used_at),
            "hits": str(block.hits),
            "digest": bf.digest(arrays),
        }
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.dir / f"{block.key.hex()}{SUFFIX}"
        data = io.BytesIO()
        mx.save_safetensors(data, arrays, meta)  # in memory: Python's own write raises on a full disk
        write_atomically(path, data.getbuffer(), prefix=f"{TEMP_PREFIX}{block.key.hex()}-", sync_folder=False)
        # No fsync of the directory per block: a crash may lose a rename (a block to compute
        # again), never leave a torn file under a block's name; one sync per file is enough.
        return path, path.stat().st_size

    # -- read ------------------------------------------------------------------------------------
    def bring_back(self, tree: kb.BlockTree, prompt: list[int]) -> int:
        """Read into memory the blocks here along a prompt's chain (those memory lacks);
        returns how many of the prompt's tokens came back."""
        if not self.index:
            return 0
        node, pos, back = None, 0, 0
        while True:
            parent = node.key if node is not None else kb.ROOT
            here = tree.children_of(node)
            if pos + kb.BLOCK_TOKENS <= len(prompt):
                key = kb.chain_key(parent, prompt[pos : pos + kb.BLOCK_TOKENS])
                block = here.get(key)
                if block is None and key in self.index:
                    block = self._load(key, node, tree)
                    back += len(block.tokens) if block is not None else 0
                if block is not None:
                    node, pos = block, pos + kb.BLOCK_TOKENS
                    continue
            rest = tuple(prompt[pos : pos + kb.BLOCK_TOKENS])
            in_memory = max((kb.common_prefix(c.tokens, rest) for c in here.values()), default=0)
            shared, key = max(
                ((kb.common_prefix(self.index[k].tokens, rest), k) for k in self.children.get(parent, ())),
                default=(0, b""),
            )
            if shared > in_memory and key not in tree.blocks:
                back += shared if self._load(key, node, tree) is not None else 0
            return back

    def prefetch(self, tree: kb.BlockTree, prompt: list[int]) -> bool:
        """Start reading, off the engine thread, the files of the blocks along a prompt's
        chain that are here and not in memory; whether every such read has ended (the row
        may be admitted: bring_back then parses bytes already read)."""
        keys = self._missing(tree, prompt)
        for key in keys:
            self.reader.start(key, self.index[key].path, self.index[key].nbytes)
        return all(self.reader.ended(key) for key in keys)

    def _missing(self, tree: kb.BlockTree, prompt: list[int]) -> list[bytes]:
        """The keys bring_back would read for this prompt. A block's key depends on its
        tokens alone, so the chain is walked by keys without loading anything."""
        if not self.index:
            return []
        parent, pos, out = kb.ROOT, 0, []
        while pos + kb.BLOCK_TOKENS <= len(prompt):
            key = kb.chain_key(parent, prompt[pos : pos + kb.BLOCK_TOKENS])
            if key not in tree.blocks and key not in self.index:
                break
            if key not in tree.blocks:
                out.append(key)
            parent, pos = key, pos + kb.BLOCK_TOKENS
        rest = tuple(prompt[pos : pos + kb.BLOCK_TOKENS])
        node = tree.blocks.get(parent)
        here = tree.children_of(node) if node is not None or parent == kb.ROOT else {}
        in_memory = max((kb.common_prefix(c.tokens, rest) for c in here.values()), default=0)
        shared, key = max(
            ((kb.common_prefix(self.index[k].tokens, rest), k) for k in self.children.get(parent, ())),
            default=(0, b""),
        )
        if shared > in_memory and key not in tree.blocks:
            out.append(key)
        return out

    def _load(self, key: bytes, parent: kb.Block | None, tree: kb.BlockTree) -> kb.Block | None:
        held = self.index[key]
        try:
            block = self._read(held, parent)
            bf.check_like(block, self._reference(tree))
        except Exception as e:  # a torn or foreign file costs that block only
            log.warning("prefix cache: skipped block file %s: %s", held.path.name, e)
            self.counts["skipped"] += 1
            self._drop(key)
            return None
        tree.add(block)
        tree.touch(block)
        held.used_at, block.hits = block.used_at, max(block.hits, held.hits)
        held.priority = self.clock.priority(held.end, held.hits)
        self.counts["read"] += 1
        return block

    def _read(self, held: DiskBlock, parent: kb.Block | None) -> kb.Block:
        import mlx_lm.models.cache as mc

        from . import quantized_kv  # noqa: F401  (registers the quantized row class for loading)

        # read, parsed and its digest checked off the engine thread, when prefetched
        read = self.reader.take(held.key)
        parsed = read if read is not None else block_bytes.checked(bf.read_regular(held.path, held.nbytes))
        meta = parsed.meta
        if meta.get("format") != FORMAT or meta.get("fingerprint") != self.fingerprint:
            raise ValueError("written for another format or model")
        if meta.get("key") != held.key.hex() or json.loads(meta["tokens"]) != list(held.tokens):
            raise ValueError("its key or tokens disagree with its name")
        arrays = block_bytes.arrays(parsed)
        pieces = [bf.decode_piece(p, f"p{i}", arrays) for i, p in enumerate(json.loads(meta["pieces"]))]
        for p in pieces:
            for a in kb.piece_arrays(p):
                if a.shape[-2] != len(held.tokens):
                    raise ValueError("a layer holds another number of positions")
        extra, values = [], {**arrays, **json.loads(meta["scalars"])}
        for j, name in enumerate(json.loads(meta["classes"])):
            prefix = f"c{j}."
            state = tree_unflatten([(k[len(prefix) :], v) for k, v in values.items() if k.startswith(prefix)])
            extra.append(getattr(mc, name).from_state(state))
        layout = json.loads(meta["checkpoints"])
        end = held.start + len(held.tokens)
        if not sc.valid_layout(layout, end):
            raise ValueError("malformed checkpoints")
        marks = sc.from_layout([0] * end, layout, extra)
        states = [a for snap in marks.states.values() for a in bf.snapshot_arrays(snap)]
        mx.eval([a for p in pieces for a in kb.piece_arrays(p)] + states)
        block = kb.Block(held.key, parent, held.tokens, held.start, pieces, dict(marks.states), set(marks.priority))
        block.used_at, block.hits = held.used_at, held.hits
        return block

    def _reference(self, tree: kb.BlockTree) -> list | None:
        """The layers' dtypes and shapes of the blocks memory holds (this model's KV), or of
        the last block written here; None before any."""
        block = next(iter(tree.blocks.values()), None)
        if block is not None:
            self._layout = bf.layout_of(block.pieces)
        return self._layout

    # -- index -----------------------------------------------------------------------------------
    def _scan(self, budget_s: float) -> None:
        if not self.dir.is_dir():
            return
        started = time.monotonic()
        uses = bf.read_uses(self.dir, self.fingerprint)
        for path in sorted(self.dir.iterdir()):
            if path.name.startswith(TEMP_PREFIX):  # left by a killed write
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            if time.monotonic() - started > budget_s:  # unindexed, it would escape the bound
                path.unlink(missing_ok=True)
                self.counts["deleted"] += 1
                continue
            try:
                if not stat.S_ISREG(path.lstat().st_mode):  # a FIFO would block the starting worker
                    raise ValueError("not a regular file")
                _, meta = mx.load(str(path), return_metadata=True)  # lazy: a torn file fails here
                if meta.get("format") != FORMAT:
                    raise ValueError("not a block file of this format")
                if meta.get("fingerprint") != self.fingerprint:
                    self.counts["refused"] += 1
                    path.unlink(missing_ok=True)
                    continue
                key = bytes.fromhex(meta["key"])
                if path.name != f"{key.hex()}{SUFFIX}":
                    raise ValueError("its key disagrees with its name")
                tokens = tuple(int(t) for t in json.loads(meta["tokens"]))
                layout = json.loads(meta["checkpoints"])
                if not sc.valid_layout(layout, int(meta["start"]) + len(tokens)):
                    raise ValueError("malformed checkpoints")
                used_at, hits = uses.get(key.hex(), (0.0, 0))
                held = DiskBlock(
                    key, bytes.fromhex(meta["parent"]), int(meta["start"]), tokens, path, path.stat().st_size,
                    max(float(meta.get("used_at", 0)), used_at), max(int(meta.get("hits", 0)), hits),
                    marks=frozenset(m[0] for m in layout["at"]),
                )  # fmt: skip
            except Exception as e:  # whatever is wrong with one file costs that file only
                log.warning("prefix cache: skipped block file %s: %s", path.name, e)
                self.counts["skipped"] += 1
                path.unlink(missing_ok=True)
                continue
            self._add(held)
        if self.counts["refused"]:
            log.warning(
                "prefix cache: %d block files in %s were written for a different version of the model; deleted",
                self.counts["refused"],
                self.dir,
            )
        self.bound()

    def save_uses(self) -> None:
        """Write every block's last use and hits (crash-safe): what memory did with blocks
        already here survives a restart without writing their KV again."""
        blocks = {h.key.hex(): [h.used_at, h.hits] for h in self.index.values()}
        bf.write_uses(self.dir, FORMAT, self.fingerprint, blocks)

    def _add(self, held: DiskBlock) -> None:
        held.priority = self.clock.priority(held.end, held.hits)
        self.index[held.key] = held
        self.children.setdefault(held.parent, set()).add(held.key)
        self.nbytes += held.nbytes

    def _drop(self, key: bytes) -> None:
        held = self.index.pop(key, None)
        self.reader.forget(key)
        if held is None:
            return
        self.children.get(held.parent, set()).discard(key)
        self.nbytes -= held.nbytes
        held.path.unlink(missing_ok=True)
        if self.on_gone is not None:
            self.on_gone(key)

    def bound(self, last: set[bytes] | frozenset[bytes] = frozenset()) -> None:
        """Blocks leave, lowest priority first (recency, hits and cost to recompute:
        worker/model/cache/eviction.py), until the rest fit; those in `last` (what memory held
        at a stop) after all others. Only blocks no other block here continues leave: a
        chain read back from its first block never misses a middle one."""
        if self.nbytes <= self.max_bytes:
            return

        def order(h: DiskBlock) -> tuple:
            return (h.key in last, h.priority, h.used_at, h.key)

        heap = [order(h) for h in self.index.values() if not self.children.get(h.key)]
        heapq.heapify(heap)
        while self.nbytes > self.max_bytes and heap:
            _, priority, _, key = heapq.heappop(heap)
            held = self.index.get(key)
            if held is None or self.children.get(key):
                continue
            self._drop(key)
            self.clock.evicted(priority)
            self.counts["deleted"] += 1
            parent = self.index.get(held.parent)
            if parent is not None and not self.children.get(parent.key):
                heapq.heappush(heap, order(parent))

    def clear(self) -> None:
        for key in list(self.index):
            self._drop(key)
        (self.dir / bf.USES).unlink(missing_ok=True)

    def snapshot(self) -> dict:
        counts = {**self.counts, **self.reader.counts}
        return {"blocks": len(self.index), "bytes": self.nbytes, "max_bytes": self.max_bytes, **counts}
