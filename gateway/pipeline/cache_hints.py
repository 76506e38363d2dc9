"""Clients' prompt-caching hints, read as hints: Anthropic's `cache_control` breakpoints and
OpenAI's `prompt_cache_retention`. The prefix cache keeps every prompt it computes whether or
not a client asks; a hint says that this request's prompt is worth keeping longer, so the
worker holds its blocks against eviction for the asked time (bounded by a share of the
cache: worker/model/cache/prefix_cache.py). A session id the client sends
(`prompt_cache_key`, Anthropic's `metadata.user_id`, the session headers of Claude Code,
Qwen Code and crush) changes nothing on one worker: with replicas it keeps the session's
turns on one replica from its first turn on (gateway/link/pool.py)."""

from __future__ import annotations

from ...shared.errors import invalid
from ...shared.events import Usage

# Headers agents send with a stable id per session, read in this order after the body's fields.
SESSION_HEADERS = ("x-claude-code-session-id", "x-qwen-code-session-id", "x-session-affinity")
MAX_SESSION_ID = 256


def session_id(headers, body: object) -> str | None:
    """The id the client gives this request's session, if any (a hint for routing only:
    it never widens a cache namespace, gateway/link/route_key.py)."""
    found = None
    if isinstance(body, dict):
        found = body.get("prompt_cache_key")
        metadata = body.get("metadata")
        if not isinstance(found, str) and isinstance(metadata, dict):
            found = metadata.get("user_id")
    if not isinstance(found, str) or not found:
        found = next((headers[h] for h in SESSION_HEADERS if headers.get(h)), None)
    return found[:MAX_SESSION_ID] if isinstance(found, str) and found else None


# Anthropic's two breakpoint lifetimes; a breakpoint without a ttl lives 5 minutes.
ANTHROPIC_TTL_S = {"5m": 300.0, "1h": 3600.0}
# OpenAI's: "in_memory" (minutes, the default) or "24h" (kept on disk for a day).
OPENAI_RETENTION_S = {"in_memory": 300.0, "24h": 86400.0}


def _ttl(block: object, where: str) -> float | None:
    mark = block.get("cache_control") if isinstance(block, dict) else None
    if mark is None:
        return None
    if not isinstance(mark, dict) or mark.get("type") != "ephemeral":
        raise invalid(f"{where}.cache_control: expected {{'type': 'ephemeral'}}", "cache_control")
    ttl = mark.get("ttl", "5m")
    if ttl not in ANTHROPIC_TTL_S:
        raise invalid(f"{where}.cache_control.ttl: expected '5m' or '1h', got {ttl!r}", "cache_control")
    return ANTHROPIC_TTL_S[ttl]


def anthropic_retention(system: object, messages: object, tools: object) -> float | None:
    """The longest lifetime any breakpoint asks for (tools, system blocks, content blocks),
    or None when the request marks nothing."""
    found: list[float] = []
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        found.append(_ttl(tool, f"tools[{i}]"))
    for i, block in enumerate(system if isinstance(system, list) else []):
        found.append(_ttl(block, f"system[{i}]"))
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            found.append(_ttl(block, f"messages[{i}].content[{j}]"))
    asked = [t for t in found if t is not None]
    return max(asked) if asked else None


def openai_retention(value: str | None) -> float | None:
    return OPENAI_RETENTION_S[value] if value is not None else None


def anthropic_usage(u: Usage, hinted: bool) -> dict:
    """Anthropic counts a prompt in three disjoint parts (input + cache read + cache write =
    the whole prompt; Claude Code sums them as the context's size): what the prefix cache
    supplied is read; what was computed is written to the cache when the request marked a
    breakpoint (the worker keeps it), and plain input when it did not."""
    computed = max(u.prompt_tokens - u.cached_tokens, 0)
    return {
        "input_tokens": 0 if hinted else computed,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": computed if hinted else 0,
    }
