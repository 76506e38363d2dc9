"""Real HTTP requests and free ports for tests."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(
    url: str, method: str = "GET", body=None, headers: dict | None = None, raw: bytes | None = None, timeout: float = 60
) -> tuple[int, dict, object]:
    """One real HTTP request: (status, headers, parsed JSON body or text)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    hdrs = {"content-type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, rh, text = r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        status, rh, text = e.code, dict(e.headers), e.read().decode()
    try:
        return status, {k.lower(): v for k, v in rh.items()}, json.loads(text)
    except ValueError:
        return status, {k.lower(): v for k, v in rh.items()}, text
