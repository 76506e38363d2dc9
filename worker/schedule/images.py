"""Text to image and image edits on a `kind: image` worker: mlx-vlm's image models (Z-Image,
FLUX.2, Qwen-Image, ERNIE-Image, ...: whichever family `mlx_vlm.generate.image` recognises in
the model folder), one image per call.

MLX arrays belong to the thread that made them (a model loaded on one thread cannot run on
another: "There is no Stream(cpu, 0) in current thread"), and one image can take minutes on a
slow host: the model loads and runs on a thread of its own, and the engine's steps only look
at it. So the engine stays responsive (cancels, status, heartbeats), its steps end in well
under the hang bound however long an image takes, and each step's Progress event keeps the
gateway's backstop moving. A cancel takes effect between images."""

from __future__ import annotations

import io
import random
import tempfile
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from ...shared import protocol as p
from ...shared.errors import ErrorCode, ServiceError
from ...shared.events import Accepted, Error, Finish, FinishReason, Phase, Progress, Usage
from .jobs import JobTable

Event = p.Event
# How long one engine step waits on the image thread: short enough for cancels and status to
# be answered promptly, long enough that the engine does not spin beside the generation.
POLL_S = 0.25
# A Progress event at most this often while an image is drawn: the gateway's backstop moves
# with it, and a stream sends its keep-alive.
PROGRESS_EVERY_S = 5.0


class ImageRunner:
    """One mlx-vlm image model, on its own thread. `edit` loads the family's edit pipeline the
    first time an edit comes (sharing the generator's weights where the family allows)."""

    context_length = 32000  # prompt characters, OpenAI's limit for its image models

    def __init__(self, folder: Path):
        self.folder = folder
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="image")
        self.model = self._thread.submit(self._load, "generate").result()  # a load failure raises here
        self.edit_model = None
        self.images = 0

    def _load(self, task: str):
        from mlx_vlm.generate.image import load_image_model

        if task == "edit":
            shared = _shared_edit_model(self.model)
            if shared is not None:
                return shared
        return load_image_model(str(self.folder), task=task)

    def draw(self, req: p.ImageRequest, index: int) -> Future:
        """The index-th image of req (PNG bytes), drawn on the image thread."""
        return self._thread.submit(self._draw, req, index)

    def _draw(self, req: p.ImageRequest, index: int) -> bytes:
        from mlx_vlm.generate.image import ImageGenerationRequest, generate_image

        seed = (req.seed if req.seed is not None else random.randrange(2**31)) + index
        size = dict(width=req.width, height=req.height)
        options = dict(seed=seed, steps=req.steps, guidance=req.guidance, **size)
        if req.image is None:
            image = generate_image(self.model, ImageGenerationRequest(prompt=req.prompt, **options)).to_pil()
        else:
            image = self._edit(req, options)
        self.images += 1
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()

    def _edit(self, req: p.ImageRequest, options: dict):
        from mlx_vlm.generate.edit_image import ImageEditRequest
        from mlx_vlm.generate.image import generate_image
        from PIL import Image

        if self.edit_model is None:
            try:
                self.edit_model = self._load("edit")
            except ValueError as e:  # the family generates only
                raise ServiceError(ErrorCode.INVALID_REQUEST, f"this model does not edit images: {e}") from None
        source = Image.open(io.BytesIO(req.image)).convert("RGB")
        with tempfile.TemporaryDirectory(prefix="mlxgw-edit-") as tmp:
            path = Path(tmp) / "source.png"  # mlx-vlm's edit pipelines read their sources from files
            source.save(path)
            edit = ImageEditRequest(prompt=req.prompt, image_paths=(str(path),), **options)
            edited = generate_image(self.edit_model, edit, task="edit").to_pil().convert("RGB")
        edited = edited.resize((req.width, req.height)) if edited.size != (req.width, req.height) else edited
        if req.mask is None:
            return edited
        # OpenAI's mask: its transparent pixels are what may change; elsewhere the source stays.
        alpha = Image.open(io.BytesIO(req.mask)).convert("RGBA").getchannel("A").resize(edited.size)
        keep = source.resize(edited.size)
        return Image.composite(keep, edited, alpha)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict:
        return {"images": self.images}

    def cache_stats(self) -> dict:
        return {}

    def cache_clear(self) -> None:
        pass


def _shared_edit_model(model):
    """The family's edit model over the generator's own pipeline, where both are dataclasses of
    (pipeline, model_id) and the pipeline edits: one copy of the weights, not two."""
    from mlx_vlm.generate.edit_image import _image_edit_model_class_for_type

    cls = _image_edit_model_class_for_type(getattr(model, "model_type", None))
    pipeline = getattr(model, "pipeline", None)
    names = getattr(cls, "__dataclass_fields__", {})
    if cls is None or pipeline is None or not hasattr(pipeline, "edit_array") or "pipeline" not in names:
        return None
    return cls(pipeline=pipeline, model_id=model.model_id)


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
    """FIFO, one image at a time on the runner's thread; a finished image is a Progress event,
    the last one the finish with every PNG."""

    request_type = p.ImageRequest

    def __init__(self, runner: ImageRunner, *, max_queue: int):
        super().__init__()
        self.runner = runner
        self.max_queue = max_queue
        self.generated_tokens = 0
        self._abandoned: deque[Future] = deque()  # cancelled jobs' images still being drawn

    def submit(self, req: p.ImageRequest) -> list[Event]:
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

    def cancel(self, rid: str) -> list[Event]:
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

    def _end(self, job, event) -> Event:
        self._set_aside(job)
        return super()._end(job, event)

    def counters(self) -> dict:
        return {"generated_tokens": self.generated_tokens}

    def step(self) -> list[Event]:
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

    def _progress(self, finished: ImageJob | None = None) -> list[Event]:
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

    def requests(self) -> list[dict]:
        now = time.monotonic()
        return [
            {
                "id": j.req.rid,
                "phase": (Phase.DRAW if j.started else Phase.QUEUED).value,
                "age_s": round(now - j.arrived, 3),
                "images": len(j.images),
            }
            for j in self._jobs.values()
        ]
