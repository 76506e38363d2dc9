"""Text to speech on a `kind: speech` worker (the runner: worker/model/speech/runner.py), one
line of text per engine step so a cancel or timeout takes effect between sentences."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ...shared import protocol as p
from ...shared.errors import ErrorCode, ServiceError
from ...shared.events import Accepted, Error, Finish, FinishReason, Phase, Usage
from ..model.speech.runner import PiperRunner
from .jobs import JobTable


@dataclass
class SpeechJob:
    req: p.SpeechRequest
    pieces: deque
    arrived: float
    deadline: float | None
    audio: list[np.ndarray] = field(default_factory=list)
    started: bool = False


class SpeechScheduler(JobTable):
    request_type = p.SpeechRequest
    running_phase = Phase.SPEAK

    def __init__(self, runner: PiperRunner, *, max_queue: int):
        super().__init__()
        self.runner = runner
        self.max_queue = max_queue

    def submit(self, req: p.SpeechRequest) -> list[p.Event]:
        if req.rid in self._jobs or len(self._jobs) >= self.max_queue or not req.input.strip():
            why = "duplicate request id" if req.rid in self._jobs else "model is at capacity"
            code = ErrorCode.INVALID_REQUEST if req.rid in self._jobs else ErrorCode.OVERLOADED
            if not req.input.strip():
                code, why = ErrorCode.INVALID_REQUEST, "'input' is empty"
            return [(req.rid, Error(ServiceError(code, why)))]
        pieces = deque(line for line in req.input.splitlines() if line.strip())
        now = time.monotonic()
        self._jobs[req.rid] = SpeechJob(req, pieces, now, now + req.timeout_s if req.timeout_s else None)
        return [(req.rid, Accepted(len(req.input), 0, self.waiting))]

    def cancel(self, rid: str) -> list[p.Event]:
        job = self._jobs.pop(rid, None)
        return [(rid, Finish(FinishReason.CANCELLED, self._usage(job)))] if job else []

    def step(self) -> list[p.Event]:
        events = self._expire(time.monotonic())
        if not self._jobs:
            return events
        job = next(iter(self._jobs.values()))  # FIFO, one line of text per step
        job.started = True
        job.audio.append(self.runner.synthesize(job.pieces.popleft(), job.req.speed))
        if not job.pieces:
            pcm = np.concatenate(job.audio).astype("<i2")
            done = Finish(FinishReason.STOP, self._usage(job), audio=pcm.tobytes(), sample_rate=self.runner.sample_rate)
            events.append(self._end(job, done))
        return events

    @staticmethod
    def _usage(job: SpeechJob | None) -> Usage:
        return Usage(prompt_tokens=len(job.req.input) if job else 0)
