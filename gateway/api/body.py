"""Reading a JSON request body: size limit and malformed JSON become clear 4xx errors."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from mlxgw.shared.errors import ErrorCode, ServiceError, invalid


def body_too_large(request: web.Request) -> ServiceError:
    return ServiceError(
        ErrorCode.BODY_TOO_LARGE, f"request body too large: the limit is {request.client_max_size} bytes"
    )


async def read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(request) from None
    if not raw:
        raise invalid("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid("the request body is not UTF-8") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise invalid(f"malformed JSON in request body: {e}") from None
