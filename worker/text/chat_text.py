"""A chat model's text side: prompts to token ids (chat template, sandboxed and budgeted),
token ids back to text (detokenizer), and the per-request output parser and constraint.

Shared by composition: the MLX runner and the vision runner each hold one, over the same
kind of mlx-lm tokenizer; neither inherits the other."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ...shared.chat import has_late_system_turn, merge_system_turns
from ...shared.errors import invalid
from ...shared.protocol import GenerateRequest
from . import templates

if TYPE_CHECKING:
    from .fim import FimPrompts

# apply_chat_template's own parameters: a request's template kwargs must not set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
        "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "tokenizer_kwargs",
        "return_assistant_tokens_mask", "sanitize_control_tokens",
    }
)  # fmt: skip


def template_kwargs(req: GenerateRequest, allow_request_template: bool) -> dict:
    """The extra variables a request passes to the chat template (enable_thinking, ...), checked."""
    kwargs = dict(req.chat_template_kwargs or {})
    if "chat_template" in kwargs and not allow_request_template:
        raise invalid(
            "this model does not accept a chat_template from the request "
            "(allow_request_chat_template is off in its models.yaml entry)",
            "chat_template_kwargs",
        )
    reserved = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS - {"chat_template"})
    if reserved:
        raise invalid(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    if req.tools:
        kwargs["tools"] = req.tools
    return kwargs


class ChatText:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        *,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        allow_request_chat_template: bool = False,
        context_length: int | None = None,
        tool_name_guard: bool = False,
        fim=None,
        chat_template: str | None = None,
    ):
        """tokenizer: mlx-lm's TokenizerWrapper; vocab_size: the model's logits width;
        fim: the model's FimPrompts (worker/text/fim.py), or None to find its format here;
        chat_template: the entry's own template (a Modelfile's TEMPLATE), in place of the
        tokenizer's: the model's template for every request, so it needs no request templates."""
        if chat_template:
            tokenizer.chat_template = chat_template  # mlx-lm's wrapper sets it on the HF tokenizer
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.allow_request_chat_template = allow_request_chat_template
        self.context_length = context_length
        self.tool_name_guard = tool_name_guard
        self._constraints = None
        self._fim = fim
        templates.install()

    def encode(self, req: GenerateRequest) -> list[int]:
        if req.prompt_tokens is not None:
            vocab = self.tokenizer.vocab_size
            if any(not isinstance(t, int) or t < 0 or t >= vocab for t in req.prompt_tokens):
                raise invalid(f"prompt token ids must be integers in [0, {vocab})", "prompt")
            return list(req.prompt_tokens)
        if req.fim is not None:
            return self.fim_prompts().encode(req.fim, self.context_length, req.max_tokens)
        if req.messages is not None:
            return self.apply_template(req)
        return self.tokenizer.encode(req.prompt or "")

    def apply_template(self, req: GenerateRequest, tokenize: bool = True):
        """The chat prompt: token ids, or the text when tokenize is False. The template renders
        sandboxed and budgeted (templates.py); tokenizing happens outside the time budget."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise invalid("this model has no chat template; use /v1/completions", "messages")
        if req.tools:
            from .output_parser import tool_syntax

            syntax = tool_syntax(self.tool_parser, self.tokenizer)
            if syntax is not None and syntax.chat_messages is not None:
                return self._apply_generic_tools(req, syntax.chat_messages, tokenize)
        kwargs = template_kwargs(req, self.allow_request_chat_template)
        try:
            text = self._render(req.messages, kwargs)
        except templates.TemplateBudgetExceeded as e:
            raise invalid(f"{e}; the request was stopped", "messages") from None
        except Exception as e:  # jinja raises TemplateError, TypeError, ... for bad messages
            if not has_late_system_turn(req.messages):
                raise invalid(f"the model's chat template rejected the messages: {e}", "messages") from None
            try:  # a template that takes a system turn only first: merge them (shared/chat.py)
                text = self._render(merge_system_turns(req.messages), kwargs)
            except templates.TemplateBudgetExceeded as e2:
                raise invalid(f"{e2}; the request was stopped", "messages") from None
            except Exception as e2:
                raise invalid(f"the model's chat template rejected the messages: {e2}", "messages") from None
        if not isinstance(text, str):
            raise invalid("the chat template did not render to text", "messages")
        return self._encode_prompt(text) if tokenize else text

    def _encode_prompt(self, text: str) -> list[int]:
        """The rendered prompt's ids; a FIM control a message mentions stays plain text
        (fim.FimPrompts.encode_mentions), as it does in a FIM prompt."""
        ids = self.fim_prompts().encode_mentions(text, self.encode_text)
        return self.encode_text(text) if ids is None else ids

    def _apply_generic_tools(self, req: GenerateRequest, chat_messages, tokenize: bool):
        """A template without a tool format: the tools go into the messages (generic format).
        Agents send many long tool descriptions (Claude Code's: ~8,000 tokens); when the full
        listing would leave under a quarter of the context, the compact one is used, and when
        that would not fit either, the minimal one (names and argument types)."""
        for listing in ({}, {"compact": True}, {"minimal": True}):
            messages = chat_messages(req.messages, req.tools, **listing)
            out = self.apply_template(replace(req, messages=messages, tools=None), tokenize)
            if not tokenize or self.context_length is None or len(out) <= self.context_length * 3 // 4:
                return out
            if listing and len(out) < self.context_length:
                return out  # the compact listing fits: names alone only when it does not
        return out

    def _render(self, messages: list[dict], kwargs: dict):
        with templates.budget():
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)

    def new_detokenizer(self):
        return self.tokenizer.detokenizer

    def make_parser(self, req: GenerateRequest, prompt: list[int]):
        from .output_parser import OutputParser, think_tags, tool_syntax

        think = think_tags(self.reasoning_parser, self.tokenizer)
        tool = tool_syntax(self.tool_parser, self.tokenizer) if req.tools else None
        if think is None and tool is None:
            return None
        in_reasoning = False
        if think is not None:
            # Templates that open the think tag themselves leave generation inside it.
            tail = self.tokenizer.decode(prompt[-48:])
            in_reasoning = tail.rfind(think[0]) > tail.rfind(think[1])
        return OutputParser(think=think, in_reasoning=in_reasoning, tool=tool, tools=req.tools)

    def make_constraint(self, req: GenerateRequest):
        """The request's grammar (a 400 for a bad one), else the tool-name guard when the
        model has it on and tools are offered, else None."""
        if req.constraint is None:
            if self.tool_name_guard and req.tools:
                return self._tool_name_guard(req.tools)
            return None
        from .output_parser import tool_syntax

        syntax = tool_syntax(self.tool_parser, self.tokenizer)
        markup = (syntax.start, syntax.end or "") if syntax and syntax.end else None
        return self._constraint_factory().processor(req.constraint, markup)

    def _tool_name_guard(self, tools: list):
        from .tool_name_guard import ToolNameGuard, offered_tools

        offered = offered_tools(tools)
        if not offered:
            return None
        factory = self._constraint_factory()
        return ToolNameGuard(factory.ll_tokenizer(), self.tokenizer._tokenizer.decode, offered, self.vocab_size)

    def _constraint_factory(self):
        if self._constraints is None:
            from .constraints import ConstraintFactory

            self._constraints = ConstraintFactory(
                self.tokenizer._tokenizer, self.vocab_size, sorted(self.tokenizer.eos_token_ids)
            )
        return self._constraints

    def fim_prompts(self) -> FimPrompts:
        """The model's FIM prompt builder, made on first use where the runner gave none."""
        if self._fim is None:
            from .fim import FimPrompts

            self._fim = FimPrompts(self.tokenizer)
        return self._fim

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
