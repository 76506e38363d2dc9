"""Prefix KV cache: reuse the KV of the longest cached prefix of a new prompt.

Storage and lookup are mlx-lm's LRUPromptCache (a token trie, byte-bounded, LRU; it only
trims caches that can be trimmed, so recurrent/hybrid models reuse exact stored prefixes
only). This wrapper adds the accounting clients and operators see (hits, reused tokens)
and, per entry, when it was last used and how often it served a lookup: what decides
which entries are written to disk when the worker stops (worker/prefix_store.py)."""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

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

    def longest_match(self, prompt: list[int]) -> tuple[list | None, int]:
        """Return (a private copy of the cached KV, number of prompt tokens it covers).

        At least the last prompt token is always left uncovered: the model must run it to
        produce the first output token's logits."""
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(prompt)
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
        self.stats.hits += 1
        self.stats.reused_tokens += covered
        if covered >= ENTRY_HIT_MIN_TOKENS:
            self._record_hit(prompt)
        return cache, covered

    def insert(self, tokens: list[int], cache: list, use: EntryUse | None = None) -> None:
        """Store a sequence's KV. use: its history when it comes back from disk; else it is
        used now and inherits the hits of the stored prefix it extends (which it replaces)."""
        if not tokens or not cache:
            return
        tokens = list(tokens)
        if use is None:
            prefix = self._stored_prefix(tokens)
            inherited = self._uses.get(entry_key(prefix)) if prefix else None
            use = EntryUse(time.time(), inherited.hits if inherited else 0)
        self._uses[entry_key(tokens)] = use
        self._lru.insert_cache(self._key, tokens, cache)
        if len(self._uses) > 2 * len(self._lru) + 64:
            self._prune_uses()

    def entries(self) -> Iterator[CachedEntry]:
        """Every stored entry (tokens, KV, size, use), least recently stored first."""
        # LRUPromptCache keeps its order and trie private; reading them is the only way to
        # enumerate what it holds (mlx-lm is pinned below 0.34 in pyproject).
        for kind in self._lru._lru._ordering:
            for model, tokens in list(self._lru._lru._lrus[kind]):
                entry = self._lru._trie.get(model, tokens)
                use = self._uses.get(entry_key(tokens)) or EntryUse(0.0)
                yield CachedEntry(list(tokens), entry.prompt_cache, entry.nbytes, use)

    def _stored_prefix(self, tokens: list[int]) -> list[int] | None:
        found = self._lru._trie.search(self._key, tokens)
        return found.exact if found.exact is not None else found.shorter

    def _record_hit(self, prompt: list[int]) -> None:
        """Credit the entry fetch_nearest_cache served (the same choice, made again)."""
        found = self._lru._trie.search(self._key, prompt)
        source = found.exact
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
        self._lru.trim_to(n_bytes=max(0, max_bytes))

    def clear(self) -> None:
        self._lru.trim_to(n_sequences=0)
        self._uses.clear()

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

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
        }
        if self.disk is not None:
            out["disk"] = dict(self.disk)
        return out
