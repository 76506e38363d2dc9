"""Split a model's streamed text into answer text, reasoning and tool calls.

Reasoning models wrap their thinking in tags (`<think>` ... `</think>`; some chat
templates open the tag themselves, so generation starts inside it). Tool-calling models
emit markup (`<tool_call>{json}</tool_call>`, `[TOOL_CALLS]...`) that must never reach a
client as text: it becomes structured tool calls, parsed by mlx-lm's per-family parsers.
Tags can be split across tokens, so a possible tag prefix is held back, as with stop
strings."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

ToolParse = Callable[[str, list | None], dict | list]


@dataclass
class Parsed:
    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # complete calls: index, id, name, arguments

    def __bool__(self) -> bool:
        return bool(self.text or self.reasoning or self.tool_calls)

    def extend(self, other: Parsed) -> None:
        self.text += other.text
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls


@dataclass(frozen=True)
class ToolSyntax:
    start: str
    end: str  # "" means the call runs to the end of the output (Mistral)
    parse: ToolParse
    bare_starts: tuple[str, ...] = ()  # an answer that begins like this is a call (Llama 3 JSON)
    wrappers: tuple[str, ...] = ()  # markup around a group of calls, dropped (DeepSeek)
    # For formats the chat template does not know (generic): rewrites the messages so the
    # template can render the tools and earlier calls; None: the template gets `tools`.
    chat_messages: Callable[[list[dict], list[dict]], list[dict]] | None = None
    # Parses a bare (untagged) call; None: `parse` does (it must then check the name itself).
    bare_parse: ToolParse | None = None


def _held_prefix(buf: str, tags: list[str]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of some tag."""
    hold = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(buf)), hold, -1):
            if buf.endswith(tag[:k]):
                hold = k
                break
    return hold


class OutputParser:
    def __init__(
        self,
        *,
        think: tuple[str, str] | None = None,
        in_reasoning: bool = False,
        tool: ToolSyntax | None = None,
        tools: list | None = None,
    ):
        self.think = think
        self.tool = tool
        self.tools = tools
        self.mode = "reasoning" if (think and in_reasoning) else "text"
        self._bare = False
        self._buf = ""
        self._calls = 0
        self._after_reasoning = False
        self._at_start = True  # nothing emitted yet: bare tool-call starts still possible

    @property
    def saw_tool_calls(self) -> bool:
        return self._calls > 0

    def feed(self, text: str) -> Parsed:
        self._buf += text
        out = Parsed()
        while self._step(out):
            pass
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        while self._step(out):
            pass
        rest, self._buf = self._buf, ""
        if self.mode == "reasoning":
            out.reasoning += rest
        elif self.mode == "tool":
            self._emit_call(rest, out, final=True)
        else:
            out.text += rest
        return out

    # One transition at most; True when the buffer may hold another.
    def _step(self, out: Parsed) -> bool:
        buf = self._buf
        if self.mode == "text":
            if self._after_reasoning:
                buf = self._buf = buf.lstrip("\n")
                self._after_reasoning = not buf
            if self._at_start and self.tool and self.tool.bare_starts:
                head = buf.lstrip()
                if any(head.startswith(b) for b in self.tool.bare_starts):
                    self.mode, self._buf, self._bare = "tool", head, True
                    return True
                if head and any(b.startswith(head) for b in self.tool.bare_starts):
                    return False  # could still become a bare call: hold it
            tags = []
            if self.think:
                tags.append(self.think[0])
            if self.tool:
                tags += [self.tool.start, *self.tool.wrappers]
            found = [(buf.find(t), t) for t in tags if buf.find(t) >= 0]
            if found:
                i, tag = min(found)
                out.text += buf[:i]
                self._buf = buf[i + len(tag) :]
                if self.tool and tag in self.tool.wrappers:
                    return True
                self.mode = "reasoning" if self.think and tag == self.think[0] else "tool"
                return True
            hold = _held_prefix(buf, tags)
            out.text += buf[: len(buf) - hold]
            self._buf = buf[len(buf) - hold :]
            if out.text.strip():
                self._at_start = False
            return False
        if self.mode == "reasoning":
            end = self.think[1]
            i = buf.find(end)
            if i >= 0:
                out.reasoning += buf[:i]
                self._buf = buf[i + len(end) :]
                self.mode = "text"
                self._after_reasoning = True  # the answer's leading newlines are layout, not content
                return True
            hold = _held_prefix(buf, [end])
            out.reasoning += buf[: len(buf) - hold]
            self._buf = buf[len(buf) - hold :]
            return False
        # tool mode: buffer until the end tag (or the end of output)
        if self.tool.end:
            i = buf.find(self.tool.end)
            if i >= 0:
                self._emit_call(buf[:i], out, final=False)
                self._buf = buf[i + len(self.tool.end) :]
                self.mode = "text"
                return True
        return False

    def _emit_call(self, body: str, out: Parsed, final: bool) -> None:
        start = "" if self._bare else self.tool.start
        parse = self.tool.bare_parse if self._bare and self.tool.bare_parse else self.tool.parse
        try:
            parsed = parse(body, self.tools)
        except Exception:  # a parser raises anything on malformed markup; keep the model's words
            out.text += start + body + (self.tool.end if not final else "")
            return
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                out.text += start + body
                return
            args = call.get("arguments", call.get("parameters", {}))
            out.tool_calls.append(
                {
                    "index": self._calls,
                    "id": f"call_{secrets.token_hex(12)}",
                    "name": call["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                }
            )
            self._calls += 1


TOOL_PARSER_ALIASES = {"hermes": "json_tools", "qwen": "json_tools", "qwen2": "json_tools"}


def tool_syntax(name: str | None, tokenizer) -> ToolSyntax | None:
    """The tool markup for a model: named in models.yaml, or inferred by mlx-lm from the
    chat template ("auto" / unset), else the generic format (a system instruction plus JSON
    markup, for templates without a tool format); "none" disables tool parsing."""
    if name == "none":
        return None
    if name in (None, "auto"):
        if getattr(tokenizer, "tool_call_start", None) and getattr(tokenizer, "tool_parser", None):
            from .tool_formats import HERMES_BARE_STARTS, offered_tool_call

            # Hermes-style templates (<tool_call>, Qwen 2.5): small models such as
            # Qwen2.5-Coder-0.5B answer with the bare JSON object, tags left off.
            hermes = tokenizer.tool_call_start == "<tool_call>"
            return ToolSyntax(
                tokenizer.tool_call_start,
                tokenizer.tool_call_end or "",
                tokenizer.tool_parser,
                bare_starts=HERMES_BARE_STARTS if hermes else (),
                bare_parse=offered_tool_call if hermes else None,
            )
        name = "generic"
    import importlib

    from .tool_formats import FORMATS

    module = FORMATS.get(name) or importlib.import_module(f"mlx_lm.tool_parsers.{TOOL_PARSER_ALIASES.get(name, name)}")
    return ToolSyntax(
        module.tool_call_start,
        module.tool_call_end or "",
        module.parse_tool_call,
        tuple(getattr(module, "bare_starts", ())),
        tuple(getattr(module, "wrappers", ())),
        getattr(module, "chat_messages", None),
    )


def think_tags(name: str | None, tokenizer) -> tuple[str, str] | None:
    if name == "none":
        return None
    if name not in (None, "auto"):
        return ("<think>", "</think>")
    if getattr(tokenizer, "has_thinking", False):
        return (tokenizer.think_start, tokenizer.think_end)
    return None
