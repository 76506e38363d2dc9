"""Constrained decoding with llguidance: JSON schema, JSON object, regex and Lark grammars.

Each constrained sequence gets its own matcher; its logits processor asks llguidance for
the next-token bitmask (computed in Rust) and masks the logits with vectorised NumPy/MLX
operations: no Python loop over the vocabulary, and unconstrained sequences in the same
batch are untouched."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np

from ...shared.errors import invalid

# Fixed separators and no free whitespace: with flexible whitespace a weak model can emit
# newlines forever and never close the object; compact JSON always parses.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintFactory:
    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: list[int]):
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._ll = None  # built on first use: ~1 s, and most requests never need it

    def _tokenizer(self):
        if self._ll is None:
            import llguidance.hf

            self._ll = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=self.eos_ids)
        return self._ll

    def grammar(self, constraint: dict) -> str:
        import llguidance

        kind = constraint.get("type")
        try:
            if kind == "json_schema":
                schema = constraint.get("schema")
                if not isinstance(schema, dict):
                    raise invalid("json_schema needs a 'schema' object", "response_format")
                return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT_JSON)
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=COMPACT_JSON)
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(str(constraint.get("pattern", "")))
            if kind == "lark":
                return llguidance.LLMatcher.grammar_from_lark(str(constraint.get("grammar", "")))
        except ValueError as e:  # llguidance reports bad schemas and grammars as ValueError
            raise invalid(f"invalid {kind} constraint: {e}", "response_format") from None
        raise invalid(f"unknown constraint type {kind!r}", "response_format")

    def tool_call_grammar(self, constraint: dict, start: str, end: str) -> str:
        """A Lark grammar for exactly one call in the model's own tool markup, with the
        arguments constrained by the chosen tool's JSON schema (tool_choice required/named)."""
        tools = [t.get("function", t) for t in constraint.get("tools") or [] if isinstance(t, dict)]
        name = constraint.get("name")
        if name is not None:
            tools = [t for t in tools if t.get("name") == name]
            if not tools:
                raise invalid(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        if not tools:
            raise invalid("tool_choice requires a tool call, but no tools were given", "tool_choice")
        options = [
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "arguments"],
                "properties": {
                    "name": {"const": t.get("name")},
                    "arguments": t.get("parameters") or {"type": "object"},
                },
            }
            for t in tools
        ]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        schema = {**schema, "x-guidance": COMPACT_JSON}
        return f"start: {json.dumps(start)} call {json.dumps(end)}\ncall: %json {json.dumps(schema)}\n"

    def processor(self, constraint: dict, tool_markup: tuple[str, str] | None = None):
        import llguidance
        import llguidance.numpy as llnp

        if constraint.get("type") == "tool_call":
            if tool_markup is None:
                raise invalid(
                    "forcing a tool call needs a tool-call format with an end tag, and this model's has none "
                    "(set tool_parser: generic in models.yaml to use mlxgw's generic format)",
                    "tool_choice",
                )
            grammar = llguidance.LLMatcher.grammar_from_lark(self.tool_call_grammar(constraint, *tool_markup))
        else:
            grammar = self.grammar(constraint)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer())
        if is_error:
            raise invalid(f"invalid {constraint.get('type')} constraint: {'; '.join(messages)}", "response_format")
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar)
        bitmask = llnp.allocate_token_bitmask(1, self._tokenizer().vocab_size)
        vocab = self.vocab_size
        state = {"started": False}

        def constrain(tokens: mx.array, logits: mx.array) -> mx.array:
            # The context's last token is the one sampled at the previous step.
            if state["started"]:
                matcher.consume_token(int(tokens[-1].item()))
            state["started"] = True
            return mask_logits(matcher, bitmask, vocab, logits)

        return constrain

    def ll_tokenizer(self):
        """llguidance's view of the tokenizer (built once, on first use)."""
        return self._tokenizer()


def mask_logits(matcher, bitmask, vocab: int, logits: mx.array) -> mx.array:
    """logits with every token the matcher does not allow next set to -inf (bitmask: a
    one-row llguidance bitmask to fill)."""
    import llguidance.numpy as llnp

    llnp.fill_next_token_bitmask(matcher, bitmask, 0)
    allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab].astype(bool)
    if len(allowed) < logits.shape[-1]:
        allowed = np.concatenate([allowed, np.zeros(logits.shape[-1] - len(allowed), dtype=bool)])
    return mx.where(mx.array(allowed), logits, -float("inf"))
