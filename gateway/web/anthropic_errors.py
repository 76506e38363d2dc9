"""Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

from ...shared.errors import ErrorCode, ServiceError

_TYPES = {
    ErrorCode.AUTHENTICATION: "authentication_error",
    ErrorCode.PERMISSION: "permission_error",
    ErrorCode.MODEL_NOT_FOUND: "not_found_error",
    ErrorCode.NOT_FOUND: "not_found_error",
    ErrorCode.RATE_LIMITED: "rate_limit_error",
    ErrorCode.OVERLOADED: "overloaded_error",
    ErrorCode.BODY_TOO_LARGE: "request_too_large",
    ErrorCode.MODEL_UNAVAILABLE: "overloaded_error",
    ErrorCode.WORKER_LOST: "api_error",
    ErrorCode.TIMEOUT: "api_error",
    ErrorCode.INTERNAL: "api_error",
}


def anthropic_message(err: ServiceError) -> str:
    # Claude Code compacts its conversation when it reads "prompt is too long".
    d = err.details
    if err.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED and "prompt_tokens" in d and "context_length" in d:
        if "max_tokens" in d:
            return (
                f"prompt is too long: {d['prompt_tokens']} tokens + max_tokens {d['max_tokens']} > "
                f"{d['context_length']} maximum"
            )
        return f"prompt is too long: {d['prompt_tokens']} tokens > {d['context_length']} maximum"
    return err.message


def anthropic_error_body(err: ServiceError) -> dict:
    return {
        "type": "error",
        "error": {"type": _TYPES.get(err.code, "invalid_request_error"), "message": anthropic_message(err)},
    }


def anthropic_status(err: ServiceError) -> int:
    # Anthropic signals overload with 529, which its SDKs retry.
    if err.code in (ErrorCode.OVERLOADED, ErrorCode.MODEL_UNAVAILABLE):
        return 529
    return err.status
