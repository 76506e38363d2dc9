"""What batch uploads and lines may cost the gateway, against a real `mlxgw up` with the echo
engine: a key's stored-bytes cap holds for uploads sent at the same time (the bytes are
reserved before the upload streams), and a line is bounded by what it costs parsed, not only
by its bytes (a line of a million tiny JSON values is refused by number, and the gateway's
memory stays within a stated multiple of the file)."""

from __future__ import annotations

import http.client
import io
import os
import threading
import time

import openai
import pytest
import yaml
from helpers import start_gateway
from helpers.rss import PeakRss

from mlxgw.gateway.access.keys import hash_key

CAP_MB = 16
VALUES = 100_000  # the gateway's bound on a body's JSON values, scaled down from 1,000,000 for CI time
KEYS = {"ann": "mlxgw-cost-ann-0123456789", "ben": "mlxgw-cost-ben-0123456789", "cat": "mlxgw-cost-cat-0123456789"}
CONFIG = {"manager": {"auto_discover": False}, "models": [{"name": "echo", "engine": "echo", "preload": True}]}


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    home = tmp_path_factory.mktemp("cost-home")
    keys_path = home / "keys.yaml"
    keys_path.write_text(yaml.safe_dump({"keys": [{"name": n, "sha256": hash_key(k)} for n, k in KEYS.items()]}))
    os.environ.update(MLXGW_FILES_MAX_MB_PER_KEY=str(CAP_MB), MLXGW_MAX_JSON_VALUES=str(VALUES))
    try:
        started = start_gateway(home, CONFIG, "cost", extra_args=("--keys", str(keys_path)))
    finally:
        del os.environ["MLXGW_FILES_MAX_MB_PER_KEY"], os.environ["MLXGW_MAX_JSON_VALUES"]
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


def _tiny_objects_file(lines: int, objects: int) -> io.BytesIO:
    """The hostile shape: each line's body carries an array of `objects` empty JSON objects
    (3 bytes of text each, a 64-byte dict each parsed)."""
    junk = "[" + ",".join(["{}"] * objects) + "]"
    out = []
    for i in range(lines):
        body = f'{{"model": "echo", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 1, "x": {junk}}}'
        out.append(f'{{"custom_id": "t{i}", "method": "POST", "url": "/v1/chat/completions", "body": {body}}}\n')
    data = io.BytesIO("".join(out).encode())
    data.name = "tiny-objects.jsonl"
    return data


def _two_batches(client: openai.OpenAI, data: io.BytesIO) -> list:
    file = client.files.create(file=data, purpose="batch")
    created = [
        client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
        for _ in range(2)
    ]
    ended = []
    for batch in created:
        deadline = time.monotonic() + 120
        while batch.status not in ("completed", "failed", "cancelled", "expired") and time.monotonic() < deadline:
            time.sleep(0.2)
            batch = client.batches.retrieve(batch.id)
        ended.append(batch)
    return ended


def test_lines_of_tiny_json_values_within_the_bound_cost_a_bounded_multiple_of_the_file(gw):
    """Parsed once each (by the handler, never also by the runner) and, together in flight,
    within one body's bound: the gateway grows by less than 3x the file plus four bodies at
    the bound parsed (~72 bytes a value: a line checked at creation, the lines in flight, and
    what the allocator keeps between them). Measured: 21 MB for a 1.5 MB file; before, with
    4 lines in flight each parsed twice and a walk that copied every container's path, 83 MB.
    First of the two: the other's refused lines must not raise the gateway's base before it."""
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEYS["cat"], max_retries=0, timeout=120)
    data = _tiny_objects_file(6, VALUES * 9 // 10)
    size = len(data.getvalue())
    with PeakRss(gw.proc.pid) as rss:
        batches = _two_batches(client, data)
    bound = 3 * size + 4 * VALUES * 72
    print(f"gateway peak growth {rss.growth / 2**20:.1f} MB for two batches of a {size / 2**20:.1f} MB file")
    for batch in batches:
        assert batch.status == "completed" and batch.request_counts.total == 6, batch
    assert rss.growth < bound, f"gateway grew {rss.growth / 2**20:.0f} MB, over {bound / 2**20:.0f} MB"


def test_lines_of_tiny_json_values_past_the_bound_are_refused_by_number(gw):
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEYS["cat"], max_retries=0, timeout=120)
    data = _tiny_objects_file(6, VALUES * 3 // 2)
    size = len(data.getvalue())
    with PeakRss(gw.proc.pid) as rss:
        batches = _two_batches(client, data)
    print(f"gateway peak growth {rss.growth / 2**20:.1f} MB for two batches of a {size / 2**20:.1f} MB file")
    for batch in batches:
        assert batch.status == "failed", batch
        by_line = {e.line: e.message for e in batch.errors.data}
        assert set(by_line) == set(range(1, 7)), by_line
        assert f"more than {VALUES:,} JSON values" in by_line[1], by_line[1]
    assert rss.growth < 3 * size, f"gateway grew {rss.growth / 2**20:.0f} MB for a {size / 2**20:.1f} MB file"
