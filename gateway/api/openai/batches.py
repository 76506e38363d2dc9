"""The OpenAI Batch API: POST /v1/batches, GET /v1/batches, GET /v1/batches/{id},
POST /v1/batches/{id}/cancel, in the official SDK's shapes. The input file is checked
line by line when the batch is created (gateway/batches/input.py: a bad line fails the batch
with its line number, as OpenAI's validation does); gateway/batches/runner.py runs it at
background priority. A key has at most MAX_ACTIVE batches not yet ended, and metadata is
capped as OpenAI caps it."""

from __future__ import annotations

import contextlib
import os

from aiohttp import web

from ....shared.errors import ErrorCode, ServiceError, invalid
from ...batches.files import is_storage_error, new_id
from ...batches.input import check_input
from ...batches.runner import BATCH_STORE, BATCH_WAKE
from ...pipeline import validate as v
from ...pipeline.body import read_object
from ...web.work_pools import THREAD_POOLS
from .files import no_room, not_found, owner_name_of, owner_of, store_call

routes = web.RouteTableDef()

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_ACTIVE = int(os.environ.get("MLXGW_BATCH_MAX_ACTIVE_PER_KEY") or 4)
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512  # as OpenAI


def check_metadata(metadata) -> dict | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > METADATA_PAIRS:
        raise invalid(f"'metadata' must be an object of up to {METADATA_PAIRS} pairs", "metadata")
    for k, value in metadata.items():
        if len(k) > METADATA_KEY:
            raise invalid(f"'metadata' keys must be at most {METADATA_KEY} characters", "metadata")
        if not isinstance(value, str) or len(value) > METADATA_VALUE:
            raise invalid(f"'metadata' values must be strings of at most {METADATA_VALUE} characters", "metadata")
    return metadata


@routes.post("/v1/batches")
async def create_batch(request: web.Request) -> web.Response:
    body = await read_object(request)
    endpoint = v.string(body, "endpoint", required_=True)
    if endpoint not in ENDPOINTS:
        raise invalid(f"'endpoint' must be one of {', '.join(ENDPOINTS)}", "endpoint")
    if body.get("completion_window", "24h") != "24h":
        raise invalid("'completion_window' must be '24h'", "completion_window")
    metadata = check_metadata(body.get("metadata"))
    file_id = v.string(body, "input_file_id", required_=True)
    store, owner = request.app[BATCH_STORE], owner_of(request)
    file = await store_call(store.get_file, file_id, owner)
    if file is None:
        raise not_found("file", file_id)
    if file["purpose"] != "batch":
        raise invalid("the input file's purpose must be 'batch'", "input_file_id")
    if await store_call(store.active_count, owner) >= MAX_ACTIVE:
        raise ServiceError(
            ErrorCode.RATE_LIMITED,
            f"this key has {MAX_ACTIVE} batches running, the most it may; wait for one to end or cancel one",
            retry_after=30,
        )
    batch_id = new_id("batch_")
    await store_call(store.begin_batch, batch_id, owner, owner_name_of(request), endpoint, file_id, metadata)
    try:
        check = await THREAD_POOLS["batch"].run(
            check_input, store, batch_id, store.file_path(file_id), endpoint, request.client_max_size
        )
    except BaseException as e:
        with contextlib.suppress(Exception):
            await store_call(store.abandon, batch_id)
        if isinstance(e, FileNotFoundError):  # its content is gone (deleted meanwhile)
            raise not_found("file content", file_id) from None
        if is_storage_error(e):
            raise no_room() from None
        raise
    batch = await store_call(store.end_creation, batch_id, owner, check.errors)
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
    data = await store_call(request.app[BATCH_STORE].list_batches, owner_of(request), everyone)
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
    batch = await store_call(request.app[BATCH_STORE].get_batch, batch_id, owner_of(request))
    if batch is None:
        raise not_found("batch", batch_id)
    return web.json_response(batch)


@routes.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: web.Request) -> web.Response:
    batch_id = request.match_info["batch_id"]
    batch = await store_call(request.app[BATCH_STORE].cancel, batch_id, owner_of(request))
    if batch is None:
        raise not_found("batch", batch_id)
    return web.json_response(batch)
