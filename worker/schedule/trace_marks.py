"""The times of one traced request in the worker: when it arrived, joined the queue, was
admitted (its prefill began), produced its first token and ended, and how many engine steps
ran with its row (prefill chunks, then decode steps).

Only a request whose GenerateRequest carries a `traceparent` has marks (the gateway sets it
when it exports traces); every other request pays one None check where a mark would be
taken. The marks go back with the request's last event (`Finish.trace` / `Error.trace`) and
the gateway makes the worker's spans of them (gateway/pipeline/worker_spans.py): the worker
needs no OpenTelemetry package, no exporter of its own and no route to the collector (a
remote worker included), and no span waits in a worker's export queue when it stops."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ...shared import protocol as p


@dataclass(slots=True)
class TraceMarks:
    parent: str  # the traceparent the request came with: the worker's spans are its children
    arrived: float  # time.monotonic() at submit
    queued: float  # prepared (template, tokens, grammar), in the waiting queue
    admitted: float | None = None  # first admitted to the runner: its prefill begins
    prefill_steps: int = 0  # engine steps that read its prompt (the last one also made its first token)
    decode_steps: int = 0  # engine steps after its first token (a speculative step makes several tokens)

    def admit(self) -> None:
        if self.admitted is None:  # a row paused and resumed keeps its first admission
            self.admitted = time.monotonic()

    def step(self, first_token_at: float | None) -> None:
        """One engine step ran with this request's row in the batch."""
        if first_token_at is None:
            self.prefill_steps += 1
        else:
            self.decode_steps += 1

    def wire(self, first_token_at: float | None) -> dict:
        """The wire map (shared/events.py Finish.trace): monotonic times as wall-clock ns,
        which is what OTLP spans carry."""
        now = time.monotonic()
        offset_ns = time.time_ns() - int(now * 1e9)

        def wall(t: float | None) -> int | None:
            return None if t is None else int(t * 1e9) + offset_ns

        return {
            "parent": self.parent,
            "arrived": wall(self.arrived),
            "queued": wall(self.queued),
            "admitted": wall(self.admitted),
            "first_token": wall(first_token_at),
            "end": wall(now),
            "prefill_steps": self.prefill_steps,
            "decode_steps": self.decode_steps,
        }


class TracedRows:
    """The traced sequences in the runner's batch: each engine step counts for them alone, so
    a batch without traced rows pays one empty loop per step and nothing per row."""

    def __init__(self) -> None:
        self.rows: dict[str, Any] = {}  # request id -> Sequence

    def add(self, seq: Any) -> None:
        seq.marks.admit()
        self.rows[seq.req.rid] = seq

    def remove(self, seq: Any) -> None:
        self.rows.pop(seq.req.rid, None)

    def step(self) -> None:
        """One engine step ran with every row in the batch."""
        for seq in self.rows.values():
            seq.marks.step(seq.first_token_at)


def marks_for(req: p.GenerateRequest, arrived: float) -> TraceMarks | None:
    """A traced request's marks, from the moment it joins the queue; None when not traced."""
    return None if req.traceparent is None else TraceMarks(req.traceparent, arrived, time.monotonic())
