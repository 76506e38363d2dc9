"""worker/schedule/sequence_output.py on its own: token ids in, the protocol's events out, no runner
and no scheduler. The sequences are the real ones (worker/schedule/sequence.py), prepared by the echo
engine's real text side: its byte detokenizer and its output parser (reasoning tags)."""

from __future__ import annotations

import time

from mlxgw.shared import protocol as p
from mlxgw.shared.events import EventKind
from mlxgw.worker.model.runners.null_runner import EchoRunner
from mlxgw.worker.schedule.intake import Preparing
from mlxgw.worker.schedule.sequence import Phase, Sequence
from mlxgw.worker.schedule.sequence_output import finish_at_time_limit, on_deadline, on_progress, on_token

EOS = 0  # the echo engine's end-of-sequence token (the runner says finish "stop" with it)


def _sequence(text: str = "hello", reasoning: str | None = None, **fields) -> Sequence:
    """A queued sequence whose prompt is `text` (the echo engine answers with it)."""
    runner = EchoRunner(reasoning_parser=reasoning)
    req = p.GenerateRequest(rid="r1", messages=[{"role": "user", "content": text}], **fields)
    (ready,) = Preparing(runner, "clamp", None).add(req)
    seq = Preparing(runner, "clamp", None).start(ready)
    assert isinstance(seq, Sequence) and seq.phase is Phase.QUEUED
    return seq


def _say(seq: Sequence, text: str, finish_last: str | None = None) -> list[tuple[dict | None, bool]]:
    ids = list(text.encode())
    return [on_token(seq, t, finish_last if i == len(ids) - 1 else None) for i, t in enumerate(ids)]


def test_each_token_is_a_delta_and_the_end_of_sequence_token_is_not_part_of_the_answer():
    seq = _sequence()
    seq.cached_tokens = 3
    outs = _say(seq, "hi!")
    assert seq.phase is Phase.DECODE and seq.first_token_at is not None
    deltas = [event for event, ended in outs]
    assert [d.text for d in deltas] == ["h", "i", "!"] and not any(ended for _, ended in outs)
    assert [d.n for d in deltas] == [1, 2, 3]
    assert deltas[0].cached == 3 and deltas[1].cached is None  # the first delta only
    event, ended = on_token(seq, EOS, "stop")
    assert ended and seq.phase is Phase.DONE
    assert event.KIND == EventKind.FINISH and event.reason == "stop" and event.text == ""
    assert event.usage.completion_tokens == 3 and seq.tokens == list(b"hi!")  # EOS not counted


def test_output_is_held_until_stream_interval_tokens_have_accumulated():
    seq = _sequence(stream_interval=4)
    outs = _say(seq, "abcdef")
    assert [event is None for event, _ in outs] == [True, True, True, False, True, True]
    assert outs[3][0].text == "abcd"
    event, ended = on_token(seq, EOS, "stop")
    assert ended and event.text == "ef"  # what was held goes out with the finish


def test_a_stop_string_ends_the_answer_before_it_and_is_reported():
    seq = _sequence(stop=["lo w"])
    outs = []
    for token in b"hello world":
        outs.append(on_token(seq, token, None))
        if outs[-1][1]:
            break
    assert len(outs) == 7  # "hello w": the token that completed "lo w" ended it
    event = outs[-1][0]
    assert event.reason == "stop" and event.stop == "lo w" and seq.phase is Phase.DONE
    assert "".join(e.text for e, _ in outs if e) == "hel"  # nothing of the stop string is sent


def test_max_tokens_finishes_with_reason_length_and_the_held_text():
    seq = _sequence(stop=["zz"])
    outs = _say(seq, "abz", finish_last="length")
    event, ended = outs[-1]
    assert ended and event.reason == "length"
    assert "".join(e.text for e, _ in outs if e) == "abz"  # the held "z" is released at the end


def test_reasoning_is_split_from_the_answer():
    seq = _sequence(reasoning="think")
    outs = _say(seq, "<think>plan</think>done")
    event, _ = on_token(seq, EOS, "stop")
    reasoning = "".join((e.reasoning or "") for e, _ in [*outs, (event, True)] if e)
    text = "".join((e.text or "") for e, _ in [*outs, (event, True)] if e)
    assert reasoning == "plan" and text == "done"


def test_a_time_limit_after_tokens_finishes_with_them():
    seq = _sequence(stream_interval=100, timeout_s=5.0)
    _say(seq, "abc")
    event = on_deadline(seq, time.monotonic() + 10, tokens_per_s=None)
    assert event.KIND == EventKind.FINISH and event.reason == "length" and event.time_limited is True
    assert event.text == "abc" and event.usage.completion_tokens == 3 and seq.phase is Phase.DONE
    assert finish_at_time_limit(_sequence()).text == ""  # nothing generated: nothing to send


def test_no_first_token_within_the_bound_is_a_timeout_unless_this_host_reads_slowly():
    seq = _sequence(timeout_s=1.0)
    later = seq.arrived + 2.0
    assert on_deadline(seq, later, tokens_per_s=0.5) is None  # its prompt needs longer here
    event = on_deadline(seq, later, tokens_per_s=None)
    assert event.KIND == EventKind.ERROR and event.error.code == "timeout" and "no first token" in event.error.message


def test_progress_is_reported_while_reading_the_prompt_and_not_for_a_resumed_row():
    seq = _sequence()
    assert on_progress(seq, 2, 5).done == 2 and seq.phase is Phase.PREFILL and seq.prefilled == 2
    assert on_progress(seq, 5, 5) is None
    seq.tokens = [1]  # a paused row that resumed: its client saw its prompt done
    assert on_progress(seq, 2, 5) is None
