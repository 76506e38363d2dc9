"""Admission and lifecycle policy for one model's requests (the runner executes).

- bounded waiting queue (`max_queue`): past it a request is refused as overloaded;
- at most `max_num_seqs` sequences run; new ones are admitted at step boundaries, by
  (priority, arrival): first come, first served within a priority;
- a request ends exactly once: finish (stop / length / cancelled) or error (timeout, ...);
  cancelled and timed-out sequences leave the runner, and so free their KV, at once.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from mlxgw.shared import protocol as p
from mlxgw.shared.errors import ErrorCode, ServiceError

from .output_parser import OutputParser, Parsed
from .runner import Runner, ThinkingBudget, check_budget
from .textstream import TextStream

Event = tuple[str, dict]  # (request id, event)


def _fields(parsed: Parsed) -> dict:
    """The non-empty parts of a delta: text always (possibly empty), the rest when present."""
    out: dict = {"text": parsed.text}
    if parsed.reasoning:
        out["reasoning"] = parsed.reasoning
    if parsed.tool_calls:
        out["tool_calls"] = parsed.tool_calls
    return out


@dataclass
class Sequence:
    req: p.GenerateRequest
    prompt: list[int]
    max_tokens: int
    arrived: float
    deadline: float | None
    text: TextStream
    phase: str = "queued"  # queued -> prefill -> decode
    uid: int | None = None
    cached_tokens: int = 0
    generated: int = 0
    first_token_at: float | None = None
    parser: OutputParser | None = None  # splits reasoning and tool calls out of the text
    constraint: object | None = None  # logits processor enforcing a grammar
    unsent: Parsed = field(default_factory=Parsed)
    unsent_tokens: int = 0

    def usage(self) -> dict:
        return {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": self.generated,
            "cached_tokens": self.cached_tokens,
        }


class Scheduler:
    request_type = p.GenerateRequest

    def __init__(self, runner: Runner, *, max_num_seqs: int, max_queue: int, policy: str = "clamp"):
        self.runner = runner
        self.max_num_seqs = max_num_seqs
        self.max_queue = max_queue
        self.policy = policy
        self._seqs: dict[str, Sequence] = {}
        self._by_uid: dict[int, Sequence] = {}
        self._waiting: list[tuple[int, int, str]] = []
        self._arrivals = itertools.count()
        self.generated_tokens = 0  # lifetime counter, for tokens/s in stats
        self.finished = 0

    # -- intake ---------------------------------------------------------------------------
    def submit(self, req: p.GenerateRequest) -> list[Event]:
        try:
            if req.rid in self._seqs:
                raise ServiceError(ErrorCode.INVALID_REQUEST, f"duplicate request id {req.rid}")
            # Requests that free running slots will take at the next step are not waiting.
            free_slots = max(0, self.max_num_seqs - len(self._by_uid))
            if self.waiting >= self.max_queue + free_slots:
                raise ServiceError(
                    ErrorCode.OVERLOADED,
                    f"model is at capacity ({self.waiting} requests waiting); retry shortly",
                    retry_after=1.0,
                )
            prompt = self.runner.encode(req)
            if not prompt:
                raise ServiceError(ErrorCode.INVALID_REQUEST, "the prompt is empty", param="prompt")
            constraint = self.runner.make_constraint(req)
            parser = self.runner.make_parser(req, prompt)
            if req.reasoning_budget is not None and parser is not None and parser.think:
                budget = ThinkingBudget(parser, req.reasoning_budget, self.runner.encode_text(parser.think[1]))
                constraint = [budget] + ([constraint] if constraint else [])
            max_tokens = check_budget(
                len(prompt), req.max_tokens, self.runner.context_length, req.max_tokens_policy or self.policy
            )
        except ServiceError as e:
            return [(req.rid, {"e": p.EV_ERROR, **e.to_wire()})]
        now = time.monotonic()
        seq = Sequence(
            req=req,
            prompt=prompt,
            max_tokens=max_tokens,
            arrived=now,
            deadline=now + req.timeout_s if req.timeout_s else None,
            text=TextStream(self.runner.new_detokenizer(), req.stop),
            parser=parser,
            constraint=constraint,
        )
        self._seqs[req.rid] = seq
        heapq.heappush(self._waiting, (req.priority, next(self._arrivals), req.rid))
        accepted = {"e": p.EV_ACCEPTED, "prompt_tokens": len(prompt), "max_tokens": max_tokens, "queued": self.waiting}
        return [(req.rid, accepted)]

    def cancel(self, rid: str) -> list[Event]:
        seq = self._seqs.get(rid)
        if seq is None:
            return []
        return [self._end(seq, {"e": p.EV_FINISH, "reason": "cancelled", "text": "", "usage": seq.usage()})]

    # -- the step loop ---------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._seqs)

    def step(self) -> list[Event]:
        events = self._expire(time.monotonic())
        events += self._admit()
        if not self._by_uid:
            return events
        out = self.runner.step()
        for uid, done, total in out.prefill:
            seq = self._by_uid.get(uid)
            if seq is not None and done < total:
                seq.phase = "prefill"
                events.append((seq.req.rid, {"e": p.EV_PROGRESS, "done": done, "total": total}))
        for t in out.tokens:
            seq = self._by_uid.get(t.uid)
            if seq is not None:
                events.extend(self._on_token(seq, t.token, t.finish))
        return events

    def _admit(self) -> list[Event]:
        """Start waiting sequences while there is room. A sequence the runner refuses at
        admission (a vision model's images its vision tower cannot take) ends with an error;
        the runner has not taken it, so the others are unaffected."""
        events = []
        while self._waiting and len(self._by_uid) < self.max_num_seqs:
            _, _, rid = heapq.heappop(self._waiting)
            seq = self._seqs.get(rid)
            if seq is None or seq.uid is not None:
                continue  # cancelled while queued
            try:
                seq.uid, seq.cached_tokens = self.runner.insert(
                    seq.prompt, seq.max_tokens, seq.req.sampling, seq.constraint
                )
            except ServiceError as e:
                events.append(self._end(seq, {"e": p.EV_ERROR, **e.to_wire()}))
                continue
            seq.phase = "prefill"
            self._by_uid[seq.uid] = seq
        return events

    def _on_token(self, seq: Sequence, token: int, finish: str | None) -> list[Event]:
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
            seq.phase = "decode"
        if finish == "stop":  # end-of-sequence token: not part of the answer
            text = seq.text.finish()
        else:
            seq.generated += 1
            self.generated_tokens += 1
            text = seq.text.push(token)
            if seq.text.stopped:
                finish = "stop"
                self.runner.remove([seq.uid])
            elif finish == "length":
                text += seq.text.finish()
        parser = seq.parser
        if text:
            seq.unsent.extend(parser.feed(text) if parser else Parsed(text=text))
        seq.unsent_tokens += 1
        if finish is not None:
            if parser:
                seq.unsent.extend(parser.finish())
                if parser.saw_tool_calls and finish == "stop":
                    finish = "tool_calls"
            end = {
                "e": p.EV_FINISH,
                "reason": finish,
                **_fields(seq.unsent),
                "stop": seq.text.stop_match,
                "usage": seq.usage(),
            }
            return [self._end(seq, end, remove=False)]
        if seq.unsent_tokens >= max(1, seq.req.stream_interval) and seq.unsent:
            delta = {"e": p.EV_DELTA, **_fields(seq.unsent), "n": seq.generated}
            seq.unsent = Parsed()
            seq.unsent_tokens = 0
            return [(seq.req.rid, delta)]
        return []

    def _expire(self, now: float) -> list[Event]:
        events = []
        for seq in [s for s in self._seqs.values() if s.deadline and now >= s.deadline]:
            err = ServiceError(
                ErrorCode.TIMEOUT, f"request timed out after {seq.req.timeout_s:g} s ({seq.generated} tokens generated)"
            )
            events.append(self._end(seq, {"e": p.EV_ERROR, **err.to_wire(), "usage": seq.usage()}))
        return events

    def _end(self, seq: Sequence, event: dict, remove: bool = True) -> Event:
        self._seqs.pop(seq.req.rid, None)
        if seq.uid is not None:
            self._by_uid.pop(seq.uid, None)
            if remove:
                self.runner.remove([seq.uid])
        self.finished += 1
        return (seq.req.rid, event)

    # -- introspection ---------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._by_uid)

    @property
    def waiting(self) -> int:
        return len(self._seqs) - len(self._by_uid)

    def requests(self) -> list[dict]:
        now = time.monotonic()
        return [
            {
                "id": s.req.rid,
                "phase": s.phase,
                "prompt_tokens": len(s.prompt),
                "cached_tokens": s.cached_tokens,
                "generated_tokens": s.generated,
                "age_s": round(now - s.arrived, 3),
                "ttft_s": round(s.first_token_at - s.arrived, 3) if s.first_token_at else None,
            }
            for s in self._seqs.values()
        ]
