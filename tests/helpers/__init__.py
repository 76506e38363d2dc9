"""Helpers shared by the test modules (no test module imports another)."""

from .gateway import (
    LONG,
    NO_EOS,
    REPO,
    TINY_CONFIG,
    GatewayProcess,
    async_openai_client,
    cancel_request,
    openai_client,
    running,
    start_gateway,
    start_long_stream,
    wait_for,
)
from .http import free_port, http
from .paths import DATA, FIXTURES, TESTS
from .reference import run_reference

__all__ = [
    "DATA",
    "FIXTURES",
    "LONG",
    "NO_EOS",
    "REPO",
    "TESTS",
    "TINY_CONFIG",
    "GatewayProcess",
    "async_openai_client",
    "cancel_request",
    "free_port",
    "http",
    "openai_client",
    "run_reference",
    "running",
    "start_gateway",
    "start_long_stream",
    "wait_for",
]
