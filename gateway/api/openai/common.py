"""Output shapes shared by the OpenAI Chat Completions and Completions modules."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from json.encoder import encode_basestring  # what json.dumps(..., ensure_ascii=False) uses for a str

from ....shared.errors import ServiceError
from ....shared.events import Finish, Usage
from ...models.generation import Generation, Outcome
from ...pipeline.stream import Emitter
from ...web.errors import openai_error_body
from ...web.sse import SSEWriter


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def include_usage(stream_options: dict | None, stream: bool | None) -> bool:
    """A final usage chunk (stream_options.include_usage), for a stream only."""
    return bool((stream_options or {}).get("include_usage")) and bool(stream)


def usage_dict(u: Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def completion_body(
    object_name: str, id_prefix: str, gen: Generation, out: Outcome, choice: Callable[[Outcome], dict]
) -> dict:
    """A non-streamed Chat Completions or Completions response: `choice` renders each
    choice's own fields (its message or text, and its logprobs)."""
    outcomes = out.choices or [out]
    return {
        "id": new_id(id_prefix),
        "object": object_name,
        "created": now(),
        "model": gen.model_name,
        "choices": [
            {"index": o.index, "logprobs": None, **choice(o), "finish_reason": o.finish_reason} for o in outcomes
        ],
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
        self._templates: dict[tuple[int, str], tuple[str, str]] = {}

    def text_chunk(self, key: str, text: str) -> str:
        """The JSON of `chunk({"delta": {key: text}, "finish_reason": None})`, byte for byte,
        from a template made once per stream and choice: per token, only the text is encoded."""
        template = self._templates.get((self.choice, key))
        if template is None:
            probe = json.dumps(
                self.chunk({"delta": {key: "\x00"}, "finish_reason": None}), separators=(",", ":"), ensure_ascii=False
            )
            head, _, tail = probe.rpartition('"\\u0000"')
            template = self._templates[(self.choice, key)] = (head, tail)
        return template[0] + encode_basestring(text) + template[1]

    def chunk(self, choice: dict) -> dict:
        chunk = {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.gen.model_name,
            "choices": [{"index": self.choice, "logprobs": None, **choice}],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def finish_choice(self, reason: str | None) -> dict:
        raise NotImplementedError

    async def finished(self, event: Finish) -> None:
        for end in event.ends():
            self.choice = end["index"]
            await self.sse.data(self.chunk(self.finish_choice(end["reason"])))
        if self.include_usage:
            await self.sse.data({**self.chunk({}), "choices": [], "usage": usage_dict(self.gen.usage)})
        await self.sse.data("[DONE]")

    def error_body(self, err: ServiceError) -> dict:
        return openai_error_body(err)
