"""The gateway <-> worker wire protocol: msgpack maps over ZeroMQ, defined once.

Every message is a map with "v" (protocol version) and "t" (type). The gateway binds a
ROUTER socket; each worker connects a DEALER (so a worker may live on another host). Both
sides heartbeat; a peer silent for `liveness` intervals is dead (ZeroMQ Guide, Paranoid
Pirate). Workers announce the model they serve (Majordomo: service name = model name).

Request events travel in batches: one EVENTS message per engine step carries the deltas of
every running request, instead of one message per token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 1

# worker -> gateway
HELLO = "hello"  # worker_id, model, kind, pid, secret?  (re-sent when the gateway asks)
READY = "ready"  # model loaded: info = {context_length, max_num_seqs, max_queue, ...}
LOAD_FAILED = "load_failed"  # error = {code, message}
EVENTS = "events"  # items = [[rid, event], ...]
REPLY = "reply"  # cid, ok, result | error
BYE = "bye"
# gateway -> worker
WELCOME = "welcome"
GENERATE = "generate"  # request = GenerateRequest
EMBED = "embed"  # request = EmbedRequest (embedding and reranking workers)
TRANSCRIBE = "transcribe"  # request = TranscribeRequest (speech-to-text workers)
SPEAK = "speak"  # request = SpeechRequest (text-to-speech workers)
CANCEL = "cancel"  # rids = [...]
CALL = "call"  # cid, op, args  (tokenize, cache_stats, cache_clear, status)
SHUTDOWN = "shutdown"  # drain: bool
RECONNECT = "reconnect"  # "who are you?": the gateway lost track of this worker
# both
HEARTBEAT = "heartbeat"  # worker's carries stats

WORKER_TYPES = {HELLO, READY, LOAD_FAILED, EVENTS, REPLY, BYE, HEARTBEAT}
GATEWAY_TYPES = {WELCOME, GENERATE, EMBED, TRANSCRIBE, SPEAK, CANCEL, CALL, SHUTDOWN, RECONNECT, HEARTBEAT}

# Event kinds inside EVENTS.
EV_ACCEPTED = "accepted"  # prompt_tokens, max_tokens (after clamping), queue position
EV_PROGRESS = "progress"  # prefill progress: done, total  (gateway sends SSE keep-alives)
EV_DELTA = "delta"  # text, n (completion tokens so far); later: reasoning, tool_calls
EV_FINISH = "finish"  # reason, text (tail), stop (matched stop string), usage
#   embeddings: vectors (float32 little-endian, row-major bytes), dim; rerank: scores
EV_ERROR = "error"  # code, message: the request is over


class ProtocolError(ValueError):
    pass


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
        raise ProtocolError(f"protocol version {msg.get('v')!r} != {PROTOCOL_VERSION}")
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


def _from_wire(cls, wire: dict, **nested: type):
    """Build a request dataclass from its wire map, ignoring fields this version does not know
    (a newer gateway may send more)."""
    known = {f.name for f in fields(cls)}
    data = {k: v for k, v in wire.items() if k in known}
    for name, tp in nested.items():
        inner = data.pop(name, None) or {}
        inner_known = {f.name for f in fields(tp)}
        data[name] = tp(**{k: v for k, v in inner.items() if k in inner_known})
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
    timeout_s: float | None = None
    # Constrained decoding: {"type": "json_schema", "schema": {...}} | {"type": "json_object"}
    # | {"type": "regex", "pattern": ...} | {"type": "lark", "grammar": ...}
    constraint: dict | None = None
    reasoning_budget: int | None = None  # reasoning tokens before the end of thinking is forced
    echo: bool = False  # completions: prepend the prompt text to the output
    # Vision models: the encoded images (PNG, JPEG, ...), in the order of the {"type": "image"}
    # parts of the messages.
    images: list[bytes] | None = None

    def to_wire(self) -> dict:
        return asdict(self)

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
        return asdict(self)

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
        return asdict(self)

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
        return asdict(self)

    @classmethod
    def from_wire(cls, wire: dict) -> SpeechRequest:
        return _from_wire(cls, wire)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
