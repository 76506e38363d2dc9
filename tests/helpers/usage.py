"""Reading usage the way clients do."""

from __future__ import annotations


def prompt_total(usage) -> int:
    """Anthropic splits a prompt in three disjoint counts; their sum is the whole prompt."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
