"""The OpenAI Files API, for batch jobs: POST /v1/files (multipart, purpose "batch", JSONL,
size-capped while it streams to disk), GET /v1/files, GET/DELETE /v1/files/{id},
GET /v1/files/{id}/content. A key sees only its own files (another key's id is a 404)."""

from __future__ import annotations

import asyncio
import os

from aiohttp import web

from mlxgw.shared.errors import ErrorCode, ServiceError, invalid

from ..batch_runner import BATCH_STORE
from ..batch_store import BatchStore, new_id

routes = web.RouteTableDef()

MAX_FILE_BYTES = int(os.environ.get("MLXGW_MAX_BATCH_FILE_MB") or 64) * 1024 * 1024
PURPOSES = ("batch",)  # what may be uploaded; outputs are "batch_output"


def owner_of(request: web.Request) -> str | None:
    key = request.get("key")
    return key.name if key is not None else None


def _store(request: web.Request) -> BatchStore:
    return request.app[BATCH_STORE]


def not_found(what: str, ident: str) -> ServiceError:
    return ServiceError(ErrorCode.NOT_FOUND, f"no {what} with id {ident!r}")


async def _save_upload(part, path) -> int:
    """Stream a multipart part to disk, refusing it past MAX_FILE_BYTES."""
    size = 0
    tmp = path.with_suffix(".part")
    try:
        with open(tmp, "wb") as f:
            while chunk := await part.read_chunk(1 << 20):
                size += len(chunk)
                if size > MAX_FILE_BYTES:
                    raise ServiceError(
                        ErrorCode.BODY_TOO_LARGE,
                        f"the file is over {MAX_FILE_BYTES // (1024 * 1024)} MB",
                        param="file",
                    )
                await asyncio.to_thread(f.write, chunk)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return size


@routes.post("/v1/files")
async def upload(request: web.Request) -> web.Response:
    if not request.content_type.startswith("multipart/"):
        raise invalid("send the file as multipart/form-data with fields 'file' and 'purpose'", "file")
    reader = await request.multipart()
    purpose, file_id, filename, size = None, None, None, 0
    store = _store(request)
    async for part in reader:
        if part.name == "purpose":
            purpose = (await part.text()).strip()
        elif part.name == "file":
            file_id, filename = new_id("file-"), part.filename or "upload.jsonl"
            size = await _save_upload(part, store.file_path(file_id))
    if file_id is None:
        raise invalid("the 'file' field is missing", "file")
    if purpose not in PURPOSES:
        store.file_path(file_id).unlink(missing_ok=True)
        raise invalid(f"'purpose' must be one of {', '.join(PURPOSES)}", "purpose")
    obj = await asyncio.to_thread(store.add_file, file_id, owner_of(request), purpose, filename, size)
    return web.json_response(obj)


@routes.get("/v1/files")
async def list_files(request: web.Request) -> web.Response:
    purpose = request.query.get("purpose")
    data = await asyncio.to_thread(_store(request).list_files, owner_of(request), purpose)
    return web.json_response({"object": "list", "data": data, "has_more": False})


@routes.get("/v1/files/{file_id}")
async def get_file(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    obj = await asyncio.to_thread(_store(request).get_file, file_id, owner_of(request))
    if obj is None:
        raise not_found("file", file_id)
    return web.json_response(obj)


@routes.delete("/v1/files/{file_id}")
async def delete_file(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    if not await asyncio.to_thread(_store(request).delete_file, file_id, owner_of(request)):
        raise not_found("file", file_id)
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


@routes.get("/v1/files/{file_id}/content")
async def file_content(request: web.Request) -> web.StreamResponse:
    file_id = request.match_info["file_id"]
    store = _store(request)
    if await asyncio.to_thread(store.get_file, file_id, owner_of(request)) is None:
        raise not_found("file", file_id)
    path = store.file_path(file_id)
    if not path.exists():
        raise not_found("file content", file_id)
    return web.FileResponse(path, headers={"content-type": "application/jsonl"})
