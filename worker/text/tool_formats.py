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

# -- the generic format: tools for chat templates that have no tool format of their own --
#
# As llama.cpp does for such templates, the tools are described in a system instruction and
# the model answers with JSON markup this module parses. The markup is the widely trained
# hermes/Qwen shape, so a model that has seen any tool-calling data has seen it; forced calls
# (tool_choice required or named) are enforced by the grammar (worker/text/constraints.py).

GENERIC_START = "<tool_call>"
GENERIC_END = "</tool_call>"
GENERIC_INSTRUCTION = (
    "You can call the following tools. Each is given as a JSON object with its name, what it "
    "does and a JSON schema of its arguments:\n{tools}\n\n"
    "To call a tool, reply with exactly this, and nothing after it:\n"
    + GENERIC_START
    + '{{"name": "<tool name>", "arguments": {{<the arguments as a JSON object>}}}}'
    + GENERIC_END
    + "\nTo call several tools, write one such block per call. The result of each call comes back "
    "in a <tool_response> block. When no tool is needed, answer the user in plain text."
)


def _generic_parse(text: str, tools=None):
    """One call object, or a list of them (some models batch their calls in one block);
    a name that is not among the offered tools is not a call (then the text stays text)."""
    body = text.strip()
    if body.startswith("```"):
        body = body.strip("`").removeprefix("json").strip()
    obj = json.loads(body)
    calls = obj if isinstance(obj, list) else [obj]
    known = {_tool_name(t) for t in tools or []}
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError("not a tool call")
        if known and call["name"] not in known:
            raise ValueError(f"unknown tool {call['name']!r}")
        args = call.get("arguments", call.get("parameters", {}))
        if isinstance(args, str):
            args = json.loads(args or "{}")
        if not isinstance(args, dict):
            raise ValueError("tool arguments must be an object")
        out.append({"name": call["name"], "arguments": args})
    if not out:
        raise ValueError("empty tool call")
    return out[0] if len(out) == 1 else out


def _tool_name(tool: dict) -> str | None:
    return (tool.get("function") or tool).get("name") if isinstance(tool, dict) else None


def _tool_summary(tool: dict) -> dict:
    fn = tool.get("function") or tool
    out = {"name": fn.get("name")}
    if fn.get("description"):
        out["description"] = fn["description"]
    out["parameters"] = fn.get("parameters") or {"type": "object"}
    return out


_SCHEMA_NOISE = ("description", "$schema", "additionalProperties", "title", "examples", "default")


def _bare_schema(schema):
    """A JSON schema without its prose and annotations: types, names, enums and nesting stay."""
    if isinstance(schema, dict):
        return {k: _bare_schema(v) for k, v in schema.items() if k not in _SCHEMA_NOISE}
    if isinstance(schema, list):
        return [_bare_schema(x) for x in schema]
    return schema


def _compact_summary(tool: dict) -> dict:
    """The first line of the description (at most 200 characters) and the bare schema."""
    out = _tool_summary(tool)
    if "description" in out:
        out["description"] = out["description"].strip().split("\n")[0][:200]
    out["parameters"] = _bare_schema(out["parameters"])
    return out


def _minimal_summary(tool: dict) -> dict:
    """The name and each argument's name and type: for a prompt that even the compact listing
    would push past the context (Codex's code-mode prompt is ~7,200 tokens on SmolLM2)."""
    fn = tool.get("function") or tool
    props = (fn.get("parameters") or {}).get("properties") or {}
    types = {k: (v.get("type") if isinstance(v, dict) else None) or "any" for k, v in props.items()}
    return {"name": fn.get("name"), "arguments": types}


def generic_instruction(tools: list[dict], compact: bool = False, minimal: bool = False) -> str:
    summary = _minimal_summary if minimal else _compact_summary if compact else _tool_summary
    listing = "\n".join(json.dumps(summary(t), ensure_ascii=False) for t in tools if isinstance(t, dict))
    return GENERIC_INSTRUCTION.format(tools=listing)


def _wrap(content, head: str, tail: str):
    """Text around a message's content, which is a string or (with images) a list of parts."""
    if isinstance(content, list):
        return [{"type": "text", "text": head}, *content, {"type": "text", "text": tail}]
    return head + str(content or "") + tail


def _join(a, b):
    if isinstance(a, str) and isinstance(b, str):
        return f"{a}\n\n{b}" if a else b
    parts = lambda c: c if isinstance(c, list) else [{"type": "text", "text": str(c or "")}]  # noqa: E731
    return parts(a) + parts(b)


def generic_chat_messages(
    messages: list[dict], tools: list[dict], compact: bool = False, minimal: bool = False
) -> list[dict]:
    """The conversation as a template without tool support can render it: the tools in the
    system turn, earlier calls as the markup the model is asked to write, and tool results as
    user turns in <tool_response> blocks (merged with a neighbouring user turn, since many
    templates insist that user and assistant turns alternate). compact: the short tool listing
    (first line of each description, schemas without prose) for a small context; minimal:
    names and argument types only, when even that does not fit."""
    instruction = generic_instruction(tools, compact, minimal)
    out: list[dict] = []
    if messages and messages[0].get("role") == "system":
        out.append({"role": "system", "content": _join(messages[0].get("content") or "", instruction)})
        messages = messages[1:]
    else:
        out.append({"role": "system", "content": instruction})
    names = {}
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            markup = ""
            for call in m["tool_calls"]:
                fn = call.get("function") or call
                names[call.get("id")] = fn.get("name")
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args or "{}")
                    except ValueError:
                        pass
                markup += GENERIC_START + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
                markup += GENERIC_END
            out.append({"role": "assistant", "content": _join(m.get("content") or "", markup)})
            continue
        if role == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id"))
            head = f'<tool_response name="{name}">\n' if name else "<tool_response>\n"
            m = {"role": "user", "content": _wrap(m.get("content"), head, "\n</tool_response>")}
        elif role not in ("user", "assistant", "system"):
            m = {"role": role, "content": m.get("content")}
        else:
            m = {k: v for k, v in m.items() if k != "tool_calls"}
        if out and m["role"] == "user" and out[-1]["role"] == "user":
            out[-1] = {"role": "user", "content": _join(out[-1]["content"], m["content"])}
        else:
            out.append(m)
    return out


generic = SimpleNamespace(
    tool_call_start=GENERIC_START,
    tool_call_end=GENERIC_END,
    parse_tool_call=_generic_parse,
    # Small models often leave the tags off and answer with the bare object; the parser
    # only takes it for a call when the name is one of the offered tools.
    bare_starts=('{"name"',),
    chat_messages=generic_chat_messages,
)

FORMATS["generic"] = generic

# A bare answer `{"name": ..., "arguments": ...}` to a hermes-style (<tool_call>) template.
HERMES_BARE_STARTS = ('{"name"',)


def offered_tool_call(text: str, tools=None):
    """A bare JSON answer is a call only when tools were offered and it names one of them
    (otherwise it stays the model's text: JSON a user asked for)."""
    if not tools:
        raise ValueError("no tools offered")
    return _generic_parse(text, tools)


# -- the calls small models write outside their family's markup --
#
# Measured with Qwen2.5-Coder-0.5B and SmolLM2: a call inside a Markdown fence
# (```json / ```tool_call), a bare JSON object or a list of them, sometimes in OpenAI's own
# shape ({"type": "function", "function": {...}}). They are calls only when every name is an
# offered tool: JSON that merely mentions a tool, or that a user asked for, stays text.

FENCE = "```"
CALL_FENCE_INFOS = frozenset({"", "json", "json5", "tool_call", "tool_calls", "tool_code", "tool", "function_call"})
LOOSE_BARE_STARTS = ('{"name":', '[{"name":', '{"type":"function"', '[{"type":"function"', '{"function":')


def _loose_call(obj) -> dict:
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = obj["function"]  # OpenAI's shape, imitated
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a tool call")
    return {"name": obj["name"], "arguments": obj.get("arguments", obj.get("parameters", obj.get("args", {})))}


def loose_tool_calls(body: str, tools) -> list[dict]:
    """The calls in a fence's body (its info line dropped) or a bare JSON answer, each naming
    an offered tool; raises ValueError otherwise."""
    text = body.strip()
    if text.startswith(FENCE):
        text = text[len(FENCE) :]
        if text.endswith(FENCE):
            text = text[: -len(FENCE)]
    info = re.match(r"\s*([A-Za-z0-9_]+)", text)
    if info and info.group(1).lower() in CALL_FENCE_INFOS:
        text = text[info.end() :]
    for tag in (GENERIC_START, GENERIC_END):
        text = text.replace(tag, "")
    obj = json.loads(text.strip())
    calls = [_loose_call(c) for c in (obj if isinstance(obj, list) else [obj])]
    if not calls or not all_offered(calls, tools):
        raise ValueError("not a call of an offered tool")
    for call in calls:
        if isinstance(call["arguments"], str):
            call["arguments"] = json.loads(call["arguments"] or "{}")
        if not isinstance(call["arguments"], dict):
            raise ValueError("tool arguments must be an object")
    return calls


def all_offered(calls: list, tools) -> bool:
    known = {_tool_name(t) for t in tools or []}
    return bool(known) and all(isinstance(c, dict) and c.get("name") in known for c in calls)


def could_start_bare_call(head: str) -> tuple[bool, bool]:
    """(is a bare call's start, may still become one) for an answer's first characters,
    whitespace inside the JSON ignored."""
    compact = "".join(head.split())[:24]
    if any(compact.startswith(s) for s in LOOSE_BARE_STARTS):
        return True, True
    return False, bool(compact) and any(s.startswith(compact) for s in LOOSE_BARE_STARTS)
