"""The OpenAI Files API, for batch jobs: POST /v1/files (multipart, purpose "batch", JSONL,
size-capped while it streams to disk), GET /v1/files, GET/DELETE /v1/files/{id},
GET /v1/files/{id}/content. A key sees only its own files (another key's id is a 404), owned
by the key's identity, not its name. An upload is metered like any request (the key's rpm and
concurrency), holds exactly one `file` part, and fits the key's file count and stored bytes;
a full disk is a 507, never a 500."""

from __future__ import annotations

import contextlib
import os

from aiohttp import web

from ....shared.errors import ErrorCode, ServiceError, invalid
from ...batches.files import MAX_FILES, MAX_STORED_BYTES, is_storage_error, new_id, open_private
from ...batches.runner import BATCH_STORE
from ...batches.store import BatchStore
from ...web.work_pools import THREAD_POOLS

routes = web.RouteTableDef()

MAX_FILE_BYTES = int(os.environ.get("MLXGW_MAX_BATCH_FILE_MB") or 64) * 1024 * 1024
PURPOSES = ("batch",)  # what may be uploaded; outputs are "batch_output"
MAX_FILENAME = 255


def owner_of(request: web.Request) -> str | None:
    """Who owns what a request stores: its key's identity (a new key under an old key's name
    is someone else), None without keys."""
    key = request.get("key")
    return key.tenant if key is not None else None


def owner_name_of(request: web.Request) -> str | None:
    key = request.get("key")
    return key.name if key is not None else None


def _store(request: web.Request) -> BatchStore:
    return request.app[BATCH_STORE]


async def store_call(fn, *args):
    """A store call on the batch I/O pool; a full disk becomes a 507."""
    try:
        return await THREAD_POOLS["batch_io"].run(fn, *args)
    except Exception as e:
        if is_storage_error(e):
            raise no_room() from None
        raise


def no_room() -> ServiceError:
    return ServiceError(ErrorCode.INSUFFICIENT_STORAGE, "the server's disk is full; retry later", retry_after=60)


def not_found(what: str, ident: str) -> ServiceError:
    return ServiceError(ErrorCode.NOT_FOUND, f"no {what} with id {ident!r}")


async def _save_upload(part, path, limit: int, why: str) -> int:
    """Stream a multipart part to disk (0600), refusing it past `limit` bytes."""
    size = 0
    tmp = path.with_suffix(".part")
    write = THREAD_POOLS["batch_io"].run
    try:
        f = await write(open_private, tmp)
        try:
            while chunk := await part.read_chunk(1 << 20):
                size += len(chunk)
                if size > limit:
                    raise ServiceError(ErrorCode.BODY_TOO_LARGE, why, param="file")
                await write(f.write, chunk)
        finally:
            await write(f.close)
        os.replace(tmp, path)
    except OSError as e:
        if is_storage_error(e):
            raise no_room() from None
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return size


async def _read_small(part, limit: int = 256) -> str:
    data = b""
    while chunk := await part.read_chunk(limit + 1):
        data += chunk
        if len(data) > limit:
            raise invalid(f"'{part.name}' is over {limit} bytes", part.name)
    return data.decode("utf-8", "replace").strip()


async def _reserve(request: web.Request, file_id: str) -> tuple[int, str]:
    """Reserve the bytes this upload may hold before any arrives (the file size cap, within
    what is left of the key's stored bytes, and within the request's Content-Length when it
    sends one, so small uploads at once do not crowd each other out); the limit and what to
    say past it. Released by add_file or release_upload."""
    most = min(MAX_FILE_BYTES, request.content_length or MAX_FILE_BYTES)
    files, stored, limit = await store_call(
        _store(request).reserve_upload, file_id, owner_of(request), most, MAX_FILES, MAX_STORED_BYTES
    )
    if files >= MAX_FILES:
        raise ServiceError(
            ErrorCode.RATE_LIMITED,
            f"this key holds {files} files (uploads in progress included), the most it may; delete some first",
            param="file",
        )
    if MAX_STORED_BYTES - stored < MAX_FILE_BYTES:
        return limit, (
            f"the key's files would pass {MAX_STORED_BYTES // (1 << 20)} MB (uploads in progress included); "
            "delete some first"
        )
    return limit, f"the file is over {MAX_FILE_BYTES // (1024 * 1024)} MB"


@routes.post("/v1/files")
async def upload(request: web.Request) -> web.Response:
    if not request.content_type.startswith("multipart/"):
        raise invalid("send the file as multipart/form-data with fields 'file' and 'purpose'", "file")
    store, file_id = _store(request), new_id("file-")
    purpose, filename, size = None, None, 0
    try:
        limit, why = await _reserve(request, file_id)
        reader = await request.multipart()
        async for part in reader:
            if part.name == "purpose":
                purpose = await _read_small(part)
            elif part.name == "file":
                if filename is not None:
                    raise invalid("send one 'file' field per upload", "file")
                filename = (part.filename or "upload.jsonl")[:MAX_FILENAME]
                size = await _save_upload(part, store.file_path(file_id), limit, why)
        if filename is None:
            raise invalid("the 'file' field is missing", "file")
        if purpose not in PURPOSES:
            raise invalid(f"'purpose' must be one of {', '.join(PURPOSES)}", "purpose")
        obj = await store_call(store.add_file, file_id, owner_of(request), purpose, filename, size)
    except BaseException:
        # Nothing registered: nothing may stay on disk, nor reserved (a release that fails
        # here, on a full disk say, is swept at the next start).
        store.file_path(file_id).unlink(missing_ok=True)
        with contextlib.suppress(Exception):
            await store_call(store.release_upload, file_id)
        raise
    return web.json_response(obj)


@routes.get("/v1/files")
async def list_files(request: web.Request) -> web.Response:
    purpose = request.query.get("purpose")
    data = await store_call(_store(request).list_files, owner_of(request), purpose)
    return web.json_response({"object": "list", "data": data, "has_more": False})


@routes.get("/v1/files/{file_id}")
async def get_file(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    obj = await store_call(_store(request).get_file, file_id, owner_of(request))
    if obj is None:
        raise not_found("file", file_id)
    return web.json_response(obj)


@routes.delete("/v1/files/{file_id}")
async def delete_file(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    if not await store_call(_store(request).delete_file, file_id, owner_of(request)):
        raise not_found("file", file_id)
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


@routes.get("/v1/files/{file_id}/content")
async def file_content(request: web.Request) -> web.StreamResponse:
    file_id = request.match_info["file_id"]
    store = _store(request)
    if await store_call(store.get_file, file_id, owner_of(request)) is None:
        raise not_found("file", file_id)
    path = store.file_path(file_id)
    if not path.exists():
        raise not_found("file content", file_id)
    return web.FileResponse(path, headers={"content-type": "application/jsonl"})
