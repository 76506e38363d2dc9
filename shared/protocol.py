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
from dataclasses import asdict, dataclass, field, fields
from types import UnionType
from typing import Any, ClassVar, Union, get_args, get_origin, get_type_hints

import msgpack

from .errors import ServiceError

PROTOCOL_VERSION = 1

# worker -> gateway
HELLO = "hello"  # worker_id, model, kind, pid, secret?  (re-sent when the gateway asks)
READY = "ready"  # model loaded: info = {context_length, max_num_seqs, max_queue, ...}
LOAD_FAILED = "load_failed"  # error = {code, message}
# A worker's exit status when its model cannot be loaded at all (a config it cannot build, a
# missing field, an unknown architecture): the gateway marks the model failed at once rather
# than restarting into the same error (sysexits' EX_CONFIG).
EXIT_UNSERVABLE = 78
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

# Event kinds inside EVENTS (each built by its dataclass below, never by hand).
EV_ACCEPTED = "accepted"
EV_PROGRESS = "progress"
EV_DELTA = "delta"
EV_PROMPT_LOGPROBS = "prompt_logprobs"
EV_FINISH = "finish"
EV_ERROR = "error"


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


_SCALARS = {int: (int,), float: (int, float), str: (str,), bool: (bool,), bytes: (bytes,), dict: (dict,)}


@functools.cache
def _shape(tp: object) -> tuple:
    return get_origin(tp), get_args(tp)


# Item types whose exact Python type msgpack decodes to: a list of exactly these conforms
# without a call per item (a long prompt_tokens list has thousands).
_EXACT_ITEMS = {int: int, str: str, bytes: bytes, dict: dict}


def _conforms(value: object, tp: object) -> bool:
    """Whether a decoded wire value has the declared type (ints, floats, strings, bools, bytes,
    dicts, lists of those, optionals). bool is not an int here."""
    origin, args = _shape(tp)
    if origin in (Union, UnionType):
        if value is None:  # most optional fields of a request are unset
            return type(None) in args
        return any(_conforms(value, arg) for arg in args)
    if tp is type(None):
        return value is None
    if origin is list:
        (item,) = args or (object,)
        if not isinstance(value, list):
            return False
        exact = _EXACT_ITEMS.get(item)
        if exact is not None and set(map(type, value)) <= {exact}:
            return True
        return all(_conforms(v, item) for v in value)
    if origin is dict:
        key, item = args or (object, object)
        return isinstance(value, dict) and all(_conforms(k, key) and _conforms(v, item) for k, v in value.items())
    if tp is object or tp is Any:
        return True
    if tp in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, _SCALARS.get(tp, (tp,)))  # type: ignore[arg-type]


@functools.cache
def _type_hints(cls) -> dict:
    return get_type_hints(cls)  # resolving string annotations costs more than a request's decoding


@functools.cache
def _field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


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
    # Fair share (worker/fair_share.py): who sent it, as a stable hash of the API key (never
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


# -- events (worker -> gateway, inside EVENTS as [request id, event map]) -----------------


def _int(value: object) -> int:
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0


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


# Priority of background work (service_tier "flex", batch jobs): after every interactive
# request (whose priorities are -100..100), and the first to be preempted.
BACKGROUND_PRIORITY = 1000

# What the gateway submits to a worker: one of these per request.
WorkerRequest = GenerateRequest | EmbedRequest | TranscribeRequest | SpeechRequest


@dataclass
class Usage:
    """Token counts of one request: built by the worker, read by the gateway, one type."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, wire: object) -> Usage:
        """Tolerant: a missing or malformed count reads as 0 (a worker bug must not 500 a reply)."""
        if not isinstance(wire, dict):
            return cls()
        return cls(*(_int(wire.get(f.name, 0)) for f in fields(cls)))


def _wire(kind: str, event: object, omit_none: bool = True) -> dict:
    out: dict = {"e": kind}
    for name in _field_names(type(event)):
        value = getattr(event, name)
        if isinstance(value, Usage):
            value = value.to_wire()
        if value is not None or not omit_none:
            out[name] = value
    return out


@dataclass
class Accepted:
    """The request is admitted to the worker's queue (the first event of every request)."""

    prompt_tokens: int
    max_tokens: int  # after clamping to the context (0 for embeddings)
    queued: int  # requests waiting ahead, this one included

    def to_wire(self) -> dict:
        return _wire(EV_ACCEPTED, self)


@dataclass
class Progress:
    """Prefill progress of a long prompt (the gateway sends keep-alives meanwhile)."""

    done: int
    total: int
    cached: int | None = None  # prompt tokens served by the prefix cache (for the access log of a cut stream)

    def to_wire(self) -> dict:
        return _wire(EV_PROGRESS, self)


@dataclass
class Delta:
    """New output of a running request."""

    text: str
    n: int  # completion tokens so far
    reasoning: str | None = None
    tool_calls: list[dict] | None = None
    # One entry per generated token when the request asked for logprobs:
    # {token, bytes, logprob, top_logprobs: [{token, bytes, logprob}]} (OpenAI Chat's shape).
    logprobs: list[dict] | None = None
    index: int | None = None  # the choice this output belongs to (n > 1); None: choice 0
    # Prompt tokens served by the prefix cache, on a request's first delta: a stream cut
    # before its finish event is still logged and billed with them.
    cached: int | None = None

    def to_wire(self) -> dict:
        return _wire(EV_DELTA, self)


@dataclass
class PromptLogprobs:
    """The prompt's log-probabilities (the request asked: prompt_logprobs), once, before
    the first output: one entry per prompt token in Delta's entry shape, except the first
    token's, which has nothing before it: {token, bytes, logprob: None, top_logprobs: None}.
    Values are the raw model's log-softmax (no penalties or biases apply to a prompt)."""

    entries: list[dict]

    def to_wire(self) -> dict:
        return _wire(EV_PROMPT_LOGPROBS, self)


@dataclass
class Finish:
    """The request is over: the last output, why it stopped, and its usage.
    Embeddings carry vectors (float32 little-endian, row-major) and dim; rerank carries scores;
    transcriptions carry segments (words when asked), language and duration; speech carries
    audio (int16 mono PCM) and sample_rate."""

    reason: str  # stop | length | tool_calls | cancelled
    usage: Usage
    text: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict] | None = None
    stop: str | None = None  # the stop string that ended the text
    vectors: bytes | None = None
    dim: int | None = None
    scores: list[float] | None = None
    logprobs: list[dict] | None = None  # entries of the last tokens, as in Delta
    # n > 1: every choice's end, [{index, reason, stop}]; reason/stop above are choice 0's.
    # A choice's last output comes before, as a Delta with its index.
    choices: list[dict] | None = None
    segments: list[dict] | None = None
    words: list[dict] | None = None
    language: str | None = None
    duration: float | None = None
    audio: bytes | None = None
    sample_rate: int | None = None
    # reason "length" because the answer's time bound ran out (not max_tokens): the text so
    # far is the answer, cut (gateway.request_timeout_s)
    time_limited: bool | None = None

    def to_wire(self) -> dict:
        return _wire(EV_FINISH, self)


@dataclass
class Error:
    """The request is over with an error: code, message, and the usage so far when known."""

    error: ServiceError
    usage: Usage | None = None

    def to_wire(self) -> dict:
        wire = {"e": EV_ERROR, **self.error.to_wire()}
        if self.usage is not None:
            wire["usage"] = self.usage.to_wire()
        return wire


def error_event(error: ServiceError, usage: Usage | None = None) -> dict:
    """The wire map of an error event: the one way to end a request with an error."""
    return Error(error, usage).to_wire()


Event = tuple[str, dict]  # (request id, wire event)
