"""Split a model's streamed text into answer text, reasoning and tool calls.

Reasoning models wrap their thinking in tags (`<think>` ... `</think>`; some chat
templates open the tag themselves, so generation starts inside it). Tool-calling models
emit markup (`<tool_call>{json}</tool_call>`, `[TOOL_CALLS]...`) that must never reach a
client as text: it becomes structured tool calls, parsed by mlx-lm's per-family parsers.
Tags can be split across tokens, so a possible tag prefix is held back, as with stop
strings.

Small models often call tools outside their family's markup: a Markdown fence
(```json {...}```), a bare JSON answer, a list of calls. When tools are offered, a fence is
held until it closes and an answer that starts like a JSON call is held to its end; either
becomes tool calls only if every name is an offered tool (worker/text/tool_formats.py
loose_tool_calls), else it is text as written. A fence of another language (```python)
streams as text at once."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from .tool_formats import CALL_FENCE_INFOS, FENCE, all_offered, could_start_bare_call, loose_tool_calls

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
        self._loose = False  # the call in progress is a loose one (bare JSON outside the markup)
        self._catch_loose = bool(tool and tools)  # fenced / bare calls of offered tools

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
        elif self.mode == "fence":  # the model stopped inside its fence
            self._emit_fence(rest, out, closed=False)
        elif self.mode == "code":
            out.text += rest
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
            if self._at_start and self.tool and (self.tool.bare_starts or self._catch_loose):
                held = self._bare_start(buf.lstrip())
                if held is not None:
                    return held
            tags = []
            if self.think:
                tags.append(self.think[0])
            if self.tool:
                tags += [self.tool.start, *self.tool.wrappers]
            if self._catch_loose:
                tags.append(FENCE)
            found = [(buf.find(t), t) for t in tags if buf.find(t) >= 0]
            if found:
                i, tag = min(found)
                out.text += buf[:i]
                self._buf = buf[i + len(tag) :]
                if self.tool and tag in self.tool.wrappers:
                    return True
                if tag == FENCE:
                    self.mode = "fence"
                    return True
                self.mode = "reasoning" if self.think and tag == self.think[0] else "tool"
                return True
            hold = _held_prefix(buf, tags)
            out.text += buf[: len(buf) - hold]
            self._buf = buf[len(buf) - hold :]
            if out.text.strip():
                self._at_start = False
            return False
        if self.mode in ("fence", "code"):
            return self._fence_step(buf, out)
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

    def _bare_start(self, head: str) -> bool | None:
        """At the answer's start: take a bare call (True), hold what may become one (False),
        or None when it cannot be one."""
        if any(head.startswith(b) for b in self.tool.bare_starts):
            self.mode, self._buf, self._bare = "tool", head, True
            return True
        is_loose, may_be_loose = could_start_bare_call(head) if self._catch_loose else (False, False)
        if is_loose:
            self.mode, self._buf, self._bare, self._loose = "tool", head, True, True
            return True
        if head and (may_be_loose or any(b.startswith(head) for b in self.tool.bare_starts)):
            return False  # could still become a bare call: hold it
        return None

    def _fence_step(self, buf: str, out: Parsed) -> bool:
        """Inside a fence: a call-like one ("fence") is held until it closes, then parsed;
        another language's ("code") streams as text up to its closing fence."""
        if self.mode == "fence":
            info = re.match(r"[A-Za-z0-9_]*", buf).group(0)
            if len(info) == len(buf) and len(buf) <= 32:
                return False  # the info word may go on: wait for the character after it
            if info.lower() not in CALL_FENCE_INFOS:  # another language's code block
                self.mode, self._buf = "code", ""
                out.text += FENCE + buf
                return False
            i = buf.find(FENCE, len(info))
            if i < 0:
                return False
            self._emit_fence(buf[:i], out)
            self._buf = buf[i + len(FENCE) :]
            self.mode = "text"
            return True
        i = buf.find(FENCE)
        if i >= 0:
            out.text += buf[: i + len(FENCE)]
            self._buf = buf[i + len(FENCE) :]
            self.mode = "text"
            return True
        hold = _held_prefix(buf, [FENCE])
        out.text += buf[: len(buf) - hold]
        self._buf = buf[len(buf) - hold :]
        return False

    def _emit_fence(self, body: str, out: Parsed, closed: bool = True) -> None:
        try:
            calls = loose_tool_calls(body, self.tools)
        except (ValueError, TypeError):  # not a call of an offered tool: the model's own text
            out.text += FENCE + body + (FENCE if closed else "")
            return
        self._append_calls(calls, out)

    def _emit_call(self, body: str, out: Parsed, final: bool) -> None:
        start = "" if self._bare else self.tool.start
        parse = self.tool.bare_parse if self._bare and self.tool.bare_parse else self.tool.parse
        if self._loose:
            parse = loose_tool_calls
        self._loose = False
        try:
            parsed = parse(body, self.tools)
            calls = parsed if isinstance(parsed, list) else [parsed]
            if self._bare and self.tools and not all_offered(calls, self.tools):
                raise ValueError("a bare answer is a call only if it names an offered tool")
        except Exception:  # a parser raises anything on malformed markup; keep the model's words
            out.text += start + body + (self.tool.end if not final else "")
            return
        if any(not isinstance(c, dict) or not isinstance(c.get("name"), str) for c in calls):
            out.text += start + body
            return
        self._append_calls(calls, out)

    def _append_calls(self, calls: list[dict], out: Parsed) -> None:
        for call in calls:
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
