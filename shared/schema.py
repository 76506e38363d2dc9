"""Typed config from YAML mappings: dataclasses filled field by field, where unknown keys,
wrong types and non-finite numbers are errors naming the field, old spellings still load
with a deprecation note, and keys moved into a section are refused naming their new place.
shared/config.py (models.yaml) and shared/mcp_config.py (its `mcp:` section) both build on
it; it imports neither."""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import types
import typing
from typing import Any, Literal

log = logging.getLogger(__name__)

__all__ = ["RENAMED", "ConfigError", "from_mapping"]


class ConfigError(ValueError):
    pass


# Old spellings still accepted (with a deprecation note): one suffix, _s, for seconds.
RENAMED = {
    "ManagerConfig": {
        "idle_unload_seconds": "idle_unload_s",
        "wait_timeout_seconds": "wait_timeout_s",
        "load_timeout_seconds": "load_timeout_s",
    },
    "ModelEntry": {"idle_unload_seconds": "idle_unload_s"},
}


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed or isinstance(value, bool):
            raise ConfigError(f"{where}: must be one of {', '.join(map(str, allowed))}, got {value!r}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):  # str enums (ModelKind): as a Literal of their values
        allowed = tuple(m.value for m in tp)
        if value not in allowed or isinstance(value, bool):
            raise ConfigError(f"{where}: must be one of {', '.join(map(str, allowed))}, got {value!r}")
        return tp(value)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return from_mapping(tp, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {_type_name(tp)}")


def from_mapping(cls: type, data: Any, where: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    data = _renamed(cls.__name__, data, where)
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    for old in unknown:  # a key from before the class had sections: name the one to write
        if old in getattr(cls, "FLAT_KEYS", {}):
            section, name = cls.FLAT_KEYS[old]
            raise ConfigError(f"{where}: field {old!r} moved: write `{section}: {{{name}: {data[old]!r}}}`")
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
    kwargs = {k: _coerce(v, hints[k], f"{where}: field {k!r}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def _renamed(cls_name: str, data: dict, where: str) -> dict:
    renames = RENAMED.get(cls_name, {})
    if not any(old in data for old in renames):
        return data
    out = dict(data)
    for old, new in renames.items():
        if old in out:
            if new in out:
                raise ConfigError(f"{where}: field {old!r}: set only {new!r} (the old spelling of the same field)")
            log.warning("%s: field %r is deprecated; call it %r", where, old, new)
            out[new] = out.pop(old)
    return out
