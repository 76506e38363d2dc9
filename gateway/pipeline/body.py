"""Reading a JSON request body: every way a body can be hostile becomes a clear 400.

Size (413), encoding, syntax, nesting depth, numbers the wire and the worker cannot hold
(integers outside 64 bits, NaN, Infinity, 1e400) and lone UTF-16 surrogates ("\\ud800",
valid JSON that no UTF-8 encoder accepts) are all refused here, before any API module or
the worker link sees the value, so a refused body never leaves residue behind it."""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

from aiohttp import web

from mlxgw.gateway.web.state import SETTINGS
from mlxgw.gateway.web.work_pools import THREAD_POOLS
from mlxgw.shared.errors import ErrorCode, ServiceError, invalid

# Deeper than any real tool schema or chat_template_kwargs; far below the recursion limits
# of json, msgpack (511) and the schema compilers downstream.
MAX_DEPTH = 64
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
# Bodies above this are parsed on a thread, so a 10 MB body does not stall every stream.
THREAD_PARSE_BYTES = 256 * 1024
# A lone surrogate can only arrive as a \\uD800-\\uDFFF escape (strict UTF-8 decoding refuses
# raw ones), so strings are checked only when the text holds such an escape.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class _BadValue(ValueError):
    """A number the body may not hold; raised from inside the JSON parser."""


def body_too_large(request: web.Request) -> ServiceError:
    return ServiceError(
        ErrorCode.BODY_TOO_LARGE, f"request body too large: the limit is {request.client_max_size} bytes"
    )


def _checked_int(text: str) -> int:
    value = int(text)
    if not INT_MIN <= value <= INT_MAX:
        raise _BadValue(text)
    return value


def _checked_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses to inf
        raise _BadValue(text)
    return value


def _refuse_constant(text: str):
    raise _BadValue(text)


def _path(parts: list) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "the body"


def _bad_scalar(value: Any, check_strings: bool) -> str | None:
    """What is wrong with one scalar, or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and not INT_MIN <= value <= INT_MAX:
        return "is an integer outside the 64-bit range"
    if isinstance(value, float) and not math.isfinite(value):
        return f"is {value!r}: NaN and Infinity are not valid JSON numbers"
    if check_strings and isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "holds a lone UTF-16 surrogate (such as \\ud800) that is not valid Unicode"
    return None


def find_problem(doc: Any, check_strings: bool = True) -> tuple[str, str] | None:
    """(path, what is wrong) for the first value the body may not hold, walking iteratively
    (a recursive walk is what the depth limit protects against)."""
    stack: list[tuple[Any, list]] = [(doc, [])]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            problem = _bad_scalar(value, check_strings)
            if problem:
                return _path(path), problem
            continue
        if len(path) >= MAX_DEPTH:
            return _path(path[:8]) + " ...", f"is nested more than {MAX_DEPTH} levels deep"
        for k, child in items:
            if check_strings and isinstance(k, str) and _bad_scalar(k, True):
                return _path(path), "has a key that " + _bad_scalar(k, True)
            if isinstance(child, (dict, list)) or _bad_scalar(child, check_strings):
                stack.append((child, [*path, k]))
    return None


def _refusal(where: str, problem: str) -> ServiceError:
    param = None if where.startswith("the body") else where.split(".")[0].split("[")[0]
    subject = where if where.startswith("the body") else f"'{where}'"
    return invalid(f"{subject} {problem}", param)


def _name_bad_number(text: str, literal: str) -> ServiceError:
    # Parse again without the checks only to name the field; this is the error path.
    try:
        found = find_problem(json.loads(text), check_strings=False)
    except (RecursionError, ValueError):
        found = None
    if found is None:
        return invalid(f"the body holds the number {literal[:40]}, which is not allowed")
    return _refusal(*found)


def parse_json(text: str) -> Any:
    """The parsed body; a ServiceError (400) saying what is wrong and where otherwise."""
    try:
        doc = json.loads(text, parse_int=_checked_int, parse_float=_checked_float, parse_constant=_refuse_constant)
    except RecursionError:
        raise invalid(f"the body is nested more than {MAX_DEPTH} levels deep") from None
    except _BadValue as e:
        raise _name_bad_number(text, str(e)) from None
    except ValueError as e:
        raise invalid(f"malformed JSON in request body: {e}") from None
    found = find_problem(doc, check_strings=bool(_SURROGATE_ESCAPE.search(text)))
    if found is not None:
        raise _refusal(*found)
    return doc


async def read_body(request: web.Request) -> bytes:
    """The raw body, within the size limit and the body timeout (slow senders get a 408
    instead of holding a connection and a request slot for as long as they like)."""
    timeout_s = request.app[SETTINGS].body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):  # no task per request, unlike wait_for
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(request) from None
    except ConnectionError:
        raise ServiceError(ErrorCode.CANCELLED, "the client closed the connection while sending the body") from None
    except asyncio.TimeoutError:
        raise ServiceError(
            ErrorCode.REQUEST_TIMEOUT, f"the request body did not arrive within {timeout_s:g} s"
        ) from None


async def read_json(request: web.Request) -> Any:
    raw = await read_body(request)
    if not raw:
        raise invalid("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid("the request body is not UTF-8") from None
    if len(raw) > THREAD_PARSE_BYTES:
        return await THREAD_POOLS["json"].run(parse_json, text)
    return parse_json(text)


async def read_object(request: web.Request) -> dict:
    """The body, which must be a JSON object: every route that decodes it into a struct reads
    it so, since a struct's decode of a list or a string would name no field."""
    body = await read_json(request)
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body
