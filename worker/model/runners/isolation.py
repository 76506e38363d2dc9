"""Per-sequence fault boxes: an exception raised for one sequence ends that sequence only.

Samplers and logits processors run inside the runner's batched step (mlx-lm's and
mlx-vlm's BatchGenerator call them row by row). An exception escaping one of them would
abort the step for the whole batch, so each sequence's callables are wrapped: the first
exception is caught and recorded in the sequence's guard, the callable turns neutral for the
rest of the step (logits unchanged, greedy draw), and after the step the scheduler ends the
faulted sequence with an error event and removes it from the batch."""

from __future__ import annotations

import logging
import os

from ....shared.errors import ErrorCode, ServiceError

log = logging.getLogger(__name__)


class SequenceGuard:
    """Records the first fault of one sequence's sampling or constraint code."""

    def __init__(self, rid: str):
        self.rid = rid
        self.error: BaseException | None = None

    @property
    def faulted(self) -> bool:
        return self.error is not None

    def record(self, error: Exception, where: str) -> None:
        heal_random_state()
        if self.error is None:
            log.error("request %s failed while %s: %r", self.rid, where, error, exc_info=error)
            self.error = error


def heal_random_state() -> None:
    """Call after an exception escaped sampling code. mlx-lm's filters are compiled with
    MLX's global random state as an implicit output; when one raises (mlx 0.32: top_k past
    the vocabulary, for one), `mx.random.state` is left holding the tracer's placeholder, and
    every later unseeded draw in the process fails with "eval an array without a primitive":
    one request's fault would end every other request's sampling. A fresh seed repairs it."""
    import mlx.core as mx

    try:
        mx.eval(mx.random.state)
    except RuntimeError:
        mx.random.seed(int.from_bytes(os.urandom(4), "little"))
        log.warning("MLX's random state was left broken by a failed sampling call; reseeded")


def as_service_error(error: BaseException, doing: str) -> ServiceError:
    """The error event for a sequence that failed: a ServiceError keeps its own code (a 400
    raised by a constraint, ...); anything else is an internal error of this request only."""
    if isinstance(error, ServiceError):
        return error
    return ServiceError(ErrorCode.INTERNAL, f"the request failed while {doing}: {type(error).__name__}: {error}")
