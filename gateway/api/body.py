"""Reading a JSON request body: size limit and malformed JSON become clear 4xx errors."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from shared.errors import ErrorCode, ServiceError, invalid


async def read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise ServiceError(ErrorCode.BODY_TOO_LARGE,
                           f"request body too large: the limit is {e.max_size} bytes") from None
    if not raw:
        raise invalid("the request body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise invalid("the request body is not UTF-8") from None
    except ValueError as e:
        raise invalid(f"malformed JSON in request body: {e}") from None
