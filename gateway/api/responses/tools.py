"""Responses API tools as the chat template takes them, and the model's calls as output items.

Every form a client sends is offered to the model:
- `function` tools as they are;
- `namespace` tools flattened to `namespace__name` (the call splits the name back);
- `custom` (freeform) tools as a function with one string parameter `input`; the model's call
  comes back as a `custom_tool_call` item whose `input` is that string. A `regex` grammar
  format is enforced as the parameter's JSON-schema `pattern` when the call is forced
  (tool_choice required or naming the tool); a `lark` grammar cannot be nested in a JSON
  string by the constraint engine, so it is shown to the model in the tool's description and
  not enforced;
- tools carried by an `additional_tools` input item (Codex's own models, "code mode": a
  developer-role item `{"type": "additional_tools", "role": "developer", "tools": [...]}`
  whose tools have the same shapes as `tools`).
Hosted tools this server cannot run (web_search, file_search, ...) are left out and named in
the x-mlxgw-ignored-tools header. A tool marked `defer_loading` is left out until a
`tool_search_output` item names it (tools.is_deferred)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ....shared.errors import invalid
from ...pipeline.tools import function_tool, is_deferred, loaded_tool_names

NAMESPACE_SEP = "__"  # namespace tools are exposed to the model as namespace__function
CUSTOM_INPUT = "input"  # the one string parameter a custom tool is offered with


@dataclass
class ResponsesTools:
    tools: list[dict] = field(default_factory=list)  # as the chat template takes them
    ignored: list[str] = field(default_factory=list)  # hosted tool types left out
    custom: set[str] = field(default_factory=set)  # exposed names of custom tools
    # A custom tool's input schema with its format enforced, for forced calls.
    enforced: dict[str, dict] = field(default_factory=dict)
    loaded: set[str] = field(default_factory=set)  # deferred tools a tool search loaded

    def add(self, tool, namespace: str | None = None) -> None:
        if not isinstance(tool, dict):
            raise invalid("each tool must be an object", "tools")
        if is_deferred(tool, self.loaded):
            return  # not in the model's context until a tool search loads it
        kind = tool.get("type", "function" if namespace else None)
        name = tool.get("name")
        if kind in ("function", "custom") and (not isinstance(name, str) or not name):
            raise invalid(f"each {kind} tool needs a 'name' string", "tools")
        exposed = f"{namespace}{NAMESPACE_SEP}{name}" if namespace else name
        if kind == "function":
            self.tools.append(function_tool(exposed, tool.get("description"), tool.get("parameters")))
        elif kind == "custom":
            self._add_custom(exposed, tool)
        elif kind == "namespace":
            if not isinstance(name, str) or not isinstance(tool.get("tools"), list):
                raise invalid("a namespace tool needs a 'name' string and a 'tools' list", "tools")
            for inner in tool["tools"]:
                self.add(inner, name)
        else:
            self.ignored.append(str(kind))

    def _add_custom(self, exposed: str, tool: dict) -> None:
        description = tool.get("description") if isinstance(tool.get("description"), str) else ""
        fmt = tool.get("format")
        param: dict = {"type": "string", "description": "the tool's input, as free-form text"}
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
                raise invalid(f"custom tool {exposed!r}: format.type must be 'text' or 'grammar'", "tools")
            if fmt["type"] == "grammar":
                syntax, definition = fmt.get("syntax"), fmt.get("definition")
                if syntax not in ("lark", "regex") or not isinstance(definition, str):
                    raise invalid(
                        f"custom tool {exposed!r}: a grammar format needs syntax 'lark' or 'regex' "
                        "and a 'definition' string",
                        "tools",
                    )
                description += f"\n\nThe input must match this {syntax} grammar:\n{definition}"
                if syntax == "regex":
                    self.enforced[exposed] = _schema({**param, "pattern": f"^(?:{definition})$"})
        self.custom.add(exposed)
        self.tools.append(function_tool(exposed, description.strip(), _schema(param)))

    def for_constraint(self) -> list[dict]:
        """The tools a forced call is decoded against: custom formats enforced where they can be."""
        return [
            function_tool(x["function"]["name"], "", self.enforced[x["function"]["name"]])
            if x["function"]["name"] in self.enforced
            else x
            for x in self.tools
        ]


def _schema(param: dict) -> dict:
    return {
        "type": "object",
        "properties": {CUSTOM_INPUT: param},
        "required": [CUSTOM_INPUT],
        "additionalProperties": False,
    }


def parse_tools(raw, items) -> ResponsesTools:
    """`tools`, plus the tools of every `additional_tools` input item."""
    out = ResponsesTools(loaded=loaded_tool_names(items))
    if raw is not None and not isinstance(raw, list):
        raise invalid("'tools' must be a list", "tools")
    for tool in raw or []:
        out.add(tool)
    for i, item in enumerate(items if isinstance(items, list) else []):
        if isinstance(item, dict) and item.get("type") == "additional_tools":
            if not isinstance(item.get("tools"), list):
                raise invalid(f"input[{i}]: an additional_tools item needs a 'tools' list", "input")
            for tool in item["tools"]:
                out.add(tool)
    return out


def split_name(exposed: str) -> dict:
    """{"name": ...} or {"namespace": ..., "name": ...} from an exposed tool name."""
    ns, sep, name = exposed.partition(NAMESPACE_SEP)
    return {"namespace": ns, "name": name} if sep else {"name": exposed}


def joined_name(item: dict) -> str:
    """The exposed name of a call item sent back (namespace and name joined)."""
    name = item.get("name", "")
    return f"{item['namespace']}{NAMESPACE_SEP}{name}" if item.get("namespace") else name


def custom_input(arguments: str) -> str:
    """The freeform input of a custom tool call from the arguments the model wrote."""
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        return arguments
    if isinstance(args, dict) and isinstance(args.get(CUSTOM_INPUT), str):
        return args[CUSTOM_INPUT]
    return arguments if not isinstance(args, str) else args


def custom_arguments(item: dict) -> str:
    """A custom_tool_call sent back, as the arguments the model is shown for it."""
    value = item.get("input")
    return json.dumps({CUSTOM_INPUT: value if isinstance(value, str) else ""}, ensure_ascii=False)
