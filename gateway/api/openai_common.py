"""Pieces shared by the OpenAI Chat Completions and Completions modules."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

from aiohttp import web
from mlxgw.shared import protocol as p
from mlxgw.shared.config import ModelEntry
from mlxgw.shared.errors import ServiceError, invalid

from ..auth import reserve_tokens
from ..generation import Generation
from ..sse import SSEWriter
from ..state import MANAGER, SETTINGS
from . import validate as v
from .errors import openai_error_body


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def first_set(*values):
    """The first value that is not None: request value, then model default, then fallback."""
    return next((x for x in values if x is not None), None)


def sampling_params(body: dict, entry: ModelEntry) -> p.SamplingParams:
    d = entry.defaults

    bias = v.mapping(body, "logit_bias")
    logit_bias = None
    if bias:
        try:
            logit_bias = {int(k): float(val) for k, val in bias.items()}
        except (TypeError, ValueError):
            raise invalid("'logit_bias' maps token ids (as strings) to numbers", "logit_bias") from None
        if any(not -100 <= b <= 100 for b in logit_bias.values()):
            raise invalid("'logit_bias' values must be between -100 and 100", "logit_bias")
    return p.SamplingParams(
        temperature=first_set(v.number(body, "temperature", 0, 2), d.temperature, 1.0),
        top_p=first_set(v.number(body, "top_p", 0, 1), d.top_p, 1.0),
        top_k=first_set(v.integer(body, "top_k", 0), d.top_k, 0),
        min_p=first_set(v.number(body, "min_p", 0, 1), d.min_p, 0.0),
        seed=v.integer(body, "seed"),
        repetition_penalty=first_set(v.number(body, "repetition_penalty", 0.01, 10), d.repetition_penalty, None),
        presence_penalty=v.number(body, "presence_penalty", -2, 2, default=0.0),
        frequency_penalty=v.number(body, "frequency_penalty", -2, 2, default=0.0),
        logit_bias=logit_bias,
    )


def max_tokens(request: web.Request, body: dict, entry: ModelEntry, *names: str) -> int | None:
    requested = None
    for name in names:
        requested = v.integer(body, name, lo=1)
        if requested is not None:
            break
    settings = request.app[SETTINGS]
    if requested is None:
        requested = first_set(entry.defaults.max_tokens, settings.max_tokens_default)
    cap = settings.max_tokens_cap
    if cap is not None:
        requested = min(requested, cap) if requested is not None else cap
    return requested


def stream_options(body: dict) -> tuple[bool, bool]:
    stream = v.boolean(body, "stream")
    opts = v.mapping(body, "stream_options") or {}
    include_usage = bool(opts.get("include_usage")) if stream else False
    return stream, include_usage


def check_unsupported(body: dict) -> None:
    n = v.integer(body, "n", lo=1)
    if n not in (None, 1):
        raise invalid("only n=1 is supported", "n")
    best_of = v.integer(body, "best_of", lo=1)
    if best_of not in (None, 1):
        raise invalid("only best_of=1 is supported", "best_of")


def chunk_maker(object_name: str, id_prefix: str, model: str, include_usage: bool) -> Callable[[dict], dict]:
    """Builds the streamed chunks of one response: same id, timestamp and model on each;
    `usage: null` on each when the client asked for a final usage chunk, as OpenAI does."""
    cid, created = new_id(id_prefix), now()

    def make(choice: dict) -> dict:
        chunk = {
            "id": cid,
            "object": object_name,
            "created": created,
            "model": model,
            "choices": [{"index": 0, "logprobs": None, **choice}],
        }
        if include_usage:
            chunk["usage"] = None
        return chunk

    return make


def usage_dict(u: p.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def base_request(request: web.Request, body: dict, entry: ModelEntry) -> dict:
    """GenerateRequest fields common to both OpenAI text APIs."""
    settings = request.app[SETTINGS]
    return dict(
        rid=request["rid"],
        sampling=sampling_params(body, entry),
        stop=v.string_list(body, "stop"),
        stream_interval=v.integer(body, "stream_interval", lo=1, hi=1024, default=entry.stream_interval),
        priority=v.integer(body, "priority", lo=-100, hi=100, default=0),
        timeout_s=settings.request_timeout_s,
        max_tokens_policy=entry.max_tokens_policy,
    )


DeltaChunks = Callable[[dict], list[dict]]  # a delta or finish event -> chunks for its content
FinishChunk = Callable[[str | None], dict]  # finish reason -> the chunk that carries it


async def stream_response(
    request: web.Request,
    gen: Generation,
    delta_chunks: DeltaChunks,
    finish_chunk: FinishChunk,
    include_usage: bool,
    preamble: list[dict],
) -> web.StreamResponse:
    """Run a generation as OpenAI SSE chunks: preamble, content deltas, the finishing chunk,
    the usage chunk when asked for, then [DONE]; or an error event that ends the stream.
    While the model loads, SSE comments keep the connection alive; an error before anything
    was sent is still a plain HTTP error with its status."""
    sse = SSEWriter(request, request.app[SETTINGS].write_timeout_s)
    gen.on_wait = sse.comment
    try:
        async with gen:
            for c in preamble:
                await sse.data(c)
            async for ev in gen.content(on_idle=sse.comment):
                kind = ev["e"]
                for c in delta_chunks(ev):
                    await sse.data(c)
                if kind == p.EV_FINISH:
                    await sse.data(finish_chunk(ev.get("reason", "stop")))
                    if include_usage:
                        await sse.data({**finish_chunk(None), "choices": [], "usage": usage_dict(gen.usage)})
                    await sse.data("[DONE]")
    except ServiceError as err:
        if not sse.opened:
            raise
        await sse.error(openai_error_body(err))
    await sse.close()
    return sse.response


def generation(request: web.Request, slot, req: p.GenerateRequest) -> Generation:
    """The request's generation, also recorded on the request for limits, metrics and logs."""
    key = request.get("key")
    reserve_tokens(request, slot, getattr(req, "max_tokens", None))
    gen = Generation(
        request.app[MANAGER], slot, req, request.app[SETTINGS].keepalive_s, owner=key.name if key else None
    )
    request["generation"] = gen
    return gen
