"""Progress inside one engine step: prefill reports each group of layers it has computed.

The gateway's watchdog kills a worker that makes no progress (gateway/liveness.py). A step
is the engine's unit of work, but one prefill step of a long prompt on a slow or throttled
host can take minutes while it is doing nothing wrong; judged by the step, it looks hung.
So, while a forward pass reads several tokens (prefill, not a one-token decode step), the
layers are evaluated in groups and each finished group calls `on_progress`: a worker is
then hung only when one group of layers stops finishing, which no slowness explains.

How: each decoder layer's class is swapped for a subclass whose __call__ evaluates its
output after every `group`-th layer. Parameters, names and attributes stay those of the
layer (nothing is wrapped), and one-token decode calls pass straight through, so the
decode step keeps mlx-lm's asynchronous pipelining. Evaluating a prefill chunk in a few
pieces costs a few synchronisations per step, nothing per token.

MLXGW_TEST_SLOW_PREFILL_MS (tests only): each prompt token read costs that many more
milliseconds, spread over the layer groups, as on a host made slow on purpose."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import mlx.core as mx

log = logging.getLogger("mlxgw.worker.progress")

GROUPS_PER_PASS = 8  # progress marks per forward pass (a 24-layer model: every 3 layers)
MIN_TOKENS = 2  # a call reading fewer tokens than this is a decode step: not interrupted
SLOW_ENV = "MLXGW_TEST_SLOW_PREFILL_MS"


def _layers(model) -> list | None:
    for holder in (model, getattr(model, "language_model", None)):
        layers = getattr(holder, "layers", None) if holder is not None else None
        if isinstance(layers, list | tuple) and layers:
            return list(layers)
    return None


def _tokens_in(args: tuple) -> int:
    x = args[0] if args else None
    if isinstance(x, mx.array) and x.ndim >= 2:
        return int(x.shape[0]) * int(x.shape[1])
    return 0


def install(model, on_progress: Callable[[], None]) -> int:
    """Make `model`'s prefill report progress per layer group; returns the marks per pass
    (0 when the model's layers cannot be found: step-level progress still holds)."""
    layers = _layers(model)
    if layers is None:
        log.info("no decoder layer list found: progress is reported per step only")
        return 0
    group = max(1, len(layers) // GROUPS_PER_PASS)
    marks = [i for i in range(len(layers)) if (i + 1) % group == 0 or i == len(layers) - 1]
    slow_ms = float(os.environ.get(SLOW_ENV) or 0)
    classes: dict[type, type] = {}
    for i in marks:
        layer = layers[i]
        base = type(layer)
        if base not in classes:
            classes[base] = _marking_class(base, on_progress, slow_ms / len(marks))
        layer.__class__ = classes[base]
    return len(marks)


def _marking_class(base: type, on_progress: Callable[[], None], slow_ms: float) -> type:
    def __call__(self, *args, **kwargs):
        out = base.__call__(self, *args, **kwargs)
        tokens = _tokens_in(args)
        if tokens < MIN_TOKENS:
            return out
        if isinstance(out, mx.array):
            mx.eval(out)
        if slow_ms:
            time.sleep(tokens * slow_ms / 1000)
        on_progress()
        return out

    return type(f"Progress{base.__name__}", (base,), {"__call__": __call__})
