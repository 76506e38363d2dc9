"""The worker's main loop: take messages from the link, step the scheduler, send events.

One EVENTS message per step carries every running request's delta (batched, not one
message per token)."""

from __future__ import annotations

import logging
import os
import time

import psutil
from mlxgw.shared import protocol as p
from mlxgw.shared.errors import ErrorCode, ServiceError

from .link import WorkerLink
from .runner import Runner

log = logging.getLogger("mlxgw.worker")

STATS_INTERVAL_S = 0.5
REQUEST_TYPES = {p.GENERATE: p.GenerateRequest, p.EMBED: p.EmbedRequest}


class Engine:
    def __init__(self, link: WorkerLink, runner: Runner, scheduler):
        """scheduler: the text Scheduler or the EmbedScheduler (same small interface)."""
        self.link = link
        self.runner = runner
        self.scheduler = scheduler
        self.draining = False
        self._proc = psutil.Process(os.getpid())
        self._last_stats = 0.0
        self._last_generated = 0
        self.steps = 0

    def run(self) -> None:
        while not self.link.gateway_gone.is_set():
            busy = self.scheduler.has_work()
            for msg in self.link.poll(0 if busy else 50):
                self._handle(msg)
            if self.scheduler.has_work():
                self._step()
            elif self.draining:
                return
            self._update_stats()

    def _step(self) -> None:
        self.link.step_started = time.monotonic()
        try:
            events = self.scheduler.step()
        except Exception as e:
            # The runner's state can no longer be trusted: end every request explicitly,
            # then let the process die so the supervisor restarts a clean worker.
            log.exception("engine step failed")
            err = ServiceError(ErrorCode.INTERNAL, f"the model worker failed: {e}").to_wire()
            items = [[r["id"], {"e": p.EV_ERROR, **err}] for r in self.scheduler.requests()]
            self.link.send(p.EVENTS, items=items)
            raise
        finally:
            self.link.step_started = None
        self.steps += 1
        if events:
            self.link.send(p.EVENTS, items=events)

    def _handle(self, msg: dict) -> None:
        kind = msg.get("t")
        if kind in REQUEST_TYPES:
            try:
                req = REQUEST_TYPES[kind].from_wire(msg["request"])
            except (KeyError, TypeError, ValueError) as e:
                rid = (msg.get("request") or {}).get("rid", "?")
                err = ServiceError(ErrorCode.INVALID_REQUEST, f"malformed request: {e}").to_wire()
                self.link.send(p.EVENTS, items=[[rid, {"e": p.EV_ERROR, **err}]])
                return
            if not isinstance(req, self.scheduler.request_type):
                # The gateway routes by kind; a mismatch means a misconfigured remote worker.
                what = "embeddings or reranking" if kind == p.EMBED else "text generation"
                err = ServiceError(ErrorCode.INVALID_REQUEST, f"this model does not serve {what}", param="model")
                self.link.send(p.EVENTS, items=[[req.rid, {"e": p.EV_ERROR, **err.to_wire()}]])
                return
            if self.draining:
                err = ServiceError(
                    ErrorCode.MODEL_UNAVAILABLE, "model worker is shutting down", retry_after=1.0
                ).to_wire()
                self.link.send(p.EVENTS, items=[[req.rid, {"e": p.EV_ERROR, **err}]])
                return
            try:
                events = self.scheduler.submit(req)
            except Exception as e:  # a bug on one request's intake must not take the worker down
                log.exception("submit failed for %s", req.rid)
                err = ServiceError(ErrorCode.INTERNAL, f"the worker could not start this request: {e}").to_wire()
                events = [(req.rid, {"e": p.EV_ERROR, **err})]
            self.link.send(p.EVENTS, items=events)
        elif kind == p.CANCEL:
            events = [ev for rid in msg.get("rids", []) for ev in self.scheduler.cancel(rid)]
            if events:
                self.link.send(p.EVENTS, items=events)
        elif kind == p.CALL:
            self._call(msg)
        elif kind == p.SHUTDOWN:
            self.draining = True
            if not msg.get("drain", True):
                for r in self.scheduler.requests():
                    self.scheduler.cancel(r["id"])
        else:
            log.warning("dropped message of unknown type %r", kind)

    def _call(self, msg: dict) -> None:
        op, cid = msg.get("op"), msg.get("cid")
        try:
            if op == "cache_stats":
                result = self.runner.cache_stats()
            elif op == "cache_clear":
                self.runner.cache_clear()
                result = self.runner.cache_stats()
            elif op == "tokenize":
                args = dict(msg.get("args") or {})
                # add_special_tokens=False: the prompt's own tokens (chat templates place theirs).
                plain = args.pop("add_special_tokens", True) is False and args.get("prompt") is not None
                req = p.GenerateRequest.from_wire({"rid": "tokenize", **args})
                ids = self.runner.encode_text(req.prompt) if plain else self.runner.encode(req)
                result = {"tokens": len(ids), "ids": [int(i) for i in ids]}
            elif op == "detokenize":
                result = {"text": self._decode((msg.get("args") or {}).get("tokens") or [])}
            elif op == "status":
                result = self.stats()
            else:
                raise ServiceError(ErrorCode.INVALID_REQUEST, f"unknown call {op!r}")
            self.link.send(p.REPLY, cid=cid, ok=True, result=result)
        except ServiceError as e:
            self.link.send(p.REPLY, cid=cid, ok=False, error=e.to_wire())
        except Exception as e:  # as above: answer the call, keep serving
            log.exception("call %s failed", op)
            self.link.send(p.REPLY, cid=cid, ok=False, error=ServiceError(ErrorCode.INTERNAL, str(e)).to_wire())

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
            "generated_tokens": s.generated_tokens,
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
        stats["tokens_per_s"] = round((stats["generated_tokens"] - self._last_generated) / elapsed, 2)
        self._last_generated = stats["generated_tokens"]
        self._last_stats = now
        self.link.stats = stats
