"""Errors as values: a code both sides agree on, a message a user can act on, an HTTP status.

Each API module renders a ServiceError in its own shape (OpenAI, Anthropic, ...)."""

from __future__ import annotations

import re
from enum import Enum

# An absolute (or ~) filesystem path of two or more parts, not an API route (/v1/...).
_FS_PATH = re.compile(r"""(?<![\w:/.~-])~?/(?!v1/)(?:[^\s/'"`:,;()\[\]{}<>|]+/)+([^\s/'"`:,;()\[\]{}<>|]*)""")


def redact_paths(text: str) -> str:
    """Server paths out of what a client reads (they reveal user names and the layout of
    the machine): '/Users/ann/.mlxgw/models/x/config.json' becomes '…/config.json'."""
    return _FS_PATH.sub(lambda m: "…/" + m.group(1), text)


class ErrorCode(str, Enum):
    INVALID_REQUEST = "invalid_request"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    MODEL_NOT_FOUND = "model_not_found"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    AUTHENTICATION = "authentication_error"
    PERMISSION = "permission_denied"
    RATE_LIMITED = "rate_limited"
    OVERLOADED = "overloaded"
    BODY_TOO_LARGE = "request_too_large"
    REQUEST_TIMEOUT = "request_timeout"
    MODEL_UNAVAILABLE = "model_unavailable"
    WORKER_LOST = "worker_lost"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    INSUFFICIENT_STORAGE = "insufficient_storage"  # the disk (or a file-size limit) is full
    INTERNAL = "internal_error"


HTTP_STATUS = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.AUTHENTICATION: 401,
    ErrorCode.PERMISSION: 403,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.OVERLOADED: 429,
    ErrorCode.BODY_TOO_LARGE: 413,
    ErrorCode.REQUEST_TIMEOUT: 408,
    ErrorCode.MODEL_UNAVAILABLE: 503,
    ErrorCode.WORKER_LOST: 502,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.CANCELLED: 499,
    ErrorCode.INSUFFICIENT_STORAGE: 507,
    ErrorCode.INTERNAL: 500,
}


class ServiceError(Exception):
    """An error that ends a request with a clear message. Raised anywhere, rendered by the API."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
        details: dict | None = None,
    ):
        # Messages reach clients; worker exceptions and load errors can carry server paths.
        message = redact_paths(message)
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
        self.param = param
        self.retry_after = retry_after
        # Structured facts an API may phrase its own way (e.g. prompt_tokens, context_length).
        self.details = details or {}

    @property
    def status(self) -> int:
        return HTTP_STATUS[self.code]

    def to_wire(self) -> dict:
        wire = {"code": self.code.value, "message": self.message}
        if self.param:
            wire["param"] = self.param
        if self.retry_after is not None:
            wire["retry_after"] = self.retry_after
        if self.details:
            wire["details"] = self.details
        return wire

    def copy(self) -> ServiceError:
        """The same error as a new exception (one error value may be raised in many tasks)."""
        return ServiceError(
            self.code, self.message, param=self.param, retry_after=self.retry_after, details=self.details
        )

    @classmethod
    def from_wire(cls, wire: dict) -> ServiceError:
        try:
            code = ErrorCode(wire.get("code"))
        except ValueError:
            code = ErrorCode.INTERNAL
        return cls(
            code,
            str(wire.get("message", "unknown error")),
            param=wire.get("param"),
            retry_after=wire.get("retry_after"),
            details=wire.get("details") if isinstance(wire.get("details"), dict) else None,
        )


def invalid(message: str, param: str | None = None) -> ServiceError:
    return ServiceError(ErrorCode.INVALID_REQUEST, message, param=param)
