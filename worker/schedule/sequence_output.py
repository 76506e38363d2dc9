"""What a sequence's tokens become on the wire: Delta, Finish and PromptLogprobs events.

The runner hands back one token per decoding row per step; this module turns them into the
protocol's events with no runner in sight (tests drive it with plain token ids):
- text goes through the sequence's TextStream (detokenizing, stop strings) and its output
  parser (reasoning, tool calls); a stop string or an end-of-sequence token ends the answer,
  and the end-of-sequence token itself is not part of it (no text, no usage, no logprob);
- output is held until `stream_interval` tokens have accumulated; the first Delta carries
  the prompt's cached token count;
- a Finish carries what is still unsent, the usage and the finish reason ("tool_calls" when
  the parser saw one and the model stopped by itself);
- a time limit after tokens were generated finishes the answer with them (reason length,
  marked time_limited): the generated tokens are the answer, not a timeout; before the first
  token, the bound on queue + prompt processing grows with the prompt on a slow host.
The caller (worker/schedule/scheduler.py) frees the row and counts the request done."""

from __future__ import annotations

import logging
import time
from collections import deque

from ...shared.errors import ErrorCode, ServiceError
from ...shared.events import Delta, Error, Finish, FinishReason, Progress, PromptLogprobs
from ..text.output_parser import Parsed
from .prefill_plan import prefill_bound
from .sequence import Phase, Sequence, prefill_timeout

log = logging.getLogger(__name__)


def parts(parsed: Parsed) -> dict:
    """The non-empty parts of a delta: text always (possibly empty), the rest when present."""
    return {"text": parsed.text, "reasoning": parsed.reasoning or None, "tool_calls": parsed.tool_calls or None}


def on_token(
    seq: Sequence, token: int, finish: str | None, logprobs: dict | None = None
) -> tuple[Delta | Finish | None, bool]:
    """(the event this token makes, or None while output is held; whether it ended seq).
    finish: the runner's reason ("stop": an end-of-sequence token, "length"), or None."""
    if seq.first_token_at is None:
        seq.first_token_at = time.monotonic()
        seq.phase = Phase.DECODE
        # The prefill bound is over; the generation gets its own, from now.
        seq.deadline = seq.first_token_at + seq.req.timeout_s if seq.req.timeout_s else None
    if finish == "stop":  # end-of-sequence token: not part of the answer
        text = seq.text.finish()
    else:
        seq.generated += 1
        seq.tokens.append(token)
        if logprobs is not None:  # the end-of-sequence token above is not part of the answer
            seq.unsent_logprobs.append(logprobs)
        text = seq.text.push(token)
        if seq.text.stopped:
            finish = FinishReason.STOP
        elif finish == FinishReason.LENGTH:
            text += seq.text.finish()
    _feed(seq, text)
    seq.unsent_tokens += 1
    if finish is not None:
        return _finish(seq, finish), True
    if seq.unsent_tokens >= max(1, seq.req.stream_interval) and seq.unsent:
        return _delta(seq), False
    return None, False


def on_progress(seq: Sequence, done: int, total: int) -> Progress | None:
    """The Progress event of a prompt being read (None for a resumed row: its client saw
    its prompt done already)."""
    if done >= total or seq.tokens:
        return None
    seq.phase = Phase.PREFILL
    seq.prefilled = done
    return Progress(done, total, seq.cached_tokens or None)


def on_deadline(seq: Sequence, now: float, tokens_per_s: float | None) -> Finish | Error | None:
    """The event that ends seq past its deadline (a Finish with the tokens it has, or a
    timeout error), or None while a long prompt's bound, scaled to this host, holds."""
    if seq.generated > 0:  # a time limit ends the answer, not the request
        return finish_at_time_limit(seq)
    if seq.first_token_at is None:
        bound = prefill_bound(len(seq.prompt), prefill_timeout(seq.req), tokens_per_s)
        if now < seq.arrived + bound:
            return None
        why = f"no first token within {bound:g} s (queue and prompt processing)"
    else:
        why = f"the answer took over {seq.req.timeout_s:g} s ({seq.generated} tokens generated)"
    return Error(ServiceError(ErrorCode.TIMEOUT, f"request timed out: {why}"), seq.usage())


def finish_at_time_limit(seq: Sequence) -> Finish:
    """The Finish of an answer whose time bound ran out after tokens were generated: they
    are the answer, finished with reason length (the client's usual "cut short")."""
    _feed(seq, seq.text.finish())
    if seq.parser:
        seq.unsent.extend(seq.parser.finish())
    log.info(
        "%s: answer time limit of %g s reached after %d tokens; finished with them",
        seq.req.rid,
        seq.req.timeout_s,
        seq.generated,
    )
    seq.phase = Phase.DONE
    end = Finish(FinishReason.LENGTH, seq.usage(), logprobs=take_logprobs(seq), time_limited=True, **parts(seq.unsent))
    return end


def take_logprobs(seq: Sequence) -> list[dict] | None:
    """The logprobs not sent yet (None when the request did not ask for them)."""
    if seq.req.logprobs is None:
        return None
    taken, seq.unsent_logprobs = seq.unsent_logprobs, []
    return taken


def _feed(seq: Sequence, text: str) -> None:
    if text:
        seq.unsent.extend(seq.parser.feed(text) if seq.parser else Parsed(text=text))


def _finish(seq: Sequence, finish: str) -> Finish:
    parser = seq.parser
    if parser:
        seq.unsent.extend(parser.finish())
        if parser.saw_tool_calls and finish == FinishReason.STOP:
            finish = FinishReason.TOOL_CALLS
    seq.phase = Phase.DONE
    end = Finish(finish, seq.usage(), stop=seq.text.stop_match, logprobs=take_logprobs(seq), **parts(seq.unsent))
    return end


def _delta(seq: Sequence) -> Delta:
    cached = None if seq.sent_delta else seq.cached_tokens or None
    delta = Delta(n=seq.generated, logprobs=take_logprobs(seq), cached=cached, **parts(seq.unsent))
    seq.sent_delta = True
    seq.unsent = Parsed()
    seq.unsent_tokens = 0
    return delta


class PromptScoring:
    """The requests whose prompt logprobs are computed (worker/model/runners/prompt_logprobs.py), oldest
    first, one chunk per engine step: the rows decoding meanwhile wait at most one chunk."""

    def __init__(self) -> None:
        self._rids: deque[str] = deque()

    def add(self, seq: Sequence) -> None:
        seq.phase = Phase.SCORING
        self._rids.append(seq.req.rid)

    def advance(self, seqs: dict[str, Sequence]) -> tuple[Sequence, PromptLogprobs | None, Exception | None] | None:
        """One chunk for the oldest request still scoring. Returns None while it is not done,
        else (its sequence, its PromptLogprobs event, None) once scored (it queues for a
        row), or (its sequence, None, the error) when scoring raised."""
        while self._rids:
            seq = seqs.get(self._rids[0])
            if seq is None or seq.scorer is None:  # cancelled or timed out meanwhile
                self._rids.popleft()
                continue
            try:
                if not seq.scorer.advance():
                    return None
            except Exception as e:
                self._rids.popleft()
                return seq, None, e
            self._rids.popleft()
            entries, seq.scorer = seq.scorer.entries, None
            seq.phase = Phase.QUEUED
            return seq, PromptLogprobs(entries), None
        return None
