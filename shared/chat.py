"""Chat messages, the parts both sides agree on."""

from __future__ import annotations


def has_late_system_turn(messages: list[dict]) -> bool:
    """A system turn after the first message (Claude Code sends them mid-conversation)."""
    return any(m.get("role") == "system" for m in messages[1:])


def merge_system_turns(messages: list[dict]) -> list[dict]:
    """The fallback for chat templates that take a system turn only first (they raise on
    one later): every system turn's text, in order and separated by a blank line, becomes
    one leading system message; the other turns keep their order."""
    system = [m for m in messages if m.get("role") == "system"]
    if not system:
        return messages
    texts = [m["content"] if isinstance(m.get("content"), str) else _text(m.get("content")) for m in system]
    rest = [m for m in messages if m.get("role") != "system"]
    return [{"role": "system", "content": "\n\n".join(t for t in texts if t)}, *rest]


def _text(content) -> str:
    if not isinstance(content, list):
        return ""
    return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
