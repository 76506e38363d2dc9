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
    oc.check_unsupported(body)
    if body.get("logprobs") is not None:
        raise invalid("logprobs are not supported yet", "logprobs")
    if body.get("suffix"):
        raise invalid("suffix (fill-in-the-middle) is not supported", "suffix")
    echo = v.boolean(body, "echo")
    if echo and text is None:
        raise invalid("echo needs a text prompt", "echo")
    parsed = t.ParsedRequest(
        prompt=text,
        prompt_tokens=tokens,
        api_max_tokens=DEFAULT_MAX_TOKENS,
        **t.parse_common(body, CompletionFields),
    )
    return parsed, text if echo else ""


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    body, slot = await t.open_request(request)
    parsed, prefix = parse(body)
    usage = oc.include_usage(body)

    def render(gen: Generation, out: Outcome) -> dict:
        return oc.completion_body("text_completion", "cmpl", gen, out, {"text": prefix + out.text})

    return await t.respond(request, slot, parsed, lambda sse, gen: CompletionChunks(sse, gen, usage, prefix), render)


class CompletionChunks(oc.OpenAIChunks):
    object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, sse, gen, include_usage: bool, prefix: str):
        super().__init__(sse, gen, include_usage)
        self.prefix = prefix

    def finish_choice(self, reason: str | None) -> dict:
        return {"text": "", "finish_reason": reason}

    async def opened(self) -> None:
        if self.prefix:
            await self.sse.data(self.chunk({"text": self.prefix, "finish_reason": None}))

    async def text(self, text: str) -> None:
        await self.sse.data(self.chunk({"text": text, "finish_reason": None}))
