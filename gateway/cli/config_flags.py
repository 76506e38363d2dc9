"""`mlxgw up`'s flags, built from shared/gateway_config.py's field metadata: each gateway:
field that names a flag gets one, with its type, range and help, and the default shown as
the models.yaml key it overrides. A flag left out is None and leaves the file's value."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import click

from ...shared.gateway_config import GatewayConfig

F = TypeVar("F", bound=Callable[..., Any])


class CommaList(click.ParamType):
    """A list field's flag: one comma-separated value ("http://a, http://b")."""

    name = "list"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[str]:
        if isinstance(value, list):
            return value
        return [part.strip() for part in str(value).split(",") if part.strip()]


def _base(hint: Any) -> Any:
    """`int | None` -> int: a flag is either given or left to the file."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _flag_type(hint: Any, minimum: float | None) -> click.ParamType:
    base = _base(hint)
    if typing.get_origin(base) is Literal:
        return click.Choice([str(v) for v in typing.get_args(base)])
    if typing.get_origin(base) is list:
        return CommaList()
    if base is int:
        return click.IntRange(int(minimum)) if minimum is not None else click.INT
    if base is float:
        return click.FloatRange(minimum) if minimum is not None else click.FLOAT
    return click.STRING


def _default_text(f: dataclasses.Field) -> str:
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float):
        return f"{default:g}"
    return "" if default in (None, []) else str(default)


def flag_help(f: dataclasses.Field) -> str:
    shown = _default_text(f)
    return f"{f.metadata['help']} [gateway.{f.name}{': ' + shown if shown else ''}]"


def gateway_flags(command: F) -> F:
    """Decorate a click command with a flag per flagged GatewayConfig field; each arrives as a
    keyword argument named after its field."""
    hints = typing.get_type_hints(GatewayConfig)
    for f in reversed(dataclasses.fields(GatewayConfig)):  # click lists them in field order
        flag = f.metadata.get("flag")
        if flag is None:
            continue
        if hints[f.name] is bool:
            option = click.option(f"{flag}/--no-{flag[2:]}", f.name, default=None, help=flag_help(f))
        else:
            flag_type = _flag_type(hints[f.name], f.metadata.get("minimum"))
            option = click.option(flag, f.name, type=flag_type, default=None, help=flag_help(f))
        command = option(command)
    return command


def with_flags(config: GatewayConfig, flags: dict[str, Any]) -> GatewayConfig:
    """The gateway: section with every flag that was given laid over it."""
    names = {f.name for f in dataclasses.fields(GatewayConfig)}
    return dataclasses.replace(config, **{k: v for k, v in flags.items() if k in names and v is not None})
