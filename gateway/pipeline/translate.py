"""The one translation layer: every generating API parses its fields into a `ParsedRequest`,
and `build_request` turns that into the one internal `GenerateRequest` (model defaults, the
max_tokens default and cap, images, timeouts). Nothing else lives here: the request's path
around it (read, decode, model, generation, stream or answer) is serving.handle, and tools
in each API's spelling are tools.py.

An API module therefore writes only what is its own: the names and ranges of its fields,
its message shapes, and its output shapes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from aiohttp import web

from ...shared import protocol as p
from ...shared.model_sections import ModelKind
from ..access.cache_scope import cache_namespace
from ..web.state import CACHE_SECRET, MANAGER, SETTINGS
from .audio_parts import collect_audio
from .fields import CommonFields, logit_bias
from .fim_support import fim_max_tokens
from .images import ImageLimits, collect_images
from .latency_class import classify, route_class, target_s
from .video import collect_videos

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
    latency_class: str | None = None  # asked; None: its route's (latency_class.py)
    stream_interval: int | None = None
    # Content a text-only model cannot take, replaced by a placeholder (x-mlxgw-omitted-content).
    omitted: list[str] = field(default_factory=list)
    logprobs: int | None = None  # alternatives per token's logprob entry; None: no logprobs
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (Completions' echo)
    n: int = 1  # choices from the one prompt
    fim: dict | None = None  # fill in the middle (fim_support.fim_map); prompt is then unused
    cache_retention_s: float | None = None  # a client's caching hint (cache_hints.py); None: none
    cache_salt: str | None = None  # narrows the key's cache namespace (access/cache_scope.py)
    video_fps: float | None = None  # frames a second sampled from each video (video.py)
    video_max_frames: int | None = None
    transcribed: list[str] = field(default_factory=list)  # media turned into text (x-mlxgw-transcribed-content)


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
    if max_tokens is None:  # only then: reading the model folder's default costs a stat per request
        models_dir = request.app[MANAGER].registry.models_dir
        max_tokens = first_set(model_max_new_tokens(entry, models_dir), DEFAULT_MAX_TOKENS)
    if settings.max_tokens_cap is not None:
        max_tokens = min(max_tokens, settings.max_tokens_cap)
    if parsed.max_tokens is None:
        max_tokens = min(max_tokens, rate_cap(slot.decode_tokens_per_s, settings.request_timeout_s) or max_tokens)
    # A default the client did not ask for is clamped to the context, never refused.
    policy = entry.max_tokens_policy if parsed.max_tokens is not None else "clamp"
    key = request.get("key")
    priority = granted_priority(request, parsed.priority, parsed.service_tier)
    latency, priority = classify(request, parsed.latency_class, route_class(parsed.fim, parsed.tools), priority)
    messages, images, videos, audio = parsed.messages, None, None, None
    if messages is not None:
        messages = with_entry_preamble(entry, messages)
        if any(isinstance(m.get("content"), list) for m in messages):  # plain text has no media to look for
            messages, images, videos, audio = await _media(request, slot, parsed, messages)
    template_kwargs = parsed.chat_template_kwargs  # an entry's own template is the worker's (chat_text.py)
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
        priority=priority,
        latency_class=latency,
        ttft_target_s=target_s(settings, latency),
        tenant=key.tenant if key is not None else None,
        weight=key.weight if key is not None else 1.0,
        timeout_s=settings.request_timeout_s,
        prefill_timeout_s=settings.prefill_timeout_s,
        constraint=parsed.constraint,
        reasoning_budget=parsed.reasoning_budget,
        images=images,
        videos=videos,
        audio=audio,
        logprobs=parsed.logprobs,
        prompt_logprobs=parsed.prompt_logprobs,
        n=parsed.n,
        adapter=request.get("adapter"),
        fim=parsed.fim,
        cache_retention_s=parsed.cache_retention_s,
        cache_namespace=cache_namespace(
            request.app[CACHE_SECRET], key, settings.default_cache_group, parsed.cache_salt
        ),
    )


async def _media(request: web.Request, slot, parsed: ParsedRequest, messages: list[dict]) -> tuple:
    """(messages with placeholders, images, videos, audio): each kind moved out of the
    messages, the transcribed audio noted on `parsed` (x-mlxgw-transcribed-content)."""
    limits = image_limits(request, slot)
    messages, images = await collect_images(messages, limits)
    messages, videos = await collect_videos(messages, limits, parsed.video_fps, parsed.video_max_frames)
    messages, audio, transcribed = await collect_audio(request, slot, messages)
    parsed.transcribed += ["audio"] if transcribed else []
    return messages, images, videos, audio


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
