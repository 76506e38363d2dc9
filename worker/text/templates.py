"""Chat templates are programs from outside (a model's files, an imported GGUF, a request):
they render in Jinja's immutable sandbox with a time and an output-size budget.

transformers renders every chat template (tokenizers' and processors' apply_chat_template)
through one compile function; `install()` replaces it with one that compiles in
BudgetedSandbox, the same sandbox transformers uses (ImmutableSandboxedEnvironment, same
extensions) plus budgets (template_budget.py). A render runs inside `budget(...)`, and:
- the deadline is checked in the sandbox's call, attribute and operator hooks, and on the
  lines of the template's frames and of the filters' Python frames (a trace hook);
- the rendered text (`concat`) is capped, and string or list repetition past the cap is
  refused before it is allocated;
- every filter, test and global is one template_filters.py knows and bounds (a closed set):
  those a size or a count argument sets the cost of (`center`, `batch`, `slice`, `wordwrap`,
  `tojson`'s indent, `lipsum`, ...) are refused from their arguments before the call, the
  others are bounded by their input; each result is held to the budget;
- str methods called from a template (`ljust`, `join`, `split`, ...) are checked the same way.
A template over budget raises TemplateBudgetExceeded, which the runner turns into a 400.

Why bounds in the process rather than rendering in a child with an address-space limit: a
render is on every chat request's path (a child would add a copy of every conversation and
a round trip per request, and its own memory per worker), while the closed set makes a new,
unknown filter a refusal instead of an escape."""

from __future__ import annotations

from functools import lru_cache

from jinja2.sandbox import ImmutableSandboxedEnvironment

from . import template_filters as tf
from .template_budget import (
    OUTPUT_BUDGET_CHARS,
    TIME_BUDGET_S,
    TemplateBudgetExceeded,
    budget,
    check,
    current,
    limit,
)

__all__ = ["OUTPUT_BUDGET_CHARS", "TIME_BUDGET_S", "BudgetedSandbox", "TemplateBudgetExceeded", "budget", "install"]

MAX_EXPONENT = 1024  # `**` past this computes huge integers in one C call


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        check()
        if isinstance(getattr(__obj, "__self__", None), str):
            args = tf.check_str_method(__obj.__self__, getattr(__obj, "__name__", ""), args, kwargs)
        out = super().call(__context, __obj, *args, **kwargs)
        if current() is not None:
            tf.check_result(out)
        return out

    def wrap_str_format(self, value):
        """str.format / format_map, as Jinja sandboxes them, with their widths bounded."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            tf.check_format_widths(value.__self__)
        return wrapped

    def getattr(self, obj, attribute):
        check()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        check()
        return super().getitem(obj, argument)

    def call_binop(self, context, operator, left, right):
        check()
        cap = limit()
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > cap:
                    raise TemplateBudgetExceeded("the chat template repeats a sequence past its output budget")
        elif operator == "%" and isinstance(left, str):
            tf.check_format_widths(left)
        elif operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise TemplateBudgetExceeded(f"the chat template raises to a power over {MAX_EXPONENT}")
        elif operator == "+" and isinstance(left, (str, list)) and isinstance(right, (str, list)):
            if len(left) + len(right) > cap:
                raise TemplateBudgetExceeded("the chat template builds a value past its output budget")
        return super().call_binop(context, operator, left, right)

    @staticmethod
    def concat(parts) -> str:  # type: ignore[override]
        b = current()
        out, size = [], 0
        for piece in parts:
            size += len(piece)
            if b is not None:
                b.check_size(size)
            out.append(piece)
        return "".join(out)


def _sandboxed_compile(original):
    """A drop-in for transformers' compile function: its environment's configuration,
    rebuilt on BudgetedSandbox with only the bounded filters, tests and globals."""

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
        budgeted.filters = tf.bounded_filters(env.filters)
        budgeted.tests = tf.bounded_tests(env.tests)
        budgeted.globals = tf.bounded_globals(env.globals)
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
