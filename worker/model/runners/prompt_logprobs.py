"""Prompt logprobs (Completions' `echo` with `logprobs`): how likely the model found each
prompt token, given the tokens before it.

The batch's prefill keeps only the last position's logits, so a request that asks gets one
extra forward pass over its prompt, of its own, with a fresh KV cache: in chunks of at most
CHUNK_TOKENS tokens, one chunk per engine step (worker/schedule/sequence_output.py:PromptScoring), so
the rows decoding meanwhile wait at most one chunk per step, and the logits held at once are
bounded by CHUNK_TOKENS x vocabulary whatever the prompt's length. Requests that do not ask
pay nothing. Once scored, the pass's KV (every prompt token but the last) goes to the prefix
cache, so the request's own prefill then reads one token: the prompt is computed once, not
twice.

Values are the raw model's log-softmax (penalties, biases and grammars shape what is
generated, not the prompt), as OpenAI and vLLM report prompt logprobs. The first prompt
token has nothing before it: its entry has `logprob: None` and `top_logprobs: None`."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from .logprobs import TokenBytes, value

CHUNK_TOKENS = 256  # prompt positions scored per engine step


class PromptScorer:
    """One request's prompt, scored a chunk at a time; `entries` once `advance` says done."""

    def __init__(
        self,
        model,
        prompt: list[int],
        top: int,
        names: TokenBytes,
        chunk: int = CHUNK_TOKENS,
        keep_kv: Callable[[list[int], list], None] | None = None,
    ):
        """keep_kv(tokens, cache): where the pass's KV goes once the prompt is scored."""
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.keep_kv = keep_kv
        self.prompt = prompt
        self.top = top
        self.names = names
        self.chunk = max(1, chunk)
        self.cache = make_prompt_cache(model)
        self.pos = 0  # prompt tokens fed to the model so far
        text, raw = names.get(prompt[0])
        self.entries: list[dict] = [{"token": text, "bytes": raw, "logprob": None, "top_logprobs": None}]

    @property
    def done(self) -> bool:
        # The last prompt token's logits predict the answer, not a prompt token: never fed.
        return self.pos >= len(self.prompt) - 1

    def advance(self) -> bool:
        """Score the next chunk; whether the whole prompt is scored."""
        if self.done:
            return True
        end = min(self.pos + self.chunk, len(self.prompt) - 1)
        logits = self.model(mx.array([self.prompt[self.pos : end]]), cache=self.cache)[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = self.prompt[self.pos + 1 : end + 1]  # position j predicts token pos + j + 1
        self.entries += self._entries(logprobs, targets)
        self.pos = end
        if self.done:
            if self.keep_kv is not None:
                self.keep_kv(self.prompt[: self.pos], self.cache)
            self.cache = None
        return self.done

    def _entries(self, logprobs: mx.array, targets: list[int]) -> list[dict]:
        """Each position's target logprob and top alternatives, evaluated in one go."""
        chosen = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)[:, 0]
        top_ids = top_values = None
        if self.top > 0:
            top_ids = mx.argpartition(-logprobs, kth=self.top - 1, axis=-1)[:, : self.top]
            top_values = mx.take_along_axis(logprobs, top_ids, axis=-1)
            mx.eval(chosen, top_ids, top_values)
        else:
            mx.eval(chosen)
        chosen_list = chosen.tolist()
        ids_rows = top_ids.tolist() if top_ids is not None else [[] for _ in targets]
        value_rows = top_values.tolist() if top_values is not None else [[] for _ in targets]
        out = []
        for token, lp, ids, values in zip(targets, chosen_list, ids_rows, value_rows):
            text, raw = self.names.get(token)
            alternatives = []
            for i, v in sorted(zip(ids, values), key=lambda x: -x[1]):
                t, b = self.names.get(i)
                alternatives.append({"token": t, "bytes": b, "logprob": value(v)})
            out.append({"token": text, "bytes": raw, "logprob": value(lp), "top_logprobs": alternatives})
        return out
