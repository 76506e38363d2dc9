"""Prefix reuse: the KV blocks, the in-memory prefix cache, its disk tiers, state checkpoints,
quantized KV."""
