"""Chat messages in OpenAI's shape, read for Chat Completions and for llama.cpp's /tokenize
(which takes the same messages through the same template)."""

from __future__ import annotations

from ...shared.errors import invalid
from . import audio_parts, video
from .images import ImageLimits, from_openai_part, join_content
from .tools import template_arguments

ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def _content(content, where: str, images: ImageLimits | None) -> str | list[dict]:
    """Text, or text and media parts (images, video, audio; images: None for a text-only model)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content parts", where)
    pieces: list = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(f"{where}.content[{i}] must be an object with a 'type'", where)
        if part["type"] in ("text", "input_text"):
            if not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content[{i}].text must be a string", where)
            pieces.append(part["text"])
        elif part["type"] in ("image_url", "input_image"):
            pieces.append(from_openai_part(part, f"{where}.content[{i}]", images, where))
        elif part["type"] in ("video_url", "input_video"):
            pieces.append(video.from_openai_part(part, f"{where}.content[{i}]", images))
        elif part["type"] in ("input_audio", "audio_url"):
            pieces.append(audio_parts.from_openai_part(part, f"{where}.content[{i}]"))
        else:
            raise invalid(f"{where}.content[{i}] has unsupported type {part['type']!r}", where)
    return join_content(pieces)


def _tool_calls(raw, where: str) -> list[dict]:
    if not isinstance(raw, list):
        raise invalid(f"{where}.tool_calls must be a list", where)
    calls = []
    for call in raw:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"{where}.tool_calls entries need function.name", where)
        args = template_arguments(fn.get("arguments") or "{}")
        calls.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return calls


def parse_messages(raw, images: ImageLimits | None = None) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise invalid("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role must be one of {', '.join(sorted(ROLES))}, got {role!r}", "messages")
        msg = {
            "role": "system" if role == "developer" else role,
            "content": _content(m.get("content"), where, images),
        }
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out
