"""Tool calls a small model cannot get wrong: a lazy constraint on a call once it opens.

Small models often write the right call shape with a made-up name (Qwen2.5-Coder-0.5B on
Claude Code's tools: ```` ```json {"name": "create hello.py", ...} ````), which then stays
text, and the agent's work is not done. llama.cpp's answer is a lazy grammar: decoding is
free until a trigger appears, then constrained. Here the trigger is the opening of a call
object (`{"name": "` where a call can start: the start of the answer, after the model's own
tool markup, at the top of a Markdown fence, or OpenAI's `{"type": "function", "function":
{"name": "`), and the constraint lasts until the call object closes: the name must be one of
the offered tools', followed by `"arguments"` valid against that tool's schema (required
fields, types, enums); then decoding is free again.

The guard is a logits processor with per-sequence state, so such rows do not speculate and
are not preempted (like any constraint): it is a per-model choice (`tool_name_guard: true`
in models.yaml's chat: section), on in config/agents.yaml."""

from __future__ import annotations

import json
import re

import mlx.core as mx

from .constraints import mask_logits

# Where a call object can open, up to the start of its name (possibly partly written: a
# token may carry the quote and the name's first letters).
_OPENER = r"(?:<tool_call>|```[A-Za-z_]*[ \t]*\n|\[)?\s*"
_NAME_KEY = r"\{\s*(?:\"type\"\s*:\s*\"function\"\s*,\s*\"function\"\s*:\s*\{\s*)?\"name\"\s*:\s*\"([^\"\\\n]{0,64})$"
AT_ANSWER_START = re.compile(r"\A\s*" + _OPENER + _NAME_KEY)
AFTER_MARKUP = re.compile(r"(?:<tool_call>|(?:^|\n)```(?:json|tool_call|tool|)[ \t]*\n)\s*" + _NAME_KEY)
NEXT_IN_LIST = re.compile(r"\}\s*,\s*" + _NAME_KEY)  # the next call of a list, once one was guided
TAIL_CHARS = 256  # how much of the answer's end the trigger is looked for in
# The call as the model likes to lay it out (Qwen2.5-Coder writes it pretty-printed), with
# whitespace bounded so it cannot run on forever: forced into compact JSON, the model lost its
# way inside the arguments and copied its prompt into them (Claude Code's Write `content`).
BOUNDED_JSON = {"whitespace_pattern": r"[\n ]{0,16}", "item_separator": ",", "key_separator": ":"}
WS_RULES = "ws: WS?\nWS: /[ \\n]{1,16}/\n"


def rust_regex_escape(text: str) -> str:
    """Escape for llguidance's (Rust) regex syntax: every ASCII punctuation character."""
    return "".join("\\" + c if c.isascii() and not c.isalnum() and c != "_" else c for c in text)


class ToolNameGuard:
    """Logits processor: free decoding, except inside a call, which must be to an offered
    tool with arguments valid for it.

    Called once per step with the sequence's tokens (the last one is the token sampled at
    the previous step) and the next token's logits."""

    def __init__(self, ll_tokenizer, decode, tools: list[tuple[str, dict]], vocab_size: int):
        """tools: (name, JSON schema of its arguments) for each offered tool."""
        self._ll = ll_tokenizer
        self._decode = decode  # token ids -> text
        self._schemas = [(n, s) for n, s in tools if isinstance(n, str) and n]
        self.names = sorted({n for n, _ in self._schemas})
        self._vocab = vocab_size
        self._text = ""  # the answer so far
        self._matcher = None  # set while a call is being written
        self._bitmask = None  # llguidance's one-row mask, allocated on the first guided step
        self._started = False
        self.guided = 0  # names constrained (for tests and stats)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._started:
            token = int(tokens[-1].item())
            if self._matcher is not None:
                self._matcher.consume_token(token)
                if self._matcher.is_accepting() or self._matcher.is_error():
                    self._matcher = None  # the call object is written: free again
            self._text += self._decode([token])
        self._started = True
        if self._matcher is None and self.names:
            self._matcher = self._trigger()
        if self._matcher is None:
            return logits
        return self._mask(logits)

    def _trigger(self):
        """A matcher for the rest of the call when a call's name has just opened, else None."""
        text = self._text
        found = AT_ANSWER_START.search(text) if len(text) <= TAIL_CHARS else None
        found = found or AFTER_MARKUP.search(text[-TAIL_CHARS:])
        if found is None and self.guided:
            found = NEXT_IN_LIST.search(text[-TAIL_CHARS:])
        if found is None:
            return None
        written = found.group(1)
        rests = [n[len(written) :] for n in self.names if n.startswith(written)]
        if not rests:
            return None  # a name no tool has: nothing to steer (the parser keeps it as text)
        import llguidance

        matcher = self._call_matcher(written, _closing(found.group(0)))
        if matcher is None:  # a schema llguidance cannot take: the name alone
            pattern = "(" + "|".join(rust_regex_escape(r) for r in rests) + ')"'
            matcher = llguidance.LLMatcher(self._ll, llguidance.LLMatcher.grammar_from_regex(pattern))
            if matcher.is_error():
                return None
        self.guided += 1
        return matcher

    def _call_matcher(self, written: str, closing: list[str]):
        """The rest of the call after the part of its name already written: an offered name,
        then `"arguments"` valid against that tool's schema, then the object's end and the
        markup that closes it (closing). A call that names the right tool with its required
        arguments missing is an error the client hands back to the model (Qwen's Claude Code
        call of `Agent` without `description`)."""
        import llguidance

        rules, alternatives = [], []
        close = " ".join(f"ws {json.dumps(c)}" if c == "}" else json.dumps(c) for c in ["}", *closing])
        for i, (name, schema) in enumerate(self._schemas):
            if not name.startswith(written):
                continue
            head = json.dumps(name[len(written) :] + '"') + ' ws "," ws "\\"arguments\\"" ws ":" ws'
            alternatives.append(f"c{i}")
            rules.append(f"c{i}: {head} a{i} {close}")
            rules.append(f"a{i}: %json {json.dumps({**schema, 'x-guidance': BOUNDED_JSON})}")
        grammar = "start: " + " | ".join(alternatives) + "\n" + "\n".join(rules) + "\n" + WS_RULES
        try:
            matcher = llguidance.LLMatcher(self._ll, llguidance.LLMatcher.grammar_from_lark(grammar))
        except (ValueError, RuntimeError):
            return None
        return None if matcher.is_error() else matcher

    def _mask(self, logits: mx.array) -> mx.array:
        if self._bitmask is None:
            import llguidance.numpy as llnp

            self._bitmask = llnp.allocate_token_bitmask(1, self._ll.vocab_size)
        return mask_logits(self._matcher, self._bitmask, self._vocab, logits)


def _closing(opening: str) -> list[str]:
    """What must follow a call object's own `}` for the call to be complete, given how it
    opened: the outer `}` of OpenAI's nested shape, then the fence's or the tag's end. Left
    free, Qwen2.5-Coder-0.5B went on after a valid call object (`\\n</tools>"\\n}` before the
    fence closed), and the whole block, no longer JSON, stayed text."""
    closing = ["}"] if '"function"' in opening else []
    if "<tool_call>" in opening:
        closing.append("\n</tool_call>")
    elif "```" in opening:
        closing.append("\n```")
    return closing


def offered_tools(tools: list | None) -> list[tuple[str, dict]]:
    """(name, arguments schema) of the offered tools, in OpenAI's or the flat shape."""
    offered = []
    for tool in tools or []:
        if isinstance(tool, dict):
            spec = tool.get("function", tool)
            if isinstance(spec, dict) and isinstance(spec.get("name"), str):
                schema = spec.get("parameters")
                offered.append((spec["name"], schema if isinstance(schema, dict) else {"type": "object"}))
    return offered
