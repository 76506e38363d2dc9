"""Batching policy for embedding and reranking workers.

Requests are split into their inputs; every engine step takes the oldest waiting inputs,
across requests, up to `max_batch_size` inputs and `max_batch_tokens` tokens, sorts them by
length and runs them in passes of near-equal length (on a CPU a padded token costs as much
as a real one, and a pass costs little else: with 8 to 40-word texts, windows of 64 went
from 60 to about 100 embeddings/s, see bench/HISTORY.md at 3b9d616, "Embeddings"). Many small concurrent requests
therefore share forward passes instead of running one by one. A request ends when its
last input is done (or on cancel / timeout)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ...shared import protocol as p
from ...shared.errors import ErrorCode, ServiceError, invalid
from ...shared.events import Accepted, Error, Finish, FinishReason, Phase, Usage
from ..model.interfaces import EmbeddingRunner
from ..model.runners.isolation import as_service_error
from .jobs import JobTable
from .preprocess import Preprocessor

Event = p.Event


# How long a ready input may wait for inputs still being tokenized (see _gathering).
GATHER_S = 0.010


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


class EmbedScheduler(JobTable):
    request_type = p.EmbedRequest

    def __init__(
        self,
        encoder: EmbeddingRunner,
        *,
        max_batch_size: int,
        max_batch_tokens: int,
        max_queue: int,
        preprocessor: Preprocessor | None = None,
    ):
        """preprocessor: tokenizes on its own thread; None tokenizes in submit."""
        super().__init__()
        self.encoder = encoder
        self.preprocessor = preprocessor
        self._intake: dict[str, tuple[p.EmbedRequest, float]] = {}
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        self._pending: deque[tuple[str, int]] = deque()  # (request id, input index), FIFO
        self.embedded_inputs = 0

    # -- intake ---------------------------------------------------------------------------
    def submit(self, req: p.EmbedRequest) -> list[Event]:
        try:
            if req.rid in self._jobs or req.rid in self._intake:
                raise ServiceError(ErrorCode.INVALID_REQUEST, f"duplicate request id {req.rid}")
            if self.waiting >= self.max_queue:
                raise ServiceError(
                    ErrorCode.OVERLOADED, f"model is at capacity ({self.waiting} requests waiting)", retry_after=1.0
                )
        except ServiceError as e:
            return [(req.rid, Error(e))]
        self._intake[req.rid] = (req, time.monotonic())
        if self.preprocessor is None:
            try:
                inputs, error = self._tokenize(req), None
            except Exception as e:
                inputs, error = None, e
            return self._on_tokenized(req.rid, inputs, error)
        self.preprocessor.submit(req.rid, lambda: self._tokenize(req))
        return []

    def _on_tokenized(self, rid: str, inputs: list | None, error: BaseException | None) -> list[Event]:
        req, arrived = self._intake.pop(rid)
        if error is not None or inputs is None:
            return [(rid, Error(as_service_error(error, "tokenizing its inputs")))]
        job = Job(req, inputs, arrived, arrived + req.timeout_s if req.timeout_s else None)
        job.results = [None] * len(inputs)
        job.remaining = len(inputs)
        self._jobs[rid] = job
        self._pending.extend((rid, i) for i in range(len(inputs)))
        return [(rid, Accepted(prompt_tokens=job.tokens, max_tokens=0, queued=self.waiting))]

    def poll_prepared(self) -> list[Event]:
        if self.preprocessor is None:
            return []
        events = []
        for rid, inputs, error in self.preprocessor.ready():
            if rid in self._intake:
                events += self._on_tokenized(rid, inputs, error)
        return events

    def preparing(self) -> int:
        return len(self._intake)

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
        if self._intake.pop(rid, None) is not None:
            if self.preprocessor is not None:
                self.preprocessor.discard(rid)
            self.finished += 1
            return [(rid, Finish(FinishReason.CANCELLED, Usage()))]
        job = self._jobs.get(rid)
        if job is None:
            return []
        return [self._end(job, Finish(FinishReason.CANCELLED, self._usage(job)))]

    # -- the step loop ---------------------------------------------------------------------
    def step(self) -> list[Event]:
        events = self.poll_prepared()
        now = time.monotonic()
        events += self._expire(now)
        if self._gathering(now):
            return events
        for batch in self._passes(self._take_window()):
            jobs = [self._jobs[rid] for rid, _, _ in batch]
            inputs = [job.inputs[i] for job, (_, i, _) in zip(jobs, batch)]
            if self.encoder.cross_encoder:
                outputs = self.encoder.score(inputs)
            else:
                outputs = self.encoder.embed(inputs, [job.req.dimensions for job in jobs])
            self.embedded_inputs += len(inputs)
            for job, (_, i, _), out in zip(jobs, batch, outputs):
                job.started = True
                job.results[i] = out
                job.remaining -= 1
                if job.remaining == 0:
                    events.append(self._end(job, self._finish_event(job)))
        return events

    def _gathering(self, now: float) -> bool:
        """Hold the pass a moment while requests that arrived together are still being
        tokenized on the preparation thread: a burst of N requests then shares a few passes
        instead of starting one pass per request as each becomes ready. Bounded: the oldest
        waiting input never waits more than GATHER_S for company."""
        if not self._pending or not self.preparing() or len(self._pending) >= self.max_batch_size:
            return False
        oldest = self._jobs.get(self._pending[0][0])
        return oldest is not None and now - oldest.arrived < GATHER_S

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
        usage = self._usage(job)
        if job.req.query is None:
            vectors = b"".join(v.tobytes() for v in job.results)
            return Finish(FinishReason.STOP, usage, vectors=vectors, dim=int(job.results[0].shape[0]))
        if self.encoder.cross_encoder:
            return Finish(FinishReason.STOP, usage, scores=job.results)
        query, docs = job.results[0], np.stack(job.results[1:])
        norms = np.linalg.norm(docs, axis=1) * max(float(np.linalg.norm(query)), 1e-12)
        scores = [float(s) for s in (docs @ query) / np.maximum(norms, 1e-12)]
        return Finish(FinishReason.STOP, usage, scores=scores)

    @staticmethod
    def _usage(job: Job) -> Usage:
        return Usage(prompt_tokens=job.tokens)

    # -- introspection ---------------------------------------------------------------------
    def counters(self) -> dict:
        return {"embedded_inputs": self.embedded_inputs}

    @property
    def waiting(self) -> int:
        return super().waiting + len(self._intake)

    def requests(self) -> list[dict]:
        now = time.monotonic()
        return [
            {
                "id": j.req.rid,
                "phase": (Phase.ENCODE if j.started else Phase.QUEUED).value,
                "prompt_tokens": j.tokens,
                "inputs": len(j.inputs),
                "inputs_done": len(j.inputs) - j.remaining,
                "age_s": round(now - j.arrived, 3),
            }
            for j in self._jobs.values()
        ]
