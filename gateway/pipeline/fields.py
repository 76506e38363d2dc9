"""The fields of every generating API, declared once with their ranges and decoded in one
pass by msgspec: for Chat Completions and Completions the whole body (the fields whose
shapes need their own messages, like `messages` and `tools`, are taken as sent and checked
by the API's parse from the decoded struct, so each field is read once). Measured on a chat
request's common fields (shared 2-core host, us per request): msgspec decode ~2, pydantic
v2 with the same constraints ~8.5, the old field-by-field checks ~15; this module's whole
path (decode, logit_bias ids, stop list) ~8.

Each API's struct differs only in the names it gives max_tokens and stop, in its
temperature range and in its own fields; every other field (the mlxgw extensions included)
is the same everywhere. A failure is a 400 that names the field (`param`) in the called
API's shape, in the words the field checks have always used; NaN and Infinity fail every range."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from ...shared.errors import invalid

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1  # any int64; the worker maps it onto its generator's range (seed mod 2^64)

M = msgspec.Meta
Tokens = Annotated[int, M(ge=1, le=INT32_MAX)]
StopText = Annotated[str, M(min_length=1, max_length=1000)]
Stop = StopText | Annotated[list[StopText], M(max_length=16)] | None
# Shape only here (an integer of bounded length); the range check names the key (logit_bias()).
TokenId = Annotated[str, M(pattern=r"^\s*-?\d{1,20}\s*$")]
Bias = Annotated[float, M(ge=-100, le=100)]


class CommonFields(msgspec.Struct):
    temperature: Annotated[float, M(ge=0, le=2)] | None = None
    top_p: Annotated[float, M(ge=0, le=1)] | None = None
    top_k: Annotated[int, M(ge=0, le=INT32_MAX)] | None = None
    min_p: Annotated[float, M(ge=0, le=1)] | None = None
    seed: Annotated[int, M(ge=-SEED_MAX - 1, le=SEED_MAX)] | None = None
    repetition_penalty: Annotated[float, M(ge=0.01, le=10)] | None = None
    presence_penalty: Annotated[float, M(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, M(ge=-2, le=2)] | None = None
    logit_bias: Annotated[dict[TokenId, Bias], M(max_length=1024)] | None = None
    stream: bool | None = None
    priority: Annotated[int, M(ge=-100, le=100)] | None = None
    # OpenAI's tiers ("flex": background priority, after every interactive request) and
    # Anthropic's ("standard_only"); the others run as interactive requests.
    service_tier: Literal["auto", "default", "flex", "priority", "scale", "standard_only"] | None = None
    # The latency class it asks (gateway/pipeline/latency_class.py; never above its key's grant).
    latency_class: Literal["editor", "chat", "agent", "background"] | None = None
    stream_interval: Annotated[int, M(ge=1, le=1024)] | None = None
    reasoning_budget: Annotated[int, M(ge=0, le=INT32_MAX)] | None = None
    # vLLM's: the request's prompt is cached apart from every request without the same salt
    # (within its key's cache group: gateway/access/cache_scope.py).
    cache_salt: Annotated[str, M(min_length=1, max_length=256)] | None = None
    # vllm-mlx's: frames a second sampled from each video part, and the most frames a video
    # gives (capped by the server: gateway/pipeline/video.py).
    video_fps: Annotated[float, M(gt=0, le=60)] | None = None
    video_max_frames: Annotated[int, M(ge=2, le=INT32_MAX)] | None = None

    # The API's names for max_tokens (the first one set wins) and for stop sequences.
    MAX_TOKENS: ClassVar[tuple[str, ...]] = ()
    STOP: ClassVar[str] = "stop"

    def requested_max_tokens(self) -> int | None:
        for name in self.MAX_TOKENS:
            value = getattr(self, name)
            if value is not None:
                return value
        return None

    def stop_list(self) -> list[str]:
        stop = getattr(self, self.STOP, None)
        return [stop] if isinstance(stop, str) else list(stop or [])

    def request_fields(self) -> dict:
        """The translate.ParsedRequest fields every API reads the same way (the mlxgw
        extensions included: seed, min_p, penalties, logit_bias, priority, stream_interval)."""
        return dict(
            sampling=self,
            stream=bool(self.stream),
            max_tokens=self.requested_max_tokens(),
            stop=self.stop_list(),
            priority=self.priority or 0,
            service_tier=self.service_tier,
            latency_class=self.latency_class,
            stream_interval=self.stream_interval,
            reasoning_budget=self.reasoning_budget,
            cache_salt=self.cache_salt,
            video_fps=self.video_fps,
            video_max_frames=self.video_max_frames,
        )


class BodyFields(CommonFields):
    """A generating API's whole body: the common fields and the model it names, so the
    body is decoded once, before the model is looked up (pipeline/serving.handle)."""

    model: str | None = None


MAX_CHOICES = 16  # n per request; each choice is a sequence in the batch
Choices = Annotated[int, M(ge=1, le=MAX_CHOICES)]


CacheRetention = Literal["in_memory", "24h"]


class ChatFields(BodyFields):
    """A Chat Completions body, every field it reads."""

    MAX_TOKENS = ("max_completion_tokens", "max_tokens")
    max_completion_tokens: Tokens | None = None
    max_tokens: Tokens | None = None
    stop: Stop = None
    n: Choices | None = None
    best_of: Annotated[int, M(ge=1, le=INT32_MAX)] | None = None  # taken only where it ranks nothing
    logprobs: bool | None = None
    top_logprobs: Annotated[int, M(ge=0, le=20)] | None = None
    stream_options: dict | None = None
    chat_template_kwargs: dict | None = None
    response_format: dict | None = None
    tools: list | None = None
    prompt_cache_key: str | None = None  # accepted; routes nothing on one worker (cache_hints.py)
    prompt_cache_retention: CacheRetention | None = None
    # As sent: their checks give messages a user can act on (openai_chat.parse).
    messages: Any = None
    tool_choice: Any = None


class CompletionFields(BodyFields):
    """A (legacy) Completions body, every field it reads."""

    MAX_TOKENS = ("max_tokens",)
    max_tokens: Tokens | None = None
    stop: Stop = None
    n: Choices | None = None
    best_of: Choices | None = None
    logprobs: Annotated[int, M(ge=0, le=5)] | None = None  # OpenAI's limit for this API
    echo: bool | None = None
    stream_options: dict | None = None
    prompt: Any = None  # a string or token ids, one or a list of one (openai_completions._prompt)
    suffix: Any = None


class AnthropicFields(BodyFields):
    """An Anthropic Messages body: every field it reads (messages and system are converted by
    anthropic_input.convert_messages, their documents read before)."""

    MAX_TOKENS, STOP = ("max_tokens",), "stop_sequences"
    temperature: Annotated[float, M(ge=0, le=1)] | None = None  # Anthropic's range
    max_tokens: Tokens | None = None
    stop_sequences: Stop = None
    # As sent: their checks give Anthropic's own messages (anthropic.parse, anthropic_input).
    messages: Any = None
    system: Any = None
    tools: Any = None
    tool_choice: Any = None
    thinking: Any = None
    output_config: Any = None


class ThinkingFields(msgspec.Struct):
    """Anthropic's `thinking` object, decoded when it is one (anthropic._thinking)."""

    type: Any = None
    budget_tokens: Annotated[int, M(ge=0, le=INT32_MAX)] | None = None


class ResponsesFields(BodyFields):
    """A Responses body, every field it reads."""

    MAX_TOKENS = ("max_output_tokens",)
    max_output_tokens: Tokens | None = None
    stop: Stop = None  # an mlxgw extension here
    instructions: str | None = None
    previous_response_id: str | None = None
    text: dict | None = None
    include: list | None = None
    top_logprobs: Annotated[int, M(ge=0, le=20)] | None = None
    prompt_cache_key: str | None = None  # accepted; routes nothing on one worker (cache_hints.py)
    prompt_cache_retention: CacheRetention | None = None
    # As sent: their checks give messages a user can act on (responses.parse, responses_tools).
    input: Any = None
    tools: Any = None
    tool_choice: Any = None


class ModelField(msgspec.Struct):
    """The model a request names: the field every non-generating route's struct shares
    (aux_fields.py, read by serving.open_fields)."""

    model: str | None = None


def decode_fields(body: dict, kind: type[msgspec.Struct]) -> msgspec.Struct:
    """The API's fields, checked; unknown fields are ignored."""
    try:
        return msgspec.convert(body, kind)
    except msgspec.ValidationError as e:
        raise _refusal(str(e), body) from None


# msgspec's names of JSON types, as a user reads them
_WHAT = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}
_WHAT |= {"object": "an object", "array": "a list"}
_TYPE = re.compile(r"^Expected `([\w |]+)`, got `(\w+)` - at `\$\.(\w+)`$")
_MISSING = re.compile(r"^Object missing required field `(\w+)`$")
_BOUND = re.compile(r"^Expected `(int|float)` (<=|>=) (\S+) - at `\$\.(\w+)`$")


def _refusal(message: str, body: dict):
    """A 400 naming the field, in the words the field checks use everywhere ("'n' must be
    at most 16, got 17"); msgspec's own words where the problem is nested."""
    missing = _MISSING.match(message)
    if missing:
        return invalid(f"missing required parameter: '{missing[1]}'", missing[1])
    typed, bound = _TYPE.match(message), _BOUND.match(message)
    wanted = [t for t in typed[1].split(" | ") if t != "null"] if typed else []
    if wanted and all(t in _WHAT for t in wanted):
        name = typed[3]
        what = " or ".join(_WHAT[t] for t in wanted)
        return invalid(f"'{name}' must be {what}, got {type(body.get(name)).__name__}", name)
    if bound:
        name, value = bound[4], body.get(bound[4])
        if isinstance(value, float) and not math.isfinite(value):
            return invalid(f"'{name}' must be a finite number, got {value}", name)
        side = "at most" if bound[2] == "<=" else "at least"
        return invalid(f"'{name}' must be {side} {bound[3]}, got {value}", name)
    # msgspec says "of length <= 1024"; users read "at most 1024 entries" faster.
    message = re.sub(r"of length <= (\d+)", r"of at most \1 entries", message)
    path = message.rpartition("`$.")[2]
    param = path.split("[", 1)[0].split(".", 1)[0].rstrip("`") or None
    return invalid(f"invalid '{param}': {message}" if param else message, param)


def logit_bias(fields: CommonFields) -> dict[int, float] | None:
    """Token ids as integers. The worker also checks them against the model's vocabulary."""
    if not fields.logit_bias:
        return None
    bias = {}
    for key, value in fields.logit_bias.items():
        token = int(key)
        if not 0 <= token <= INT32_MAX:
            raise invalid(f"'logit_bias' keys must be token ids from 0 to {INT32_MAX}, got {key!r}", "logit_bias")
        bias[token] = value
    return bias
