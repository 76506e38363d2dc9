"""Prefix KV cache: reuse the KV of the longest cached prefix of a new prompt.

Storage and lookup are mlx-lm's LRUPromptCache (a token trie, byte-bounded, LRU). It only
trims caches that can be trimmed, so for families with recurrent or sliding-window layers
each entry also carries state checkpoints (worker/state_checkpoints.py): a lookup resumes
from the deepest checkpoint at or before the prefix a new prompt shares with an entry.
Checkpoint bytes count against the same bound and leave with their entry. This wrapper adds
the accounting clients and operators see (hits, reused tokens) and, per entry, when it was
last used and how often it served a lookup: what decides which entries are written to disk
when the worker stops (worker/prefix_store.py)."""

from __future__ import annotations

import copy
import hashlib
import logging
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from . import state_checkpoints as sc

log = logging.getLogger("mlxgw.worker.prefix_cache")

# A lookup counts as a hit of the entry it came from (for keeping entries on disk) only when
# it reused this many tokens: prompts that share just a template's first tokens do not.
ENTRY_HIT_MIN_TOKENS = 64


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0


@dataclass
class EntryUse:
    last_used: float  # wall-clock seconds (time.time()): it travels to disk and back
    hits: int = 0  # lookups it served (>= ENTRY_HIT_MIN_TOKENS), inherited by the longer entry replacing it


@dataclass
class CachedEntry:
    tokens: list[int]
    cache: list
    nbytes: int
    use: EntryUse
    checkpoints: sc.Checkpoints | None = None


def entry_key(tokens: list[int]) -> str:
    """A short stable name for a token sequence (its disk file name too)."""
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).hexdigest()


class PrefixCache:
    def __init__(self, max_bytes: int, max_entries: int = 512):
        self._lru = LRUPromptCache(max_size=max_entries, max_bytes=max_bytes)
        self.max_bytes = max_bytes
        self.stats = CacheStats()
        self._key = "model"  # one model per worker process
        self._uses: dict[str, EntryUse] = {}  # entry_key -> use; pruned to the live entries
        self.disk: dict | None = None  # the disk store's last restore/save report, when one is on
        self._checkpoints: dict[str, sc.Checkpoints] = {}  # entry_key -> its checkpoints
        self._checkpoint_bytes = 0
        self.checkpoint_hits = 0  # lookups served from a checkpoint (not an entry's end)

    def longest_match(self, prompt: list[int]) -> tuple[list | None, int]:
        """Return (a private copy of the cached KV, number of prompt tokens it covers).

        At least the last prompt token is always left uncovered: the model must run it to
        produce the first output token's logits."""
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(prompt)
        if self._checkpoints:
            try:
                found = self._checkpoint_match(prompt)
            except Exception:  # a bad checkpoint costs this lookup its reuse, nothing more
                log.exception("prefix cache: checkpoint lookup failed; prefilling in full")
                found = None
            if found is not None:
                return self._credit(prompt, *found)  # (cache, covered, the entry that served)
        cache, rest = self._lru.fetch_nearest_cache(self._key, prompt)
        if cache is None:
            return None, 0
        if not rest:
            if not can_trim_prompt_cache(cache):
                return None, 0
            trim_prompt_cache(cache, 1)
            rest = prompt[-1:]
        covered = len(prompt) - len(rest)
        if covered <= 0:
            return None, 0
        return self._credit(prompt, cache, covered)

    def _credit(self, prompt: list[int], cache: list, covered: int, source: list[int] | None = None):
        self.stats.hits += 1
        self.stats.reused_tokens += covered
        if covered >= ENTRY_HIT_MIN_TOKENS:
            self._record_hit(prompt, source)
        return cache, covered

    def _checkpoint_match(self, prompt: list[int]) -> tuple[list, int, list[int]] | None:
        """The deepest resumable position for a prompt among the entries it shares a prefix
        with: a stored prefix of it (its end), or a checkpoint of an entry at or before the
        shared prefix. None when nothing beats what the plain lookup finds."""
        found = self._lru._trie.search(self._key, prompt)
        limit = len(prompt) - 1  # the last token is always run
        best: tuple[int, list[int], int | None] | None = None  # (position, entry tokens, checkpoint)
        if found.shorter is not None:
            best = (len(found.shorter), found.shorter, None)
        for tokens, shared in ((found.exact, len(prompt)), (found.longer, found.common_prefix)):
            marks = self._checkpoints.get(entry_key(tokens)) if tokens is not None else None
            position = marks.best(min(shared, limit)) if marks is not None else None
            if position is not None and (best is None or position > best[0]):
                best = (position, tokens, position)
        if best is None:
            return None
        position, tokens, mark = best
        entry = self._lru._trie.get(self._key, tokens)
        if mark is None:  # a stored prefix: its whole cache, as mlx-lm's lookup gives it
            return copy.deepcopy(entry.prompt_cache), position, tokens
        snap = self._checkpoints[entry_key(tokens)].states[mark]
        self.checkpoint_hits += 1
        return sc.restore(snap, entry.prompt_cache, len(tokens), position), position, tokens

    def insert(
        self,
        tokens: list[int],
        cache: list,
        use: EntryUse | None = None,
        checkpoints: sc.Checkpoints | None = None,
    ) -> None:
        """Store a sequence's KV. use: its history when it comes back from disk; else it is
        used now and inherits the hits of the stored prefix it extends (which it replaces).
        checkpoints: state checkpoints at positions of tokens (for non-trimmable layers)."""
        if not tokens or not cache:
            return
        tokens = list(tokens)
        key = entry_key(tokens)
        prefix = self._stored_prefix(tokens)
        if use is None:
            inherited = self._uses.get(entry_key(prefix)) if prefix else None
            use = EntryUse(time.time(), inherited.hits if inherited else 0)
        self._uses[key] = use
        if sc.needs_checkpoints(cache):
            checkpoints = self._gather_checkpoints(tokens, prefix, checkpoints)
        self._lru.insert_cache(self._key, tokens, cache)
        if checkpoints is not None and checkpoints.states:
            self._checkpoints[key] = checkpoints
            self._checkpoint_bytes += checkpoints.nbytes
        if len(self._uses) > 2 * len(self._lru) + 64:
            self._prune_uses()
        self._sync_checkpoints()
        self.trim_to(self.max_bytes)

    def _gather_checkpoints(self, tokens, prefix, given: sc.Checkpoints | None) -> sc.Checkpoints:
        """The new entry's checkpoints: the given ones, those of the entry it replaces (same
        tokens) and those of the stored prefix it extends (positions valid for it too)."""
        merged = sc.Checkpoints(tokens)
        extended = self._checkpoints.get(entry_key(prefix)) if prefix else None
        for source in (given, self._checkpoints.get(entry_key(tokens)), extended):
            if source is not None:
                merged.merge(source)
        old = self._checkpoints.pop(entry_key(tokens), None)
        if old is not None:
            self._checkpoint_bytes -= old.nbytes
        return merged

    def checkpoints_of(self, tokens: list[int]) -> sc.Checkpoints | None:
        return self._checkpoints.get(entry_key(tokens))

    def _sync_checkpoints(self) -> None:
        """Drop the checkpoints of entries the LRU evicted."""
        live = {entry_key(tokens) for kind in self._lru._lru._lrus.values() for _, tokens in kind}
        for key in [k for k in self._checkpoints if k not in live]:
            self._checkpoint_bytes -= self._checkpoints.pop(key).nbytes

    def entries(self) -> Iterator[CachedEntry]:
        """Every stored entry (tokens, KV, size, use), least recently stored first."""
        # LRUPromptCache keeps its order and trie private; reading them is the only way to
        # enumerate what it holds (mlx-lm is pinned below 0.34 in pyproject).
        for kind in self._lru._lru._ordering:
            for model, tokens in list(self._lru._lru._lrus[kind]):
                entry = self._lru._trie.get(model, tokens)
                key = entry_key(tokens)
                use = self._uses.get(key) or EntryUse(0.0)
                marks = self._checkpoints.get(key)
                size = entry.nbytes + (marks.nbytes if marks else 0)
                yield CachedEntry(list(tokens), entry.prompt_cache, size, use, marks)

    def _stored_prefix(self, tokens: list[int]) -> list[int] | None:
        found = self._lru._trie.search(self._key, tokens)
        return found.exact if found.exact is not None else found.shorter

    def _record_hit(self, prompt: list[int], source: list[int] | None = None) -> None:
        """Credit the entry that served: `source`, else the one fetch_nearest_cache served
        (the same choice, made again)."""
        found = self._lru._trie.search(self._key, prompt)
        source = source if source is not None else found.exact
        if source is None:
            shorter = len(found.shorter) if found.shorter is not None else 0
            if found.longer is not None and found.common_prefix > shorter:
                longer = self._lru._trie.get(self._key, found.longer)
                source = found.longer if can_trim_prompt_cache(longer.prompt_cache) else found.shorter
            else:
                source = found.shorter
        if source:
            use = self._uses.setdefault(entry_key(source), EntryUse(0.0))
            use.hits += 1
            use.last_used = time.time()

    def _prune_uses(self) -> None:
        live = {entry_key(tokens) for kind in self._lru._lru._lrus.values() for _, tokens in kind}
        self._uses = {k: u for k, u in self._uses.items() if k in live}

    def trim_to(self, max_bytes: int) -> None:
        """Evict least recently used entries (with their checkpoints) until all fits."""
        max_bytes = max(0, max_bytes)
        if not self._checkpoints:
            self._lru.trim_to(n_bytes=max_bytes)
            return
        while self.nbytes > max_bytes and len(self._lru):  # one at a time: entries own checkpoints
            self._lru.trim_to(n_sequences=len(self._lru) - 1)
            self._sync_checkpoints()

    def clear(self) -> None:
        self._lru.trim_to(n_sequences=0)
        self._uses.clear()
        self._checkpoints.clear()
        self._checkpoint_bytes = 0

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes + self._checkpoint_bytes

    def __len__(self) -> int:
        return len(self._lru)

    def snapshot(self) -> dict:
        s = self.stats
        out = {
            "entries": len(self),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "lookups": s.lookups,
            "hits": s.hits,
            "hit_rate": (s.hits / s.lookups) if s.lookups else 0.0,
            "prompt_tokens": s.prompt_tokens,
            "reused_tokens": s.reused_tokens,
            "token_reuse_rate": (s.reused_tokens / s.prompt_tokens) if s.prompt_tokens else 0.0,
            "checkpoints": sum(len(c.states) for c in self._checkpoints.values()),
            "checkpoint_bytes": self._checkpoint_bytes,
            "checkpoint_hits": self.checkpoint_hits,
        }
        if self.disk is not None:
            out["disk"] = dict(self.disk)
        return out
