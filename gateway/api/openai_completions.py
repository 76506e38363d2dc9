"""OpenAI (legacy) Completions: POST /v1/completions."""

from __future__ import annotations

from aiohttp import web
from mlxgw.shared.errors import invalid

from ..generation import Generation, Outcome
from . import openai_common as oc
from . import translate as t
from . import validate as v
from .fields import CompletionFields

routes = web.RouteTableDef()

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this API
MAX_LOGPROBS = 5  # OpenAI's limit for this API


def legacy_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """Chat-shaped logprob entries in this API's column shape; text_offset counts characters
    from the start of the choice's text (offset: what came before in a stream)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def _prompt(body: dict) -> tuple[str | None, list[int] | None]:
    """A string, a one-element list of strings, a token list, or a one-element list of those."""
    prompt = v.required(body, "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, prompt
    if isinstance(prompt, list) and len(prompt) > 1:
        raise invalid("batched prompts are not supported; send one prompt per request", "prompt")
    raise invalid("'prompt' must be a string or a list of token ids", "prompt")


def parse(body: dict) -> tuple[t.ParsedRequest, str]:
    """The parsed request, and the text echoed before the completion ('' unless echo)."""
    text, tokens = _prompt(body)
    n = oc.choices_count(body)
    logprobs = v.integer(body, "logprobs", lo=0, hi=MAX_LOGPROBS)
    if body.get("suffix"):
        raise invalid("suffix (fill-in-the-middle) is not supported", "suffix")
    echo = v.boolean(body, "echo")
    if echo and text is None:
        raise invalid("echo needs a text prompt", "echo")
    if echo and logprobs is not None:
        raise invalid("echo with logprobs (prompt logprobs) is not supported; send one of them", "echo")
    parsed = t.ParsedRequest(
        prompt=text,
        prompt_tokens=tokens,
        api_max_tokens=DEFAULT_MAX_TOKENS,
        n=n,
        logprobs=logprobs,
        **t.parse_common(body, CompletionFields),
    )
    return parsed, text if echo else ""


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    body, slot = await t.open_request(request)
    parsed, prefix = parse(body)
    usage = oc.include_usage(body)

    def render(gen: Generation, out: Outcome) -> dict:
        def choice(o: Outcome) -> dict:
            lp = legacy_logprobs(o.logprobs) if parsed.logprobs is not None else None
            return {"text": prefix + o.text, "logprobs": lp}

        return oc.completion_body("text_completion", "cmpl", gen, out, choice)

    return await t.respond(request, slot, parsed, lambda sse, gen: CompletionChunks(sse, gen, usage, prefix), render)


class CompletionChunks(oc.OpenAIChunks):
    object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, sse, gen, include_usage: bool, prefix: str):
        super().__init__(sse, gen, include_usage)
        self.prefix = prefix
        self.offsets: dict[int, int] = {}  # per choice: characters of logprob tokens so far

    def finish_choice(self, reason: str | None) -> dict:
        return {"text": "", "finish_reason": reason}

    async def opened(self) -> None:
        if self.prefix:
            for index in range(self.gen.req.n):
                self.choice = index
                await self.sse.data(self.chunk({"text": self.prefix, "finish_reason": None}))

    async def text_with_logprobs(self, text: str, entries: list[dict]) -> None:
        await self.sse.data(self.chunk({"text": text, "logprobs": self._logprobs(entries), "finish_reason": None}))

    async def logprobs(self, entries: list[dict]) -> None:
        await self.sse.data(self.chunk({"text": "", "logprobs": self._logprobs(entries), "finish_reason": None}))

    def _logprobs(self, entries: list[dict]) -> dict:
        out = legacy_logprobs(entries, self.offsets.get(self.choice, 0))
        self.offsets[self.choice] = self.offsets.get(self.choice, 0) + sum(len(e["token"]) for e in entries)
        return out

    async def text(self, text: str) -> None:
        await self.sse.data(self.chunk({"text": text, "finish_reason": None}))
