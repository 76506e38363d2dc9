"""Chat templates are programs from outside (a model's files, an imported GGUF, a request):
they render in Jinja's immutable sandbox with a time and an output-size budget.

transformers renders every chat template (tokenizers' and processors' apply_chat_template)
through one compile function; `install()` replaces it with one that compiles in
BudgetedSandbox, the same sandbox transformers uses (ImmutableSandboxedEnvironment, same
filters and globals) plus budgets. A render runs inside `budget(...)`, which:
- checks a deadline in the sandbox's call, attribute and operator hooks, and on every line
  of the compiled template (a thread-local trace hook limited to template frames, so a
  loop with no calls in its body is stopped too);
- caps the rendered text (`concat`) and refuses string or list repetition past the cap
  before it is allocated.
A template over budget raises TemplateBudgetExceeded, which the runner turns into a 400."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

TIME_BUDGET_S = 5.0
OUTPUT_BUDGET_CHARS = 32 << 20  # a 10 MB body rendered with a template's own text around it
MAX_EXPONENT = 1024  # `**` past this computes huge integers in one C call
_CHECK_EVERY = 256  # template lines between clock reads

_state = threading.local()


class TemplateBudgetExceeded(SecurityError):
    pass


@lru_cache(maxsize=1)
def _template_filenames() -> frozenset[str]:
    return frozenset({"<template>", "<unknown>"})


class _Budget:
    def __init__(self, seconds: float, max_chars: int):
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.max_chars = max_chars
        self.lines = 0

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBudgetExceeded(f"the chat template ran longer than its {self.seconds:g} s budget")

    def check_size(self, n: int) -> None:
        if n > self.max_chars:
            raise TemplateBudgetExceeded(f"the chat template's output passed its {self.max_chars} character budget")


def _current() -> _Budget | None:
    return getattr(_state, "budget", None)


def _check() -> None:
    b = _current()
    if b is not None:
        b.check()


def _line_tracer(frame, event, arg):
    b = _current()
    if b is not None and event == "line":
        b.lines += 1
        if b.lines % _CHECK_EVERY == 0:
            b.check()
    return _line_tracer


def _call_tracer(frame, event, arg):
    """Trace only the compiled template's own frames (root, blocks, macros), line by line."""
    if event == "call" and frame.f_code.co_filename in _template_filenames():
        return _line_tracer
    return None


@contextmanager
def budget(seconds: float = TIME_BUDGET_S, max_chars: int = OUTPUT_BUDGET_CHARS) -> Iterator[None]:
    """Renders inside this block (on this thread) are bounded in time and output size."""
    previous_trace = sys.gettrace()
    _state.budget = _Budget(seconds, max_chars)
    sys.settrace(_call_tracer)
    try:
        yield
    finally:
        sys.settrace(previous_trace)
        _state.budget = None


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+"})

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        _check()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        _check()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _check()
        return super().getitem(obj, argument)

    def call_binop(self, context, operator, left, right):
        _check()
        b = _current()
        limit = b.max_chars if b is not None else OUTPUT_BUDGET_CHARS
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > limit:
                    raise TemplateBudgetExceeded("the chat template repeats a sequence past its output budget")
        elif operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise TemplateBudgetExceeded(f"the chat template raises to a power over {MAX_EXPONENT}")
        elif operator == "+" and isinstance(left, (str, list)) and isinstance(right, (str, list)):
            if len(left) + len(right) > limit:
                raise TemplateBudgetExceeded("the chat template builds a value past its output budget")
        return super().call_binop(context, operator, left, right)

    @staticmethod
    def concat(parts) -> str:  # type: ignore[override]
        b = _current()
        out, size = [], 0
        for piece in parts:
            size += len(piece)
            if b is not None:
                b.check_size(size)
            out.append(piece)
        return "".join(out)


def _sandboxed_compile(original):
    """A drop-in for transformers' compile function: its environment's configuration,
    rebuilt on BudgetedSandbox."""

    @lru_cache(maxsize=64)
    def compile_template(chat_template: str):
        # transformers' environment (extensions, filters, globals), taken from an empty
        # template: compiling the untrusted one there would run its constant folding unbounded.
        env = original("").environment
        budgeted = BudgetedSandbox(
            trim_blocks=env.trim_blocks,
            lstrip_blocks=env.lstrip_blocks,
            extensions=[type(e) for e in env.extensions.values()],
        )
        budgeted.filters.update(env.filters)
        budgeted.globals.update(env.globals)
        return budgeted.from_string(chat_template)

    return compile_template


_installed = False


def install() -> None:
    """Route every chat template transformers renders through BudgetedSandbox (idempotent)."""
    global _installed
    if _installed:
        return
    from transformers.utils import chat_template_utils as ctu

    ctu._compile_jinja_template = _sandboxed_compile(ctu._compile_jinja_template)
    _installed = True
