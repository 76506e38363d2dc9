"""Prefix KV cache: reuse the KV of the longest cached prefix of a new prompt.

Storage is a shared block store (worker/model/cache/kv_blocks.py): KV in fixed-size token blocks keyed
by the hash chain of their tokens, so sessions sharing a system prompt hold it once and the
byte bound counts each block once. A lookup walks the chain of a prompt's blocks, takes any
tokens it shares with a block below the last whole one, and assembles a private contiguous
cache from those blocks. A finished or removed row's KV is published as blocks (those
already stored are not copied again). For families with recurrent or sliding-window layers
a block also carries the state checkpoints (worker/model/cache/state_checkpoints.py) taken at positions
inside it, and a lookup resumes from the deepest checkpoint at or before the shared prefix.

When a disk tier is attached (worker/model/cache/block_disk.py), blocks evicted from memory are written
there and read back when a lookup's chain reaches them; a graceful stop writes the blocks still
in memory there too (worker/model/cache/prefix_store.py). "Entries" (what /v1/status counts) are the
leaves of the block tree in memory: one per stored sequence that no longer one extends."""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx

from . import kv_blocks as kb
from . import state_checkpoints as sc
from .prefix_events import PrefixEvents

log = logging.getLogger(__name__)

# A lookup counts as a hit of the blocks it came from (for keeping them on disk) only when it
# reused this many tokens: prompts that share just a template's first tokens do not.
ENTRY_HIT_MIN_TOKENS = 64


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    disk_tokens: int = 0  # reused tokens whose blocks came back from the disk tier


@dataclass
class EntryUse:
    last_used: float  # wall-clock seconds (time.time()): it travels to disk and back
    hits: int = 0  # lookups it served (>= ENTRY_HIT_MIN_TOKENS)


@dataclass
class CachedEntry:
    tokens: list[int]
    cache: list
    nbytes: int  # the bytes of its blocks not already counted by an entry listed before it
    use: EntryUse
    checkpoints: sc.Checkpoints | None = None


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.tree = kb.BlockTree()
        self.max_bytes = max_bytes
        self.stats = CacheStats()
        self.disk: dict | None = None  # the store's last index/save report (prefix_store.py), when on
        self.disk_tier = None  # worker/block_disk.BlockDisk: where evicted blocks go, when on
        self.checkpoint_hits = 0  # lookups served from a checkpoint (not a plain KV cut)
        self._hybrid = False  # some layer cannot be cut back: reuse needs a checkpoint
        self._junction: int | None = None  # the last lookup's divergence past its checkpoint
        # What it holds in the gateway's route entries (worker/model/cache/prefix_events.py),
        # made by the first request that carries a route (a model with several workers).
        self.events: PrefixEvents | None = None
        self.tree.on_gone = self.left

    def describe(self, model_cache: list) -> None:
        """The model's cache layers (empty): what blocks read back from disk are assembled
        into before any sequence was stored in this worker."""
        if self.tree.templates is None:
            self.tree.templates = [kb.template_of(layer) for layer in model_cache]
            self._hybrid = sc.needs_checkpoints(model_cache)

    # -- lookup --------------------------------------------------------------------------------
    def prefetch(self, prompt: list[int]) -> bool:
        """Start reading off the engine thread the prompt's blocks that only the disk tier
        holds; whether they are all read (a lookup now costs no disk wait). Never raises."""
        if self.disk_tier is None:
            return True
        try:
            return self.disk_tier.prefetch(self.tree, prompt)
        except Exception:  # a prefetch only saves a wait: the lookup reads what it lacks
            log.exception("prefix cache: prefetch failed")
            return True

    def cached_tokens(self, prompt: list[int]) -> int:
        """How many of the prompt's tokens a lookup now would find, in whole blocks, in
        memory or on disk: an estimate for ordering the waiting queue (a lookup may find a
        few more in a partial block, or fewer where a hybrid family has no checkpoint).
        Reads nothing and changes nothing. Never raises."""
        disk = self.disk_tier.index if self.disk_tier is not None else {}
        parent, pos = kb.ROOT, 0
        try:
            while pos + kb.BLOCK_TOKENS <= len(prompt):
                key = kb.chain_key(parent, prompt[pos : pos + kb.BLOCK_TOKENS])
                if key not in self.tree.blocks and key not in disk:
                    break
                parent, pos = key, pos + kb.BLOCK_TOKENS
        except Exception:  # an estimate only: the queue then orders this prompt as uncached
            log.exception("prefix cache: estimate failed")
            return 0
        return min(pos, max(0, len(prompt) - 1))

    def longest_match(self, prompt: list[int]) -> tuple[list | None, int]:
        """Return (a private copy of the cached KV, number of prompt tokens it covers).

        At least the last prompt token is always left uncovered: the model must run it to
        produce the first output token's logits."""
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(prompt)
        self._junction = None
        if self.tree.templates is None and self.disk_tier is None:
            return None, 0
        try:
            found = self._find(prompt)
        except Exception:  # a bad block or checkpoint costs this lookup its reuse, nothing more
            log.exception("prefix cache: lookup failed; prefilling in full")
            return None, 0
        if found is None:
            return None, 0
        chain, covered, snap = found
        cache = kb.assemble(self.tree.templates, chain, covered, snap)
        last = next(b for b in reversed(chain) if b.start < covered)
        self.tree.touch(last, hit=covered >= ENTRY_HIT_MIN_TOKENS)
        self.stats.hits += 1
        self.stats.reused_tokens += covered
        if snap is not None:
            self.checkpoint_hits += 1
        return cache, covered

    def _find(self, prompt: list[int]) -> tuple[list[kb.Block], int, list | None] | None:
        """The chain, covered length and checkpoint (hybrid families) of the deepest resume."""
        if self.disk_tier is not None:
            self.stats.disk_tokens += self.disk_tier.bring_back(self.tree, prompt)
        if self.tree.templates is None:
            return None
        node, partial = self.tree.walk(prompt)
        chain = node.chain() if node is not None else []
        limit = len(prompt) - 1  # the last token is always run
        options = [(chain, node.end if node is not None else 0)] + [(chain + [c], c.start + n) for c, n in partial]
        if not self._hybrid:
            chain, shared = max(options, key=lambda o: o[1])
            covered = min(shared, limit)
            return (chain, covered, None) if covered > 0 else None
        shared_most = min(max(shared for _, shared in options), limit)
        best: tuple[int, list[kb.Block], kb.Block] | None = None
        for chain, shared in options:
            reach = min(shared, limit)
            for b in chain:
                for p in b.checkpoints:
                    if p <= reach and (best is None or p > best[0]):
                        best = (p, chain, b)
        if best is None or best[0] < shared_most:
            self._junction = shared_most if shared_most > 0 else None
        if best is None:
            return None
        position, chain, holder = best
        return chain, position, holder.checkpoints[position]

    def junctions(self) -> list[int]:
        """Where the last prompt looked up leaves what is stored, past the checkpoint it
        resumed from (hybrid families): a checkpoint there while reading it lets the next
        prompt sharing that prefix resume at it (vLLM's and llama.cpp's junctions)."""
        return [self._junction] if self._junction is not None else []

    @staticmethod
    def _checkpoints(tokens: list[int], chain: list[kb.Block], upto: int) -> sc.Checkpoints:
        out = sc.Checkpoints(list(tokens))
        for b in chain:
            for p, snap in b.checkpoints.items():
                if p <= upto:
                    out.states[p] = snap
                    out.nbytes += sc.nbytes(snap)
                    if p in b.boundaries:
                        out.priority.add(p)
        return out

    # -- publish -------------------------------------------------------------------------------
    def insert(
        self,
        tokens: list[int],
        cache: list,
        use: EntryUse | None = None,
        checkpoints: sc.Checkpoints | None = None,
        hold_s: float | None = None,
    ) -> kb.Block | None:
        """Store a sequence's KV as blocks (those already stored are shared, not copied).
        use: its history when it comes back from disk. checkpoints: state checkpoints at
        positions of tokens (for non-trimmable layers). hold_s: a client's caching hint
        (cache_control, prompt_cache_retention): its blocks leave memory only after every
        block nobody asked to keep, for this long. Returns its last block."""
        if not tokens or not cache:
            return None
        tree = self.tree
        self.describe(cache)
        length = min(len(tokens), _offset(cache, len(tokens)))
        marks = dict(checkpoints.states) if checkpoints is not None else {}
        boundaries = checkpoints.priority if checkpoints is not None else set()
        if self._hybrid and length not in marks:
            marks[length] = sc.snapshot(cache)  # the state at its end: resumes its next turn
        node, fresh = None, []
        for start in range(0, length, kb.BLOCK_TOKENS):
            segment = tuple(tokens[start : min(start + kb.BLOCK_TOKENS, length)])
            node = self._block_for(node, segment, start, cache, fresh)
            for p in [p for p in marks if start < p <= start + len(segment)]:
                tree.add_checkpoint(node, p, marks[p], p in boundaries)
        mx.eval([a for b in fresh for p in b.pieces for a in kb.piece_arrays(p)])
        if node is None:
            return None
        tree.touch(node)
        if use is not None:
            node.used_at, node.hits = use.last_used, max(node.hits, use.hits)
        if hold_s:
            until = time.time() + hold_s
            for block in node.chain():
                block.held_until = max(block.held_until, until)
        self.trim_to(self.max_bytes)
        return node

    # -- what it holds, in the gateway's route entries (prefix_events.py) -------------------------
    def routed(self, route: list[bytes], last: kb.Block | None, prompt_length: int) -> None:
        """A prompt that came with route entries was stored (its chain ends at `last`): the
        entries are noted against the deepest whole block inside the prompt."""
        block = last
        while block is not None and (block.end > prompt_length or not block.full):
            block = block.parent
        # Shorter than a block, stored short of its end (a row cut in its prefill) or trimmed
        # at once: nothing to hold.
        if block is None or block.end + kb.BLOCK_TOKENS <= prompt_length:
            return
        if not self._holds(block.key):
            return
        if self.events is None:
            self.events = PrefixEvents()
        self.events.note(route, block.key)

    def left(self, key: bytes) -> None:
        """A block left memory or the disk tier: gone for good once neither holds it."""
        events = self.events
        if events is not None and key in events.entries and not self._holds(key):
            events.gone(key)

    def _holds(self, key: bytes) -> bool:
        return key in self.tree.blocks or (self.disk_tier is not None and key in self.disk_tier.index)

    def _block_for(self, parent, segment: tuple, start: int, cache: list, fresh: list) -> kb.Block:
        """The stored block for a segment below parent: the same one, a longer one holding
        it (a tail already extended), or a new block cut from the row's cache."""
        siblings = self.tree.children_of(parent)
        key = kb.chain_key(parent.key if parent is not None else kb.ROOT, segment)
        found = siblings.get(key)
        if found is None and len(segment) < kb.BLOCK_TOKENS:
            found = next((c for c in siblings.values() if c.tokens[: len(segment)] == segment), None)
        if found is not None:
            return found
        end = start + len(segment)
        block = kb.Block(key, parent, segment, start, [kb.cut_layer(layer, start, end) for layer in cache])
        # Shorter tails it extends (a sequence's last block, before its next turn) leave;
        # their checkpoints and hits stay with it.
        for old in [c for c in siblings.values() if len(c.tokens) < len(segment) and not c.children]:
            if segment[: len(old.tokens)] == old.tokens and not old.pins:
                block.checkpoints.update(old.checkpoints)
                block.boundaries |= old.boundaries
                block.hits = max(block.hits, old.hits)
                self.tree.remove(old)
        self.tree.add(block)
        fresh.append(block)
        return block

    # -- bound ---------------------------------------------------------------------------------
    def trim_to(self, max_bytes: int) -> None:
        """Evict leaf blocks (with their checkpoints), lowest priority first (recency, hits
        and cost to recompute: worker/model/cache/eviction.py), until all fits; to the disk
        tier when one is attached."""
        max_bytes = max(0, max_bytes)
        tree = self.tree
        if tree.nbytes <= max_bytes:
            return
        now = time.time()

        def order(b: kb.Block) -> tuple:  # a hint's blocks after all others, then by priority
            return (b.held_until > now, b.priority, b.tick, id(b), b)

        heap = [order(b) for b in tree.evictable()]
        heapq.heapify(heap)
        while tree.nbytes > max_bytes and heap:
            *_, victim = heapq.heappop(heap)
            if victim.key not in tree.blocks or victim.children or victim.pins:
                continue
            if self.disk_tier is not None:
                self.disk_tier.keep(victim)
            tree.remove(victim)
            tree.clock.evicted(victim.priority)
            parent = victim.parent
            if parent is not None and not parent.children and not parent.pins:
                heapq.heappush(heap, order(parent))

    def clear(self) -> None:
        self.tree.clear()
        if self.disk_tier is not None:
            self.disk_tier.clear()

    @property
    def nbytes(self) -> int:
        return self.tree.nbytes

    def __len__(self) -> int:
        return len(self.tree.leaves())

    # -- enumeration (tests, benches) ------------------------------------------------------------
    def entries(self) -> Iterator[CachedEntry]:
        """Every stored sequence (a leaf's chain: tokens, KV, use), least recently used first.
        nbytes counts each block once: under the first entry listed that holds it."""
        counted: set[bytes] = set()
        for leaf in sorted(self.tree.leaves(), key=lambda b: b.tick):
            chain = leaf.chain()
            length, snap = leaf.end, None
            if self._hybrid:
                positions = [p for b in chain for p in b.checkpoints]
                if not positions:
                    continue
                length = max(positions)
                snap = next(b.checkpoints[length] for b in chain if length in b.checkpoints)
            tokens = [t for b in chain for t in b.tokens][:length]
            size = sum(b.nbytes for b in chain if b.key not in counted)
            counted.update(b.key for b in chain)
            marks = self._checkpoints(tokens, chain, length) if self._hybrid else None
            use = kb_use(chain)
            yield CachedEntry(tokens, kb.assemble(self.tree.templates, chain, length, snap), size, use, marks)

    def snapshot(self) -> dict:
        s = self.stats
        blocks = self.tree.blocks.values()
        out = {
            "entries": len(self),
            "blocks": len(self.tree.blocks),
            "block_tokens": kb.BLOCK_TOKENS,
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "lookups": s.lookups,
            "hits": s.hits,
            "hit_rate": (s.hits / s.lookups) if s.lookups else 0.0,
            "prompt_tokens": s.prompt_tokens,
            "reused_tokens": s.reused_tokens,
            "token_reuse_rate": (s.reused_tokens / s.prompt_tokens) if s.prompt_tokens else 0.0,
            "checkpoints": sum(len(b.checkpoints) for b in blocks),
            "checkpoint_bytes": sum(b.checkpoint_bytes for b in blocks),
            "checkpoint_hits": self.checkpoint_hits,
        }
        if self.disk is not None:
            out["disk"] = dict(self.disk)
        if self.disk_tier is not None:
            out["disk_tier"] = {**self.disk_tier.snapshot(), "tokens_brought_back": s.disk_tokens}
        return out


def kb_use(chain: list[kb.Block]) -> EntryUse:
    """A sequence's use: its last block's last use, and the most hits any of its blocks had."""
    return EntryUse(max(b.used_at for b in chain), max(b.hits for b in chain))


def _offset(cache: list, default: int) -> int:
    """Positions the cache's trimmable layers hold (a row's KV may stop short of its tokens)."""
    for layer in cache:
        for leaf in layer.caches if hasattr(layer, "caches") else (layer,):
            if isinstance(leaf, sc.TRIMMABLE):
                return int(leaf.offset)
    return default
