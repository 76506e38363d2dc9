"""What batch uploads and lines may cost the gateway, against a real `mlxgw up` with the echo
engine: a key's stored-bytes cap holds for uploads sent at the same time (the bytes are
reserved before the upload streams), and a line is bounded by what it costs parsed, not only
by its bytes (a line of a million tiny JSON values is refused by number, and the gateway's
memory stays within a stated multiple of the file)."""

from __future__ import annotations

import http.client
import os
import threading
import time

import pytest
import yaml
from helpers import start_gateway

from mlxgw.gateway.access.keys import hash_key

CAP_MB = 16
KEYS = {"ann": "mlxgw-cost-ann-0123456789", "ben": "mlxgw-cost-ben-0123456789", "cat": "mlxgw-cost-cat-0123456789"}
CONFIG = {"manager": {"auto_discover": False}, "models": [{"name": "echo", "engine": "echo", "preload": True}]}


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    home = tmp_path_factory.mktemp("cost-home")
    keys_path = home / "keys.yaml"
    keys_path.write_text(yaml.safe_dump({"keys": [{"name": n, "sha256": hash_key(k)} for n, k in KEYS.items()]}))
    os.environ["MLXGW_FILES_MAX_MB_PER_KEY"] = str(CAP_MB)
    try:
        started = start_gateway(home, CONFIG, "cost", extra_args=("--keys", str(keys_path)))
    finally:
        del os.environ["MLXGW_FILES_MAX_MB_PER_KEY"]
    yield started
    started.stop()


def _multipart(content: bytes) -> tuple[bytes, bytes, str]:
    """(head, tail, content type) of a multipart upload around `content`."""
    boundary = "mlxgwcostboundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    return head, f"\r\n--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _slow_upload(gw, key: str, content: bytes, started: threading.Barrier, out: list) -> None:
    """One upload with its Content-Length, sent in 16 pieces over about 1.6 s, so that two of
    them stream at the same time."""
    head, tail, ctype = _multipart(content)
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=60)
    try:
        conn.putrequest("POST", "/v1/files")
        conn.putheader("Authorization", f"Bearer {key}")
        conn.putheader("Content-Type", ctype)
        conn.putheader("Content-Length", str(len(head) + len(content) + len(tail)))
        conn.endheaders()
        started.wait()
        conn.send(head)
        step = len(content) // 16 + 1
        for i in range(0, len(content), step):
            conn.send(content[i : i + step])
            time.sleep(0.1)
        conn.send(tail)
        out.append(conn.getresponse().status)
    except (BrokenPipeError, ConnectionResetError):  # refused while sending: read the answer
        out.append(conn.getresponse().status)
    finally:
        conn.close()


def _uploads_at_once(gw, key: str, sizes: list[int]) -> list[int]:
    statuses: list[int] = []
    barrier = threading.Barrier(len(sizes))
    content = [b'{"a": 1}\n' * (size // 9) for size in sizes]
    threads = [threading.Thread(target=_slow_upload, args=(gw, key, c, barrier, statuses)) for c in content]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(statuses)


def test_two_uploads_at_once_cannot_both_pass_a_keys_stored_bytes_cap(gw):
    mb = 1 << 20
    # 10 MB + 10 MB on a 16 MB cap: one of them is refused, whichever reserved second.
    assert _uploads_at_once(gw, KEYS["ann"], [10 * mb, 10 * mb]) == [200, 413]
    # Within the cap together, both pass: each reserves its Content-Length, not the file cap.
    assert _uploads_at_once(gw, KEYS["ben"], [5 * mb, 5 * mb]) == [200, 200]
