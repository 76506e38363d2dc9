"""Reading a JSON request body: every way a body can be hostile becomes a clear 400.

Size (413), encoding, syntax, nesting depth, the number of values (what a body costs parsed:
a 3-byte `{}` is a 64-byte dict, so a few MB of them would be hundreds of MB), numbers the
wire and the worker cannot hold (integers outside 64 bits, NaN, Infinity, 1e400) and lone
UTF-16 surrogates ("\\ud800", valid JSON that no UTF-8 encoder accepts) are all refused here,
before any API module or the worker link sees the value, so a refused body never leaves
residue behind it."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import os
import re
from typing import Any

from aiohttp import web

from ...shared.errors import ErrorCode, ServiceError, invalid
from ..web.routes import route_of
from ..web.state import SETTINGS
from ..web.work_pools import THREAD_POOLS

# Deeper than any real tool schema or chat_template_kwargs; far below the recursion limits
# of json, msgpack (511) and the schema compilers downstream.
MAX_DEPTH = 64
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
# The most JSON values (objects, arrays, strings, numbers, literals) a body may hold: each costs
# up to ~72 bytes parsed whatever its text, so this bounds a body's parsed form (~72 MB) where
# the byte limit alone would not (10 MB of `{},` is 3.5 million dicts, ~250 MB). Above any
# real request: a 128k-token prompt sent as token ids is 128k values.
MAX_JSON_VALUES = int(os.environ.get("MLXGW_MAX_JSON_VALUES") or 1_000_000)
# A JSON string, escapes included (the unrolled form: no backtracking per character).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
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


async def form_parts(request: web.Request, what: str, field: str):
    """The parts of a form upload, one at a time; a 400 that says how to send `what` when the
    body is no form, and one that says why when it is malformed."""
    if not request.content_type.startswith("multipart/form-data"):
        raise invalid(f"send {what} as multipart/form-data with a '{field}' file field", field)
    try:
        reader = await request.multipart()
    except (ValueError, AssertionError) as e:
        raise invalid(f"malformed multipart body: {e}") from None
    while True:
        try:
            part = await reader.next()
        except ValueError as e:
            raise invalid(f"malformed multipart body: {e}") from None
        if part is None:
            return
        yield part


async def read_capped(part, cap: int) -> bytes | None:
    """A form part's bytes, or None once they pass `cap` (the caller refuses in its API's words)."""
    chunks, size = [], 0
    while chunk := await part.read_chunk(1 << 16):
        size += len(chunk)
        if size > cap:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


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
    (a recursive walk is what the depth limit protects against) with one iterator per level:
    the walk holds the path it is on, never a copy of every container's path (which cost 3x
    the parsed body for a wide array of small objects)."""
    if not isinstance(doc, (dict, list)):
        problem = _bad_scalar(doc, check_strings)
        return ("the body", problem) if problem else None
    stack, path = [_items(doc)], []  # path: the key of each container under the root on the stack
    while stack:
        entry = next(stack[-1], None)
        if entry is None:
            stack.pop()
            if path:
                path.pop()
            continue
        k, child = entry
        if check_strings and isinstance(k, str) and _bad_scalar(k, True):
            return _path(path), "has a key that " + _bad_scalar(k, True)
        if isinstance(child, (dict, list)):
            if len(path) + 1 >= MAX_DEPTH:
                return _path([*path, k][:8]) + " ...", f"is nested more than {MAX_DEPTH} levels deep"
            path.append(k)
            stack.append(_items(child))
        elif problem := _bad_scalar(child, check_strings):
            return _path([*path, k]), problem
    return None


def _items(container: dict | list):
    return iter(container.items()) if isinstance(container, dict) else enumerate(container)


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


def values_at_most(text: str) -> int:
    """An upper bound on the values a JSON text holds, without parsing it: each value after a
    container's first follows a comma, and each container opens with a bracket (commas
    inside strings only overcount)."""
    return 1 + text.count(",") + text.count("[") + text.count("{")


def count_values(text: str) -> int:
    """The values a JSON text holds, near enough (object keys count as the values they name);
    cheap while the text is short enough that it cannot pass the bound."""
    if len(text) <= 2 * MAX_JSON_VALUES or values_at_most(text) <= MAX_JSON_VALUES:
        return min(values_at_most(text), len(text) // 2 + 1)  # a value takes 2 characters at least
    bare = _STRING.sub('""', text)  # an empty container holds no first value
    return values_at_most(bare) - bare.count("{}") - bare.count("[]")


def parse_json(text: str) -> Any:
    """The parsed body; a ServiceError (400) saying what is wrong and where otherwise."""
    if count_values(text) > MAX_JSON_VALUES:  # counted before anything is built
        raise invalid(
            f"the body holds more than {MAX_JSON_VALUES:,} JSON values, the most a request may "
            "(each costs the server up to ~72 bytes parsed, whatever its size in the text)"
        )
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
    doc = await THREAD_POOLS["json"].run(parse_json, text) if len(raw) > THREAD_PARSE_BYTES else parse_json(text)
    if route_of(request).audit is not None:  # what a change asked for, kept whatever its handler does to it
        request["json_body"] = copy.deepcopy(doc)
    return _line_body(doc) if request.get("batch_line") else doc


def _line_body(line: Any) -> dict:
    """A batch request arrives as its input line, sent as it is (the runner never parses it,
    so a line is held parsed once, here); its request is the line's body, never streamed."""
    body = line.get("body") if isinstance(line, dict) else None
    if not isinstance(body, dict):  # checked when the batch was created: the file changed since
        raise invalid("the batch's input line no longer holds its request")
    body["stream"] = False
    return body


async def read_object(request: web.Request) -> dict:
    """The body, which must be a JSON object: every route that decodes it into a struct reads
    it so, since a struct's decode of a list or a string would name no field."""
    body = await read_json(request)
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body
