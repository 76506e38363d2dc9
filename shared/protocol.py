"""The gateway <-> worker wire protocol: msgpack maps over ZeroMQ, defined once.

Every message is a map with "v" (protocol version) and "t" (type). The gateway binds a
ROUTER socket; each worker connects a DEALER (so a worker may live on another host). Both
sides heartbeat; a peer silent for `liveness` intervals is dead (ZeroMQ Guide, Paranoid
Pirate). Workers announce the model they serve (Majordomo: service name = model name).

Request events travel in batches: one EVENTS message per engine step carries the deltas of
every running request, instead of one message per token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from .events import AnyEvent
from .wire_types import _conforms, _field_names, _type_hints

PROTOCOL_VERSION = 1

# worker -> gateway
# worker_id, model, kind, pid, secret?, seq? (the number of the next EVENTS frame on this
# socket: a gateway that expected a lower one knows frames were lost)  (re-sent when asked)
HELLO = "hello"
READY = "ready"  # model loaded: info = {context_length, max_num_seqs, max_queue, ...}
LOAD_FAILED = "load_failed"  # error = {code, message}
# A worker's exit status when its model cannot be loaded at all (a config it cannot build, a
# missing field, an unknown architecture): the gateway marks the model failed at once rather
# than restarting into the same error (sysexits' EX_CONFIG).
EXIT_UNSERVABLE = 78
EVENTS = "events"  # items = [[rid, event], ...], seq? (numbered per worker link, from 0)
REPLY = "reply"  # cid, ok, result | error
BYE = "bye"
# What the worker's prefix cache holds, in the route chain entries its requests came with
# (GenerateRequest.route): held = [entry, ...] newly stored, evicted = [entry, ...] whose
# blocks left memory and disk; snapshot: true when held is all it holds (sent after each
# WELCOME, so a restarted gateway rebuilds its index). Batched: at most one per stats tick.
PREFIXES = "prefixes"
# gateway -> worker
WELCOME = "welcome"
GENERATE = "generate"  # request = GenerateRequest
EMBED = "embed"  # request = EmbedRequest (embedding and reranking workers)
TRANSCRIBE = "transcribe"  # request = TranscribeRequest (speech-to-text workers)
SPEAK = "speak"  # request = SpeechRequest (text-to-speech workers)
DRAW = "draw"  # request = ImageRequest (image workers)
CANCEL = "cancel"  # rids = [...]
CALL = "call"  # cid, op, args  (tokenize, cache_stats, cache_clear, status)
SHUTDOWN = "shutdown"  # drain: bool
RECONNECT = "reconnect"  # "who are you?": the gateway lost track of this worker
# both
# A worker's carries stats, step_busy_s and progress? (a count that moves while its requests
# get anywhere: gateway/link/liveness.py bounds a worker that heartbeats without progress)
HEARTBEAT = "heartbeat"

WORKER_TYPES = {HELLO, READY, LOAD_FAILED, EVENTS, REPLY, BYE, HEARTBEAT, PREFIXES}
GATEWAY_TYPES = {WELCOME, GENERATE, EMBED, TRANSCRIBE, SPEAK, DRAW, CANCEL, CALL, SHUTDOWN, RECONNECT, HEARTBEAT}

# Event kinds inside EVENTS: EventKind (shared/events.py), each built by its dataclass.


class ProtocolError(ValueError):
    pass


class VersionMismatch(ProtocolError):
    """A peer speaks another protocol version: refuse it (once, loudly), never half-understand it."""

    def __init__(self, version: object, msg: dict):
        super().__init__(f"protocol version {version!r} != {PROTOCOL_VERSION}")
        self.version = version
        self.msg = msg


def encode(msg_type: str, **fields_: Any) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": msg_type, **fields_}, use_bin_type=True)


def decode(frame: bytes, allowed: set[str]) -> dict:
    """Parse one frame; ProtocolError for anything malformed, foreign or of an unknown type."""
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"undecodable frame ({len(frame)} bytes): {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("frame is not a map")
    if msg.get("v") != PROTOCOL_VERSION:
        raise VersionMismatch(msg.get("v"), msg)
    if msg.get("t") not in allowed:
        raise ProtocolError(f"unknown message type {msg.get('t')!r}")
    return msg


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # token id -> additive bias; msgpack keeps int keys (strict_map_key=False above).
    logit_bias: dict[int, float] | None = None


@functools.cache
def _nested_fields(cls) -> frozenset[str]:
    """The fields declared as a dataclass (GenerateRequest.sampling)."""
    return frozenset(name for name, tp in _type_hints(cls).items() if hasattr(tp, "__dataclass_fields__"))


def _plain(obj) -> dict:
    """A request dataclass as its wire map, nested dataclasses as maps: what asdict gives,
    without deep-copying every message and list (msgpack packs them as they are)."""
    out = {name: getattr(obj, name) for name in _field_names(type(obj))}
    for name in _nested_fields(type(obj)):
        if out[name] is not None:
            out[name] = _plain(out[name])
    return out


def _from_wire(cls, wire: dict, **nested: type):
    """Build a request dataclass from its wire map, ignoring fields this version does not know
    (a newer gateway may send more). ValueError names a field of the wrong type."""
    if not isinstance(wire, dict):
        raise ValueError("the request is not a map")
    hints = _type_hints(cls)
    data = {k: v for k, v in wire.items() if k in hints and k not in nested}
    for name, value in data.items():
        if not _conforms(value, hints[name]):
            raise ValueError(f"field {name!r} has the wrong type ({type(value).__name__})")
    for name, tp in nested.items():
        inner = wire.get(name) or {}
        if not isinstance(inner, dict):
            raise ValueError(f"field {name!r} is not a map")
        data[name] = _from_wire(tp, inner)
    return cls(**data)


@dataclass
class GenerateRequest:
    """The one internal request every generating API translates into."""

    WIRE_TYPE: ClassVar[str] = GENERATE
    rid: str
    # Exactly one of messages (chat), prompt (text) or prompt_tokens is set.
    messages: list[dict] | None = None
    prompt: str | None = None
    prompt_tokens: list[int] | None = None
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: as many as the context leaves
    max_tokens_policy: str = "clamp"  # or "reject" when prompt + max_tokens > context
    stop: list[str] = field(default_factory=list)
    stream_interval: int = 1  # tokens per delta event
    priority: int = 0  # lower runs first; FCFS within a priority
    # Latency class (worker/schedule/latency.py): "editor", "chat", "agent" or "background", and
    # its target seconds to the first token: within a priority the worker admits the earliest
    # arrival + target first. None: from the priority, with the worker's default targets.
    latency_class: str | None = None
    ttft_target_s: float | None = None
    # Fair share (worker/schedule/fair_share.py): who sent it, as a stable hash of the API key (never
    # its name), and the key's weight; requests of one tenant share that tenant's turn.
    tenant: str | None = None
    weight: float = 1.0
    # Two bounds: queue + prefill until the first token, then generation from the first token.
    # Long agent prompts on a slow host can take minutes to prefill; that must not eat the
    # time the answer has.
    timeout_s: float | None = None  # from the first token
    prefill_timeout_s: float | None = None  # from arrival to the first token (None: timeout_s)
    # Constrained decoding: {"type": "json_schema", "schema": {...}} | {"type": "json_object"}
    # | {"type": "regex", "pattern": ...} | {"type": "lark", "grammar": ...}
    constraint: dict | None = None
    reasoning_budget: int | None = None  # reasoning tokens before the end of thinking is forced
    echo: bool = False  # completions: prepend the prompt text to the output
    # Vision models: the encoded images (PNG, JPEG, ...), in the order of the {"type": "image"}
    # parts of the messages.
    images: list[bytes] | None = None
    # Vision models: the videos' sampled frames, in the order of the {"type": "video"} parts:
    # {"frames": [JPEG bytes, ...], "fps": the rate they were sampled at}. A worker of an
    # older version ignores the field.
    videos: list[dict] | None = None
    # Vision models whose family reads audio: each audio part as 16 kHz mono int16 PCM, in the
    # order of the {"type": "audio"} parts. A worker of an older version ignores the field.
    audio: list[bytes] | None = None
    # Per-token log-probabilities: None (none), or how many top alternatives each token's
    # entry lists (0-20). Only the sequences that ask pay for them.
    logprobs: int | None = None
    # Prompt logprobs (Completions' echo + logprobs): None, or how many top alternatives each
    # prompt token's entry lists (0-20). Scored by one extra forward pass over the prompt,
    # in bounded chunks between engine steps; sent as one PromptLogprobs event before the
    # first output.
    prompt_logprobs: int | None = None
    # Choices sampled from one prompt (prefilled once); choice i samples with seed + i.
    n: int = 1
    # A LoRA adapter of the worker's model (models.yaml `adapters`), by its name; None: the
    # base model. A worker of an older version ignores the field.
    adapter: str | None = None
    # Fill-in-the-middle (worker/text/fim.py): {"prefix", "suffix", "middle" (text after the middle
    # token, llama.cpp's `prompt`), "extra" ([[filename, text], ...]: other files as context),
    # "filename", "repo"}; set, the worker builds the prompt with the model's FIM tokens and
    # `prompt` is unused.
    fim: dict | None = None
    # A client's caching hint (Anthropic cache_control, OpenAI prompt_cache_retention): hold
    # this prompt's blocks in the prefix cache for this many seconds. None: no hint. A worker
    # of an older version ignores the field.
    cache_retention_s: float | None = None
    # The prefix-cache namespace the gateway gives the request (its key's cache group, narrowed
    # by a `cache_salt`): its prompt matches only blocks of the same namespace
    # (worker/model/cache/scopes.py). None: the base namespace (no keys). An opaque digest.
    cache_namespace: str | None = None
    # W3C trace context (`traceparent`, 00-<trace id>-<span id>-<flags>) of the gateway span
    # this request belongs to, when the gateway exports traces (gateway/pipeline/tracing.py);
    # set, the worker notes its queue, prefill and decode times and returns them with the
    # request's last event (shared/events.py TraceMarks' wire map). None: nothing is noted.
    traceparent: str | None = None
    # Where the gateway routes by prefix (a model with several workers): the tail of the
    # request's route chain (gateway/link/route_key.py), 16-byte entries, each covering the
    # prompt up to one message. The worker names the blocks it stores for the prompt by them
    # in its PREFIXES messages. None: one worker, nothing is reported.
    route: list[bytes] | None = None

    def to_wire(self) -> dict:
        return _plain(self)

    @classmethod
    def from_wire(cls, wire: dict) -> GenerateRequest:
        return _from_wire(cls, wire, sampling=SamplingParams)


@dataclass
class EmbedRequest:
    """Embeddings (inputs -> vectors) or reranking (query + inputs -> scores)."""

    WIRE_TYPE: ClassVar[str] = EMBED
    rid: str
    inputs: list = field(default_factory=list)  # strings or lists of token ids
    query: str | None = None  # set: rerank the inputs against it
    dimensions: int | None = None  # truncate vectors to this size, renormalised
    truncate: bool | None = None  # None: the model entry's setting
    priority: int = 0
    timeout_s: float | None = None

    def to_wire(self) -> dict:
        return _plain(self)

    @classmethod
    def from_wire(cls, wire: dict) -> EmbedRequest:
        return _from_wire(cls, wire)


@dataclass
class TranscribeRequest:
    """Speech to text: decoded audio (the gateway decodes uploads) and Whisper's options.
    The finish event carries segments (start, end, text, ...), language and duration."""

    WIRE_TYPE: ClassVar[str] = TRANSCRIBE
    rid: str
    audio: bytes = b""  # 16 kHz mono int16 little-endian PCM
    task: str = "transcribe"  # or "translate" (to English)
    language: str | None = None  # None: detected
    prompt: str | None = None
    temperature: float = 0.0  # 0: greedy with temperature fallback
    stream: bool = False  # text deltas as windows finish
    word_timestamps: bool = False  # the finish event also carries words: [{word, start, end}]
    priority: int = 0
    timeout_s: float | None = None

    def to_wire(self) -> dict:
        return _plain(self)

    @classmethod
    def from_wire(cls, wire: dict) -> TranscribeRequest:
        return _from_wire(cls, wire)


@dataclass
class SpeechRequest:
    """Text to speech; the finish event carries `audio` (int16 mono PCM) and `sample_rate`."""

    WIRE_TYPE: ClassVar[str] = SPEAK
    rid: str
    input: str = ""
    voice: str | None = None
    speed: float = 1.0
    priority: int = 0
    timeout_s: float | None = None

    def to_wire(self) -> dict:
        return _plain(self)

    @classmethod
    def from_wire(cls, wire: dict) -> SpeechRequest:
        return _from_wire(cls, wire)


@dataclass
class ImageRequest:
    """Text to image, or an edit of `image` (encoded bytes as uploaded; `mask`: a PNG whose
    transparent pixels mark what may change). The finish event carries `images`: PNG bytes,
    one per image; Progress events count the images done."""

    WIRE_TYPE: ClassVar[str] = DRAW
    rid: str
    prompt: str = ""
    n: int = 1
    width: int = 512
    height: int = 512
    steps: int | None = None  # None: the model's default
    guidance: float | None = None
    seed: int | None = None
    image: bytes | None = None
    mask: bytes | None = None
    priority: int = 0
    timeout_s: float | None = None

    def to_wire(self) -> dict:
        return _plain(self)

    @classmethod
    def from_wire(cls, wire: dict) -> ImageRequest:
        return _from_wire(cls, wire)


# Priority of background work (service_tier "flex", batch jobs): after every interactive
# request (whose priorities are -100..100), and the first to be preempted.
BACKGROUND_PRIORITY = 1000

# What the gateway submits to a worker: one of these per request.
WorkerRequest = GenerateRequest | EmbedRequest | TranscribeRequest | SpeechRequest | ImageRequest


Event = tuple[str, AnyEvent]  # (request id, event): the worker's link encodes it (worker/process/link.py)
