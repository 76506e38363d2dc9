"""Prefix KV cache: reuse the KV of the longest cached prefix of a new prompt.

Storage and lookup are mlx-lm's LRUPromptCache (a token trie, byte-bounded, LRU; it only
trims caches that can be trimmed, so recurrent/hybrid models reuse exact stored prefixes
only). This wrapper adds the accounting clients and operators see (hits, reused tokens)."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0


class PrefixCache:
    def __init__(self, max_bytes: int, max_entries: int = 512):
        self._lru = LRUPromptCache(max_size=max_entries, max_bytes=max_bytes)
        self.max_bytes = max_bytes
        self.stats = CacheStats()
        self._key = "model"  # one model per worker process

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
        return cache, covered

    def insert(self, tokens: list[int], cache: list) -> None:
        if tokens and cache:
            self._lru.insert_cache(self._key, list(tokens), cache)

    def trim_to(self, max_bytes: int) -> None:
        self._lru.trim_to(n_bytes=max(0, max_bytes))

    def clear(self) -> None:
        self._lru.trim_to(n_sequences=0)

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def __len__(self) -> int:
        return len(self._lru)

    def snapshot(self) -> dict:
        s = self.stats
        return {
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
