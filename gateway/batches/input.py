"""Checking a batch's input file as the batch is created, one line at a time.

The file is never read whole: each line is read within the gateway's body limit (a longer
line is refused with its number and skipped unread), parsed with the same checks as a request
body (nesting, the number of values, numbers, surrogates: a line nested 100,000 deep or of a
million `{}` is a 400 naming it), and only its position in the file is stored, a thousand
lines a transaction. Runs on the `batch` thread pool, never the event loop or the default
executor."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from ...shared.errors import ServiceError
from ..pipeline.body import parse_json
from .store import BatchStore

MAX_LINES = 50_000  # requests per batch, as OpenAI
MAX_ERRORS = 100
MAX_CUSTOM_ID = 512
CHUNK_LINES = 1000


@dataclass
class InputCheck:
    total: int = 0
    errors: list[dict] = field(default_factory=list)
    _seen: set[bytes] = field(default_factory=set)  # custom_id digests: 16 bytes each, not the ids
    _rows: list[tuple[int, str, int, int, int, str | None]] = field(default_factory=list)

    def error(self, message: str, line: int | None, code: str = "invalid_request") -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append({"code": code, "message": message, "param": None, "line": line})


def check_input(store: BatchStore, batch_id: str, path: Path, endpoint: str, max_line_bytes: int) -> InputCheck:
    """Store the requests of a well-formed file under `batch_id`; the errors of a bad one."""
    check = InputCheck()
    with open(path, "rb") as f:
        offset, number = 0, 0
        while len(check.errors) < MAX_ERRORS:
            raw = f.readline(max_line_bytes + 1)
            if not raw:
                break
            number += 1
            start, offset = offset, offset + len(raw)
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                offset += _skip_line(f)
                check.error(f"line {number} is over the {max_line_bytes}-byte request body limit", number)
                continue
            if not raw.strip():
                continue
            _check_line(check, raw, number, start, endpoint)
            if check.total > MAX_LINES:
                check.error(f"over {MAX_LINES} requests", number, "too_many_requests")
                break
            if len(check._rows) >= CHUNK_LINES and not check.errors:
                store.add_requests(batch_id, check._rows)
                check._rows = []
    if check.total == 0 and not check.errors:
        check.error("the input file has no requests", None, "empty_file")
    if not check.errors and check._rows:
        store.add_requests(batch_id, check._rows)
    check._rows, check._seen = [], set()
    return check


def _skip_line(f) -> int:
    """Read past the rest of an over-long line, a megabyte at a time; the bytes skipped."""
    skipped = 0
    while chunk := f.readline(1 << 20):
        skipped += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return skipped


def _check_line(check: InputCheck, raw: bytes, number: int, offset: int, endpoint: str) -> None:
    check.total += 1
    try:
        line = parse_json(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return check.error(f"line {number} is not UTF-8", number)
    except ServiceError as e:
        return check.error(f"line {number}: {e.message}", number)
    problem = _line_problem(line, endpoint)
    if problem:
        return check.error(f"line {number}: {problem}", number)
    custom_id = line["custom_id"]
    digest = hashlib.blake2b(custom_id.encode(), digest_size=16).digest()
    if digest in check._seen:
        return check.error(f"line {number}: 'custom_id' {custom_id!r} is used by an earlier line", number)
    check._seen.add(digest)
    model = line["body"].get("model")
    model = model[:256] if isinstance(model, str) else None
    check._rows.append((check.total - 1, custom_id, number, offset, len(raw), model))


def _line_problem(line, endpoint: str) -> str | None:
    if not isinstance(line, dict):
        return "each line must be a JSON object with custom_id, method, url and body"
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "'custom_id' must be a non-empty string"
    if len(custom_id) > MAX_CUSTOM_ID:
        return f"'custom_id' must be at most {MAX_CUSTOM_ID} characters"
    if line.get("method", "POST") != "POST":
        return "'method' must be POST"
    if line.get("url") != endpoint:
        return f"'url' must be the batch's endpoint {endpoint}"
    if not isinstance(line.get("body"), dict):
        return "'body' must be a JSON object"
    return None
