"""POST /tokenize and POST /detokenize in vLLM's shape, from the worker's own tokenizer.

/tokenize takes `prompt` (text; `add_special_tokens` defaults to true) or `messages`
(OpenAI chat messages, with `tools` and `chat_template_kwargs`, through the model's chat
template with the generation prompt, exactly as a chat request is: the count equals the
prompt_tokens that request reports). /detokenize turns `tokens` back into text."""

from __future__ import annotations

from aiohttp import web

from mlxgw.shared.errors import invalid

from ..state import MANAGER, SETTINGS
from . import translate as t
from . import validate as v
from .images import collect_images
from .openai_chat import parse_messages

routes = web.RouteTableDef()

MAX_TOKENS_IN = 1_000_000  # ids per /detokenize request


def _tokenize_args(body: dict, images) -> dict:
    """The worker's tokenize arguments: a prompt, or chat messages (images still inline)."""
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise invalid("send exactly one of 'prompt' or 'messages'", "prompt")
    if has_prompt:
        return {"prompt": v.string(body, "prompt"), "add_special_tokens": v.boolean(body, "add_special_tokens", True)}
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid("'tools' must be a list", "tools")
    return {
        "messages": parse_messages(body["messages"], images),
        "tools": tools or None,
        "chat_template_kwargs": v.mapping(body, "chat_template_kwargs"),
    }


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    body, slot = await t.open_request(request)
    limits = t.image_limits(request, slot)
    args = _tokenize_args(body, limits)
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
    body, slot = await t.open_request(request)
    tokens = v.required(body, "tokens")
    if (
        not isinstance(tokens, list)
        or len(tokens) > MAX_TOKENS_IN
        or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= v.INT32_MAX for x in tokens)
    ):
        raise invalid(f"'tokens' must be a list of at most {MAX_TOKENS_IN} token ids (integers >= 0)", "tokens")
    manager = request.app[MANAGER]
    conn = await manager.acquire(slot)
    timeout = request.app[SETTINGS].prefill_timeout_s  # on the preparation thread too, behind prompts
    result = await manager.broker.call(conn, "detokenize", {"tokens": tokens}, timeout=timeout)
    return web.json_response({"prompt": result["text"]})
