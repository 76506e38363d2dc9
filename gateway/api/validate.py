"""Field checks for the request fields that fields.py does not declare (embeddings,
rerank, nested objects): each failure is a 400 naming the field. Non-finite numbers (NaN,
Infinity) are refused wherever a number is read."""

from __future__ import annotations

import math
from typing import Any

from mlxgw.shared.errors import invalid

_MISSING = object()

INT32_MAX = 2**31 - 1


def require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def required(body: dict, name: str) -> Any:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        raise invalid(f"missing required parameter: '{name}'", name)
    return value


def string(body: dict, name: str, *, required_: bool = False, default: str | None = None) -> str | None:
    value = required(body, name) if required_ else body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise invalid(f"'{name}' must be a string, got {type(value).__name__}", name)
    return value


def _in_range(name: str, value: float, lo: float | None, hi: float | None) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise invalid(f"'{name}' must be a finite number, got {value}", name)
    if lo is not None and value < lo:
        raise invalid(f"'{name}' must be at least {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise invalid(f"'{name}' must be at most {hi}, got {value}", name)


def _numeric(body: dict, name: str, types: tuple, what: str, lo, hi):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, types):
        raise invalid(f"'{name}' must be {what}, got {type(value).__name__}", name)
    _in_range(name, value, lo, hi)
    return value


def number(
    body: dict, name: str, lo: float | None = None, hi: float | None = None, default: float | None = None
) -> float | None:
    value = _numeric(body, name, (int, float), "a number", lo, hi)
    return default if value is None else float(value)


def integer(
    body: dict, name: str, lo: int | None = None, hi: int | None = INT32_MAX, default: int | None = None
) -> int | None:
    value = _numeric(body, name, (int,), "an integer", lo, hi)
    return default if value is None else value


def _of_type(body: dict, name: str, tp: type, what: str):
    value = body.get(name)
    if value is not None and not isinstance(value, tp):
        raise invalid(f"'{name}' must be {what}, got {type(value).__name__}", name)
    return value


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = _of_type(body, name, bool, "true or false")
    return default if value is None else value


def mapping(body: dict, name: str) -> dict | None:
    return _of_type(body, name, dict, "an object")
