"""Worker events are decoded once, at the broker, into shared/events.py's dataclasses, and the
wire enums are byte for byte the strings they replace."""

from __future__ import annotations

import json

import msgpack
import pytest

from mlxgw.shared import protocol as p
from mlxgw.shared.config import parse_registry
from mlxgw.shared.errors import ErrorCode, ServiceError
from mlxgw.shared.events import (
    Accepted,
    Delta,
    Error,
    EventKind,
    Finish,
    FinishReason,
    Phase,
    Progress,
    PromptLogprobs,
    Usage,
    error_event,
    event_from_wire,
)
from mlxgw.shared.model_sections import KINDS, ModelKind
from mlxgw.shared.schema import ConfigError

EVENTS = [
    Accepted(prompt_tokens=5, max_tokens=16, queued=1),
    Progress(done=512, total=2048, cached=64),
    Delta("hi", 3),
    Delta("x", 4, reasoning="r", tool_calls=[{"name": "f", "arguments": "{}"}], index=1, cached=2),
    PromptLogprobs(entries=[{"token": "a", "bytes": [97], "logprob": None, "top_logprobs": None}]),
    Finish(FinishReason.LENGTH, Usage(5, 16, 2), text="!", stop=None, time_limited=True),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_decodes_from_its_wire_map_into_the_same_dataclass(event):
    wire = msgpack.unpackb(msgpack.packb(event.to_wire()), raw=False, strict_map_key=False)
    assert event_from_wire(wire) == event


def test_an_error_event_decodes_into_its_service_error_and_usage():
    wire = error_event(ServiceError(ErrorCode.TIMEOUT, "too slow", retry_after=2.0), Usage(3, 1))
    event = event_from_wire(wire)
    assert isinstance(event, Error) and event.error.code is ErrorCode.TIMEOUT
    assert event.error.message == "too slow" and event.error.retry_after == 2.0 and event.usage == Usage(3, 1)


def test_an_unknown_event_kind_is_not_an_event():
    assert event_from_wire({"e": "telepathy", "text": "hi"}) is None


def test_missing_and_wrong_typed_fields_read_as_their_defaults():
    assert event_from_wire({"e": "delta", "text": 5, "n": "x", "cached": 3}) == Delta("", 0, cached=3)
    finish = event_from_wire({"e": "finish"})
    assert finish == Finish(FinishReason.STOP, None)  # no usage: the gateway keeps its own count


def test_a_finish_with_an_unknown_reason_ends_the_request_with_an_error_saying_so():
    event = event_from_wire({"e": "finish", "reason": "bored", "usage": {"completion_tokens": 2}})
    assert isinstance(event, Error) and event.error.code is ErrorCode.INTERNAL
    assert "'bored'" in event.error.message and event.usage.completion_tokens == 2
    bad_choice = {"e": "finish", "reason": "stop", "choices": [{"index": 0, "reason": "?"}]}
    assert isinstance(event_from_wire(bad_choice), Error)


def test_choice_ends_are_typed_and_a_single_choice_has_one():
    wire = {"e": "finish", "reason": "stop", "choices": [{"index": 1, "reason": "length", "stop": None}]}
    assert event_from_wire(wire).ends() == [{"index": 1, "reason": FinishReason.LENGTH, "stop": None}]
    assert Finish("stop", Usage(), stop="END").ends() == [{"index": 0, "reason": "stop", "stop": "END"}]


@pytest.mark.parametrize("member", [*EventKind, *FinishReason, *Phase, *ModelKind], ids=str)
def test_wire_enums_encode_exactly_as_their_strings(member):
    value = member.value
    assert type(value) is str and member == value and hash(member) == hash(value)
    assert str(member) == f"{member}" == value and json.dumps({"k": member}) == json.dumps({"k": value})
    assert msgpack.packb(member) == msgpack.packb(value)


def test_event_kind_names_are_the_enum_members_defined_once():
    assert EventKind.DELTA is EventKind.DELTA and EventKind.FINISH is EventKind.FINISH
    assert Delta.KIND is EventKind.DELTA and Finish("stop", Usage()).to_wire()["e"] == "finish"


def test_a_model_kind_parses_into_the_enum_and_a_typo_is_refused_as_before(tmp_path):
    reg = parse_registry({"models": [{"name": "e", "kind": "embedding"}]}, tmp_path / "models.yaml")
    assert reg.models[0].kind is ModelKind.EMBEDDING
    with pytest.raises(ConfigError, match=f"must be one of {', '.join(KINDS)}, got 'chatt'"):
        parse_registry({"models": [{"name": "c", "kind": "chatt"}]}, tmp_path / "models.yaml")


WIRE_EVENTS = [
    *EVENTS,
    Finish(
        "stop",
        Usage(3, 2),
        text="",
        vectors=b"\x00\x01",
        dim=1,
        choices=[{"index": 0, "reason": "stop", "stop": None}],
    ),
    Error(ServiceError(ErrorCode.TIMEOUT, "too slow", retry_after=2.0), Usage(3, 1)),
    Error(ServiceError(ErrorCode.INVALID_REQUEST, "bad", param="n")),
]


@pytest.mark.parametrize("event", WIRE_EVENTS, ids=lambda e: type(e).__name__)
def test_the_worker_link_encodes_a_typed_event_into_the_frame_its_wire_map_made(event):
    """Schedulers hand the link dataclasses; the EVENTS frame is byte for byte the one the
    wire maps built where the events were made gave (the gateway reads the same bytes)."""
    from mlxgw.worker.process.link import encode_events

    old = p.encode(p.EVENTS, items=[("r1", event.to_wire()), ("r2", Delta("x", 1).to_wire())], seq=7)
    assert encode_events(items=[("r1", event), ("r2", Delta("x", 1))], seq=7) == old


def test_choices_merge_typed_events_into_the_maps_the_dict_merge_sent():
    from mlxgw.worker.schedule.choices import ChoiceGroups

    groups = ChoiceGroups()
    groups.expand(p.GenerateRequest(rid="r", prompt="hi", n=2))
    events = [
        ("r#0", Accepted(2, 4, 1)),
        ("r#1", Accepted(2, 4, 2)),
        ("r#1", Delta("b", 1)),
        ("r#0", Finish("length", Usage(2, 3, 1), text="a")),
        ("r#1", Finish(FinishReason.STOP, Usage(2, 2, 1), text="", stop="END")),
    ]
    merged, cancel = groups.merge(events)
    assert cancel == [] and all(rid == "r" for rid, _ in merged)
    assert [ev.to_wire() for _, ev in merged] == [
        {"e": "accepted", "prompt_tokens": 2, "max_tokens": 4, "queued": 1},
        {"e": "delta", "text": "b", "n": 1, "index": 1},
        {"e": "delta", "text": "a", "n": 4, "index": 0},
        {
            "e": "finish",
            "reason": "length",
            "usage": {"prompt_tokens": 2, "completion_tokens": 5, "cached_tokens": 1},
            "text": "",
            "choices": [{"index": 0, "reason": "length", "stop": None}, {"index": 1, "reason": "stop", "stop": "END"}],
        },
    ]
