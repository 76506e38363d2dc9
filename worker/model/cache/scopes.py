"""Cache scopes: whose prefix-cache blocks a row may read and write.

A prefix cache shared by every key is an oracle: `cached_tokens` (or the time to the first
token) tells a key, token by token, what another key sent (Gu et al., "Auditing prompt caching
in language model APIs", 2025). So every row runs in a scope: the gateway's cache namespace for
its key (a cache group, narrowed by a request's `cache_salt`) and the adapter it runs, and its
cache keys are its tokens moved into that scope's own range. Nothing matches across scopes:
not a block in memory or on disk, not a prefix another row is reading (prefix_inflight), so no
count and no timing crosses them. The base scope (no namespace, no adapter) keeps the plain
tokens: the keyless quick start is one namespace, as before.

vLLM mixes its `cache_salt` into the first block's hash; moving the tokens instead carries the
scope into every place that compares token lists, not only the block hashes."""

from __future__ import annotations

import hashlib

# Token ids are below 2**24 in every vocabulary (the largest are ~2**18); the scope takes the
# bits above them, up to the cache's signed 64-bit keys (array('q')).
TOKEN_BITS = 24
SCOPE_BITS = 63 - TOKEN_BITS
BASE = 0


def check_vocabulary(vocab_size: int) -> None:
    if vocab_size >= 1 << TOKEN_BITS:
        raise ValueError(f"a vocabulary of {vocab_size} tokens does not fit the prefix cache's scoped keys")


def scope_of(namespace: str | None, adapter_tag: int = 0) -> int:
    """The scope of a row: BASE for no namespace and no adapter, else a 39-bit tag of both."""
    if not namespace and not adapter_tag:
        return BASE
    digest = hashlib.blake2b(f"{namespace or ''}\0{adapter_tag}".encode(), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "little") % ((1 << SCOPE_BITS) - 1)


def scoped(tokens: list[int], scope: int) -> list[int]:
    """The cache keys of a row's tokens in its scope."""
    if scope == BASE:
        return list(tokens)
    shift = scope << TOKEN_BITS
    return [t + shift for t in tokens]
