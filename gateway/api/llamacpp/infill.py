"""llama.cpp's server API for editors: POST /infill (fill in the middle: input_prefix,
input_suffix, input_extra file chunks, prompt after the middle token) and POST /completion
(a plain prompt), in llama.cpp's request and response shapes, as llama.vscode and llama.vim
send them.

What llama.cpp decides per token is done here on the text as it arrives: `n_indent` (a new
line indented less than that ends the middle, cut before the line's first character) and
`t_max_predict_ms` (past that time since the first token, the middle ends at the first new
line). Leaving the generation cancels the worker's sequence at once. `n_predict: 0` (how
llama.vscode warms the cache with its ring of chunks) reads the prompt and returns nothing.
`cache_prompt` is always on (the prefix cache; fim.kv_shift_min_tokens also moves the
suffix's KV); `t_max_prompt_ms` and the sampler-order fields are accepted and not used. A request
without `model` goes to the first FIM model."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any

from aiohttp import web

from ....shared.errors import ErrorCode, ServiceError, invalid
from ....shared.events import Finish, FinishReason
from ....shared.model_sections import CHAT_KINDS
from ...access.auth import may_use
from ...models.generation import Generation
from ...pipeline.fields import INT32_MAX, BodyFields, M, Stop
from ...pipeline.fim_support import fim_format, fim_map, parse_extra
from ...pipeline.serving import ApiFamily, generation, handle
from ...pipeline.translate import ParsedRequest, build_request
from ...web.sse import SSEWriter
from ...web.state import MANAGER, SETTINGS

routes = web.RouteTableDef()
Millis = Annotated[int, M(ge=0, le=INT32_MAX)]


class LlamaCppFields(BodyFields):
    """The /infill and /completion fields read here (llama.cpp's names); others are ignored."""

    MAX_TOKENS = ("n_predict",)
    n_predict: Annotated[int, M(ge=-1, le=INT32_MAX)] | None = None  # -1: no limit of its own
    stop: Stop = None
    repeat_penalty: Annotated[float, M(ge=0.01, le=10)] | None = None
    n_indent: Annotated[int, M(ge=0, le=1024)] | None = None
    t_max_predict_ms: Millis | None = None
    t_max_prompt_ms: Millis | None = None
    cache_prompt: bool | None = None
    prompt: Any = None  # /completion: the prompt; /infill: text after the middle token
    input_prefix: str | None = None
    input_suffix: str | None = None
    input_extra: Any = None  # [{"filename", "text"}, ...] (fim_support.parse_extra)
    filename: str | None = None  # mlxgw: the current file's name (repository-level prompts)

    def __post_init__(self) -> None:
        if self.repeat_penalty is not None:
            self.repetition_penalty = self.repeat_penalty

    def requested_max_tokens(self) -> int | None:
        if self.n_predict is None or self.n_predict < 0:
            return None
        return max(self.n_predict, 1)  # 0: read the prompt only (one token, not returned)


@dataclass
class MiddleCut:
    """llama.cpp's per-token ends, on the text as it streams (see the module docstring)."""

    n_indent: int = 0
    t_max_predict_ms: int = 0
    text: str = ""
    line_start: int = -1  # where the newest line began (after a newline), -1: still on the first
    started: float | None = None  # the first token's arrival
    stopped: bool = False

    def feed(self, piece: str) -> str:
        """What of piece the client gets; sets `stopped` when the middle ends inside it."""
        if self.stopped or not piece:
            return ""
        if self.started is None:
            self.started = time.monotonic()
        before = len(self.text)
        self.text += piece
        if self.n_indent > 0:
            self._check_indent()
        if not self.stopped and self.t_max_predict_ms > 0 and "\n" in self.text:
            if (time.monotonic() - self.started) * 1000 > self.t_max_predict_ms:
                self.stopped = True
        return self.text[before:]

    def _check_indent(self) -> None:
        while True:
            if self.line_start >= 0:
                pos = self.line_start
                while pos < len(self.text) and self.text[pos] in " \t":
                    pos += 1
                if pos < len(self.text) and self.text[pos] != "\n" and pos - self.line_start < self.n_indent:
                    self.text, self.stopped = self.text[:pos], True
                    return
            newline = self.text.find("\n", max(self.line_start, 0))  # the end of the newest line
            if newline < 0:
                return
            self.line_start = newline + 1


def _default_model(request: web.Request, fim: bool) -> str:
    """llama.cpp serves one model; here a request without `model` goes to the first model
    that can fill in the middle (for /completion, else the first chat model)."""
    chat = [s for s in request.app[MANAGER].slots.values() if s.entry.kind in CHAT_KINDS and may_use(request, s)]
    for slot in chat:
        if fim_format(request, slot) is not None:
            return slot.name
    if chat and not fim:
        return chat[0].name
    raise invalid("no model here can fill in the middle; name one with 'model'", "model")


def _parse(f: LlamaCppFields, fim: bool) -> ParsedRequest:
    if fim:
        middle = f.prompt if isinstance(f.prompt, str) else ""
        if f.prompt is not None and not isinstance(f.prompt, str):
            raise invalid("/infill's 'prompt' (text after the middle token) must be a string", "prompt")
        extra = parse_extra(f.input_extra)
        fim_req = fim_map(f.input_prefix or "", f.input_suffix or "", middle, extra, f.filename)
        return ParsedRequest(fim=fim_req, **f.request_fields())
    if isinstance(f.prompt, str) and f.prompt:
        return ParsedRequest(prompt=f.prompt, **f.request_fields())
    tokens = f.prompt
    if isinstance(tokens, list) and tokens and all(isinstance(x, int) and not isinstance(x, bool) for x in tokens):
        return ParsedRequest(prompt_tokens=tokens, **f.request_fields())
    raise invalid("'prompt' must be a non-empty string or a list of token ids", "prompt")


class LlamaCppCompletion(ApiFamily):
    """/completion: a plain prompt. Its answer is llama.cpp's objects, cut by MiddleCut as the
    text arrives, so `answer` is its own (no Emitter: a cut ends the generation early)."""

    Fields = LlamaCppFields
    fills_middle = False
    fields: LlamaCppFields

    def model_name(self, fields: LlamaCppFields) -> str:
        return fields.model or _default_model(self.request, self.fills_middle)

    async def parse(self, fields: LlamaCppFields) -> ParsedRequest:
        self.fields = fields
        return _parse(fields, self.fills_middle)

    async def answer(self, parsed: ParsedRequest) -> web.StreamResponse:
        f = self.fields
        gen = generation(self.request, self.slot, await build_request(self.request, self.slot, parsed))
        cut = MiddleCut(f.n_indent or 0, f.t_max_predict_ms or 0)
        if f.n_predict == 0:
            cut.stopped = True  # the prompt is read (and cached); nothing is returned
        if parsed.stream:
            return await _stream(self.request, gen, cut)
        return await _whole(gen, cut)


class LlamaCppInfill(LlamaCppCompletion):
    """/infill: fill in the middle (a newer request for the same file supersedes this one)."""

    fills_middle = True
    supersedes = True


@routes.post("/infill")
async def infill(request: web.Request) -> web.StreamResponse:
    return await handle(request, LlamaCppInfill)


@routes.post("/completion")
async def completion(request: web.Request) -> web.StreamResponse:
    return await handle(request, LlamaCppCompletion)


# -- output -------------------------------------------------------------------------------------


def _final(gen: Generation, content: str, finish: Finish | None, cut: MiddleCut) -> dict:
    """llama.cpp's last object (the whole answer without streaming)."""
    usage = gen.usage
    if finish is None or cut.stopped:
        stop_type, word = "limit", ""
    elif finish.reason is FinishReason.LENGTH:
        stop_type, word = "limit", ""
    elif finish.stop:
        stop_type, word = "word", finish.stop
    else:
        stop_type, word = "eos", ""
    now = time.monotonic()
    first = gen.first_token_at or now
    prompt_ms, predicted_ms = (first - gen.started) * 1000, (now - first) * 1000
    new_prompt = max(usage.prompt_tokens - (usage.cached_tokens or 0), 0)
    return {
        "content": content,
        "tokens": [],
        "id_slot": 0,
        "stop": True,
        "model": gen.slot.name,
        "tokens_predicted": usage.completion_tokens,
        "tokens_evaluated": usage.prompt_tokens,
        "tokens_cached": usage.cached_tokens or 0,
        "has_new_line": "\n" in content,
        "truncated": False,
        "stop_type": stop_type,
        "stopping_word": word,
        "timings": {
            "cache_n": usage.cached_tokens or 0,
            "prompt_n": new_prompt,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / new_prompt if new_prompt else 0.0,
            "prompt_per_second": new_prompt / prompt_ms * 1000 if prompt_ms > 0 else 0.0,
            "predicted_n": usage.completion_tokens,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / usage.completion_tokens if usage.completion_tokens else 0.0,
            "predicted_per_second": usage.completion_tokens / predicted_ms * 1000 if predicted_ms > 0 else 0.0,
        },
    }


async def _whole(gen: Generation, cut: MiddleCut) -> web.Response:
    parts: list[str] = []
    finish = None
    async with gen:
        async for ev in gen.content():
            parts.append(cut.feed(ev.text or ""))
            if type(ev) is Finish:
                finish = ev
            if cut.stopped:
                break  # leaving the block cancels the rest of the sequence in the worker
    return web.json_response(_final(gen, "".join(parts), finish, cut))


async def _stream(request: web.Request, gen: Generation, cut: MiddleCut) -> web.StreamResponse:
    """Server-sent events, one object per piece of text, the last with stop: true and timings."""
    sse = SSEWriter(request, request.app[SETTINGS].write_timeout_s)
    gen.on_wait = sse.comment
    content: list[str] = []
    finish = None
    try:
        async with gen:
            async for ev in gen.content(on_idle=sse.comment):
                piece = cut.feed(ev.text or "")
                if piece:
                    content.append(piece)
                    await sse.data({"content": piece, "stop": False, "id_slot": 0, "index": 0, "tokens": []})
                if type(ev) is Finish:
                    finish = ev
                if cut.stopped:
                    break
    except ServiceError as err:
        if not sse.opened:
            raise
        await sse.error({"error": {"code": err.status, "message": err.message, "type": _error_type(err)}})
        await sse.close()
        return sse.response
    await sse.data({**_final(gen, "".join(content), finish, cut), "content": ""})
    await sse.close()
    return sse.response


def _error_type(err: ServiceError) -> str:
    return "invalid_request_error" if err.code is ErrorCode.INVALID_REQUEST else "server_error"
