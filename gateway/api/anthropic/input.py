"""Anthropic Messages requests as internal chat messages.

Every shape current Claude Code sends is accepted: `system` turns inside `messages` (those
before the first assistant turn join the leading system prompt, later ones stay in place;
a model whose chat template takes system turns only first gets them all merged into the
leading system prompt, see shared/chat.py), tool results with text, images and
documents, `document` blocks (plain text, or PDF read to text),
`thinking` and `redacted_thinking` blocks sent back (accepted, not rendered: they are the
model's own earlier reasoning), `cache_control` on any block (read as a hint by
pipeline/cache_hints.py, not here). Unknown fields are ignored, never a 400.

Claude Code opens its system prompt with a billing line for Anthropic's servers
(`x-anthropic-billing-header: cc_version=2.1.332.848; cc_entrypoint=sdk-cli; cch=...;`) whose
values change per session or per request. It says nothing to the model, and at the very
start of the prompt it would make every new session miss the prefix cache on ~5,800 tokens of
system prompt and tools (minutes of prefill on a slow host): it is left out, as vLLM and
SGLang do."""

from __future__ import annotations

import re

from ....shared.chat import merge_opening_system_turns
from ....shared.errors import invalid
from ...pipeline import video
from ...pipeline.content import ContentPolicy, b64decode, blocks_of, read_pdfs, text_file, titled
from ...pipeline.images import from_base64, from_url, join_content

BILLING_LINE = re.compile(r"^x-anthropic-billing-header:[^\n]*(\n|$)", re.MULTILINE)

# Blocks that carry nothing a chat template renders: accepted and left out.
SILENT_BLOCKS = {"thinking", "redacted_thinking", "server_tool_use", "web_search_tool_result", "container_upload"}


def _image(block: dict, where: str, policy: ContentPolicy, in_tool_result: bool):
    if policy.images is None:
        if in_tool_result:
            return policy.image_placeholder()
        raise invalid(f"{where}: this model does not accept images; use a vision model")
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        return from_base64(source.get("media_type"), source.get("data"), where, policy.images)
    if kind == "url":
        return from_url(source.get("url"), where, policy.images)
    raise invalid(f"{where}.source: an image source must be of type 'base64' or 'url'")


def _document(block: dict, where: str, policy: ContentPolicy) -> str:
    if id(block) in policy.documents:
        return titled(policy.documents[id(block)], block.get("title"))
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text" and isinstance(source.get("data"), str):
        return titled(source["data"], block.get("title"))
    if kind == "base64" and source.get("media_type") != "application/pdf":
        return titled(
            text_file(b64decode(source.get("data"), where, "messages"), where, "messages"), block.get("title")
        )
    if kind == "content":
        return titled(_text_of(source.get("content"), f"{where}.source.content", policy), block.get("title"))
    if kind in ("url", "file"):
        raise invalid(f"{where}.source: documents by {kind} are not fetched by this server; send the data inline")
    raise invalid(f"{where}.source: a document source must be of type 'text', 'base64' or 'content'")


def _piece(block, where: str, policy: ContentPolicy, in_tool_result: bool = False):
    """One content block as text or an image part; None for blocks that render nothing."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise invalid(f"{where}.text: Input should be a valid string")
        return block["text"]
    if kind == "image":
        return _image(block, where, policy, in_tool_result)
    if kind == "video" and not in_tool_result:
        return video.from_anthropic_block(block, where, policy.images)
    if kind == "document":
        return _document(block, where, policy)
    if kind == "tool_reference" and isinstance(block.get("tool_name"), str):
        # A client-side tool search's result: the tool is offered from here on (tools.is_deferred).
        return f"Tool loaded: {block['tool_name']}"
    if kind == "search_result":
        return titled(_text_of(block.get("content"), f"{where}.content", policy), block.get("title"))
    if kind is None:
        raise invalid(f"{where}: each content block needs a 'type'")
    if kind in SILENT_BLOCKS:
        return None
    raise invalid(f"{where}: content blocks of type {kind!r} are not supported here")


def _pieces(content, where: str, policy: ContentPolicy, in_tool_result: bool = False) -> list:
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of content blocks")
    pieces = (_piece(b, f"{where}.{j}", policy, in_tool_result) for j, b in enumerate(content))
    return [x for x in pieces if x is not None]


def _text_of(content, where: str, policy: ContentPolicy) -> str:
    """Text of a string or of text blocks (system prompts)."""
    pieces = _pieces(content, where, policy)
    if any(isinstance(x, dict) for x in pieces):
        raise invalid(f"{where}: images are accepted in message content and tool results only")
    return "\n".join(pieces)


def _tool_call(block: dict, where: str) -> dict:
    if not isinstance(block.get("name"), str):
        raise invalid(f"{where}.name: Field required")
    arguments = block.get("input") if isinstance(block.get("input"), dict) else {}
    return {"id": block.get("id"), "type": "function", "function": {"name": block["name"], "arguments": arguments}}


def _convert_message(m: dict, i: int, policy: ContentPolicy) -> list[dict]:
    where = f"messages.{i}"
    role = m.get("role")
    if role not in ("user", "assistant", "system"):
        raise invalid(f"{where}.role: Input should be 'user', 'assistant' or 'system'")
    content = m.get("content")
    if role == "system":
        return [{"role": "system", "content": _text_of(content, f"{where}.content", policy)}]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content: Input should be a valid string or list of content blocks")
    out: list[dict] = []
    pieces: list = []  # text, and image parts for vision models
    calls: list[dict] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, f"{where}.content.{j}"))
        elif kind == "tool_result" and role == "user":
            result = _pieces(block.get("content") or "", f"{where}.content.{j}.content", policy, in_tool_result=True)
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": join_content(result)})
        else:
            piece = _piece(block, f"{where}.content.{j}", policy)
            if piece is not None:
                pieces.append(piece)
    if pieces or calls or not out:
        msg = {"role": role, "content": join_content([x for x in pieces if x])}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _pdf_blocks(messages):
    """Every base64 PDF document of the request, to read before converting."""
    for i, j, block in blocks_of(messages):
        source = block.get("source")
        if block.get("type") == "document" and isinstance(source, dict) and source.get("type") == "base64":
            if source.get("media_type") == "application/pdf":
                where = f"messages.{i}.content.{j}"
                yield block, b64decode(source.get("data"), where, "messages"), where


async def read_documents(messages, policy: ContentPolicy) -> None:
    """The PDFs of `messages` (as sent), read to text once before the messages are converted."""
    await read_pdfs(_pdf_blocks(messages), policy, "messages")


def convert_messages(raw, system, policy: ContentPolicy) -> list[dict]:
    """`messages` and `system` (as sent) as internal chat messages."""
    if raw is None:
        raise invalid("messages: Field required", "messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages: at least one message is required", "messages")
    messages: list[dict] = []
    if system:
        text = BILLING_LINE.sub("", _text_of(system, "system", policy))
        if text:
            messages.append({"role": "system", "content": text})
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise invalid(f"messages.{i}: Input should be a valid dictionary")
        messages.extend(_convert_message(m, i, policy))
    return merge_opening_system_turns(messages)
