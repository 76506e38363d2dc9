"""The OpenAI Batch API: POST /v1/batches, GET /v1/batches, GET /v1/batches/{id},
POST /v1/batches/{id}/cancel, in the official SDK's shapes. The input file is checked
when the batch is created (a bad line fails the batch with its line number, as OpenAI's
validation does); gateway/batch_runner.py runs it at background priority."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from mlxgw.shared.errors import ErrorCode, ServiceError, invalid

from ..batch_runner import BATCH_STORE, BATCH_WAKE
from . import validate as v
from .body import read_json
from .files import not_found, owner_of

routes = web.RouteTableDef()

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_LINES = 50_000  # requests per batch, as OpenAI


def parse_lines(text: str, endpoint: str) -> tuple[list[tuple[str, dict]], list[dict]]:
    """(custom_id, body) per request line, and the errors of the lines that are not one."""
    lines: list[tuple[str, dict]] = []
    errors: list[dict] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        problem = _line_problem(raw, endpoint, seen)
        if isinstance(problem, str):
            errors.append({"code": "invalid_request", "message": problem, "param": None, "line": number})
        else:
            lines.append(problem)
            seen.add(problem[0])
        if len(lines) > MAX_LINES:
            errors.append({"code": "too_many_requests", "message": f"over {MAX_LINES} requests", "line": number})
            break
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "the input file has no requests", "line": None})
    return lines, errors[:100]


def _line_problem(raw: str, endpoint: str, seen: set[str]) -> str | tuple[str, dict]:
    try:
        line = json.loads(raw)
    except ValueError as e:
        return f"not JSON: {e}"
    if not isinstance(line, dict):
        return "each line must be a JSON object with custom_id, method, url and body"
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "'custom_id' must be a non-empty string"
    if custom_id in seen:
        return f"'custom_id' {custom_id!r} is used by an earlier line"
    if line.get("method", "POST") != "POST":
        return "'method' must be POST"
    if line.get("url") != endpoint:
        return f"'url' must be the batch's endpoint {endpoint}"
    if not isinstance(line.get("body"), dict):
        return "'body' must be a JSON object"
    return custom_id, line["body"]


@routes.post("/v1/batches")
async def create_batch(request: web.Request) -> web.Response:
    body = v.require_object(await read_json(request))
    endpoint = v.string(body, "endpoint", required_=True)
    if endpoint not in ENDPOINTS:
        raise invalid(f"'endpoint' must be one of {', '.join(ENDPOINTS)}", "endpoint")
    if body.get("completion_window", "24h") != "24h":
        raise invalid("'completion_window' must be '24h'", "completion_window")
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and len(metadata) <= 16 and all(isinstance(x, str) for x in metadata.values())
    ):
        raise invalid("'metadata' must be an object of up to 16 string values", "metadata")
    file_id = v.string(body, "input_file_id", required_=True)
    store, owner = request.app[BATCH_STORE], owner_of(request)
    file = await asyncio.to_thread(store.get_file, file_id, owner)
    if file is None:
        raise not_found("file", file_id)
    if file["purpose"] != "batch":
        raise invalid("the input file's purpose must be 'batch'", "input_file_id")
    text = await asyncio.to_thread(store.file_path(file_id).read_text, "utf-8", "replace")
    lines, errors = await asyncio.to_thread(parse_lines, text, endpoint)
    batch = await asyncio.to_thread(store.create_batch, owner, endpoint, file_id, lines, errors, metadata)
    request.app[BATCH_WAKE].set()
    return web.json_response(batch)


@routes.get("/v1/batches")
async def list_batches(request: web.Request) -> web.Response:
    try:
        limit = int(request.query.get("limit", 20))
    except ValueError:
        raise invalid("'limit' must be an integer", "limit") from None
    limit = min(100, max(1, limit))
    everyone = request.query.get("all") == "true"  # mlxgw's extension, for the console
    key = request.get("key")
    if everyone and key is not None and not key.admin:
        raise ServiceError(ErrorCode.PERMISSION, "listing every key's batches needs an admin key")
    data = await asyncio.to_thread(request.app[BATCH_STORE].list_batches, owner_of(request), everyone)
    after = request.query.get("after")
    if after:
        ids = [b["id"] for b in data]
        data = data[ids.index(after) + 1 :] if after in ids else []
    page = data[:limit]
    return web.json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(data) > limit,
        }
    )


@routes.get("/v1/batches/{batch_id}")
async def get_batch(request: web.Request) -> web.Response:
    batch_id = request.match_info["batch_id"]
    batch = await asyncio.to_thread(request.app[BATCH_STORE].get_batch, batch_id, owner_of(request))
    if batch is None:
        raise not_found("batch", batch_id)
    return web.json_response(batch)


@routes.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: web.Request) -> web.Response:
    batch_id = request.match_info["batch_id"]
    batch = await asyncio.to_thread(request.app[BATCH_STORE].cancel, batch_id, owner_of(request))
    if batch is None:
        raise not_found("batch", batch_id)
    return web.json_response(batch)
