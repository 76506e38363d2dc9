"""Checks shared by the hostile-input, flood and team tests: the error shape of each API,
raw HTTP on a socket, and the residue a refused request must not leave."""

from __future__ import annotations

import socket
import time

from helpers import GatewayProcess, http

# route -> the error shape its clients parse
ROUTE_FAMILY = {
    "/v1/chat/completions": "openai",
    "/v1/completions": "openai",
    "/v1/responses": "openai",
    "/v1/embeddings": "openai",
    "/v1/messages": "anthropic",
    "/v1/messages/count_tokens": "anthropic",
}


def assert_error_shape(payload, family: str, status: int) -> str:
    """The payload is the API's error object; returns its message."""
    assert isinstance(payload, dict), payload
    if family == "anthropic":
        assert payload.get("type") == "error" and set(payload["error"]) == {"type", "message"}, payload
        if status == 400:
            assert payload["error"]["type"] == "invalid_request_error", payload
        return payload["error"]["message"]
    assert set(payload["error"]) == {"message", "type", "param", "code"}, payload
    return payload["error"]["message"]


def raw_request(port: int, data: bytes, timeout: float = 10) -> tuple[int, bytes]:
    """Send bytes as they are; (status, body) of the answer. For requests no client library
    would build (oversized headers, broken request lines)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            chunks.append(chunk)
    reply = b"".join(chunks)
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def worker_pids(gw: GatewayProcess, models: list[str], headers: dict | None = None) -> dict[str, list[int]]:
    status = http(f"{gw.url}/v1/status", headers=headers)[2]
    return {m["name"]: sorted(w["pid"] for w in m["workers"]) for m in status["models"] if m["name"] in models}


def wait_in_flight_zero(gw: GatewayProcess, headers: dict | None = None, timeout: float = 20) -> dict[str, int]:
    """Every model's in-flight count back to zero (a refused request leaves nothing behind);
    the counts still above zero when the time is up."""
    deadline = time.monotonic() + timeout
    while True:
        status = http(f"{gw.url}/v1/status", headers=headers)[2]
        busy = {m["name"]: m["in_flight"] for m in status["models"] if m["in_flight"]}
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.2)


def assert_chat_refused(gw: GatewayProcess, body: dict, message: str, watched: str) -> None:
    """A Chat Completions request that must be a 400 in OpenAI's error shape naming `message`,
    with the worker of `watched` the same process after it: a bad input fails its request,
    never the worker."""
    pid = gw.worker_pid(watched)
    status, _, reply = http(f"{gw.url}/v1/chat/completions", "POST", body)
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error" and message in reply["error"]["message"], reply
    assert gw.worker_pid(watched) == pid
