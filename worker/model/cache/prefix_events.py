"""What this worker's prefix cache holds, told to the gateway in the gateway's own terms.

The gateway routes a model's requests over its replicas by the hash chain of each request's
messages (gateway/link/route_key.py); it cannot tokenize, so it cannot name this worker's KV
blocks, and this worker cannot name its messages. A request routed by prefix carries the tail
of its chain (GenerateRequest.route), and when its prompt's KV is stored each of those entries
is noted against the deepest whole block of the prompt: the entry is held while some block it
was noted against is held, in memory or on the disk tier. When the last one leaves both for
good the entry is evicted. New holds and evictions are gathered here and sent batched, at most
once per stats tick (PREFIXES; worker/process/engine.py); after each WELCOME everything held
goes as a snapshot, and the map is written next to the disk tier at a graceful stop, so a
gateway restarted with its workers learns where each session's prefix lives from them.

Conservative by design: an entry stands for the whole prompt it came with, so a session whose
tail was evicted while its head stays counts as evicted (the gateway then places it by its
anchor, which keeps it where it was unless that replica is busy). Nothing is noted for a model
with one worker (its requests carry no route), so it costs nothing there."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import msgpack

from ....shared.atomic_file import write_atomically

log = logging.getLogger(__name__)

ENTRIES = 1 << 16  # entries remembered (least recently stored go first, reported as evicted)
ROUTES = "routes.msgpack"  # the map at a graceful stop, beside the disk tier's blocks


class PrefixEvents:
    def __init__(self, limit: int = ENTRIES):
        self.limit = limit
        self.blocks: OrderedDict[bytes, set[bytes]] = OrderedDict()  # entry -> block keys it was noted on
        self.entries: dict[bytes, set[bytes]] = {}  # block key -> entries noted on it
        self.held: set[bytes] = set()  # since the last drain
        self.evicted: set[bytes] = set()

    def note(self, entries: Iterable[bytes], block: bytes) -> None:
        """A prompt whose route carried these entries is stored up to this block."""
        noted = self.entries.setdefault(block, set())
        for entry in entries:
            keys = self.blocks.get(entry)
            if keys is None:
                keys = self.blocks[entry] = set()
                self.held.add(entry)
                self.evicted.discard(entry)
            else:
                self.blocks.move_to_end(entry)
            keys.add(block)
            noted.add(entry)
        while len(self.blocks) > self.limit:
            entry, keys = self.blocks.popitem(last=False)
            for key in keys:
                self._unnote(key, entry)
            self._lost(entry)

    def gone(self, block: bytes) -> None:
        """A block left memory and disk: the entries it alone held are evicted."""
        for entry in self.entries.pop(block, ()):
            keys = self.blocks.get(entry)
            if keys is None:
                continue
            keys.discard(block)
            if not keys:
                del self.blocks[entry]
                self._lost(entry)

    def _unnote(self, block: bytes, entry: bytes) -> None:
        noted = self.entries.get(block)
        if noted is not None:
            noted.discard(entry)
            if not noted:
                del self.entries[block]

    def _lost(self, entry: bytes) -> None:
        self.held.discard(entry)
        self.evicted.add(entry)  # reported even if its hold was not yet: the gateway guessed it

    def drain(self) -> tuple[list[bytes], list[bytes]]:
        """(newly held, evicted) since the last drain."""
        held, evicted = list(self.held), list(self.evicted)
        self.held.clear()
        self.evicted.clear()
        return held, evicted

    def snapshot(self) -> list[bytes]:
        """Every entry held; what was pending is part of it."""
        self.held.clear()
        self.evicted.clear()
        return list(self.blocks)

    # -- across a restart -------------------------------------------------------------------------
    def save(self, folder: Path, kept) -> None:
        """The map, for the blocks `kept` (a container of block keys: the disk tier's index)."""
        routes = {entry: [k for k in keys if k in kept] for entry, keys in self.blocks.items()}
        data = msgpack.packb({e: k for e, k in routes.items() if k}, use_bin_type=True)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomically(folder / ROUTES, data, prefix="tmp-routes-")

    @classmethod
    def load(cls, folder: Path, kept) -> PrefixEvents | None:
        """The map a graceful stop left, for the blocks still `kept`; None if none is left."""
        try:
            raw = msgpack.unpackb((folder / ROUTES).read_bytes(), raw=False, strict_map_key=False)
        except FileNotFoundError:
            return None
        except Exception as e:  # a torn or foreign file: the routes start empty, nothing else is lost
            log.warning("prefix cache: ignored %s: %s", folder / ROUTES, e)
            return None
        events = cls()
        for entry, keys in raw.items() if isinstance(raw, dict) else ():
            if isinstance(entry, bytes) and isinstance(keys, list):
                for key in keys:
                    if isinstance(key, bytes) and key in kept:
                        events.note([entry], key)
        events.held.clear()  # known from the snapshot each WELCOME brings, not as news
        return events if events.blocks else None
