"""The vision runner's prefix cache: mlx-vlm's automatic prefix cache (APC), its blocks keyed by
each prompt's media and cache scope (vision_media.media_key), so a conversation about one video
reads the first turn's KV (video tokens included) on every later turn.

mlx-vlm keys a block by the token ids before it and one salt per prompt (its "semantic hash").
Left to itself it salts with the prompt's whole input embeddings, so no two turns share a
block, and it refuses any block holding media tokens. Salted here with the media's content
hash and the request's cache namespace, equal ids with other media or from another scope
never meet, and a block holding media tokens is exactly as reusable as a text block: the
refusal is turned off for this generator.

The hit is looked up when a row is inserted (the scheduler reports `cached_tokens` then) and
its blocks are held until the row's first token, so the prefill's own lookup finds the same
blocks. Where the hit covers every media token of a Qwen2-VL or Qwen2.5-VL prompt, the vision
tower is not run at all: the embeddings of a cached prefix are never read (the prefill
starts after it), so the media's features are given as zeros of their shape."""

from __future__ import annotations

import secrets
from typing import Any

BLOCK_TOKENS = 16
DEFAULT_MEMORY_MB = 256  # the blocks' bytes when the entry sets no cache.prefix_memory_mb
FLAT_FEATURE_FAMILIES = ("qwen2_vl", "qwen2_5_vl")  # vision features: one (tokens, hidden) array


def make_manager(memory_mb: int | None):
    """mlx-vlm's block store in memory only (no disk tier), or None when turned off (0 MB)."""
    memory_mb = DEFAULT_MEMORY_MB if memory_mb is None else memory_mb
    if memory_mb <= 0:
        return None
    from mlx_vlm.apc import DEFAULT_NUM_BLOCKS, APCManager

    overrides = {"memory_max_gb": memory_mb / 1024, "memory_reserve_gb": 0}
    return APCManager(num_blocks=DEFAULT_NUM_BLOCKS, block_size=BLOCK_TOKENS, disk=None, overrides=overrides)


class MediaPrefixStore:
    def __init__(self, generator, manager) -> None:
        self.generator = generator
        self.manager = manager
        self._held: dict[int, list] = {}  # uid -> blocks held from insert to the first token
        self.encodes_skipped = 0
        self.configured_bytes = manager.memory_max_bytes if manager is not None else 0
        if manager is not None:
            # Blocks are salted with the media's content (media_key): one holding media tokens
            # is safe to reuse, and a second turn about a video must reuse it.
            generator._apc_prefix_has_media_tokens = lambda ids, prefix_len: False

    @staticmethod
    def salt(prompt) -> int:
        """A prompt's key (vision_media.media_key); a resumed row's plain list of ids has none
        and gets a salt of its own: it neither reads nor leaves blocks for another scope."""
        key = getattr(prompt, "cache_key", None)
        return key if key is not None else secrets.randbits(62)

    def lookup(self, ids: list[int], salt: int) -> tuple[int, list]:
        """(cached prefix length, the blocks held for it) for a prompt about to be inserted."""
        if self.manager is None:
            return 0, []
        hit = self.generator._apc_pick_for((-1, ids, 0, {"_apc_semantic_hash": salt}, None, None))
        if hit is None:
            return 0, []
        return int(hit.get("prefix_len") or 0), list(hit.get("matched_blocks") or [])

    def hold(self, uid: int, blocks: list) -> None:
        if blocks:
            self._held[uid] = blocks

    def release(self, uid: int) -> None:
        blocks = self._held.pop(uid, None)
        if blocks:
            self.manager.release(blocks)

    def skip_encoding(self, model, ids: list[int], cached: int) -> dict[str, Any]:
        """`cached_image_features` standing in for the vision tower's output when the cached
        prefix covers every media token (their embeddings are never read), else {}."""
        config = model.config
        if cached <= 0 or getattr(config, "model_type", None) not in FLAT_FEATURE_FAMILIES:
            return {}
        media = {getattr(config, "image_token_id", None), getattr(config, "video_token_id", None)} - {None}
        positions = [i for i, t in enumerate(ids) if t in media]
        if not positions or positions[-1] >= cached:
            return {}
        import mlx.core as mx

        embedded = model.language_model.model.embed_tokens(mx.array([[ids[0]]]))  # the width and dtype
        self.encodes_skipped += 1
        return {"cached_image_features": mx.zeros((len(positions), embedded.shape[-1]), dtype=embedded.dtype)}

    def limit(self, max_bytes: int) -> None:
        """Hold at most max_bytes (what the admitted rows leave of the KV budget) and never more
        than configured: the blocks are KV too, and give way to the rows."""
        if self.manager is None:
            return
        self.manager.memory_max_bytes = min(self.configured_bytes, max_bytes)
        self.manager._make_room()  # evicts idle blocks only (held ones stay)

    def stats(self) -> dict:
        if self.manager is None:
            return {}
        snap = self.manager.stats_snapshot()
        return {
            "bytes": snap.get("resident_bytes", 0),
            "prefix_hits": snap.get("lookups_hit", 0),
            "prefix_matched_tokens": snap.get("matched_tokens", 0),
            "prefix_resident_bytes": snap.get("resident_bytes", 0),
            "media_encodes_skipped": self.encodes_skipped,
        }

    def clear(self) -> None:
        if self.manager is not None:
            self.manager.clear()
