"""Output shapes shared by the OpenAI Chat Completions and Completions modules."""

from __future__ import annotations

import secrets
import time

from mlxgw.shared import protocol as p
from mlxgw.shared.errors import ServiceError, invalid

from ..generation import Generation, Outcome
from ..sse import SSEWriter
from . import validate as v
from .errors import openai_error_body
from .stream import Emitter


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def include_usage(body: dict) -> bool:
    opts = v.mapping(body, "stream_options") or {}
    return bool(opts.get("include_usage")) and v.boolean(body, "stream")


def check_unsupported(body: dict) -> None:
    n = v.integer(body, "n", lo=1)
    if n not in (None, 1):
        raise invalid("only n=1 is supported", "n")
    best_of = v.integer(body, "best_of", lo=1)
    if best_of not in (None, 1):
        raise invalid("only best_of=1 is supported", "best_of")
    if body.get("logprobs"):
        raise invalid("logprobs are not supported yet", "logprobs")


def usage_dict(u: p.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def completion_body(object_name: str, id_prefix: str, gen: Generation, out: Outcome, choice: dict) -> dict:
    """A non-streamed Chat Completions or Completions response with its one choice."""
    return {
        "id": new_id(id_prefix),
        "object": object_name,
        "created": now(),
        "model": gen.slot.name,
        "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": out.finish_reason}],
        "usage": usage_dict(out.usage),
    }


class OpenAIChunks(Emitter):
    """Chunks with one id, timestamp and model; `usage: null` on each when the client asked
    for a final usage chunk (as OpenAI does); the finishing chunk, the usage chunk, [DONE]."""

    object_name = ""
    id_prefix = ""

    def __init__(self, sse: SSEWriter, gen: Generation, include_usage: bool):
        super().__init__(sse, gen)
        self.include_usage = include_usage
        self.id, self.created = new_id(self.id_prefix), now()

    def chunk(self, choice: dict) -> dict:
        chunk = {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.gen.slot.name,
            "choices": [{"index": 0, "logprobs": None, **choice}],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def finish_choice(self, reason: str | None) -> dict:
        raise NotImplementedError

    async def finished(self, event: dict) -> None:
        await self.sse.data(self.chunk(self.finish_choice(event.get("reason", "stop"))))
        if self.include_usage:
            await self.sse.data({**self.chunk({}), "choices": [], "usage": usage_dict(self.gen.usage)})
        await self.sse.data("[DONE]")

    def error_body(self, err: ServiceError) -> dict:
        return openai_error_body(err)
