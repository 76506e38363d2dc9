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
  before it is allocated;
- refuses, before the C call that would allocate it, what the trace hook cannot interrupt
  (issue 26): `lipsum` past a few paragraphs, `center`/`indent` widths, `replace` and
  `format` results past the output budget.
A template over budget raises TemplateBudgetExceeded, which the runner turns into a 400."""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from jinja2 import filters as jinja_filters
from jinja2 import utils as jinja_utils
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
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        _check()
        if isinstance(getattr(__obj, "__self__", None), str):
            _check_str_method(__obj.__self__, getattr(__obj, "__name__", ""), args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        """str.format / format_map, as Jinja sandboxes them, with their widths bounded."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_format_widths(value.__self__)
        return wrapped

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
        elif operator == "%" and isinstance(left, str):
            _check_format_widths(left)
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


# -- what one C call could allocate: refused from its arguments, before the call -------------

MAX_LIPSUM_WORDS = 10_000
_FORMAT_WIDTH = re.compile(r"(\d+)")


def _limit() -> int:
    b = _current()
    return b.max_chars if b is not None else OUTPUT_BUDGET_CHARS


def _refuse_past(size: int, what: str) -> None:
    if size > _limit():
        raise TemplateBudgetExceeded(f"the chat template's {what} would pass its output budget")


def _bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (Jinja's names)
    if not all(isinstance(x, int) for x in (n, min, max)) or n * max > MAX_LIPSUM_WORDS or n < 0 or min < 1:
        raise TemplateBudgetExceeded(
            f"the chat template's lipsum() asks for more than its budget of {MAX_LIPSUM_WORDS} words"
        )
    return jinja_utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)


def _center(value, width: int = 80) -> str:
    _refuse_past(int(width) if isinstance(width, int) else 0, "center width")
    return jinja_filters.do_center(value, width)


def _indent(s, width=4, first: bool = False, blank: bool = False) -> str:
    unit = width if isinstance(width, int) else len(str(width))
    _refuse_past(unit * (str(s).count("\n") + 1) + len(str(s)), "indent")
    return jinja_filters.do_indent(s, width, first, blank)


@jinja_filters.pass_eval_context
def _replace(eval_ctx, s, old, new, count=None) -> str:
    text, old_text, new_text = str(s), str(old), str(new)
    times = text.count(old_text) if old_text else len(text) + 1
    if isinstance(count, int) and count >= 0:
        times = min(times, count)
    _refuse_past(len(text) + times * len(new_text), "replace")
    return jinja_filters.do_replace(eval_ctx, s, old, new, count)


def _check_format_widths(spec: str) -> None:
    """Any number in a format string may be a field width ("%999999999d", "{:>999999999}")."""
    numbers = _FORMAT_WIDTH.findall(spec)
    _refuse_past(max((int(w) if len(w) < 12 else _limit() + 1 for w in numbers), default=0), "format width")


_WIDTH_METHODS = {"center", "ljust", "rjust", "zfill"}


def _check_str_method(text: str, name: str, args: tuple, kwargs: dict) -> None:
    """The str methods whose result size an argument sets, checked before the call."""
    if name in _WIDTH_METHODS and args and isinstance(args[0], int):
        _refuse_past(args[0], f"{name} width")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        _refuse_past(len(text) + text.count("\t") * (size if isinstance(size, int) else 0), "expandtabs")
    elif name == "replace" and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        times = text.count(old) if old else len(text) + 1
        _refuse_past(len(text) + times * len(new), "replace")


def _format(value, *args, **kwargs) -> str:
    _check_format_widths(str(value))
    return jinja_filters.do_format(value, *args, **kwargs)


BOUNDED_FILTERS = {"center": _center, "indent": _indent, "replace": _replace, "format": _format}


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
        budgeted.filters.update(BOUNDED_FILTERS)
        budgeted.globals.update(env.globals)
        budgeted.globals["lipsum"] = _bounded_lipsum
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
