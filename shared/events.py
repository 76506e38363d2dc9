"""Request events (worker -> gateway, inside EVENTS as [request id, event map]) and the wire
enums: each event is a dataclass the worker builds and sends with `to_wire`, and the gateway
decodes once with `event_from_wire` into the same dataclass, then reads attributes, never keys.

Enums are `str` enums: a member compares, hashes, msgpacks and JSON-encodes as its value,
so the wire and every API's output stay byte for byte what plain strings gave.

Decoding is tolerant where the gateway always was (a worker is another process, maybe another
host): a missing or wrong-typed field reads as its default, and a stream still ends exactly
once. A kind this version does not know is malformed (the broker counts and drops it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import ClassVar

from .errors import ErrorCode, ServiceError
from .wire_types import conforms, field_names, type_hints


class WireEnum(str, Enum):
    """A wire value with a name: str() and format() give the value on every Python version
    (3.12 changed format() of mixed-in enums to the member's name)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return self.value.__format__(spec)


class EventKind(WireEnum):
    """The "e" of an event map."""

    ACCEPTED = "accepted"
    PROGRESS = "progress"
    DELTA = "delta"
    PROMPT_LOGPROBS = "prompt_logprobs"
    FINISH = "finish"
    ERROR = "error"


class FinishReason(WireEnum):
    """Why a request (or one of its choices) ended; each API maps it to its own word."""

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    CANCELLED = "cancelled"


class Phase(WireEnum):
    """Where a request is in a worker, as its status (`/v1/status` requests) reports it."""

    PREPARING = "preparing"  # chat template, images, constraints: before the scheduler has it
    QUEUED = "queued"
    SCORING = "scoring"  # prompt logprobs being computed
    PREFILL = "prefill"
    DECODE = "decode"  # generating (a speech-to-text worker: decoding audio windows)
    ENCODE = "encode"  # embedding and rerank workers
    SPEAK = "speak"  # text-to-speech workers
    DRAW = "draw"  # image workers
    DONE = "done"  # its last event is made (gone from the status the same step)


def _int(value: object) -> int:
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0


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
    for name in field_names(type(event)):
        value = getattr(event, name)
        if isinstance(value, Usage):
            value = value.to_wire()
        if value is not None or not omit_none:
            out[name] = value
    return out


def _fields_from_wire(cls, wire: dict, defaults: dict, typed: tuple[str, ...] = ()) -> dict:
    """The declared fields of `cls` in `wire` that have their declared type; `defaults` fill
    the required ones missing or malformed (the gateway's reading of a careless worker).
    `typed`: fields the caller decodes itself (usage, an enum)."""
    hints = type_hints(cls)
    data = dict(defaults)
    for name, value in wire.items():
        tp = hints.get(name)
        if tp is not None and name not in typed and conforms(value, tp):
            data[name] = value
    return data


@dataclass(slots=True)
class Accepted:
    """The request is admitted to the worker's queue (the first event of every request)."""

    KIND: ClassVar[EventKind] = EventKind.ACCEPTED
    prompt_tokens: int
    max_tokens: int  # after clamping to the context (0 for embeddings)
    queued: int  # requests waiting ahead, this one included

    def to_wire(self) -> dict:
        return _wire(EventKind.ACCEPTED, self)

    @classmethod
    def from_wire(cls, wire: dict) -> Accepted:
        return cls(**_fields_from_wire(cls, wire, {"prompt_tokens": 0, "max_tokens": 0, "queued": 0}))


@dataclass(slots=True)
class Progress:
    """Prefill progress of a long prompt (the gateway sends keep-alives meanwhile)."""

    KIND: ClassVar[EventKind] = EventKind.PROGRESS
    done: int
    total: int
    cached: int | None = None  # prompt tokens served by the prefix cache (for the access log of a cut stream)

    def to_wire(self) -> dict:
        return _wire(EventKind.PROGRESS, self)

    @classmethod
    def from_wire(cls, wire: dict) -> Progress:
        return cls(**_fields_from_wire(cls, wire, {"done": 0, "total": 0}))


@dataclass(slots=True)
class Delta:
    """New output of a running request."""

    KIND: ClassVar[EventKind] = EventKind.DELTA
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
        return _wire(EventKind.DELTA, self)

    @classmethod
    def from_wire(cls, wire: dict) -> Delta:
        return cls(**_fields_from_wire(cls, wire, {"text": "", "n": 0}))


@dataclass(slots=True)
class PromptLogprobs:
    """The prompt's log-probabilities (the request asked: prompt_logprobs), once, before
    the first output: one entry per prompt token in Delta's entry shape, except the first
    token's, which has nothing before it: {token, bytes, logprob: None, top_logprobs: None}.
    Values are the raw model's log-softmax (no penalties or biases apply to a prompt)."""

    KIND: ClassVar[EventKind] = EventKind.PROMPT_LOGPROBS
    entries: list[dict]

    def to_wire(self) -> dict:
        return _wire(EventKind.PROMPT_LOGPROBS, self)

    @classmethod
    def from_wire(cls, wire: dict) -> PromptLogprobs:
        return cls(**_fields_from_wire(cls, wire, {"entries": []}))


@dataclass(slots=True)
class Finish:
    """The request is over: the last output, why it stopped, and its usage.
    Embeddings carry vectors (float32 little-endian, row-major) and dim; rerank carries scores;
    transcriptions carry segments (words when asked), language and duration; speech carries
    audio (int16 mono PCM) and sample_rate; images carry PNGs."""

    KIND: ClassVar[EventKind] = EventKind.FINISH
    # A finish's own output (text, logprobs) is choice 0's: read like a Delta's index.
    index: ClassVar[None] = None
    reason: FinishReason  # the worker may pass the plain string; from_wire gives the member
    usage: Usage | None  # None only when a worker sent none (the gateway keeps its own count)
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
    images: list[bytes] | None = None  # image workers: one PNG per image
    # reason "length" because the answer's time bound ran out (not max_tokens): the text so
    # far is the answer, cut (gateway.request_timeout_s)
    time_limited: bool | None = None
    # The worker's times of a traced request (its GenerateRequest had a traceparent):
    # {parent, arrived, queued, admitted, first_token, end (wall-clock ns), steps}; the gateway
    # makes the worker's spans of them (gateway/pipeline/worker_spans.py). None: not traced.
    trace: dict | None = None

    def to_wire(self) -> dict:
        return _wire(EventKind.FINISH, self)

    @classmethod
    def from_wire(cls, wire: dict) -> Finish | Error:
        """An unknown reason (or choice reason) ends the request with an error that says so:
        the stream still ends once, and nothing guesses what the worker meant."""
        data = _fields_from_wire(cls, wire, {"reason": FinishReason.STOP}, ("reason", "usage"))
        data["usage"] = Usage.from_wire(wire["usage"]) if "usage" in wire else None
        try:
            if "reason" in wire:
                data["reason"] = FinishReason(wire["reason"])
            if data.get("choices") is not None:
                data["choices"] = [_choice_end(end) for end in data["choices"]]
        except (ValueError, TypeError, KeyError):
            message = f"the worker ended the request with a malformed finish ({wire.get('reason')!r})"
            return Error(ServiceError(ErrorCode.INTERNAL, message), data["usage"])
        return cls(**data)

    def ends(self) -> list[dict]:
        """Every choice's end ({index, reason, stop}); one entry for a single choice."""
        return self.choices or [{"index": 0, "reason": self.reason, "stop": self.stop}]


def _choice_end(end: dict) -> dict:
    return {"index": int(end["index"]), "reason": FinishReason(end["reason"]), "stop": end.get("stop")}


@dataclass(slots=True)
class Error:
    """The request is over with an error: code, message, and the usage so far when known."""

    KIND: ClassVar[EventKind] = EventKind.ERROR
    error: ServiceError
    usage: Usage | None = None
    trace: dict | None = None  # as Finish's: the worker's times of a traced request

    def to_wire(self) -> dict:
        wire = {"e": EventKind.ERROR, **self.error.to_wire()}
        if self.usage is not None:
            wire["usage"] = self.usage.to_wire()
        if self.trace is not None:
            wire["trace"] = self.trace
        return wire

    @classmethod
    def from_wire(cls, wire: dict) -> Error:
        usage = Usage.from_wire(wire["usage"]) if "usage" in wire else None
        trace = wire.get("trace")
        return cls(ServiceError.from_wire(wire), usage, trace if isinstance(trace, dict) else None)


def error_event(error: ServiceError, usage: Usage | None = None) -> dict:
    """The wire map of an error event: the one way to end a request with an error."""
    return Error(error, usage).to_wire()


# Every event the gateway reads, decoded.
AnyEvent = Accepted | Progress | Delta | PromptLogprobs | Finish | Error
TERMINAL_EVENTS = (Finish, Error)

_DECODERS = {cls.KIND.value: cls.from_wire for cls in (Accepted, Progress, Delta, PromptLogprobs, Finish, Error)}


def event_from_wire(wire: dict) -> AnyEvent | None:
    """One event map as its dataclass; None for a kind this version does not know."""
    kind = wire.get("e")
    if kind == "delta":  # the hot path (one per engine step and stream): no lookups, no checks per field
        text, n = wire.get("text"), wire.get("n")
        if len(wire) == 3 and type(text) is str and type(n) is int:
            return Delta(text, n)
        return Delta.from_wire(wire)
    decode = _DECODERS.get(kind)  # type: ignore[arg-type]
    return decode(wire) if decode is not None else None
