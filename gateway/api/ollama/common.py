"""Ollama's request pieces shared by its routes: model names with tags, `options`,
`keep_alive`, `format`, timestamps and the timing fields of a finished answer."""

from __future__ import annotations

import asyncio
import math
import re
import time
from datetime import datetime, timezone
from typing import TypeVar

from aiohttp import web

from ....shared.errors import ErrorCode, ServiceError, invalid
from ....shared.model_sections import CHAT_KINDS, ModelKind
from ...access import audit
from ...access.auth import resolve_model
from ...models.lifecycle import SlotState
from ...pipeline.body import read_object
from ...pipeline.fields import decode_fields
from ...pipeline.tools import json_schema_constraint
from ...web.state import MANAGER
from .fields import OllamaBody, OllamaOptions

B = TypeVar("B", bound=OllamaBody)

# Go's time.ParseDuration units, which Ollama's keep_alive strings use.
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_options(f: OllamaBody, stream: bool = False) -> dict:
    """The ParsedRequest fields from `options` (and `stream`), checked with the shared ranges."""
    common = decode_fields(f.options or {}, OllamaOptions).request_fields()
    common["stream"] = stream
    if common["sampling"].num_predict == 0:
        raise invalid("'num_predict' must be a positive number of tokens, or -1 for no limit", "num_predict")
    return common


def parse_duration(value, name: str = "keep_alive") -> float | None:
    """keep_alive in seconds: a number of seconds or a Go duration string ("5m", "1h30m",
    "0"); negative: forever (math.inf); None when not sent. Anything else is a 400."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise invalid(f"'{name}' must be a duration such as \"5m\" or a number of seconds", name)
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        if body == "0":
            return 0.0
        parts = _DURATION.findall(body)
        if not body or "".join(a + u for a, u in parts) != body:
            raise invalid(f'\'{name}\' is not a valid duration: {value!r} (examples: "5m", "1h30m", "0")', name)
        seconds = sign * sum(float(a) * _UNITS[u] for a, u in parts)
    else:
        seconds = float(value)
    if not math.isfinite(seconds):
        raise invalid(f"'{name}' must be finite", name)
    return math.inf if seconds < 0 else seconds


def format_constraint(fmt) -> dict | None:
    """`format`: "json", or a JSON schema; enforced by constrained decoding."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return json_schema_constraint(fmt, "format", "format")
    raise invalid("'format' must be \"json\" or a JSON schema object", "format")


def think_kwargs(think) -> dict | None:
    """`think`: true/false, or an effort ("low", "medium", "high"), as the chat template's switch."""
    if think is None:
        return None
    if isinstance(think, bool):
        return {"enable_thinking": think}
    if think in ("low", "medium", "high"):
        return {"enable_thinking": True, "reasoning_effort": think}
    raise invalid('\'think\' must be true, false, "low", "medium" or "high"', "think")


def resolve(request: web.Request, name: str, kinds: tuple[ModelKind, ...] = CHAT_KINDS):
    """The model slot; Ollama clients name models with a tag, so "name:latest" is "name"."""
    try:
        return resolve_model(request, name, kinds)
    except ServiceError as e:
        if e.code != ErrorCode.MODEL_NOT_FOUND or not name.endswith(":latest"):
            raise
        return resolve_model(request, name.removesuffix(":latest"), kinds)


async def open_request(
    request: web.Request, kind: type[B], kinds: tuple[ModelKind, ...] = CHAT_KINDS
) -> tuple[B, object]:
    """The body decoded once into its route's struct, and the model slot it names."""
    f = decode_fields(await read_object(request), kind)
    name = f.model_name()
    if not name:
        raise invalid("missing required parameter: 'model'", "model")
    return f, resolve(request, name, kinds)


def created_at(at: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if at is None else at, timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def timings(gen, usage) -> dict:
    """Ollama's counters and durations (nanoseconds) of a finished generation."""
    now = time.monotonic()
    first = gen.first_token_at or now
    return {
        "total_duration": _ns(now - gen.started),
        "load_duration": 0,
        "prompt_eval_count": usage.prompt_tokens,
        "prompt_eval_duration": _ns(first - gen.started),
        "eval_count": usage.completion_tokens,
        "eval_duration": _ns(now - first),
    }


def done_reason(reason: str | None) -> str:
    """Ollama says "stop" after tool calls too; "length" when max tokens ran out."""
    return "length" if reason == "length" else "stop"


# -- keep_alive: residency ------------------------------------------------------------------------

_UNLOADS: set[asyncio.Task] = set()
UNLOAD_WAIT_S = 120.0  # how long a keep_alive 0 waits for the model's other requests to end


def may_set_residency(request: web.Request) -> bool:
    """Residency is the operator's: keep_alive counts only from an admin key, a key
    with `residency: true`, or anyone when keys are off. Other keys' keep_alive is ignored:
    one key must not unload (keep_alive 0) or pin (-1, "9999h") a model for everyone."""
    key = request.get("key")
    return key is None or key.admin or key.residency


def apply_keep_alive(request: web.Request, slot, seconds: float | None) -> None:
    """After a request: keep the model for `seconds`, or (0) unload it once it is idle."""
    if seconds is None or not may_set_residency(request):
        return
    audit.residency(request, slot.name, seconds)
    manager = request.app[MANAGER]
    if seconds > 0:
        manager.keep_loaded(slot, seconds)
        return
    manager.keep_loaded(slot, 0)
    task = asyncio.get_running_loop().create_task(unload_when_idle(manager, slot))
    _UNLOADS.add(task)
    task.add_done_callback(_UNLOADS.discard)


async def unload_when_idle(manager, slot) -> None:
    """Unload once no request is in flight on the model (others' requests finish first)."""
    deadline = time.monotonic() + UNLOAD_WAIT_S
    while manager.in_flight(slot) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    if manager.in_flight(slot) == 0 and slot.process is not None and slot.state is SlotState.READY:
        await manager.unload(slot, "keep_alive 0")
