"""Batching policy for embedding and reranking workers.

Requests are split into their inputs; every engine step takes the oldest waiting inputs,
across requests, up to `max_batch_size` inputs and `max_batch_tokens` tokens, sorts them by
length and runs them in passes of near-equal length (on a CPU a padded token costs as much
as a real one, and a pass costs little else: with 8 to 40-word texts, windows of 64 went
from 60 to about 100 embeddings/s, see bench/README.md). Many small concurrent requests
therefore share forward passes instead of running one by one. A request ends when its
last input is done (or on cancel / timeout)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from mlxgw.shared import protocol as p
from mlxgw.shared.errors import ErrorCode, ServiceError, invalid

from .encoder import TextEncoder

Event = tuple[str, dict]


def _length(item) -> int:
    """Tokens of one input: token ids, or a cross-encoder's (ids, token types) pair."""
    return len(item[0]) if isinstance(item, tuple) else len(item)


@dataclass
class Job:
    req: p.EmbedRequest
    inputs: list  # token ids (embedding) or (ids, token types) pairs (cross-encoder)
    arrived: float
    deadline: float | None
    results: list = field(default_factory=list)
    remaining: int = 0
    started: bool = False

    @property
    def tokens(self) -> int:
        return sum(_length(x) for x in self.inputs)


class EmbedScheduler:
    request_type = p.EmbedRequest

    def __init__(self, encoder: TextEncoder, *, max_batch_size: int, max_batch_tokens: int, max_queue: int):
        self.encoder = encoder
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        self._jobs: dict[str, Job] = {}
        self._pending: deque[tuple[str, int]] = deque()  # (request id, input index), FIFO
        self.generated_tokens = 0  # nothing is generated; the engine's stats ask every scheduler
        self.finished = 0

    # -- intake ---------------------------------------------------------------------------
    def submit(self, req: p.EmbedRequest) -> list[Event]:
        try:
            if req.rid in self._jobs:
                raise ServiceError(ErrorCode.INVALID_REQUEST, f"duplicate request id {req.rid}")
            if self.waiting >= self.max_queue:
                raise ServiceError(
                    ErrorCode.OVERLOADED, f"model is at capacity ({self.waiting} requests waiting)", retry_after=1.0
                )
            inputs = self._tokenize(req)
        except ServiceError as e:
            return [(req.rid, {"e": p.EV_ERROR, **e.to_wire()})]
        now = time.monotonic()
        job = Job(req, inputs, now, now + req.timeout_s if req.timeout_s else None)
        job.results = [None] * len(inputs)
        job.remaining = len(inputs)
        self._jobs[req.rid] = job
        self._pending.extend((req.rid, i) for i in range(len(inputs)))
        return [(req.rid, {"e": p.EV_ACCEPTED, "prompt_tokens": job.tokens, "max_tokens": 0, "queued": self.waiting})]

    def _tokenize(self, req: p.EmbedRequest) -> list:
        enc = self.encoder
        if not req.inputs:
            raise invalid("'input' must not be empty", "input")
        if req.query is not None:
            if enc.cross_encoder:
                return [enc.tokenize_pair(req.query, doc) for doc in req.inputs]
            # Embedding-similarity reranking: the query is embedded along with the documents;
            # documents longer than the model's limit are cut, as rerank APIs do.
            return [enc.tokenize(req.query, 0)] + [enc.tokenize(d, i, truncate=True) for i, d in enumerate(req.inputs)]
        if enc.cross_encoder:
            raise invalid("this model is a reranker (cross-encoder): use /v1/rerank", "model")
        if req.dimensions is not None and not 1 <= req.dimensions <= enc.dim:
            raise invalid(f"'dimensions' must be between 1 and {enc.dim} for this model", "dimensions")
        return [enc.tokenize(x, i, req.truncate) for i, x in enumerate(req.inputs)]

    def cancel(self, rid: str) -> list[Event]:
        job = self._jobs.get(rid)
        if job is None:
            return []
        return [self._end(job, {"e": p.EV_FINISH, "reason": "cancelled", "usage": self._usage(job)})]

    # -- the step loop ---------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._jobs)

    def step(self) -> list[Event]:
        events = self._expire(time.monotonic())
        for batch in self._passes(self._take_window()):
            jobs = [self._jobs[rid] for rid, _, _ in batch]
            inputs = [job.inputs[i] for job, (_, i, _) in zip(jobs, batch)]
            if self.encoder.cross_encoder:
                outputs = self.encoder.score(inputs)
            else:
                outputs = self.encoder.embed(inputs, [job.req.dimensions for job in jobs])
            for job, (_, i, _), out in zip(jobs, batch, outputs):
                job.started = True
                job.results[i] = out
                job.remaining -= 1
                if job.remaining == 0:
                    events.append(self._end(job, self._finish_event(job)))
        return events

    def _take_window(self) -> list[tuple[str, int, int]]:
        """The oldest waiting inputs as (request id, input index, tokens), within the budgets."""
        window: list[tuple[str, int, int]] = []
        tokens = 0
        while self._pending and len(window) < self.max_batch_size:
            rid, i = self._pending[0]
            job = self._jobs.get(rid)
            if job is None:  # cancelled or expired: its inputs are dropped as they come up
                self._pending.popleft()
                continue
            n = _length(job.inputs[i])
            if window and tokens + n > self.max_batch_tokens:
                break  # next step
            tokens += n
            self._pending.popleft()
            window.append((rid, i, n))
        return window

    def _passes(self, window: list[tuple[str, int, int]]) -> list[list[tuple[str, int, int]]]:
        """The window sorted by length and cut where an input is over 10% (+2 tokens) longer
        than the shortest of its pass, so almost nothing of a pass is padding."""
        passes: list[list[tuple[str, int, int]]] = []
        for item in sorted(window, key=lambda x: x[2]):
            current = passes[-1] if passes else None
            if current is None or item[2] > 1.1 * current[0][2] + 2:
                passes.append([item])
            else:
                current.append(item)
        return passes

    def _finish_event(self, job: Job) -> dict:
        event = {"e": p.EV_FINISH, "reason": "stop", "usage": self._usage(job)}
        if job.req.query is None:
            event["vectors"] = b"".join(v.tobytes() for v in job.results)
            event["dim"] = int(job.results[0].shape[0])
        elif self.encoder.cross_encoder:
            event["scores"] = job.results
        else:
            query, docs = job.results[0], np.stack(job.results[1:])
            norms = np.linalg.norm(docs, axis=1) * max(float(np.linalg.norm(query)), 1e-12)
            event["scores"] = [float(s) for s in (docs @ query) / np.maximum(norms, 1e-12)]
        return event

    @staticmethod
    def _usage(job: Job) -> dict:
        return {"prompt_tokens": job.tokens, "completion_tokens": 0, "cached_tokens": 0}

    def _expire(self, now: float) -> list[Event]:
        events = []
        for job in [j for j in self._jobs.values() if j.deadline and now >= j.deadline]:
            err = ServiceError(ErrorCode.TIMEOUT, f"request timed out after {job.req.timeout_s:g} s")
            events.append(self._end(job, {"e": p.EV_ERROR, **err.to_wire()}))
        return events

    def _end(self, job: Job, event: dict) -> Event:
        self._jobs.pop(job.req.rid, None)
        self.finished += 1
        return (job.req.rid, event)

    # -- introspection ---------------------------------------------------------------------
    @property
    def running(self) -> int:
        return sum(1 for j in self._jobs.values() if j.started)

    @property
    def waiting(self) -> int:
        return len(self._jobs) - self.running

    def requests(self) -> list[dict]:
        now = time.monotonic()
        return [
            {
                "id": j.req.rid,
                "phase": "encode" if j.started else "queued",
                "prompt_tokens": j.tokens,
                "inputs": len(j.inputs),
                "inputs_done": len(j.inputs) - j.remaining,
                "age_s": round(now - j.arrived, 3),
            }
            for j in self._jobs.values()
        ]
