"""The one translation layer: every generating API parses its body into a `ParsedRequest`,
`build_request` turns that into the one internal `GenerateRequest` (model defaults, the
max_tokens default and cap, images, timeouts), and `respond` answers with one body or a
stream driven by `run_stream` (stream.py) and the API's emitter.

An API module therefore writes only what is its own: the names and ranges of its fields,
its message shapes, and its output shapes."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TypeVar

from aiohttp import web

from mlxgw.gateway.access.auth import reserve_tokens, resolve_model
from mlxgw.gateway.models.generation import Generation, Outcome
from mlxgw.gateway.pipeline import validate as v
from mlxgw.gateway.pipeline.body import read_json
from mlxgw.gateway.pipeline.fields import CommonFields, ModelField, decode_fields, logit_bias
from mlxgw.gateway.pipeline.fim_support import fim_max_tokens
from mlxgw.gateway.pipeline.images import ImageLimits, collect_images
from mlxgw.gateway.pipeline.stream import EmitterFactory, run_stream
from mlxgw.gateway.web.sse import SSEWriter
from mlxgw.gateway.web.state import MANAGER, SETTINGS
from mlxgw.shared import protocol as p
from mlxgw.shared.config import CHAT_KINDS, ModelKind
from mlxgw.shared.errors import invalid

# max_tokens when neither the request, the model's entry (defaults.max_tokens), the server
# (--max-tokens-default) nor the model's own generation_config.json (max_new_tokens) sets
# one: clients that send none (Open WebUI, curl) would otherwise generate up to the whole
# context.
DEFAULT_MAX_TOKENS = 4096
# A request without max_tokens, on a host whose measured decode rate cannot produce the
# default within the answer's time bound, gets what that rate produces in RATE_CAP_SHARE of
# it (never fewer than RATE_CAP_FLOOR tokens): it ends with finish_reason "length" on its own
# instead of at the time limit.
RATE_CAP_SHARE = 0.9
RATE_CAP_FLOOR = 256

F = TypeVar("F", bound=ModelField)


@dataclass
class ParsedRequest:
    """One API request, parsed and range-checked, before the model's defaults apply."""

    sampling: CommonFields  # the API's fields as decoded; only the sampling ones are read from it
    stream: bool = False
    messages: list[dict] | None = None
    prompt: str | None = None
    prompt_tokens: list[int] | None = None
    tools: list[dict] | None = None
    constraint: dict | None = None
    chat_template_kwargs: dict | None = None
    reasoning_budget: int | None = None
    max_tokens: int | None = None  # as sent; None: the defaults below apply
    api_max_tokens: int | None = None  # the API's own default (legacy Completions: 16)
    stop: list[str] = field(default_factory=list)
    priority: int = 0
    service_tier: str | None = None  # "flex": background priority
    stream_interval: int | None = None
    # Content a text-only model cannot take, replaced by a placeholder (x-mlxgw-omitted-content).
    omitted: list[str] = field(default_factory=list)
    logprobs: int | None = None  # alternatives per token's logprob entry; None: no logprobs
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (Completions' echo)
    n: int = 1  # choices from the one prompt
    fim: dict | None = None  # fill in the middle (fim_support.fim_map); prompt is then unused


def parse_common(body: dict, kind: type[CommonFields]) -> dict:
    """The ParsedRequest fields every generating API reads the same way (mlxgw extensions
    included: seed, min_p, penalties, logit_bias, priority, stream_interval), decoded once."""
    return common_fields(decode_fields(body, kind))


def common_fields(f: CommonFields) -> dict:
    """The ParsedRequest fields of an API's decoded struct that every API reads the same way."""
    return dict(
        sampling=f,
        stream=bool(f.stream),
        max_tokens=f.requested_max_tokens(),
        stop=f.stop_list(),
        priority=f.priority or 0,
        service_tier=f.service_tier,
        stream_interval=f.stream_interval,
        reasoning_budget=f.reasoning_budget,
    )


def first_set(*values):
    """The first value that is not None: request value, then model default, then fallback."""
    return next((x for x in values if x is not None), None)


def _sampling_params(s: CommonFields, slot) -> p.SamplingParams:
    d = slot.entry.defaults
    return p.SamplingParams(
        temperature=first_set(s.temperature, d.temperature, 1.0),
        top_p=first_set(s.top_p, d.top_p, 1.0),
        top_k=first_set(s.top_k, d.top_k, 0),
        min_p=first_set(s.min_p, d.min_p, 0.0),
        seed=s.seed,
        repetition_penalty=first_set(s.repetition_penalty, d.repetition_penalty),
        presence_penalty=first_set(s.presence_penalty, 0.0),
        frequency_penalty=first_set(s.frequency_penalty, 0.0),
        logit_bias=logit_bias(s),
    )


def rate_cap(tokens_per_s: float | None, answer_timeout_s: float | None) -> int | None:
    """The max_tokens this host's decode rate produces within the answer timeout."""
    if not tokens_per_s or not answer_timeout_s:
        return None
    return max(RATE_CAP_FLOOR, int(tokens_per_s * answer_timeout_s * RATE_CAP_SHARE))


async def build_request(request: web.Request, slot, parsed: ParsedRequest) -> p.GenerateRequest:
    """The internal request: model defaults, the max_tokens default and cap, images out of
    the messages, timeouts. The one place these rules live."""
    settings = request.app[SETTINGS]
    entry = slot.entry
    # A completion at the cursor is a few lines: its own default before the model's chat one.
    fim_default = fim_max_tokens(slot) if parsed.fim is not None else None
    max_tokens = first_set(
        parsed.max_tokens, fim_default, entry.defaults.max_tokens, settings.max_tokens_default, parsed.api_max_tokens
    )
    models_dir = request.app[MANAGER].registry.models_dir
    max_tokens = first_set(max_tokens, model_max_new_tokens(entry, models_dir), DEFAULT_MAX_TOKENS)
    if settings.max_tokens_cap is not None:
        max_tokens = min(max_tokens, settings.max_tokens_cap)
    if parsed.max_tokens is None:
        max_tokens = min(max_tokens, rate_cap(slot.decode_tokens_per_s, settings.request_timeout_s) or max_tokens)
    # A default the client did not ask for is clamped to the context, never refused.
    policy = entry.max_tokens_policy if parsed.max_tokens is not None else "clamp"
    key = request.get("key")
    messages, images = parsed.messages, None
    if messages is not None:
        messages = with_entry_preamble(entry, messages)
        messages, images = await collect_images(messages, image_limits(request, slot))
    template_kwargs = parsed.chat_template_kwargs
    if entry.chat.chat_template and not (template_kwargs or {}).get("chat_template"):
        template_kwargs = {**(template_kwargs or {}), "chat_template": entry.chat.chat_template}
    return p.GenerateRequest(
        rid=request["rid"],
        messages=messages,
        prompt=parsed.prompt,
        prompt_tokens=parsed.prompt_tokens,
        tools=parsed.tools or None,
        chat_template_kwargs=template_kwargs,
        sampling=_sampling_params(parsed.sampling, slot),
        max_tokens=max_tokens,
        max_tokens_policy=policy,
        stop=parsed.stop,
        stream_interval=first_set(parsed.stream_interval, entry.stream_interval),
        priority=granted_priority(request, parsed.priority, parsed.service_tier),
        tenant=key.tenant if key is not None else None,
        weight=key.weight if key is not None else 1.0,
        timeout_s=settings.request_timeout_s,
        prefill_timeout_s=settings.prefill_timeout_s,
        constraint=parsed.constraint,
        reasoning_budget=parsed.reasoning_budget,
        images=images,
        logprobs=parsed.logprobs,
        prompt_logprobs=parsed.prompt_logprobs,
        n=parsed.n,
        adapter=request.get("adapter"),
        fim=parsed.fim,
    )


def with_entry_preamble(entry, messages: list[dict]) -> list[dict]:
    """The entry's Modelfile turns (MESSAGE) after the request's leading system turns, and its
    SYSTEM first when the request brings no system turn of its own."""
    if not entry.chat.system and not entry.chat.messages:
        return messages
    lead = 0
    while lead < len(messages) and messages[lead].get("role") in ("system", "developer"):
        lead += 1
    head = [{"role": "system", "content": entry.chat.system}] if entry.chat.system and lead == 0 else []
    preset = [{"role": m.role, "content": m.content} for m in entry.chat.messages]
    return head + messages[:lead] + preset + messages[lead:]


def granted_priority(request: web.Request, requested: int, service_tier: str | None = None) -> int:
    """The priority a request runs at: background for service_tier "flex" and batch jobs
    (gateway/batches/runner.py marks its requests), else what it asked, clamped to what its
    key was granted (keys.yaml min_priority, default 0; without keys, as asked)."""
    if service_tier == "flex" or request.get("background"):
        return p.BACKGROUND_PRIORITY
    key = request.get("key")
    return key.granted_priority(requested) if key is not None else requested


def model_max_new_tokens(entry, models_dir: Path) -> int | None:
    """`max_new_tokens` of the model folder's generation_config.json, where the model is
    local and its authors set one (a remote-only model's folder is not here: None)."""
    path = entry.model_path(models_dir) / "generation_config.json"
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return None
    return _max_new_tokens(path, stamp)


@lru_cache(maxsize=256)
def _max_new_tokens(path: Path, stamp: int) -> int | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("max_new_tokens")
    except (OSError, ValueError, AttributeError):
        return None  # unreadable or not an object: as if it set nothing
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def image_limits(request: web.Request, slot) -> ImageLimits | None:
    """The image limits when the model takes images, else None."""
    return request.app[SETTINGS].images if slot.entry.kind == ModelKind.VISION else None


async def open_request(request: web.Request, kinds: tuple[ModelKind, ...] = CHAT_KINDS) -> tuple[dict, object]:
    """The handler preamble of the generating APIs: the JSON body (which their parse decodes
    into the API's struct) and the model slot it names."""
    body = v.require_object(await read_json(request))
    return body, _slot(request, decode_fields(body, ModelField), kinds)


async def open_fields(
    request: web.Request, kind: type[F], kinds: tuple[ModelKind, ...] = CHAT_KINDS
) -> tuple[F, object]:
    """The handler preamble of a route whose struct declares all it reads, `model` included:
    the body decoded once, and the model slot it names."""
    fields = decode_fields(v.require_object(await read_json(request)), kind)
    return fields, _slot(request, fields, kinds)


def _slot(request: web.Request, fields: ModelField, kinds: tuple[ModelKind, ...]):
    if fields.model is None:
        raise invalid("missing required parameter: 'model'", "model")
    return resolve_model(request, fields.model, kinds)


def generation(request: web.Request, slot, req: p.WorkerRequest) -> Generation:
    """The request's generation, also recorded on the request for limits, metrics and logs."""
    key = request.get("key")
    if isinstance(req, p.GenerateRequest):  # embeddings are charged their input only
        reserve_tokens(request, slot, req.max_tokens * req.n if req.max_tokens is not None else None, req.n)
    gen = Generation(
        request.app[MANAGER], slot, req, request.app[SETTINGS].keepalive_s, owner=key.name if key else None
    )
    request["generation"] = gen
    return gen


async def respond(
    request: web.Request,
    slot,
    parsed: ParsedRequest,
    emitter: EmitterFactory,
    render: Callable[[Generation, Outcome], dict],
    headers: dict[str, str] | None = None,
    writer: type[SSEWriter] = SSEWriter,
) -> web.StreamResponse:
    """Run the request: one JSON body from `render`, or a stream through the API's emitter
    in the writer's wire format."""
    gen = generation(request, slot, await build_request(request, slot, parsed))
    headers = {**(headers or {}), **omitted_header(parsed)}
    if parsed.stream:
        return await run_stream(request, gen, emitter, headers, writer)
    async with gen:
        out = await gen.result()
    return web.json_response(render(gen, out), headers=headers)


def omitted_header(parsed: ParsedRequest) -> dict[str, str]:
    """Names what a text-only model was sent a placeholder for (images in tool results)."""
    return {"x-mlxgw-omitted-content": ",".join(sorted(set(parsed.omitted)))} if parsed.omitted else {}


# -- tools and constraints, in every API's own spelling ---------------------------------------


def loaded_tool_names(conversation: object) -> set[str]:
    """Deferred tools a tool search already loaded: the names in `tool_reference` blocks
    (Anthropic) and in `tool_search_output` items' tools (OpenAI Responses)."""
    found: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            kind = node.get("type")
            if kind == "tool_reference" and isinstance(node.get("tool_name"), str):
                found.add(node["tool_name"])
            elif kind == "tool_search_output" and isinstance(node.get("tools"), list):
                found.update(x["name"] for x in node["tools"] if isinstance(x, dict) and isinstance(x.get("name"), str))
            if isinstance(node.get("content"), list):
                walk(node["content"])

    walk(conversation)
    return found


def is_deferred(tool: object, loaded: set[str]) -> bool:
    """A tool marked `defer_loading` (Anthropic's and OpenAI's tool search) is not in the
    model's context until a search loads it: shown earlier, a small model calls it (Claude
    Code offers `DeferredToolPlaceholder`, "never call this tool", first)."""
    return isinstance(tool, dict) and tool.get("defer_loading") is True and tool.get("name") not in loaded


def function_tool(name, description, parameters) -> dict:
    """A tool as the chat template takes it."""
    if not isinstance(name, str) or not name:
        raise invalid("each tool needs a 'name' string", "tools")
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description if isinstance(description, str) else "",
            "parameters": parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}},
        },
    }


def forced_tool(tools: list[dict] | None, name: str | None, param: str = "tool_choice") -> dict:
    """A tool call enforced by constrained decoding: any of the tools, or the named one."""
    if not tools:
        raise invalid(f"{param} requires tools", param)
    return {"type": "tool_call", "tools": tools, "name": name}


def one_constraint(output_format: dict | None, forced: dict | None, names: str) -> dict | None:
    """An output format or a forced tool call; both at once cannot be enforced."""
    if output_format is not None and forced is not None:
        raise invalid(f"{names} cannot be combined", "tool_choice")
    return forced or output_format


def json_schema_constraint(schema, where: str, param: str) -> dict:
    if not isinstance(schema, dict):
        raise invalid(f"{where} must be a JSON schema object", param)
    return {"type": "json_schema", "schema": schema}
