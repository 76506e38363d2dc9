"""POST /tokenize and POST /detokenize in vLLM's shape, from the worker's own tokenizer.

/tokenize takes `prompt` (text; `add_special_tokens` defaults to true) or `messages`
(OpenAI chat messages, with `tools` and `chat_template_kwargs`, through the model's chat
template with the generation prompt, exactly as a chat request is: the count equals the
prompt_tokens that request reports). /detokenize turns `tokens` back into text."""

from __future__ import annotations

from aiohttp import web

from ....shared.errors import invalid
from ...pipeline.aux_fields import DetokenizeFields, TokenizeFields, required
from ...pipeline.fields import INT32_MAX
from ...pipeline.images import collect_images
from ...pipeline.messages import parse_messages
from ...pipeline.serving import open_fields
from ...pipeline.translate import image_limits
from ...web.state import MANAGER, SETTINGS

routes = web.RouteTableDef()

MAX_TOKENS_IN = 1_000_000  # ids per /detokenize request


def _tokenize_args(f: TokenizeFields, images) -> dict:
    """The worker's tokenize arguments: a prompt, or chat messages (images still inline)."""
    has_prompt, has_messages = f.prompt is not None, f.messages is not None
    if has_prompt == has_messages:
        raise invalid("send exactly one of 'prompt' or 'messages'", "prompt")
    if has_prompt:
        return {"prompt": f.prompt, "add_special_tokens": f.add_special_tokens is not False}
    return {
        "messages": parse_messages(f.messages, images),
        "tools": f.tools or None,
        "chat_template_kwargs": f.chat_template_kwargs,
    }


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    f, slot = await open_fields(request, TokenizeFields)
    limits = image_limits(request, slot)
    args = _tokenize_args(f, limits)
    if "messages" in args:
        args["messages"], images = await collect_images(args["messages"], limits)
        if images:
            args["images"] = images
    manager = request.app[MANAGER]
    conn = await manager.acquire(slot)
    # Tokenized on the worker's preparation thread (never its engine thread), like a chat
    # prompt: megabytes take seconds on a busy host, so as long as a chat's preparation may.
    result = await manager.broker.call(conn, "tokenize", args, timeout=request.app[SETTINGS].prefill_timeout_s)
    return web.json_response(
        {
            "count": result["tokens"],
            "max_model_len": conn.info.get("context_length"),
            "tokens": result["ids"],
            "token_strs": None,
        }
    )


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    f, slot = await open_fields(request, DetokenizeFields)
    tokens = required(f.tokens, "tokens")
    if (
        not isinstance(tokens, list)
        or len(tokens) > MAX_TOKENS_IN
        or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= INT32_MAX for x in tokens)
    ):
        raise invalid(f"'tokens' must be a list of at most {MAX_TOKENS_IN} token ids (integers >= 0)", "tokens")
    manager = request.app[MANAGER]
    conn = await manager.acquire(slot)
    timeout = request.app[SETTINGS].prefill_timeout_s  # on the preparation thread too, behind prompts
    result = await manager.broker.call(conn, "detokenize", {"tokens": tokens}, timeout=timeout)
    return web.json_response({"prompt": result["text"]})
