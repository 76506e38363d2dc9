"""Render a ServiceError in the shape of the API that was called."""

from __future__ import annotations

import json
import math

from aiohttp import web

from ...shared.errors import ErrorCode, ServiceError
from .routes import family_of

__all__ = ["error_headers", "error_response", "family_of", "openai_error_body"]

_OPENAI_TYPES = {
    ErrorCode.AUTHENTICATION: "authentication_error",
    ErrorCode.PERMISSION: "permission_error",
    ErrorCode.RATE_LIMITED: "rate_limit_error",
    ErrorCode.OVERLOADED: "rate_limit_error",
    ErrorCode.MODEL_UNAVAILABLE: "server_error",
    ErrorCode.WORKER_LOST: "server_error",
    ErrorCode.TIMEOUT: "server_error",
    ErrorCode.INSUFFICIENT_STORAGE: "server_error",
    ErrorCode.INTERNAL: "server_error",
}


def openai_error_body(err: ServiceError) -> dict:
    return {
        "error": {
            "message": err.message,
            "type": _OPENAI_TYPES.get(err.code, "invalid_request_error"),
            "param": err.param,
            "code": err.code.value,
        }
    }


def error_headers(err: ServiceError) -> dict[str, str]:
    if err.retry_after is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(err.retry_after)))}


def error_response(err: ServiceError, family: str = "openai") -> web.Response:
    if family == "anthropic":
        from .anthropic_errors import anthropic_error_body, anthropic_status

        body, status = anthropic_error_body(err), anthropic_status(err)
    elif family == "ollama":  # Ollama's shape: {"error": "..."} with the status
        body, status = {"error": err.message}, err.status
    else:
        body, status = openai_error_body(err), err.status
    return web.Response(
        status=status, text=json.dumps(body), content_type="application/json", headers=error_headers(err)
    )
