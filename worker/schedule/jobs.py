"""Bookkeeping shared by the schedulers whose requests are jobs rather than decoding
sequences (embedding, speech to text, text to speech, images): the job table, timeouts, the
finished and generated counts and the running/waiting view the engine reports."""

from __future__ import annotations

import time
from typing import Any

from ...shared import protocol as p
from ...shared.errors import ErrorCode, ServiceError
from ...shared.events import AnyEvent, Error, Phase


class JobTable:
    """Jobs keyed by request id; each job has `req` (with `rid`, `timeout_s`), `deadline`
    (monotonic time or None), `arrived` and `started`."""

    running_phase = Phase.QUEUED  # what a started job is doing, named by each scheduler

    def __init__(self) -> None:
        self._jobs: dict[str, Any] = {}
        self.finished = 0
        self.generated_tokens = 0

    def counters(self) -> dict:
        return {"generated_tokens": self.generated_tokens}

    def has_work(self) -> bool:
        return bool(self._jobs)

    def preparing(self) -> int:
        return 0  # nothing is prepared off the engine thread unless a scheduler says so

    def poll_prepared(self) -> list[p.Event]:
        return []

    def _expire(self, now: float) -> list[p.Event]:
        events = []
        for job in [j for j in self._jobs.values() if j.deadline and now >= j.deadline]:
            err = ServiceError(ErrorCode.TIMEOUT, f"request timed out after {job.req.timeout_s:g} s")
            events.append(self._end(job, Error(err)))
        return events

    def _end(self, job, event: AnyEvent) -> p.Event:
        self._jobs.pop(job.req.rid, None)
        self.finished += 1
        return (job.req.rid, event)

    @property
    def running(self) -> int:
        return sum(1 for j in self._jobs.values() if j.started)

    @property
    def waiting(self) -> int:
        return len(self._jobs) - self.running

    def requests(self) -> list[dict]:
        now, phase = time.monotonic(), {True: self.running_phase.value, False: Phase.QUEUED.value}
        return [
            {"id": j.req.rid, "phase": phase[j.started], "age_s": round(now - j.arrived, 3), **self._request_row(j)}
            for j in self._jobs.values()
        ]

    def _request_row(self, job) -> dict:
        return {}  # what else a scheduler shows of a job
