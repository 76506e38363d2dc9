"""Model runners: what turns admitted prompts into tokens, one engine step at a time.

The scheduler owns policy (who runs, when, cancellation); a runner owns execution. The MLX
runner drives mlx-lm's BatchGenerator, which interleaves one decode step of the running
batch with one prefill chunk (`prefill_step_size` tokens) of arriving prompts, so a long
prompt never freezes the streams already decoding."""

from __future__ import annotations

import gc
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path

from mlxgw.shared.chat import has_late_system_turn, merge_system_turns
from mlxgw.shared.errors import ServiceError, invalid
from mlxgw.shared.protocol import GenerateRequest, SamplingParams


@dataclass
class TokenOut:
    uid: int
    token: int
    finish: str | None  # "stop" (end-of-sequence token) or "length"


@dataclass
class StepOutput:
    tokens: list[TokenOut] = field(default_factory=list)
    prefill: list[tuple[int, int, int]] = field(default_factory=list)  # uid, done, total


class Runner(ABC):
    context_length: int

    @abstractmethod
    def encode(self, req: GenerateRequest) -> list[int]: ...

    @abstractmethod
    def new_detokenizer(self): ...

    @abstractmethod
    def insert(self, prompt: list[int], max_tokens: int, sampling: SamplingParams, constraint=None) -> tuple[int, int]:
        """Queue a prompt for execution; return (uid, prompt tokens served from the cache)."""

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a piece of text, without special tokens."""
        return list(text.encode())

    def make_constraint(self, req: GenerateRequest):
        """A logits processor enforcing req.constraint (raises a 400 for a bad one), or None."""
        if req.constraint is not None:
            raise invalid("constrained decoding is not available for this engine", "response_format")
        return None

    @abstractmethod
    def step(self) -> StepOutput: ...

    @abstractmethod
    def remove(self, uids: list[int]) -> None: ...

    def make_parser(self, req: GenerateRequest, prompt: list[int]):
        """An OutputParser when the model reasons or the request offers tools, else None."""
        return None

    def stats(self) -> dict:
        return {}

    def cache_stats(self) -> dict:
        return {}

    def cache_clear(self) -> None:
        return None


class MLXRunner(Runner):
    def __init__(
        self,
        model_path: Path,
        *,
        context_length: int | None,
        max_num_seqs: int,
        prefill_step_size: int,
        cache_bytes: int,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
    ):
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.generate import BatchGenerator

        from .prefix_cache import PrefixCache

        self._mx = mx
        self.model, self.tokenizer, config = load(str(model_path), return_config=True)
        model_context = int(config.get("max_position_embeddings") or 4096)
        self.context_length = min(context_length or model_context, model_context)
        self.generator = BatchGenerator(
            self.model,
            stop_tokens=[[t] for t in sorted(self.tokenizer.eos_token_ids)],
            completion_batch_size=max_num_seqs,
            prefill_batch_size=max_num_seqs,
            prefill_step_size=prefill_step_size,
        )
        self.prefix_cache = PrefixCache(cache_bytes)
        self.cache_bytes = cache_bytes
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self._constraints = None
        self.vocab_size = self.model.args.vocab_size if hasattr(self.model, "args") else self.tokenizer.vocab_size

    # -- prompts ------------------------------------------------------------------------
    def encode(self, req: GenerateRequest) -> list[int]:
        if req.prompt_tokens is not None:
            vocab = self.tokenizer.vocab_size
            if any(not isinstance(t, int) or t < 0 or t >= vocab for t in req.prompt_tokens):
                raise invalid(f"prompt token ids must be integers in [0, {vocab})", "prompt")
            return list(req.prompt_tokens)
        if req.messages is not None:
            return self._apply_template(req)
        return self.tokenizer.encode(req.prompt or "")

    def _apply_template(self, req: GenerateRequest, tokenize: bool = True):
        """The chat prompt: token ids, or the text when tokenize is False."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise invalid("this model has no chat template; use /v1/completions", "messages")
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:
            from .output_parser import tool_syntax

            syntax = tool_syntax(self.tool_parser, self.tokenizer)
            if syntax is not None and syntax.chat_messages is not None:
                return self._apply_generic_tools(req, syntax.chat_messages, tokenize)
            kwargs["tools"] = req.tools
        try:
            out = self._render(req.messages, tokenize, kwargs)
        except Exception as e:  # jinja raises TemplateError, TypeError, ... for bad messages
            if not has_late_system_turn(req.messages):
                raise invalid(f"the model's chat template rejected the messages: {e}", "messages") from None
            try:  # a template that takes a system turn only first: merge them (shared/chat.py)
                out = self._render(merge_system_turns(req.messages), tokenize, kwargs)
            except Exception as e2:
                raise invalid(f"the model's chat template rejected the messages: {e2}", "messages") from None
        if not tokenize:
            return out
        if isinstance(out, dict):  # some transformers versions return a BatchEncoding
            out = out["input_ids"]
        return list(out)

    def _apply_generic_tools(self, req: GenerateRequest, chat_messages, tokenize: bool):
        """A template without a tool format: the tools go into the messages (generic format).
        Agents send many long tool descriptions (Claude Code's: ~8,000 tokens); when the full
        listing would leave under a quarter of the context, the compact one is used."""
        full = self._apply_template(replace(req, messages=chat_messages(req.messages, req.tools), tools=None), tokenize)
        if not tokenize or len(full) <= self.context_length * 3 // 4:
            return full
        compact = chat_messages(req.messages, req.tools, compact=True)
        return self._apply_template(replace(req, messages=compact, tools=None), tokenize)

    def _render(self, messages: list[dict], tokenize: bool, kwargs: dict):
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize, **kwargs)

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

    # -- execution ----------------------------------------------------------------------
    def make_constraint(self, req: GenerateRequest):
        if req.constraint is None:
            return None
        if self._constraints is None:
            from .constraints import ConstraintFactory

            self._constraints = ConstraintFactory(
                self.tokenizer._tokenizer, self.vocab_size, sorted(self.tokenizer.eos_token_ids)
            )
        from .output_parser import tool_syntax

        syntax = tool_syntax(self.tool_parser, self.tokenizer)
        markup = (syntax.start, syntax.end or "") if syntax and syntax.end else None
        return self._constraints.processor(req.constraint, markup)

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def insert(self, prompt: list[int], max_tokens: int, sampling: SamplingParams, constraint=None) -> tuple[int, int]:
        from .sampling import build_logits_processors, build_sampler

        processors = build_logits_processors(sampling)
        if constraint is not None:
            # last: masks apply after any bias or penalty; several may be chained
            processors += constraint if isinstance(constraint, list) else [constraint]
        cache, cached = self.prefix_cache.longest_match(prompt)
        (uid,) = self.generator.insert(
            [prompt[cached:]],
            max_tokens=[max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[prompt[:cached]],
            samplers=[build_sampler(sampling)],
            logits_processors=[processors],
        )
        return uid, cached

    def step(self) -> StepOutput:
        prompt_responses, gen_responses = self.generator.next()
        out = StepOutput()
        for r in prompt_responses:
            done, total = r.progress if isinstance(r.progress, tuple) else (0, 0)
            out.prefill.append((r.uid, done, total))
        for r in gen_responses:
            if r.finish_reason is not None and r.prompt_cache is not None:
                # The finished sequence's KV (prompt + answer) seeds the next turn's prompt.
                self.prefix_cache.insert(r.all_tokens, r.prompt_cache)
                self._bound_cache()
            out.tokens.append(TokenOut(r.uid, int(r.token), r.finish_reason))
        return out

    def remove(self, uids: list[int]) -> None:
        if uids:
            self.generator.remove(uids)

    def _bound_cache(self) -> None:
        # Live sequences' KV counts against the same budget as the stored prefixes.
        self.prefix_cache.trim_to(self.cache_bytes - self.generator.prompt_cache_nbytes)

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> dict:
        mx = self._mx
        return {
            "mlx_active_bytes": int(mx.get_active_memory()),
            "mlx_peak_bytes": int(mx.get_peak_memory()),
            "mlx_cache_bytes": int(mx.get_cache_memory()),
            "kv_bytes": int(self.generator.prompt_cache_nbytes),
        }

    def cache_stats(self) -> dict:
        return self.prefix_cache.snapshot()

    def cache_clear(self) -> None:
        self.prefix_cache.clear()
        gc.collect()
        self._mx.clear_cache()


class ThinkingBudget:
    """Logits processor that ends reasoning after `budget` tokens by forcing the model's end
    tag, one token per step (the tag may span several tokens)."""

    def __init__(self, parser, budget: int, end_tokens: list[int]):
        self.parser = parser
        self.budget = budget
        self.end_tokens = list(end_tokens)
        self.used = 0
        self.forcing: list[int] | None = None

    def __call__(self, tokens, logits):
        import mlx.core as mx

        if self.forcing is None:
            if self.parser.mode != "reasoning":
                return logits
            self.used += 1
            if self.used <= self.budget:
                return logits
            self.forcing = list(self.end_tokens)
        if not self.forcing:
            return logits
        token = self.forcing.pop(0)
        return mx.where(mx.arange(logits.shape[-1]) == token, logits, -float("inf"))


def check_budget(prompt_len: int, req_max_tokens: int | None, context: int, policy: str) -> int:
    """Validate the prompt against the context and return the max_tokens to use."""
    if prompt_len >= context:
        raise ServiceError(
            "context_length_exceeded",
            f"This model's maximum context length is {context} tokens, but the prompt has "
            f"{prompt_len} tokens. Shorten the prompt.",
            param="messages",
            details={"prompt_tokens": prompt_len, "context_length": context},
        )
    room = context - prompt_len
    if req_max_tokens is None:
        return room
    if req_max_tokens > room and policy == "reject":
        raise ServiceError(
            "context_length_exceeded",
            f"This model's maximum context length is {context} tokens; the prompt has "
            f"{prompt_len} tokens and max_tokens asks for {req_max_tokens} more.",
            param="max_tokens",
            details={"prompt_tokens": prompt_len, "context_length": context, "max_tokens": req_max_tokens},
        )
    return min(req_max_tokens, room)
