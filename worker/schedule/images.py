"""Text to image and image edits on a `kind: image` worker, FIFO, one image at a time on the
runner's own thread (worker/model/image/runner.py): a step only looks at it, so it ends well
under the hang bound however long an image takes, and its Progress event keeps the gateway's
backstop moving; a finished image is a Progress event, the last one the finish with every
PNG. A cancel takes effect between images."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

from ...shared import protocol as p
from ...shared.errors import ErrorCode, ServiceError
from ...shared.events import Accepted, Error, Finish, FinishReason, Phase, Progress, Usage
from ..model.image.runner import ImageRunner
from .jobs import JobTable

# How long one engine step waits on the image thread: short enough for cancels and status to
# be answered promptly, long enough that the engine does not spin beside the generation.
POLL_S = 0.25
# A Progress event at most this often while an image is drawn: the gateway's backstop moves
# with it, and a stream sends its keep-alive.
PROGRESS_EVERY_S = 5.0


@dataclass
class ImageJob:
    req: p.ImageRequest
    arrived: float
    deadline: float | None
    images: list[bytes] = field(default_factory=list)
    running: Future | None = None
    started: bool = False
    reported: float = 0.0


class ImageScheduler(JobTable):
    request_type = p.ImageRequest
    running_phase = Phase.DRAW

    def __init__(self, runner: ImageRunner, *, max_queue: int):
        super().__init__()
        self.runner = runner
        self.max_queue = max_queue
        self._abandoned: deque[Future] = deque()  # cancelled jobs' images still being drawn

    def submit(self, req: p.ImageRequest) -> list[p.Event]:
        why = None
        if req.rid in self._jobs:
            why = ServiceError(ErrorCode.INVALID_REQUEST, "duplicate request id")
        elif len(self._jobs) >= self.max_queue:
            why = ServiceError(ErrorCode.OVERLOADED, "model is at capacity")
        elif not req.prompt.strip() or not 1 <= req.n <= 10:
            why = ServiceError(ErrorCode.INVALID_REQUEST, "'prompt' must not be empty and 'n' is 1 to 10")
        if why is not None:
            return [(req.rid, Error(why))]
        now = time.monotonic()
        self._jobs[req.rid] = ImageJob(req, now, now + req.timeout_s if req.timeout_s else None)
        return [(req.rid, Accepted(len(req.prompt), 0, self.waiting))]

    def has_work(self) -> bool:
        return bool(self._jobs) or bool(self._abandoned)

    def cancel(self, rid: str) -> list[p.Event]:
        job = self._jobs.pop(rid, None)
        if job is None:
            return []
        self._set_aside(job)
        return [(rid, Finish(FinishReason.CANCELLED, self._usage(job)))]

    def _set_aside(self, job: ImageJob) -> None:
        """A job that ends while the thread still draws its image (cancelled, timed out): the
        next job starts once that image is done."""
        if job.running is not None and not job.running.done():
            self._abandoned.append(job.running)

    def _end(self, job, event) -> p.Event:
        self._set_aside(job)
        return super()._end(job, event)

    def step(self) -> list[p.Event]:
        events = self._expire(time.monotonic())
        while self._abandoned and self._abandoned[0].done():
            self._abandoned.popleft()
        if self._abandoned:
            wait([self._abandoned[0]], timeout=POLL_S)
            return events + self._progress()
        job = next(iter(self._jobs.values()), None)
        if job is None:
            return events
        if job.running is None:
            job.started = True
            job.running = self.runner.draw(job.req, len(job.images))
        try:
            png = job.running.result(timeout=POLL_S)
        except TimeoutError:
            return events + self._progress()
        except ServiceError as e:
            return events + [self._end(job, Error(e))]
        except ValueError as e:  # the family's own check of the request (a size it cannot draw)
            return events + [self._end(job, Error(ServiceError(ErrorCode.INVALID_REQUEST, str(e))))]
        except Exception as e:  # one request's failure; the model stays loaded for the next
            err = ServiceError(ErrorCode.INTERNAL, f"image generation failed: {e}")
            return events + [self._end(job, Error(err))]
        job.images.append(png)
        job.running = None
        if len(job.images) < job.req.n:
            return events + self._progress(job)
        done = Finish(FinishReason.STOP, self._usage(job), images=job.images)
        return events + [self._end(job, done)]

    def _progress(self, finished: ImageJob | None = None) -> list[p.Event]:
        """Progress for the job that just finished an image, and for every job (drawing or
        queued behind it) not reported for PROGRESS_EVERY_S: the gateway bounds silence, and
        a request waiting behind a long one is not silent."""
        now = time.monotonic()
        events = []
        for job in self._jobs.values():
            if job is finished or now - job.reported >= PROGRESS_EVERY_S:
                job.reported = now
                events.append((job.req.rid, Progress(len(job.images), job.req.n)))
        return events

    @staticmethod
    def _usage(job: ImageJob) -> Usage:
        return Usage(prompt_tokens=len(job.req.prompt))  # characters, as speech counts its input

    def _request_row(self, job: ImageJob) -> dict:
        return {"images": len(job.images)}
