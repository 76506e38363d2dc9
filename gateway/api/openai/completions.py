"""OpenAI (legacy) Completions: POST /v1/completions, one ApiFamily (`OpenAICompletions`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from aiohttp import web

from ....shared.errors import invalid
from ....shared.events import Finish
from ...models.generation import Generation, Outcome
from ...pipeline.fields import CompletionFields
from ...pipeline.fim_support import fim_map
from ...pipeline.serving import ApiFamily, handle
from ...pipeline.translate import ParsedRequest
from . import common as oc

routes = web.RouteTableDef()

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this API


def legacy_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """Chat-shaped logprob entries in this API's column shape; text_offset counts characters
    from the start of the choice's text (offset: what came before in a stream). The first
    prompt token of an echoed prompt has no logprob: null in both columns, as OpenAI sends."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            None if e["top_logprobs"] is None else {a["token"]: a["logprob"] for a in e["top_logprobs"]}
            for e in entries
        ],
        "text_offset": offsets,
    }


def joined_logprobs(first: dict, then: dict) -> dict:
    """Two column sets, one after the other (the echoed prompt's, then the completion's)."""
    return {key: first[key] + then[key] for key in first}


@dataclass
class Options:
    """What this API does around the generation: echo, the logprobs the client asked for,
    and best_of (candidates generated, the n best returned)."""

    prefix: str = ""  # the prompt text when echo, else ''
    logprobs: int | None = None  # as the client asked (best_of asks the worker for them anyway)
    n: int = 1
    best_of: int = 1
    include_usage: bool = False  # a stream ends with a usage chunk


def _prompt(prompt: object) -> tuple[str | None, list[int] | None]:
    """A string, a one-element list of strings, a token list, or a one-element list of those."""
    if prompt is None:
        raise invalid("missing required parameter: 'prompt'", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, prompt
    if isinstance(prompt, list) and len(prompt) > 1:
        raise invalid("batched prompts are not supported; send one prompt per request", "prompt")
    raise invalid("'prompt' must be a string or a list of token ids", "prompt")


def _choices(f: CompletionFields) -> tuple[int, int]:
    """n and best_of (n <= best_of <= 16, ranges checked by fields.CompletionFields):
    best_of candidates are generated, the n with the highest logprob per token returned.
    OpenAI cannot stream that, nor can this."""
    n = f.n or 1
    best_of = n if f.best_of is None else f.best_of
    if best_of < n:
        raise invalid(f"best_of ({best_of}) must be at least n ({n})", "best_of")
    if best_of > n and f.stream:
        raise invalid("best_of > n cannot be streamed (the best are known only at the end)", "best_of")
    return n, best_of


def _fim(suffix: object, text: str | None, tokens: list[int] | None) -> dict | None:
    """`suffix` set (a string, even empty: the cursor at the end of the file): the prompt is
    the code before the cursor and the model fills in the middle (worker/text/fim.py)."""
    if suffix is None:
        return None
    if not isinstance(suffix, str):
        raise invalid("'suffix' must be a string", "suffix")
    if text is None:
        raise invalid("'suffix' needs a text prompt (the code before the cursor), not token ids", "suffix")
    return fim_map(text, suffix)


def parse(f: CompletionFields) -> tuple[ParsedRequest, Options]:
    """The parsed request (what the worker generates), and what this API does around it.
    One pass over the decoded struct (fields.CompletionFields), then the checks across fields."""
    text, tokens = _prompt(f.prompt)
    n, best_of = _choices(f)
    logprobs = f.logprobs
    fim = _fim(f.suffix, text, tokens)
    echo = bool(f.echo)
    if echo and fim is not None:
        raise invalid("echo cannot be combined with suffix (the prompt is split around the middle)", "echo")
    if echo and text is None:
        raise invalid("echo needs a text prompt", "echo")
    parsed = ParsedRequest(
        prompt=None if fim else text,
        prompt_tokens=tokens,
        fim=fim,
        api_max_tokens=DEFAULT_MAX_TOKENS,
        n=best_of,
        # Ranking best_of candidates needs their token logprobs, asked or not.
        logprobs=logprobs if logprobs is not None or best_of == n else 0,
        prompt_logprobs=logprobs if echo else None,
        **f.request_fields(),
    )
    usage = oc.include_usage(f.stream_options, f.stream)
    return parsed, Options(text if echo else "", logprobs, n, best_of, usage)


def mean_logprob(o: Outcome) -> float:
    """A candidate's score for best_of: its logprob per token (OpenAI: "the highest log
    probability per token"); one without tokens ranks last."""
    if not o.logprobs:
        return -math.inf
    return sum(e["logprob"] for e in o.logprobs) / len(o.logprobs)


def best_choices(out: Outcome, n: int) -> Outcome:
    """The n best candidates, best first, numbered 0..n-1; usage stays that of all of them."""
    ranked = sorted(out.choices or [out], key=lambda o: (-mean_logprob(o), o.index))[:n]
    chosen = [dataclasses.replace(o, index=i, choices=[]) for i, o in enumerate(ranked)]
    first = chosen[0]
    first.choices = chosen if n > 1 else []
    return first


class OpenAICompletions(ApiFamily):
    Fields = CompletionFields
    opts: Options  # what this API does around the generation, set by parse

    async def parse(self, fields: CompletionFields) -> ParsedRequest:
        parsed, self.opts = parse(fields)
        return parsed

    def emitter(self, sse, gen: Generation) -> CompletionChunks:
        return CompletionChunks(sse, gen, self.opts.include_usage, self.opts)

    def render(self, gen: Generation, out: Outcome) -> dict:
        opts = self.opts
        if opts.best_of > opts.n:
            out = best_choices(out, opts.n)

        def choice(o: Outcome) -> dict:
            if opts.logprobs is None:
                return {"text": opts.prefix + o.text, "logprobs": None}
            lp = legacy_logprobs(o.logprobs, len(opts.prefix))
            if gen.prompt_logprobs is not None:
                lp = joined_logprobs(legacy_logprobs(gen.prompt_logprobs), lp)
            return {"text": opts.prefix + o.text, "logprobs": lp}

        return oc.completion_body("text_completion", "cmpl", gen, out, choice)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await handle(request, OpenAICompletions)


class CompletionChunks(oc.OpenAIChunks):
    object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, sse, gen, include_usage: bool, opts: Options):
        super().__init__(sse, gen, include_usage)
        self.prefix = opts.prefix
        # With logprobs, the echoed prompt's chunk carries its logprobs: it waits for them
        # (they come before the first output), and the completion's offsets follow the prompt.
        self.echo_pending = bool(self.prefix) and opts.logprobs is not None
        self.offsets: dict[int, int] = {}  # per choice: characters of logprob tokens so far

    def finish_choice(self, reason: str | None) -> dict:
        return {"text": "", "finish_reason": reason}

    async def opened(self) -> None:
        if self.prefix and not self.echo_pending:
            await self._echo(None)

    async def _echo(self, logprobs: dict | None) -> None:
        """The echoed prompt, one chunk per choice, as OpenAI streams it."""
        current = self.choice
        for index in range(self.gen.req.n):
            self.choice = index
            self.offsets[index] = len(self.prefix)
            await self.sse.data(self.chunk({"text": self.prefix, "logprobs": logprobs, "finish_reason": None}))
        self.choice = current

    async def _echo_with_logprobs(self) -> None:
        if self.echo_pending:
            self.echo_pending = False
            await self._echo(legacy_logprobs(self.gen.prompt_logprobs or []))

    async def text_with_logprobs(self, text: str, entries: list[dict]) -> None:
        await self._echo_with_logprobs()
        await self.sse.data(self.chunk({"text": text, "logprobs": self._logprobs(entries), "finish_reason": None}))

    async def logprobs(self, entries: list[dict]) -> None:
        await self._echo_with_logprobs()
        await self.sse.data(self.chunk({"text": "", "logprobs": self._logprobs(entries), "finish_reason": None}))

    def _logprobs(self, entries: list[dict]) -> dict:
        out = legacy_logprobs(entries, self.offsets.get(self.choice, 0))
        self.offsets[self.choice] = self.offsets.get(self.choice, 0) + sum(len(e["token"]) for e in entries)
        return out

    async def text(self, text: str) -> None:
        await self._echo_with_logprobs()
        await self.sse.data(self.chunk({"text": text, "finish_reason": None}))

    async def finished(self, event: Finish) -> None:
        await self._echo_with_logprobs()
        await super().finished(event)
