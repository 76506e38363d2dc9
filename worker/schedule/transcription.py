"""Batching policy for Whisper workers: windows from every request share encoder passes and
decoder steps.

A request's audio is cut into 30-second windows (Whisper's input) that are decoded
independently, so a long file's windows batch like many short requests. Each engine step:
  1. admission: waiting windows (oldest first) fill the free decoder rows; the new ones are
     encoded in ONE encoder pass and prefilled together per prompt length;
  2. one decoder step for every running row, whatever step it started at (the decoder's
     cache keeps a position per row), so rows join and leave between any two steps.
A window whose greedy result looks like a failure (repetitive, or unlikely) is decoded again
at the next fallback temperature, reusing its encoder features. A request ends when its
last window is done; with streaming, each window's text is sent as soon as every window
before it is done."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ...shared import protocol as p
from ...shared.errors import ErrorCode, ServiceError, invalid
from ...shared.events import Accepted, Delta, Error, Finish, FinishReason, Phase, Usage
from ..model.whisper.decoding import (
    FALLBACK_TEMPERATURES,
    RowRules,
    choose,
    compression_ratio,
    needs_fallback,
    split_segments,
)
from ..model.whisper.model import DecoderCache, keep_rows, merge_caches
from ..model.whisper.runner import SAMPLE_RATE, WINDOW_SAMPLES, WhisperRunner
from ..model.whisper.words import word_timestamps
from .jobs import JobTable

Event = p.Event
MIN_TAIL_SAMPLES = SAMPLE_RATE // 10  # a last window shorter than 0.1 s holds no speech
MAX_PROMPT_TOKENS = 223  # Whisper keeps n_text_ctx // 2 - 1 tokens of prompt


@dataclass
class Window:
    job: Job
    index: int
    samples: np.ndarray
    offset_s: float
    temperatures: list[float]
    features: mx.array | None = None  # (1, ctx, state), kept for fallback retries
    result: dict | None = None
    best: tuple[float, dict] | None = None  # most likely attempt so far: (avg logprob, result)


@dataclass
class Row:
    window: Window
    temperature: float
    sampled: list[int] = field(default_factory=list)
    sum_logprob: float = 0.0
    no_speech_prob: float = 0.0
    limit: int = 224  # tokens this row may sample: the prompt and the text share n_text_ctx


@dataclass
class Job:
    req: p.TranscribeRequest
    language: str | None
    prompt_tokens: list[int]
    arrived: float
    deadline: float | None
    windows: list[Window] = field(default_factory=list)
    sent: int = 0  # windows whose text was streamed
    tokens: int = 0
    started: bool = False
    rng: np.random.Generator = field(default_factory=np.random.default_rng)

    @property
    def done(self) -> bool:
        return all(w.result is not None for w in self.windows)


class AudioScheduler(JobTable):
    request_type = p.TranscribeRequest

    def __init__(self, runner: WhisperRunner, *, max_rows: int, max_queue: int):
        super().__init__()
        self.runner = runner
        self.tok = runner.tokens
        self.rules = RowRules(self.tok)
        self.max_rows = max_rows
        self.max_queue = max_queue
        self.max_new_tokens = runner.dims.n_text_ctx // 2
        self._pending: list[Window] = []
        self._rows: list[Row] = []
        self._cache: DecoderCache | None = None

    # -- intake ---------------------------------------------------------------------------
    def submit(self, req: p.TranscribeRequest) -> list[Event]:
        try:
            if req.rid in self._jobs:
                raise ServiceError(ErrorCode.INVALID_REQUEST, f"duplicate request id {req.rid}")
            if len(self._jobs) >= self.max_queue:
                raise ServiceError(ErrorCode.OVERLOADED, "model is at capacity", retry_after=1.0)
            job = self._new_job(req)
        except ServiceError as e:
            return [(req.rid, Error(e))]
        self._jobs[req.rid] = job
        self._pending.extend(job.windows)
        return [(req.rid, Accepted(len(job.prompt_tokens), 0, self.waiting))]

    def _new_job(self, req: p.TranscribeRequest) -> Job:
        tok = self.tok
        if req.task not in ("transcribe", "translate"):
            raise invalid(f"unknown task {req.task!r}", "task")
        if req.task == "translate" and not tok.multilingual:
            raise invalid("this model is English-only and cannot translate; use a multilingual Whisper", "model")
        language = (req.language or "").lower() or None
        if language is not None and language not in tok.languages:
            detail = "this model is English-only" if not tok.multilingual else "unknown language code"
            raise invalid(f"language {req.language!r} is not supported: {detail}", "language")
        audio = np.frombuffer(req.audio, dtype="<i2").astype(np.float32) / 32768.0
        if audio.size == 0:
            raise invalid("the audio is empty", "file")
        prompt = tok.encode(" " + req.prompt.strip())[-MAX_PROMPT_TOKENS:] if req.prompt else []
        temps = list(FALLBACK_TEMPERATURES) if req.temperature <= 0 else [float(req.temperature)]
        now = time.monotonic()
        job = Job(req, language, prompt, now, now + req.timeout_s if req.timeout_s else None)
        for i, start in enumerate(range(0, audio.size, WINDOW_SAMPLES)):
            chunk = audio[start : start + WINDOW_SAMPLES]
            if i > 0 and chunk.size < MIN_TAIL_SAMPLES:
                break
            job.windows.append(Window(job, i, chunk, start / SAMPLE_RATE, list(temps)))
        return job

    def cancel(self, rid: str) -> list[Event]:
        job = self._jobs.get(rid)
        if job is None:
            return []
        return [self._end(job, Finish(FinishReason.CANCELLED, self._usage(job)))]

    # -- the step loop ---------------------------------------------------------------------
    def step(self) -> list[Event]:
        events = self._expire(time.monotonic())
        self._drop_orphans()
        self._admit()
        if self._rows:
            events.extend(self._decode_step())
        return events

    def _drop_orphans(self) -> None:
        """Rows and waiting windows of requests that were cancelled or timed out."""
        self._pending = [w for w in self._pending if w.job.req.rid in self._jobs]
        keep = [i for i, r in enumerate(self._rows) if r.window.job.req.rid in self._jobs]
        if len(keep) < len(self._rows):
            self._rows = [self._rows[i] for i in keep]
            self._cache = keep_rows(self._cache, keep)

    def _admit(self) -> None:
        free = self.max_rows - len(self._rows)
        if free <= 0 or not self._pending:
            return
        batch, self._pending = self._pending[:free], self._pending[free:]
        fresh = [w for w in batch if w.features is None]
        if fresh:
            features = self.runner.encode([w.samples for w in fresh])
            for i, w in enumerate(fresh):
                w.features = features[i : i + 1]
                w.job.started = True
        self._detect_languages([w for w in batch if w.job.language is None and self.tok.multilingual])
        by_prompt: dict[int, list[tuple[Window, list[int]]]] = {}
        for w in batch:
            prompt = self._prompt(w)
            by_prompt.setdefault(len(prompt), []).append((w, prompt))
        for group in by_prompt.values():
            features = mx.concatenate([w.features for w, _ in group], axis=0)
            logits, cache = self.runner.prefill([pr for _, pr in group], features)
            for (w, _), row_logits in zip(group, logits):
                room = self.runner.dims.n_text_ctx - len(group[0][1])
                row = Row(w, w.temperatures.pop(0), limit=min(self.max_new_tokens, room))
                row.no_speech_prob = self._no_speech_prob(row_logits[0])
                self._rows.append(row)
                self._take(row, row_logits[-1])
            self._cache = merge_caches(self._cache, cache)

    def _detect_languages(self, windows: list[Window]) -> None:
        jobs = {id(w.job): w for w in windows}  # the first window of each job decides
        if not jobs:
            return
        first = list(jobs.values())
        found = self.runner.detect_languages(mx.concatenate([w.features for w in first], axis=0))
        for w, (code, _prob) in zip(first, found):
            w.job.language = code

    def _prompt(self, w: Window) -> list[int]:
        job = w.job
        prev = [self.tok.sot_prev, *job.prompt_tokens] if job.prompt_tokens else []
        return prev + self.tok.sot_sequence(job.language, job.req.task)

    def _no_speech_prob(self, sot_logits: np.ndarray) -> float:
        if self.tok.no_speech is None:
            return 0.0
        z = sot_logits - sot_logits.max()
        e = np.exp(z)
        return float(e[self.tok.no_speech] / e.sum())

    def _take(self, row: Row, logits: np.ndarray) -> None:
        filtered = self.rules.apply(logits[: self.tok.vocab_size], row.sampled)
        token, logprob = choose(filtered, row.temperature, row.window.job.rng)
        row.sampled.append(token)
        if token != self.tok.eot:
            row.sum_logprob += logprob

    def _decode_step(self) -> list[Event]:
        logits = self.runner.step([r.sampled[-1] for r in self._rows], self._cache)
        done: list[int] = []
        for i, row in enumerate(self._rows):
            if row.sampled[-1] != self.tok.eot and len(row.sampled) < row.limit:
                self._take(row, logits[i])
                self.generated_tokens += 1
                row.window.job.tokens += 1
            if row.sampled[-1] == self.tok.eot or len(row.sampled) >= row.limit:
                done.append(i)
        events: list[Event] = []
        for i in done:
            events.extend(self._finish_row(self._rows[i]))
        if done:
            keep = [i for i in range(len(self._rows)) if i not in set(done)]
            self._rows = [self._rows[i] for i in keep]
            self._cache = keep_rows(self._cache, keep)
        return events

    def _finish_row(self, row: Row) -> list[Event]:
        """A window's attempt is over: keep it, or decode the window again hotter. When every
        temperature failed, the most likely attempt wins (as faster-whisper does; the last,
        hottest one is usually the worst)."""
        w, tok = row.window, self.tok
        text = tok.decode([t for t in row.sampled if t < tok.eot])
        avg_logprob = row.sum_logprob / (len(row.sampled) + 1)
        ratio = compression_ratio(text)
        attempt = (avg_logprob, self._window_result(row, avg_logprob, ratio))
        if w.best is None or attempt[0] > w.best[0]:
            w.best = attempt
        if needs_fallback(avg_logprob, ratio, row.no_speech_prob):
            if w.temperatures:
                self._pending.insert(0, w)  # again, hotter, before newer work
                return []
            attempt = w.best
        w.result = attempt[1]
        if w.job.req.word_timestamps:
            job = w.job
            w.result["words"] = word_timestamps(
                self.runner.model,
                tok,
                w.features,
                tok.sot_sequence(job.language, job.req.task),
                w.result["text_tokens"],
                w.samples.size,
                w.offset_s,
            )
        w.features = None
        return self._progress(w.job)

    def _window_result(self, row: Row, avg_logprob: float, ratio: float) -> dict:
        w = row.window
        segments = split_segments(row.sampled, self.tok, w.offset_s, w.samples.size / SAMPLE_RATE)
        return {
            "text_tokens": [t for t in row.sampled if t < self.tok.eot],
            "segments": [
                {
                    "start": s.start,
                    "end": s.end,
                    "text": s.text,
                    "tokens": s.tokens,
                    "temperature": row.temperature,
                    "avg_logprob": round(avg_logprob, 4),
                    "compression_ratio": round(ratio, 4),
                    "no_speech_prob": round(row.no_speech_prob, 4),
                }
                for s in segments
            ],
        }

    def _progress(self, job: Job) -> list[Event]:
        events: list[Event] = []
        texts = []
        while job.sent < len(job.windows) and job.windows[job.sent].result is not None:
            texts.extend(s["text"] for s in job.windows[job.sent].result["segments"])
            job.sent += 1
        if job.req.stream and texts and not job.done:
            events.append((job.req.rid, Delta("".join(texts), job.tokens)))
        if job.done:
            events.append(self._end(job, self._finish_event(job, "".join(texts) if job.req.stream else None)))
        return events

    def _finish_event(self, job: Job, tail: str | None) -> Finish:
        segments = [s for w in job.windows for s in w.result["segments"]]
        for i, s in enumerate(segments):
            s["id"] = i
        words = [word for w in job.windows for word in w.result.get("words", [])] if job.req.word_timestamps else None
        return Finish(
            FinishReason.STOP,
            self._usage(job),
            text=tail,
            segments=segments,
            words=words,
            language=job.language or "en",
            duration=round(sum(w.samples.size for w in job.windows) / SAMPLE_RATE, 3),
        )

    def _usage(self, job: Job) -> Usage:
        return Usage(prompt_tokens=len(job.prompt_tokens), completion_tokens=job.tokens)

    # -- introspection ---------------------------------------------------------------------
    def requests(self) -> list[dict]:
        now = time.monotonic()
        return [
            {
                "id": j.req.rid,
                "phase": (Phase.DECODE if j.started else Phase.QUEUED).value,
                "windows": len(j.windows),
                "windows_done": sum(1 for w in j.windows if w.result is not None),
                "completion_tokens": j.tokens,
                "age_s": round(now - j.arrived, 3),
            }
            for j in self._jobs.values()
        ]
