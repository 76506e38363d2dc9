"""Requests between submit and the waiting queue: prepared, then started as Sequences.

Preparation (template, tokens, grammar: sequence.prepare) runs on the Preprocessor's thread
when there is one (a worker), else at submit (in-process tests and benchmarks). A request
being prepared is listed in /v1/status as "preparing" and can be cancelled; whatever its
preparation raises ends that request only, as a 4xx when it is the request's fault. A
prepared request whose prompt + max_tokens cannot fit the KV budget even alone ends here
too (worker/model/memory/kv_budget.py), or has its max_tokens cut under max_tokens_policy clamp."""

from __future__ import annotations

import itertools
import logging
import time

from ...shared import protocol as p
from ...shared.errors import ServiceError
from ...shared.events import Error
from ..model.interfaces import TextRunner
from ..model.memory.kv_budget import KVBudget
from ..model.runners.isolation import as_service_error
from ..text.fim import retyped_suffix_stop
from ..text.textstream import TextStream, exact_text
from .preprocess import Preprocessor
from .sequence import Intake, Prepared, Sequence, prepare

log = logging.getLogger(__name__)

Ready = tuple[Intake, Prepared | None, BaseException | None]  # prepared, or what preparing raised


class Preparing:
    """The requests being prepared, in arrival order."""

    def __init__(self, runner: TextRunner, policy: str, preprocessor: Preprocessor | None, kv: KVBudget | None = None):
        self.runner = runner
        self.policy = policy  # max_tokens past the context: worker/schedule/budget.py
        self.preprocessor = preprocessor
        self.kv = kv
        self._intake: dict[str, Intake] = {}
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._intake)

    def __contains__(self, rid: str) -> bool:
        return rid in self._intake

    def add(self, req: p.GenerateRequest) -> list[Ready]:
        """Start preparing req (checked already); without a preprocessor it is ready now."""
        intake = Intake(req, next(self._arrivals), time.monotonic())
        if self.preprocessor is None:
            try:
                return [(intake, prepare(req, self.runner, self.policy), None)]
            except Exception as e:
                return [(intake, None, e)]
        self._intake[req.rid] = intake
        self.preprocessor.submit(req.rid, lambda: prepare(req, self.runner, self.policy))
        return []

    def ready(self, wait_s: float = 0.0) -> list[Ready]:
        """The requests whose preparation has finished, taken off this list; those that
        arrived since the last call are waited for up to wait_s."""
        if self.preprocessor is None:
            return []
        self.preprocessor.settle(wait_s)
        done = []
        for rid, prepared, error in self.preprocessor.ready():
            intake = self._intake.pop(rid, None)
            if intake is not None:  # else cancelled meanwhile
                done.append((intake, prepared, error))
        return done

    def cancel(self, rid: str) -> bool:
        """Whether rid was being prepared (its preparation is dropped)."""
        if self._intake.pop(rid, None) is None:
            return False
        if self.preprocessor is not None:
            self.preprocessor.discard(rid)
        return True

    def listing(self, now: float) -> list[dict]:
        return [i.listing(now) for i in self._intake.values()]

    def start(self, ready: Ready) -> Sequence | Error:
        """The sequence of a prepared request, or the error event that ends it."""
        intake, prepared, error = ready
        req = intake.req
        if error is not None or prepared is None:
            if not isinstance(error, ServiceError):
                log.error("preparing %s failed: %r", req.rid, error, exc_info=error)
            return Error(as_service_error(error, "preparing its prompt"))
        if self.kv is not None:
            try:
                policy = req.max_tokens_policy or self.policy
                prepared.max_tokens = self.kv.check_alone(len(prepared.prompt), prepared.max_tokens, policy)
            except ServiceError as e:
                return Error(e)
        try:
            detokenizer = self.runner.new_detokenizer()
            if req.messages is None:  # a continuation: its text is exactly its tokens' decoding
                detokenizer = exact_text(detokenizer)
            stop = req.stop
            retyped = retyped_suffix_stop(req.fim) if req.fim else None
            if retyped is not None and retyped not in stop:  # a middle ends where the suffix is typed again
                stop = [*stop, retyped]
            seq = Sequence.start(intake, prepared, TextStream(detokenizer, stop))
        except Exception as e:
            return Error(as_service_error(e, "starting its detokenizer"))
        if req.prompt_logprobs is not None:
            try:
                scope = {"namespace": req.cache_namespace} if self.runner.supports_cache_scopes else {}
                seq.scorer = self.runner.prompt_scorer(seq.prompt, req.prompt_logprobs, **scope)
            except Exception as e:
                return Error(as_service_error(e, "scoring its prompt"))
        return seq
