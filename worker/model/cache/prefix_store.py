"""The prefix cache on disk, restart tier: the hottest entries' KV survives idle unloads and
restarts. A graceful stop writes the hottest entries (a leaf's sequence in the block store)
to `$MLXGW_HOME/prefix-cache/<model>/`; the next worker reads them back before its first
request. The live tier (blocks evicted while the worker runs, in `blocks/` below it) is
worker/model/cache/block_disk.py, attached by `restore`; one bound holds both, entries first.

- Format: one safetensors file per entry, written by mlx-lm's `save_prompt_cache` (the KV
  state of every layer, the cache classes and their meta state), with our metadata: the
  format, the model's fingerprint and the entry's token ids. An entry of a family with
  recurrent or sliding-window layers also carries its state checkpoints: their layers follow
  the model's layers in the same file, and `checkpoints` (JSON) says which position each
  belongs to (worker/model/cache/state_checkpoints.py). `index.json` holds what changes between saves
  (hits, last use), so an entry already on disk is not written again.
- Fingerprint (`model_fingerprint`): sha256 over config.json's bytes, the name, size and
  mtime of every weight file, and the mlx-lm version. Cheap (no weight bytes are read) and
  on the safe side: a changed, re-imported or even copied model gets a new one. Entries
  with another fingerprint are refused: deleted, with one log line.
- Hot: entries that served at least one lookup come first, then the rest; most recently
  used first within each group. Entries are taken in that order while they fit the disk
  bound (a larger one is skipped, a smaller one after it may still fit).
- Safety: each file is written to a temporary name, fsynced and renamed (a kill mid-write
  leaves only a temporary file, removed later); writing stops at a time budget so a stop is
  never held up for long; an unreadable, truncated or inconsistent file is skipped with one
  log line and deleted, never a crash."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from mlxgw.worker.model.cache import state_checkpoints as sc
from mlxgw.worker.model.cache.block_disk import BlockDisk, default_bound_mb, fsync_path
from mlxgw.worker.model.cache.prefix_cache import CachedEntry, EntryUse, PrefixCache, entry_key

log = logging.getLogger(__name__)

FORMAT = "mlxgw-prefix-kv/1"
SAVE_BUDGET_S = 10.0  # a stop waits at most this for the writes (the gateway kills after 30 s)
RESTORE_BUDGET_S = 10.0  # the first request waits at most this for the reads
ENTRY_FILE = re.compile(r"^[0-9a-f]{32}\.safetensors$")
TEMP_PREFIX = "tmp-"
INDEX = "index.json"
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz")


def model_fingerprint(model_path: Path) -> str:
    import mlx_lm

    digest = hashlib.sha256(f"{FORMAT}\0mlx-lm {mlx_lm.__version__}\0".encode())
    digest.update((model_path / "config.json").read_bytes())
    for f in sorted(model_path.iterdir()):
        if f.name.endswith(WEIGHT_SUFFIXES):
            st = f.stat()  # follows links (hub-cache snapshots): the blob's own size and time
            digest.update(f"\0{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


def hotness(use: EntryUse) -> tuple[bool, float]:
    """The order entries are kept in, hottest first: reused ones, then most recent."""
    return use.hits > 0, use.last_used


@dataclass
class Candidate:
    name: str
    use: EntryUse
    nbytes: int
    entry: CachedEntry | None  # None: on disk only


@dataclass
class OnDisk:
    path: Path
    tokens: list[int]
    use: EntryUse
    nbytes: int
    checkpoints: dict | None = None  # their layout in the file (state_checkpoints.to_layout)


class PrefixStore:
    def __init__(self, directory: Path, fingerprint: str, max_bytes: int):
        self.dir = directory
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        # The model's cache classes, one per layer (from the cache, at restore): a file that
        # disagrees is corrupt, and must be refused here rather than fail a batch step later.
        self.layer_classes: list[str] | None = None
        self._restored: set[str] = set()  # entry files loaded by this worker
        self.live: BlockDisk | None = None  # the live tier, sharing this store's byte bound

    # -- restore ---------------------------------------------------------------------------------
    def restore(self, cache: PrefixCache, budget_s: float = RESTORE_BUDGET_S) -> dict:
        """Load the hottest stored entries that fit the in-memory cache's bound into it."""
        started = time.monotonic()
        if cache.disk_tier is None:  # the live tier: blocks evicted from memory (worker/model/cache/block_disk.py)
            cache.disk_tier = BlockDisk(self.dir / "blocks", self.fingerprint, self.max_bytes)
        self.live = cache.disk_tier
        if self.layer_classes is None and cache.tree.templates is not None:
            self.layer_classes = [type(layer).__name__ for layer in cache.tree.templates]
        report = {"restored_entries": 0, "restored_tokens": 0, "restored_bytes": 0, "refused": 0, "skipped": 0}
        if not self.dir.is_dir():
            return self._report(cache, report, started)
        self._remove_temporaries()
        stored = self._scan(report)
        self.live.reserve(sum(s.nbytes for s in stored))  # one bound for both tiers
        chosen, room = [], cache.max_bytes
        for s in sorted(stored, key=lambda s: hotness(s.use), reverse=True):
            if s.nbytes <= room:
                chosen.append(s)
                room -= s.nbytes
        restored = []
        for s in chosen:
            if time.monotonic() - started > budget_s:
                log.warning("prefix cache: restore stopped at its %g s budget", budget_s)
                break
            kv = self._read(s)
            if kv is not None:
                restored.append((s, kv))
            else:
                report["skipped"] += 1
        # Oldest first, so the in-memory LRU order matches the entries' recency.
        for s, (kv, marks) in sorted(restored, key=lambda r: hotness(r[0].use)):
            cache.insert(s.tokens, kv, use=s.use, checkpoints=marks)
            self._restored.add(s.path.name)
            report["restored_entries"] += 1
            report["restored_tokens"] += len(s.tokens)
            report["restored_bytes"] += s.nbytes
        self._report(cache, report, started)
        if report["restored_entries"]:
            log.info(
                "prefix cache: restored %d entries (%d tokens, %.1f MB) from %s in %.2f s",
                report["restored_entries"],
                report["restored_tokens"],
                report["restored_bytes"] / 1e6,
                self.dir,
                report["restore_s"],
            )
        return report

    def _scan(self, report: dict) -> list[OnDisk]:
        """Every readable entry with this model's fingerprint; the others are deleted."""
        index = self._read_index()
        found = []
        for path in sorted(self.dir.iterdir()):
            if not ENTRY_FILE.match(path.name):
                continue
            try:
                if not _regular_file(path):  # a FIFO would block the restoring worker until it is killed
                    raise ValueError("not a regular file")
                meta, nbytes = self._header(path)
            except Exception as e:  # whatever is wrong with one file costs that file only
                self._discard(path, f"unusable ({e})")
                report["skipped"] += 1
                continue
            if meta.get("fingerprint") != self.fingerprint:
                report["refused"] += 1
                path.unlink(missing_ok=True)
                continue
            use = _use(index.get(path.name), meta["saved_at"])
            found.append(OnDisk(path, meta["tokens"], use, nbytes, meta.get("checkpoints")))
        if report["refused"]:
            log.warning(
                "prefix cache: %d entries in %s were written for a different version of the model; deleted",
                report["refused"],
                self.dir,
            )
        return found

    def _header(self, path: Path) -> tuple[dict, int]:
        """The entry's metadata and KV size, checked: mx.load is lazy (no KV bytes are read
        yet) and refuses a file whose tensors reach past its end."""
        import mlx.core as mx

        arrays, flat = mx.load(str(path), return_metadata=True)
        # save_prompt_cache stores [our metadata, cache classes, scalars] flattened: ours is "0.*".
        meta = {k[2:]: v for k, v in flat.items() if k.startswith("0.")}
        if meta.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        tokens = json.loads(meta.get("tokens", "null"))
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) for t in tokens):
            raise ValueError("no token list")
        if entry_key(tokens) + ".safetensors" != path.name:
            raise ValueError("tokens do not match the file name")
        marks = json.loads(meta.get("checkpoints", "null"))
        if marks is not None and not sc.valid_layout(marks, len(tokens)):
            raise ValueError("malformed checkpoints")
        meta = {**meta, "tokens": tokens, "saved_at": float(meta.get("saved_at", 0)), "checkpoints": marks}
        return meta, sum(a.nbytes for a in arrays.values())

    def _read(self, s: OnDisk) -> tuple[list, sc.Checkpoints | None] | None:
        """The entry's KV and checkpoints, read now (a bad read fails here, not in a step)."""
        import mlx.core as mx
        from mlx_lm.models.cache import load_prompt_cache

        try:
            kv = load_prompt_cache(str(s.path))
            layers = s.checkpoints["layers"] if s.checkpoints else len(kv)
            kv, extra = kv[:layers], kv[layers:]
            marks = sc.from_layout(s.tokens, s.checkpoints, extra) if s.checkpoints else None
            classes = [type(layer).__name__ for layer in kv]
            if self.layer_classes is not None and classes != self.layer_classes:
                raise ValueError(f"{len(kv)} cache layers that do not match the model's {len(self.layer_classes)}")
            for layer in kv:
                if getattr(layer, "offset", len(s.tokens)) != len(s.tokens):
                    raise ValueError(f"a layer holds {layer.offset} positions for {len(s.tokens)} tokens")
            mx.eval([layer.state for layer in kv])
            if marks is not None:
                mx.eval([layer.state for layer in extra])
            return kv, marks
        except Exception as e:  # any fault in one file costs that entry only
            self._discard(s.path, f"unusable ({e})")
            return None

    # -- save ------------------------------------------------------------------------------------
    def save(self, cache: PrefixCache, budget_s: float = SAVE_BUDGET_S) -> dict:
        """Keep the hottest entries that fit the disk bound: write those not on disk yet
        (until the time budget runs out), remove every other entry."""
        started = time.monotonic()
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._remove_temporaries()
        index = self._read_index()
        kept: dict[str, dict] = {}
        written = total = 0
        late = False  # past the time budget: entries not on disk yet are dropped
        for c in self._candidates(cache, index):
            path = self.dir / c.name
            if c.name in index and path.exists():
                size = path.stat().st_size  # written by an earlier stop, for this fingerprint
            elif c.entry is None or total + c.nbytes > self.max_bytes:
                continue
            elif late or time.monotonic() - started > budget_s:
                if not late:
                    log.warning("prefix cache: writing stopped at its %g s budget", budget_s)
                late = True
                continue
            else:
                size = self._write(path, c.entry)
                c.entry, written = None, written + 1  # its assembled KV copy is freed now
            if total + size > self.max_bytes:
                continue  # removed below with the others
            total += size
            kept[c.name] = {"hits": c.use.hits, "last_used": c.use.last_used, "bytes": size}
        self._write_index(kept)
        for path in self.dir.iterdir():
            if ENTRY_FILE.match(path.name) and path.name not in kept:
                path.unlink(missing_ok=True)
        if cache.disk_tier is not None:  # the live tier's blocks fit in what the entries leave
            cache.disk_tier.reserve(total)
        report = {"saved_entries": len(kept), "written_entries": written, "saved_bytes": total}
        self._report(cache, report, started, "save_s")
        log.info(
            "prefix cache: kept %d entries (%.1f MB, %d newly written) in %s, %.2f s",
            len(kept),
            total / 1e6,
            written,
            self.dir,
            report["save_s"],
        )
        return report

    def _candidates(self, cache: PrefixCache, index: dict[str, dict]) -> list[Candidate]:
        """What may be kept, hottest first: the in-memory entries, and the stored ones this
        worker never loaded (they did not fit its memory bound or its restore budget)."""
        out = {}
        for e in cache.entries():
            name = entry_key(e.tokens) + ".safetensors"
            out[name] = Candidate(name, e.use, e.nbytes, e)
        for name, saved in index.items():
            if name not in out and name not in self._restored and ENTRY_FILE.match(name):
                out[name] = Candidate(name, _use(saved, 0.0), 0, None)
        return sorted(out.values(), key=lambda c: hotness(c.use), reverse=True)

    def _write(self, path: Path, e: CachedEntry) -> int:
        from mlx_lm.models.cache import save_prompt_cache

        meta = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "tokens": json.dumps(e.tokens, separators=(",", ":")),
            "saved_at": repr(time.time()),
        }
        layers = list(e.cache)
        if e.checkpoints is not None and e.checkpoints.states:
            layout, extra = sc.to_layout(e.checkpoints, len(layers))
            meta["checkpoints"] = json.dumps(layout, separators=(",", ":"))
            layers += extra
        # mx.save_safetensors appends ".safetensors" to a name without it: give it one.
        temp = self.dir / f"{TEMP_PREFIX}{path.stem}-{os.getpid()}.safetensors"
        try:
            save_prompt_cache(str(temp), layers, meta)
            fsync_path(temp)
            os.chmod(temp, 0o600)  # prompts are users' data
            os.replace(temp, path)
        finally:
            temp.unlink(missing_ok=True)
        fsync_path(self.dir)
        return path.stat().st_size

    # -- index, clear, housekeeping --------------------------------------------------------------
    def _read_index(self) -> dict[str, dict]:
        path = self.dir / INDEX
        if path.exists() and not _regular_file(path):
            log.warning("prefix cache: %s is not a regular file; entries keep their saved times", path)
            return {}
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("prefix cache: %s is unreadable (%s); entries keep their saved times", path, e)
            return {}
        if not isinstance(data, dict) or data.get("fingerprint") != self.fingerprint:
            return {}  # another model's index: its entries are refused one by one
        entries = data.get("entries")
        return entries if isinstance(entries, dict) else {}

    def _write_index(self, entries: dict[str, dict]) -> None:
        path = self.dir / INDEX
        temp = self.dir / f"{TEMP_PREFIX}{INDEX}-{os.getpid()}"
        temp.write_text(json.dumps({"format": FORMAT, "fingerprint": self.fingerprint, "entries": entries}))
        fsync_path(temp)
        os.replace(temp, path)

    def clear(self) -> None:
        """Forget every stored entry (DELETE /v1/cache clears the disk copy too)."""
        if self.live is not None:
            self.live.reserve(0)
        if not self.dir.is_dir():
            return
        for path in self.dir.iterdir():
            if ENTRY_FILE.match(path.name) or path.name == INDEX or path.name.startswith(TEMP_PREFIX):
                path.unlink(missing_ok=True)

    def _remove_temporaries(self) -> None:
        for path in self.dir.glob(f"{TEMP_PREFIX}*"):
            path.unlink(missing_ok=True)

    def _discard(self, path: Path, why: str) -> None:
        log.warning("prefix cache: skipped %s: %s", path.name, why)
        path.unlink(missing_ok=True)

    def _report(self, cache: PrefixCache, report: dict, started: float, took: str = "restore_s") -> dict:
        """report, with the seconds it took under `took`, into the cache's stats (/v1/status)."""
        report[took] = round(time.monotonic() - started, 3)
        cache.disk = {**(cache.disk or {}), **report}
        return report


def _use(saved, saved_at: float) -> EntryUse:  # from index.json; else the file's own save time
    try:
        return EntryUse(float(saved.get("last_used", saved_at)), int(saved.get("hits", 0)))
    except (AttributeError, TypeError, ValueError):
        return EntryUse(saved_at)


def _regular_file(path: Path) -> bool:  # a link, FIFO, socket or device can block a read
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def store_for(model_name: str, model_path: Path, max_mb: int | None) -> PrefixStore | None:  # None: off
    from mlxgw.shared.paths import home

    max_mb = default_bound_mb(home()) if max_mb is None else max_mb  # None: sized from free disk
    if max_mb <= 0:
        return None
    try:
        fingerprint = model_fingerprint(model_path)
    except OSError as e:
        log.warning("prefix cache on disk is off for %s: %s", model_name, e)
        return None
    return PrefixStore(home() / "prefix-cache" / model_name, fingerprint, max_mb << 20)


def restore_into(runner) -> None:
    """Fill a runner's prefix cache from its store (runners without one: nothing)."""
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
