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


def merge_opening_system_turns(messages: list[dict]) -> list[dict]:
    """System turns before the model's first reply join the leading system prompt; later ones
    stay in place. Claude Code 2.1 sends its environment block as a system turn right after
    the first user message. Measured with Qwen2.5-Coder-0.5B on Claude Code's real request:
    rendered there, the last thing before the reply, the model copied it into the file it
    wrote; as a system turn of its own before the user's, it answered with a code block and
    called no tool (3 of 3); merged into the system prompt, it called Write with the right file.
    Before the first reply the move changes nothing the model has answered, and it is the same
    on every later turn. The cost: the block names the working directory, so the system prompt
    and the tools a template renders after it are a new prefix in each new project."""
    first_reply = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    opening = messages[:first_reply]
    if not any(m.get("role") == "system" for m in opening[1:]):
        return messages
    return merge_system_turns(opening) + messages[first_reply:]


def _text(content) -> str:
    if not isinstance(content, list):
        return ""
    return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
