"""The worker's main loop: take messages from the link, step the scheduler, send events.

One EVENTS message per step carries every running request's delta (batched, not one
message per token). A fault that belongs to one request ends that request only (see
scheduler and isolation); only a failure of the batched step itself, which no single
request can be blamed for, ends the process."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future

import psutil

from ...shared import protocol as p
from ...shared.errors import ErrorCode, ServiceError
from ...shared.events import Error
from ..model.interfaces import ModelRunner, Scheduler
from ..schedule.preprocess import Preprocessor
from .link import WorkerLink

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5
IDLE_POLL_MS = 50
PREPARING_POLL_MS = 5  # a request is being prepared: look for it soon
REQUEST_TYPES = {
    p.GENERATE: p.GenerateRequest,
    p.EMBED: p.EmbedRequest,
    p.TRANSCRIBE: p.TranscribeRequest,
    p.SPEAK: p.SpeechRequest,
    p.DRAW: p.ImageRequest,
}
SERVES = {
    p.EMBED: "embeddings or reranking",
    p.TRANSCRIBE: "speech to text",
    p.SPEAK: "text to speech",
    p.DRAW: "images",
}


class Engine:
    def __init__(self, link: WorkerLink, runner: ModelRunner, scheduler: Scheduler, preprocessor: Preprocessor):
        """preprocessor: the preparation thread, where worker calls (tokenize) run too."""
        self.link = link
        self.preprocessor = preprocessor
        self.runner = runner
        self.scheduler = scheduler
        self.draining = False
        self._proc = psutil.Process(os.getpid())
        self._last_stats = 0.0
        self._last_generated = 0
        self.steps = 0
        self._calls: list[tuple[object, Future]] = []  # (cid, result) of calls on the preparation thread
        self.layer_progress = None  # step_progress.LayerProgress: told how long each step took
        self._welcomes = 0  # the link's WELCOMEs answered with a snapshot of the prefix cache

    def run(self) -> None:
        while not self.link.gateway_gone.is_set():
            busy = self.scheduler.has_work()
            preparing = self.scheduler.preparing()
            wait_ms = 0 if busy else PREPARING_POLL_MS if preparing or self._calls else IDLE_POLL_MS
            for msg in self.link.poll(wait_ms):
                self._watched(self._handle, msg)
            self._reply_finished_calls()
            self.link.flush()  # the acceptances of all of them in one frame, before a step can take long
            if self.scheduler.has_work():
                self._watched(self._step)
            elif self.scheduler.preparing():
                self._watched(self._send_prepared)
            elif self.draining:
                return
            self._update_stats()

    def _watched(self, fn, *args) -> None:
        """Run one phase of the loop under the watchdog: heartbeats report how long it has
        run, and the gateway declares the worker hung past its limit."""
        self.link.step_started = time.monotonic()
        try:
            fn(*args)
        finally:
            self.link.step_started = None

    def _send(self, events: list[p.Event]) -> None:
        if events:
            self.link.send(p.EVENTS, items=events)

    def _send_prepared(self) -> None:
        self._send(self.scheduler.poll_prepared())

    def _step(self) -> None:
        started = time.monotonic()
        try:
            events = self.scheduler.step()
        except Exception as e:
            # The batched step failed, not one sequence: the runner's state can no longer be
            # trusted. End every request explicitly, then let the supervisor restart a clean worker.
            log.exception("engine step failed")
            err = ServiceError(ErrorCode.INTERNAL, f"the model worker failed: {e}")
            self._send([(r["id"], Error(err)) for r in self.scheduler.requests()])
            self.link.flush()  # the link gathers events until the next poll, which will not come
            raise
        self.steps += 1
        if self.layer_progress is not None:
            self.layer_progress.note_step(time.monotonic() - started)
        self._send(events)

    def _handle(self, msg: dict) -> None:
        kind = msg.get("t")
        if kind in REQUEST_TYPES:
            self._intake(kind, msg)
        elif kind == p.CANCEL:
            rids = msg.get("rids")
            self._send([ev for rid in (rids if isinstance(rids, list) else []) for ev in self.scheduler.cancel(rid)])
        elif kind == p.CALL:
            self._call(msg)
        elif kind == p.SHUTDOWN:
            self.draining = True
            if not msg.get("drain", True):
                for r in self.scheduler.requests():
                    self.scheduler.cancel(r["id"])
        else:
            log.warning("dropped message of unknown type %r", kind)

    def _intake(self, kind: str, msg: dict) -> None:
        wire = msg.get("request")
        rid = wire.get("rid") if isinstance(wire, dict) and isinstance(wire.get("rid"), str) else "?"
        try:
            req = REQUEST_TYPES[kind].from_wire(wire)
            if not isinstance(req, self.scheduler.request_type):
                # The gateway routes by kind; a mismatch means a misconfigured remote worker.
                what = SERVES.get(kind, "text generation")
                raise ServiceError(ErrorCode.INVALID_REQUEST, f"this model does not serve {what}", param="model")
            if self.draining:
                raise ServiceError(ErrorCode.MODEL_UNAVAILABLE, "model worker is shutting down", retry_after=1.0)
            events = self.scheduler.submit(req)
        except ServiceError as e:
            events = [(rid, Error(e))]
        except (KeyError, TypeError, ValueError) as e:
            events = [(rid, Error(ServiceError(ErrorCode.INVALID_REQUEST, f"malformed request: {e}")))]
        except Exception as e:  # a bug on one request's intake must not take the worker down
            log.exception("submit failed for %s", rid)
            err = ServiceError(ErrorCode.INTERNAL, f"the worker could not start this request: {e}")
            events = [(rid, Error(err))]
        self._send(events)

    def _call(self, msg: dict) -> None:
        op, cid = msg.get("op"), msg.get("cid")
        try:
            if op == "cache_stats":
                result = self.runner.cache_stats()
            elif op == "cache_clear":
                self.runner.cache_clear()
                result = self.runner.cache_stats()
            elif op in ("tokenize", "detokenize"):
                args = dict(msg.get("args") or {})
                job = (lambda: self._tokenize(args)) if op == "tokenize" else (lambda: self._detokenize(args))
                # Off the engine thread, as a chat request's prompt. It was looked up on
                # the scheduler once; when that moved into its intake, every tokenize quietly ran
                # here and stalled the streams for as long as it took.
                self._calls.append((cid, self.preprocessor.call(job)))
                return
            elif op == "status":
                result = self.stats()
            elif op == "adapters":  # hot add and remove (gateway/api/admin/adapters.py)
                result = self._set_adapters(msg.get("args"))
            else:
                raise ServiceError(ErrorCode.INVALID_REQUEST, f"unknown call {op!r}")
            self.link.send(p.REPLY, cid=cid, ok=True, result=result)
        except ServiceError as e:
            self.link.send(p.REPLY, cid=cid, ok=False, error=e.to_wire())
        except Exception as e:  # as above: answer the call, keep serving
            log.exception("call %s failed", op)
            self.link.send(p.REPLY, cid=cid, ok=False, error=ServiceError(ErrorCode.INTERNAL, str(e)).to_wire())

    def _set_adapters(self, args: object) -> dict:
        bank = getattr(self.runner, "adapters", None)
        sources = args.get("adapters") if isinstance(args, dict) else None
        if bank is None:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "this model's engine does not serve LoRA adapters")
        if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
            raise ServiceError(ErrorCode.INVALID_REQUEST, "adapters: expected a map of name to folder")
        check = args.get("check") if isinstance(args, dict) else None
        return bank.set_sources(sources, check if isinstance(check, str) else None)

    def _tokenize(self, args: dict) -> dict:
        # add_special_tokens=False: the prompt's own tokens (chat templates place theirs).
        plain = args.pop("add_special_tokens", True) is False and args.get("prompt") is not None
        req = p.GenerateRequest.from_wire({"rid": "tokenize", **args})
        ids = self.runner.encode_text(req.prompt) if plain else self.runner.encode(req)
        return {"tokens": len(ids), "ids": [int(i) for i in ids]}

    def _detokenize(self, args: dict) -> dict:
        return {"text": self._decode(args.get("tokens") or [])}

    def _reply_finished_calls(self) -> None:
        if not self._calls:
            return
        waiting = []
        for cid, future in self._calls:
            if not future.done():
                waiting.append((cid, future))
                continue
            error = future.exception()
            if error is None:
                self.link.send(p.REPLY, cid=cid, ok=True, result=future.result())
                continue
            if not isinstance(error, ServiceError):
                kind = "invalid" if isinstance(error, (KeyError, TypeError, ValueError)) else "internal"
                code = ErrorCode.INVALID_REQUEST if kind == "invalid" else ErrorCode.INTERNAL
                error = ServiceError(code, f"the tokenizer refused this input: {type(error).__name__}: {error}")
            self.link.send(p.REPLY, cid=cid, ok=False, error=error.to_wire())
        self._calls = waiting

    def _decode(self, ids: list) -> str:
        """Token ids back to text with the model's own tokenizer (the engines without one
        use their streaming detokenizer)."""
        tokenizer = getattr(self.runner, "tokenizer", None)
        vocab = getattr(self.runner, "vocab_size", None) or getattr(tokenizer, "vocab_size", None)
        if any(not isinstance(t, int) or t < 0 or (vocab is not None and t >= vocab) for t in ids):
            raise ServiceError(
                ErrorCode.INVALID_REQUEST, f"token ids must be integers in [0, {vocab or 'vocab'})", param="tokens"
            )
        if tokenizer is not None and hasattr(tokenizer, "decode"):
            return tokenizer.decode(ids)
        detok, pieces = self.runner.new_detokenizer(), []
        for t in ids:
            detok.add_token(t)
            pieces.append(detok.last_segment)
        detok.finalize()
        return "".join(pieces) + detok.last_segment

    def stats(self) -> dict:
        s = self.scheduler
        return {
            "running": s.running,
            "waiting": s.waiting,
            **s.counters(),
            "finished_requests": s.finished,
            "steps": self.steps,
            "rss_bytes": self._proc.memory_info().rss,
            "requests": s.requests(),
            "cache": self.runner.cache_stats(),
            **self.runner.stats(),
        }

    def _update_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < STATS_INTERVAL_S:
            return
        stats = self.stats()
        elapsed = now - self._last_stats if self._last_stats else STATS_INTERVAL_S
        if "generated_tokens" in stats:
            stats["tokens_per_s"] = round((stats["generated_tokens"] - self._last_generated) / elapsed, 2)
            self._last_generated = stats["generated_tokens"]
        self._last_stats = now
        self.link.stats = stats
        self._report_prefixes()

    def _report_prefixes(self) -> None:
        """What the prefix cache stored and evicted since the last tick, in the gateway's route
        entries (worker/model/cache/prefix_events.py; kept only where requests carry a route,
        a model with several workers), in one message; all it holds after each WELCOME."""
        events = getattr(getattr(self.runner, "prefix_cache", None), "events", None)
        welcomed, self._welcomes = self.link.welcomes != self._welcomes, self.link.welcomes
        if events is None:
            return
        if welcomed:
            self.link.send(p.PREFIXES, held=events.snapshot(), evicted=[], snapshot=True)
        elif events.held or events.evicted:
            held, evicted = events.drain()
            self.link.send(p.PREFIXES, held=held, evicted=evicted)
