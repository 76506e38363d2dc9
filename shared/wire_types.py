"""Type checks of decoded wire values against a dataclass's declared field types, shared by
the request structs (shared/protocol.py) and the event structs (shared/events.py)."""

from __future__ import annotations

import functools
from dataclasses import fields
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

_SCALARS = {int: (int,), float: (int, float), str: (str,), bool: (bool,), bytes: (bytes,), dict: (dict,)}


@functools.cache
def _shape(tp: object) -> tuple:
    return get_origin(tp), get_args(tp)


# Item types whose exact Python type msgpack decodes to: a list of exactly these conforms
# without a call per item (a long prompt_tokens list has thousands).
_EXACT_ITEMS = {int: int, str: str, bytes: bytes, dict: dict}


def _conforms(value: object, tp: object) -> bool:
    """Whether a decoded wire value has the declared type (ints, floats, strings, bools, bytes,
    dicts, lists of those, optionals). bool is not an int here."""
    origin, args = _shape(tp)
    if origin in (Union, UnionType):
        if value is None:  # most optional fields of a request are unset
            return type(None) in args
        return any(_conforms(value, arg) for arg in args)
    if tp is type(None):
        return value is None
    if origin is list:
        (item,) = args or (object,)
        if not isinstance(value, list):
            return False
        exact = _EXACT_ITEMS.get(item)
        if exact is not None and set(map(type, value)) <= {exact}:
            return True
        return all(_conforms(v, item) for v in value)
    if origin is dict:
        key, item = args or (object, object)
        return isinstance(value, dict) and all(_conforms(k, key) and _conforms(v, item) for k, v in value.items())
    if tp is object or tp is Any:
        return True
    if tp in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, _SCALARS.get(tp, (tp,)))  # type: ignore[arg-type]


@functools.cache
def _type_hints(cls) -> dict:
    return get_type_hints(cls)  # resolving string annotations costs more than a request's decoding


@functools.cache
def _field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


# Public names for the modules that share these checks.
conforms = _conforms
type_hints = _type_hints
field_names = _field_names
