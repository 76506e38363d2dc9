"""Tools in every API's spelling, as the one internal request takes them: tool definitions
(a function with a JSON-schema `parameters`, as chat templates render them), tool calls sent
back in the conversation, and the constraints that force a call or an output format.

The API modules read their own shapes (Anthropic's `input_schema`, Ollama's arguments as an
object, Responses' namespaces and custom tools) and meet here, so the internal shapes are
made in one place."""

from __future__ import annotations

import json

from ...shared.errors import invalid

# -- tool definitions ---------------------------------------------------------------------------


def function_tool(name, description, parameters) -> dict:
    """A tool as the chat template takes it."""
    if not isinstance(name, str) or not name:
        raise invalid("each tool needs a 'name' string", "tools")
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description if isinstance(description, str) else "",
            "parameters": parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}},
        },
    }


def loaded_tool_names(conversation: object) -> set[str]:
    """Deferred tools a tool search already loaded: the names in `tool_reference` blocks
    (Anthropic) and in `tool_search_output` items' tools (OpenAI Responses)."""
    found: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            kind = node.get("type")
            if kind == "tool_reference" and isinstance(node.get("tool_name"), str):
                found.add(node["tool_name"])
            elif kind == "tool_search_output" and isinstance(node.get("tools"), list):
                found.update(x["name"] for x in node["tools"] if isinstance(x, dict) and isinstance(x.get("name"), str))
            if isinstance(node.get("content"), list):
                walk(node["content"])

    walk(conversation)
    return found


def is_deferred(tool: object, loaded: set[str]) -> bool:
    """A tool marked `defer_loading` (Anthropic's and OpenAI's tool search) is not in the
    model's context until a search loads it: shown earlier, a small model calls it (Claude
    Code offers `DeferredToolPlaceholder`, "never call this tool", first)."""
    return isinstance(tool, dict) and tool.get("defer_loading") is True and tool.get("name") not in loaded


# -- tool calls sent back -----------------------------------------------------------------------


def template_arguments(args):
    """Tool-call arguments as chat templates expect them: an object where the JSON parses."""
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


# -- forced calls and output formats ------------------------------------------------------------


def forced_tool(tools: list[dict] | None, name: str | None, param: str = "tool_choice") -> dict:
    """A tool call enforced by constrained decoding: any of the tools, or the named one."""
    if not tools:
        raise invalid(f"{param} requires tools", param)
    return {"type": "tool_call", "tools": tools, "name": name}


def one_constraint(output_format: dict | None, forced: dict | None, names: str) -> dict | None:
    """An output format or a forced tool call; both at once cannot be enforced."""
    if output_format is not None and forced is not None:
        raise invalid(f"{names} cannot be combined", "tool_choice")
    return forced or output_format


def json_schema_constraint(schema, where: str, param: str) -> dict:
    if not isinstance(schema, dict):
        raise invalid(f"{where} must be a JSON schema object", param)
    return {"type": "json_schema", "schema": schema}


def openai_constraint(fmt: dict | None, choice, tools: list | None, name: str, schema_where: str, param: str):
    """OpenAI's output format (Chat's response_format, Responses' text.format, named `name`)
    or its forced tool_choice, as the one constraint of the request."""
    return one_constraint(
        openai_output_format(fmt, name, schema_where, param),
        openai_tool_choice(choice, tools),
        f"{name} and a forced tool_choice",
    )


def openai_tool_choice(choice, tools: list | None) -> dict | None:
    """OpenAI's tool_choice (Chat, and Responses in Chat's spelling): "required" or a named
    function is enforced by constrained decoding."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return forced_tool(tools, None)
    if isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        return forced_tool(tools, choice["function"]["name"])
    raise invalid("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', ...}", "tool_choice")


def openai_output_format(fmt: dict | None, name: str, schema_where: str, param: str) -> dict | None:
    """An OpenAI output format (Chat's response_format, Responses' text.format)."""
    if not fmt or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt["type"] == "json_schema":
        return json_schema_constraint(fmt.get("schema"), schema_where, param)
    raise invalid(f"{name} type {fmt['type']!r} is not supported (text, json_object, json_schema)", param)
