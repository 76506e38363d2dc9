"""Field checks for request bodies: each failure is a 400 naming the field."""

from __future__ import annotations

from typing import Any

from mlxgw.shared.errors import invalid

_MISSING = object()


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


def number(
    body: dict, name: str, lo: float | None = None, hi: float | None = None, default: float | None = None
) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"'{name}' must be a number, got {type(value).__name__}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise invalid(f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return float(value)


def integer(
    body: dict, name: str, lo: int | None = None, hi: int | None = None, default: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"'{name}' must be an integer, got {type(value).__name__}", name)
    if lo is not None and value < lo:
        raise invalid(f"'{name}' must be at least {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise invalid(f"'{name}' must be at most {hi}, got {value}", name)
    return value


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"'{name}' must be true or false, got {type(value).__name__}", name)
    return value


def string_list(body: dict, name: str, max_items: int = 16) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise invalid(f"'{name}' must be a string or a list of strings", name)
    if len(value) > max_items:
        raise invalid(f"'{name}' takes at most {max_items} entries, got {len(value)}", name)
    return value


def mapping(body: dict, name: str) -> dict | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(f"'{name}' must be an object", name)
    return value
