"""What a chat template may call, each bounded: the sandbox's filters, tests and globals.

The set is closed. Every filter, test and global is one this module knows, wrapped so that
it checks the deadline before and after it runs and its result (text or items) is held to the
output budget; one it does not know (a newer Jinja's or transformers') is left out, and a
template that uses it is refused like any template error. Known is one of:
- bounded by its input: time and result grow with the value it is given, whose own size the
  budget already holds (`upper`, `length`, `dictsort`, ...); a filter that turns its input into
  items (`list`, `sort`, `map`, ...) refuses an input of more than MAX_ITEMS;
- bounded here from its arguments, before the call that would allocate: a size or a count
  set by an argument (`center`, `indent`, `batch`, `slice`, `wordwrap`, `tojson`'s indent,
  `join`'s separator, `sum` of lists, `lipsum`, `strftime_now`, ...), whose result a single C
  call or a Python loop would otherwise build past the budget before any check could look."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from functools import wraps

from jinja2 import filters as jinja_filters
from jinja2 import utils as jinja_utils
from jinja2.utils import _PassArg

from .template_budget import TemplateBudgetExceeded, check, current, limit, refuse_past

MAX_LIPSUM_WORDS = 10_000
MAX_PIECES = 100_000  # batch size, slice count, wrapped lines: Jinja's own bound on range()
MAX_ITEMS = 1_000_000  # items a filter may make of its input (8 MB of references)
MAX_JSON_INDENT = 256  # characters of tojson's indent and of each separator
_FORMAT_WIDTH = re.compile(r"(\d+)")

# Time and result bounded by the input (already within the budget).
INPUT_BOUNDED_FILTERS = frozenset(
    {
        "abs", "attr", "capitalize", "count", "d", "default", "dictsort", "filesizeformat", "first", "float",
        "groupby", "int", "items", "last", "length", "list", "lower", "map", "max", "min", "pprint", "random",
        "reject", "rejectattr", "reverse", "round", "safe", "select", "selectattr", "sort", "string", "striptags",
        "title", "trim", "truncate", "unique", "upper", "urlize", "wordcount", "xmlattr",
    }
)  # fmt: skip
# Filters that make items of their input: an input of more items than MAX_ITEMS is refused.
ITEM_FILTERS = frozenset(
    {"list", "sort", "dictsort", "unique", "groupby", "map", "select", "reject", "selectattr", "rejectattr",
     "items", "batch", "slice", "join", "sum"}
)  # fmt: skip
INPUT_BOUNDED_GLOBALS = frozenset({"range", "dict", "cycler", "joiner", "namespace", "raise_exception"})


def _refuse_count(n, bound: int, what: str) -> None:
    if isinstance(n, int) and n > bound:
        raise TemplateBudgetExceeded(f"the chat template's {what} {n} is over its budget of {bound}")


def _too_many(what: str) -> TemplateBudgetExceeded:
    return TemplateBudgetExceeded(f"the chat template's {what} takes more than its budget of {MAX_ITEMS} items")


def _items(value, what: str) -> list:
    """The value's items, at most MAX_ITEMS of them (a generator is read only that far)."""
    out = list(itertools.islice(value, MAX_ITEMS + 1))
    if len(out) > MAX_ITEMS:
        raise _too_many(what)
    return out


# -- the filters a size or a count argument sets the cost of -------------------------------------


def _center(value, width: int = 80) -> str:
    refuse_past(int(width) if isinstance(width, int) else 0, "center width")
    return jinja_filters.do_center(value, width)


def _indent(s, width=4, first: bool = False, blank: bool = False) -> str:
    unit = width if isinstance(width, int) else len(str(width))
    refuse_past(unit * (str(s).count("\n") + 1) + len(str(s)), "indent")
    return jinja_filters.do_indent(s, width, first, blank)


@jinja_filters.pass_eval_context
def _replace(eval_ctx, s, old, new, count=None) -> str:
    text, old_text, new_text = str(s), str(old), str(new)
    times = text.count(old_text) if old_text else len(text) + 1
    if isinstance(count, int) and count >= 0:
        times = min(times, count)
    refuse_past(len(text) + times * len(new_text), "replace")
    return jinja_filters.do_replace(eval_ctx, s, old, new, count)


def check_format_widths(spec: str) -> None:
    """Any number in a format string may be a field width ("%999999999d", "{:>999999999}")."""
    numbers = _FORMAT_WIDTH.findall(spec)
    refuse_past(max((int(w) if len(w) < 12 else limit() + 1 for w in numbers), default=0), "format width")


def _format(value, *args, **kwargs) -> str:
    check_format_widths(str(value))
    return jinja_filters.do_format(value, *args, **kwargs)


def _batch(value, linecount: int, fill_with=None):
    _refuse_count(linecount, MAX_PIECES, "batch size")
    return jinja_filters.do_batch(value, linecount, fill_with)


@jinja_filters.pass_eval_context
def _slice(eval_ctx, value, slices: int, fill_with=None):
    _refuse_count(slices, MAX_PIECES, "slice count")
    return jinja_filters.do_slice(eval_ctx, value, slices, fill_with)


@jinja_filters.pass_environment
def _wordwrap(environment, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True) -> str:
    text = str(s)
    lines = len(text) // width + text.count("\n") + 1 if isinstance(width, int) and width > 0 else 1
    _refuse_count(lines, MAX_PIECES, "wordwrap line count")
    refuse_past(len(text) + lines * len(wrapstring or environment.newline_sequence), "wordwrap")
    return jinja_filters.do_wordwrap(environment, s, width, break_long_words, wrapstring, break_on_hyphens)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson (json.dumps, no HTML escaping). With an indent or separators the
    text is built piece by piece and stopped at the budget: its size is the item count times
    the indent times the depth, which no argument check alone can bound."""
    if indent is None and separators is None:  # the compact form: a few times its input at most
        return json.dumps(x, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
    unit = indent if isinstance(indent, int) and not isinstance(indent, bool) else len(str(indent or ""))
    seps = [str(s) for s in separators] if isinstance(separators, (list, tuple)) else []
    _refuse_count(max([unit, *map(len, seps)]), MAX_JSON_INDENT, "tojson indent or separator length")
    encoder = json.JSONEncoder(
        ensure_ascii=ensure_ascii, indent=indent, separators=tuple(separators) if separators else None,
        sort_keys=sort_keys,
    )  # fmt: skip
    out, size, budget = [], 0, limit()
    for i, piece in enumerate(encoder.iterencode(x)):
        size += len(piece)
        if size > budget:
            raise TemplateBudgetExceeded("the chat template's tojson would pass its output budget")
        if i % 4096 == 0:
            check()
        out.append(piece)
    return "".join(out)


@jinja_filters.pass_eval_context
def _join(eval_ctx, value, d="", attribute=None) -> str:
    items = _items(value, "join")
    size = sum(len(str(x)) for x in items) + len(str(d)) * max(len(items) - 1, 0)
    refuse_past(size, "join")
    return jinja_filters.do_join(eval_ctx, items, d, attribute)


@jinja_filters.pass_environment
def _sum(environment, iterable, attribute=None, start=0):
    """Numbers, or lists (tuples) joined into one: in linear time, where Python's sum of lists
    copies the growing result once per item."""
    items = _items(iterable, "sum")
    if attribute is not None:
        getter = jinja_filters.make_attrgetter(environment, attribute)
        items = [getter(x) for x in items]
    if isinstance(start, (list, tuple)) and all(type(x) is type(start) for x in items):
        _refuse_count(len(start) + sum(len(x) for x in items), MAX_ITEMS, "sum's item count")
        return type(start)(itertools.chain(start, *items))
    if all(isinstance(x, (int, float)) for x in (start, *items)):
        return sum(items, start)
    raise TypeError("sum adds numbers, or lists (tuples) to a list (tuple) as 'start'")


_ESCAPED_GROWTH = {"&": 4, "<": 3, ">": 3, '"': 4, "'": 4}  # "&amp;" is 4 more than "&"


def _escape_bounded(fn: Callable) -> Callable:
    def escape(value):
        text = value if isinstance(value, str) else str(value)
        refuse_past(len(text) + sum(text.count(c) * n for c, n in _ESCAPED_GROWTH.items()), "escape")
        return fn(value)

    return escape


def _urlencode(value):
    if isinstance(value, str):
        refuse_past(3 * len(value.encode("utf-8", "replace")), "urlencode")  # "%XX" per byte at most
    return jinja_filters.do_urlencode(value)


def bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (Jinja's names)
    if not all(isinstance(x, int) for x in (n, min, max)) or n * max > MAX_LIPSUM_WORDS or n < 0 or min < 1:
        raise TemplateBudgetExceeded(
            f"the chat template's lipsum() asks for more than its budget of {MAX_LIPSUM_WORDS} words"
        )
    return jinja_utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)


def _strftime_bounded(fn: Callable) -> Callable:
    def strftime_now(format):  # noqa: A002 (transformers' name)
        text = str(format)
        refuse_past(len(text) + 64 * text.count("%"), "strftime_now")  # %c is 24 characters, %Ec more
        return fn(format)

    return strftime_now


BOUNDED_FILTERS = {
    "center": _center, "indent": _indent, "replace": _replace, "format": _format, "batch": _batch,
    "slice": _slice, "wordwrap": _wordwrap, "tojson": _tojson, "join": _join, "sum": _sum,
    "urlencode": _urlencode,
}  # fmt: skip
_ESCAPING = ("e", "escape", "forceescape")


# -- the wrapper every callable gets -----------------------------------------------------------------


def check_result(out) -> None:
    """Text or items past the budget (a result no argument check foresaw) end the render."""
    if isinstance(out, str):
        refuse_past(len(out), "value")
    elif isinstance(out, (list, tuple, dict, set)) and len(out) > MAX_ITEMS:
        raise TemplateBudgetExceeded(f"the chat template made more than its budget of {MAX_ITEMS} items")


def guarded(name: str, fn: Callable, items_in: bool = False) -> Callable:
    """fn with the deadline checked around it and its result held to the budget; items_in:
    an input of more than MAX_ITEMS items is refused first."""
    value_at = 1 if _PassArg.from_obj(fn) is not None else 0

    @wraps(fn)  # keeps Jinja's pass_context / pass_environment mark
    def call(*args, **kwargs):
        check()
        if items_in and len(args) > value_at:
            value = args[value_at]
            if hasattr(value, "__len__") and len(value) > MAX_ITEMS:
                raise _too_many(name)
        out = fn(*args, **kwargs)
        if current() is not None:
            check()
            check_result(out)
        return out

    return call


def bounded_filters(available: dict[str, Callable]) -> dict[str, Callable]:
    """The sandbox's filters: those known bounded, each guarded; the rest left out."""
    out = {}
    for name, fn in available.items():
        if name in BOUNDED_FILTERS:
            fn = BOUNDED_FILTERS[name]
        elif name in _ESCAPING:
            fn = _escape_bounded(fn)
        elif name not in INPUT_BOUNDED_FILTERS:
            continue
        out[name] = guarded(name, fn, name in ITEM_FILTERS)
    return out


def bounded_globals(available: dict[str, object]) -> dict[str, object]:
    out: dict[str, object] = {"lipsum": guarded("lipsum", bounded_lipsum)}
    for name, value in available.items():
        if name == "strftime_now":
            out[name] = guarded(name, _strftime_bounded(value))
        elif name in INPUT_BOUNDED_GLOBALS:
            out[name] = value  # classes and objects: their calls go through the sandbox's call hook
    return out


def bounded_tests(available: dict[str, Callable]) -> dict[str, Callable]:
    """Jinja's tests compare or look at one value: each guarded, none takes a size."""
    return {name: guarded(name, fn) for name, fn in available.items()}


# -- str methods a template calls (the sandbox's call hook) ----------------------------------------

_WIDTH_METHODS = {"center", "ljust", "rjust", "zfill"}
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def check_str_method(text: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """The str methods whose result size an argument sets, checked before the call; returns
    the arguments to call with (an iterable to join is read once, here)."""
    if name in _WIDTH_METHODS and args and isinstance(args[0], int):
        refuse_past(args[0], f"{name} width")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        refuse_past(len(text) + text.count("\t") * (size if isinstance(size, int) else 0), "expandtabs")
    elif name == "replace" and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        times = text.count(old) if old else len(text) + 1
        refuse_past(len(text) + times * len(new), "replace")
    elif name == "join" and args:
        items = _items(args[0], "join")
        refuse_past(sum(len(x) for x in items if isinstance(x, str)) + len(text) * len(items), "join")
        return (items, *args[1:])
    elif name in ("split", "rsplit", "splitlines"):
        sep = args[0] if args and name != "splitlines" else kwargs.get("sep")
        breaks = _LINE_BREAKS if name == "splitlines" else (" \t" + _LINE_BREAKS if sep is None else None)
        pieces = sum(text.count(c) for c in breaks) if breaks else text.count(str(sep)) if sep else 0
        _refuse_count(pieces + 1, MAX_ITEMS, f"{name} piece count")
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        refuse_past(len(text) * max(longest, 1), "translate")
    return args
