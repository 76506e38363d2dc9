"""Tool-call formats mlx-lm has no parser for: Llama 3 JSON and DeepSeek.

Each module-like object has tool_call_start, tool_call_end and parse_tool_call(text, tools),
the same interface as mlx_lm.tool_parsers.* modules."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace


def _llama3_parse(text: str, tools=None):
    """Llama 3.x: {"name": ..., "parameters": {...}} (after <|python_tag|> or as the whole
    answer); several calls may be separated by ';'."""
    calls = []
    for chunk in [c for c in re.split(r";\s*(?=\{)", text.strip()) if c.strip()]:
        obj = json.loads(chunk)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError("not a tool call")
        calls.append({"name": obj["name"], "arguments": obj.get("parameters", obj.get("arguments", {}))})
    if not calls:
        raise ValueError("empty tool call")
    return calls[0] if len(calls) == 1 else calls


llama3_json = SimpleNamespace(
    tool_call_start="<|python_tag|>",
    tool_call_end="",
    parse_tool_call=_llama3_parse,
    # Without the tag, a Llama 3 answer that *is* a JSON call starts like this.
    bare_starts=('{"name"',),
)

_DEEPSEEK_SEP = "<｜tool▁sep｜>"


def _deepseek_parse(text: str, tools=None):
    """DeepSeek V3/R1: function<｜tool▁sep｜>NAME\\n```json\\n{ARGS}\\n```"""
    _, sep, rest = text.partition(_DEEPSEEK_SEP)
    if not sep:
        raise ValueError("no tool separator")
    name, _, body = rest.partition("\n")
    body = body.strip()
    if body.startswith("```"):
        body = body.strip("`").removeprefix("json").strip()
    return {"name": name.strip(), "arguments": json.loads(body or "{}")}


deepseek = SimpleNamespace(
    tool_call_start="<｜tool▁call▁begin｜>",
    tool_call_end="<｜tool▁call▁end｜>",
    parse_tool_call=_deepseek_parse,
    wrappers=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
)

FORMATS = {"llama3_json": llama3_json, "llama3": llama3_json, "deepseek": deepseek, "deepseek_v3": deepseek}
