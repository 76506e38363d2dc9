"""The budget a chat template renders under: a deadline and an output size, per thread.

The deadline is checked by the sandbox's hooks (templates.py), by every filter, test and
global (template_filters.py), and on the lines of the frames a render runs its own loops in:
a thread-local trace hook follows the compiled template's frames and the pure-Python filter
implementations (Jinja's filters, textwrap, json's encoder, pprint), so a loop with no call
in its body, in the template or in a filter such as `slice`, is stopped too."""

from __future__ import annotations

import os
import pprint
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from jinja2 import async_utils as jinja_async_utils
from jinja2 import filters as jinja_filters
from jinja2 import utils as jinja_utils
from jinja2.exceptions import SecurityError

TIME_BUDGET_S = 5.0
# Tests only: a shorter deadline, so tests of endless templates wait less than 5 s per request.
TIME_BUDGET_ENV = "MLXGW_TEST_TEMPLATE_BUDGET_S"
OUTPUT_BUDGET_CHARS = 32 << 20  # a 10 MB body rendered with a template's own text around it
_CHECK_EVERY = 256  # traced lines between clock reads

_state = threading.local()

# Frames traced line by line: the compiled template's own, and the Python code filters run in.
_TRACED_FILES = frozenset(
    {"<template>", "<unknown>"}
    | {m.__file__ for m in (jinja_filters, jinja_utils, jinja_async_utils, textwrap, pprint)}
)


class TemplateBudgetExceeded(SecurityError):
    pass


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


def current() -> _Budget | None:
    return getattr(_state, "budget", None)


def check() -> None:
    b = current()
    if b is not None:
        b.check()


def limit() -> int:
    b = current()
    return b.max_chars if b is not None else OUTPUT_BUDGET_CHARS


def refuse_past(size: int, what: str) -> None:
    if size > limit():
        raise TemplateBudgetExceeded(f"the chat template's {what} would pass its output budget")


def _line_tracer(frame, event, arg):
    b = current()
    if b is not None and event == "line":
        b.lines += 1
        if b.lines % _CHECK_EVERY == 0:
            b.check()
    return _line_tracer


def _call_tracer(frame, event, arg):
    """Trace only the template's frames and the filters' Python frames, line by line (a
    generator's frame is traced again each time it resumes)."""
    if event == "call" and frame.f_code.co_filename in _TRACED_FILES:
        return _line_tracer
    return None


@contextmanager
def budget(seconds: float | None = None, max_chars: int = OUTPUT_BUDGET_CHARS) -> Iterator[None]:
    """Renders inside this block (on this thread) are bounded in time (default TIME_BUDGET_S)
    and output size."""
    if seconds is None:
        seconds = float(os.environ.get(TIME_BUDGET_ENV) or TIME_BUDGET_S)
    previous_trace = sys.gettrace()
    _state.budget = _Budget(seconds, max_chars)
    sys.settrace(_call_tracer)
    try:
        yield
    finally:
        sys.settrace(previous_trace)
        _state.budget = None
