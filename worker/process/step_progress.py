"""Progress inside one engine step: prefill reports each group of layers it has computed.

The gateway's watchdog kills a worker that makes no progress (gateway/link/liveness.py). A step
is the engine's unit of work, but one prefill step of a long prompt on a slow or throttled
host can take minutes while it is doing nothing wrong; judged by the step, it looks hung.
So, while a forward pass reads several tokens (prefill, not a one-token decode step), the
layers are evaluated in groups and each finished group calls `on_progress`: a worker is
then hung only when one group of layers stops finishing, which no slowness explains.

How: each decoder layer's class is swapped for a subclass whose __call__ evaluates its
output after every `group`-th layer. Parameters, names and attributes stay those of the
layer (nothing is wrapped), and one-token decode calls pass straight through, so the
decode step keeps mlx-lm's asynchronous pipelining. Evaluating a prefill chunk in pieces
costs a few synchronisations per step: measured, that doubled a test's time with a tiny
model's millisecond steps, so the marks are on only while steps are long enough for the
watchdog to care (`LayerProgress.note_step`): on a fast host they cost nothing.

MLXGW_TEST_SLOW_PREFILL_MS (tests only): each prompt token read costs that many more
milliseconds, spread over the layer groups, as on a host made slow on purpose."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import mlx.core as mx

log = logging.getLogger(__name__)

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


class LayerProgress:
    """The switch and the threshold of one model's layer marks."""

    def __init__(self, marks: int, long_step_s: float):
        self.marks = marks  # progress marks per forward pass (0: the layers were not found)
        self.long_step_s = long_step_s  # a step this long turns the marks on for the next ones
        self.enabled = False

    def note_step(self, seconds: float) -> None:
        """The engine's last step took `seconds`: marks on while steps are long."""
        self.enabled = self.marks > 0 and seconds >= self.long_step_s


def install(model, on_progress: Callable[[], None], long_step_s: float = 5.0) -> LayerProgress:
    """Make `model`'s prefill report progress per layer group once steps take long_step_s
    (no layer list found: step-level progress still holds)."""
    layers = _layers(model)
    if layers is None:
        log.info("no decoder layer list found: progress is reported per step only")
        return LayerProgress(0, long_step_s)
    group = max(1, len(layers) // GROUPS_PER_PASS)
    marks = [i for i in range(len(layers)) if (i + 1) % group == 0 or i == len(layers) - 1]
    slow_ms = float(os.environ.get(SLOW_ENV) or 0)
    progress = LayerProgress(len(marks), long_step_s)
    classes: dict[type, type] = {}
    for i in marks:
        layer = layers[i]
        base = type(layer)
        if base not in classes:
            classes[base] = _marking_class(base, on_progress, slow_ms / len(marks), progress)
        layer.__class__ = classes[base]
    return progress


def _marking_class(base: type, on_progress: Callable[[], None], slow_ms: float, progress: LayerProgress) -> type:
    def __call__(self, *args, **kwargs):
        out = base.__call__(self, *args, **kwargs)
        tokens = _tokens_in(args)
        if tokens < MIN_TOKENS:
            return out
        if slow_ms:  # the test's slow host: every prompt token costs time, marks or not
            time.sleep(tokens * slow_ms / 1000)
        if not progress.enabled:
            return out
        if isinstance(out, mx.array):
            mx.eval(out)
        on_progress()
        return out

    return type(f"Progress{base.__name__}", (base,), {"__call__": __call__})
