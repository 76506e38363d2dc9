"""Requests the batch runner sends to this gateway itself: they carry a secret header, and
run as the batch's owner (gateway/batches/runner.py sends them; auth recognises them here, a
floor below the batches)."""

from __future__ import annotations

import hmac

from aiohttp import web

BATCH_TOKEN = web.AppKey("batch_token", str)
TOKEN_HEADER, OWNER_HEADER = "x-mlxgw-batch-token", "x-mlxgw-batch-owner"
LINE_HEADER = "x-mlxgw-batch-line"  # "1": the body is the input line itself, its request under "body"


def batch_owner(request: web.Request) -> tuple[bool, str | None]:
    """(True, owner identity) for a request the batch runner sent (its secret header matches)."""
    given = request.headers.get(TOKEN_HEADER)
    token = request.app.get(BATCH_TOKEN)
    if not given or not token or not hmac.compare_digest(given.encode(), token.encode()):
        return False, None
    return True, request.headers.get(OWNER_HEADER) or None
