"""Token budgets of one sequence: the context window (check_budget, at admission) and the
reasoning budget (ThinkingBudget, a logits processor that forces the end of thinking)."""

from __future__ import annotations

from ...shared.errors import ServiceError


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
            f"{prompt_len} tokens. Shorten the prompt, or use a model with a longer context: agent clients "
            "send 6-10k tokens before the first question (Qwen Code 9.5k), which the agent model "
            "qwen2.5-coder-0.5b (32,768 tokens; `make run-agents`, docs/agents.md) reads; a client's own "
            "setting that shrinks its prompt (fewer tools or MCP servers) helps too.",
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
