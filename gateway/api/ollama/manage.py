"""Ollama's model management: POST /api/pull, DELETE /api/delete, POST /api/copy (POST
/api/create: gateway/api/ollama/create.py).

Admin routes (gateway/web/routes.py), recorded in the usage ledger. Each change is written to
models.yaml with a backup and the registry reloaded (gateway/models/registry_edit.py). Pulls and
GGUF imports run `mlxgw models pull/import` as a child process: the same code as the CLI, and
the gateway never imports worker code. No request names a path outside the models directory
and `manager.allowed_import_paths`; model names are folder-safe (no `/`, no `..`). A delete
removes only the folder the entry's own pull or import wrote, and only while no other entry
serves from it; a copy shares its source's folder (gateway/models/ownership.py)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import shutil
import sys
import time
import uuid
from pathlib import Path

from aiohttp import web

from ....shared import model_store
from ....shared.config import ConfigError, parse_registry
from ....shared.errors import ErrorCode, ServiceError, invalid
from ....shared.platform import EXIT_WITH_PARENT_ENV
from ...access import audit
from ...access.auth import may_manage
from ...models import ownership
from ...models.registry_edit import edit_registry, listed_entry, registry_file
from ...pipeline.body import read_object
from ...web.state import MANAGER

routes = web.RouteTableDef()

PROGRESS_INTERVAL_S = 0.5  # at most this often a progress line (tqdm redraws far more often)
MAX_LINE_CHARS = 300
_HUB_PREFIX = re.compile(r"^(?:https?://)?(?:hf\.co|huggingface\.co)/")
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(?:@[A-Za-z0-9._-]+)?$")


async def read_body(request: web.Request) -> dict:
    return await read_object(request)


def model_name(value, field: str = "model") -> str:
    """A name for a new or existing model: Ollama's ":latest" tag dropped, folder-safe."""
    if not isinstance(value, str) or not value.strip():
        raise invalid(f"missing required parameter: '{field}'", field)
    name = value.strip().removesuffix(":latest")
    if ":" in name:
        raise invalid(f"'{field}': mlxgw models have no tags other than latest: {value!r}", field)
    try:
        model_store.validate_model_name(name)
    except model_store.InvalidModelName as e:
        raise invalid(str(e), field) from None
    return name


def named_model(body: dict, field: str = "model") -> str:
    return model_name(body.get(field) if body.get(field) is not None else body.get("name"), field)


def _ndjson(line: dict) -> bytes:
    return (json.dumps(line) + "\n").encode()


async def stream_lines(request: web.Request, lines: list[dict]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    for line in lines:
        await response.write(_ndjson(line))
    await response.write_eof()
    return response


# -- pull -----------------------------------------------------------------------------------------
def _repo(body: dict) -> tuple[str, str]:
    """(the repository to pull, the model name it is served under). A repository is served
    under its own name; a served model's name, as Ollama clients pull installed models to
    update them (Open WebUI's "Update All Models"), means the repository it was pulled from."""
    raw = body.get("model") if body.get("model") is not None else body.get("name")
    if not isinstance(raw, str) or not raw.strip():
        raise invalid("missing required parameter: 'model'", "model")
    repo = _HUB_PREFIX.sub("", raw.strip()).removesuffix(":latest")
    if _REPO.match(repo) and ".." not in repo:
        return repo, model_name(repo.split("@")[0].split("/")[-1])
    try:
        model_store.validate_model_name(repo)  # a folder-safe name: no separators, no `..`
    except model_store.InvalidModelName:
        raise invalid(
            f"'model' must be a Hugging Face repository, ORG/NAME[@REVISION] (optionally hf.co/...): {raw!r}", "model"
        ) from None
    spec = (model_store.read_import_record(model_store.models_dir() / repo) or {}).get("source_spec")
    pulled_from = spec[3:].split("@")[0] if isinstance(spec, str) and spec.startswith("hf:") else ""
    if not _REPO.match(pulled_from):
        raise invalid(f"model {repo!r} was not pulled from the Hugging Face hub: there is nothing to pull", "model")
    return pulled_from, repo  # its latest revision: an update


async def run_cli(args: list[str], on_line) -> tuple[int, str]:
    """`mlxgw ARGS` as a child; each output line (tqdm's \\r redraws split) to on_line.
    Returns (exit code, the last `error:` line or the last line). Killed if the request ends."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mlxgw",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, EXIT_WITH_PARENT_ENV: str(os.getpid())},  # a killed gateway takes it along
    )
    last, error, pending = "", "", b""
    try:
        while chunk := await proc.stdout.read(4096):
            pending += chunk
            *complete, pending = re.split(rb"[\r\n]", pending)
            pending = pending[-4096:]  # a line with no end in sight stays bounded
            for raw in complete:
                text = raw.decode(errors="replace").strip()[:MAX_LINE_CHARS]
                if text:
                    last = text
                    error = text.removeprefix("error: ") if text.startswith("error: ") else error
                    await on_line(text)
        return await proc.wait(), error or last
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _ensure_listed(request: web.Request, name: str):
    """An entry for a pulled model. `mlxgw models pull` writes to $MLXGW_HOME/models; a
    registry with another models_dir gets the folder's path as the entry's source."""
    pulled = model_store.models_dir() / name
    same_dir = request.app[MANAGER].registry.models_dir.resolve() == model_store.models_dir().resolve()

    def change(data: dict) -> None:
        if listed_entry(data, name) is None:
            owned = {"owns": str(ownership.real(pulled))}  # what the pull wrote: its delete removes it
            data["models"].append(
                {"name": name, **owned} if same_dir else {"name": name, "source": str(pulled), **owned}
            )

    return change


@routes.post("/api/pull")
async def pull(request: web.Request) -> web.StreamResponse:
    body = await read_body(request)
    repo, name = _repo(body)
    request["model"] = name
    may_manage(request, name)
    registry_file(request.app)  # refuse before downloading when models.yaml cannot be changed
    stream = body.get("stream") is not False
    response: web.StreamResponse | None = None
    last_sent = 0.0
    if stream:
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        await response.write(_ndjson({"status": f"pulling {repo}"}))

    async def progress(text: str) -> None:
        nonlocal last_sent
        if text.startswith("error: "):
            return  # the failure is the final line, in Ollama's error shape
        if response is not None and time.monotonic() - last_sent >= PROGRESS_INTERVAL_S:
            last_sent = time.monotonic()
            await response.write(_ndjson({"status": text}))

    code, message = await run_cli(["models", "pull", repo, "--name", name], progress)
    if code == 0:
        await edit_registry(request.app, _ensure_listed(request, name))
    if response is None:
        if code != 0:
            return web.json_response({"error": f"pull {repo}: {message}"}, status=502)
        return web.json_response({"status": "success"})
    await audit.record(request, status=200 if code == 0 else 502, reason=None if code == 0 else message)
    await response.write(_ndjson({"status": "success"} if code == 0 else {"error": f"pull {repo}: {message}"}))
    await response.write_eof()
    return response


# -- delete ---------------------------------------------------------------------------------------
def _own_folder(request: web.Request, name: str) -> Path | None:
    """An unlisted model folder of mlxgw's own, by its name: in the registry's models
    directory or the one `mlxgw models pull` writes to; None otherwise."""
    registry_dir = request.app[MANAGER].registry.models_dir.resolve()
    for directory in (registry_dir, model_store.models_dir().resolve()):
        folder = directory / name
        if folder.is_dir() and (
            model_store.read_import_record(folder) is not None or (folder / "config.json").exists()
        ):
            return ownership.real(folder)
    return None


def _served_elsewhere(request: web.Request, data: dict, listed_before: set[str], name: str, folder: Path) -> bool:
    """Whether any entry but `name` serves from folder once models.yaml is `data`."""
    registry = request.app[MANAGER].registry
    try:
        listed = parse_registry(data, registry.path).models
    except ConfigError as e:
        raise invalid(f"the change would make models.yaml invalid: {e}") from None
    others = ownership.other_entries(registry, listed, listed_before, name)
    return bool(ownership.users(others, registry.models_dir, folder))


def _set_aside(folders: list[Path], trash: list[Path]) -> None:
    """Rename each folder out of the models directory's listing (`.trash-...-PID`) while the
    edit still holds the lock, so no create can take it up between the check and the removal;
    what a kill leaves there is removed at the next start (model_store.clean_stale_temp_dirs)."""
    for folder in folders:
        aside = folder.parent / f".trash-{folder.name}-{uuid.uuid4().hex[:8]}-{os.getpid()}"
        try:
            folder.rename(aside)
        except FileNotFoundError:
            continue
        trash.append(aside)


@routes.delete("/api/delete")
async def delete(request: web.Request) -> web.Response:
    name = named_model(await read_body(request))
    request["model"] = name
    may_manage(request, name)
    registry = request.app[MANAGER].registry
    found = {m.name: m for m in registry.discovered}
    remove: list[Path] = []

    def change(data: dict) -> None:
        listed_before = {m.get("name") for m in data["models"] if isinstance(m, dict)}
        entry = listed_entry(data, name)
        if entry is not None:
            data["models"].remove(entry)
            folder = ownership.owned_folder(entry, registry.models_dir)
            if folder is not None and not _served_elsewhere(request, data, listed_before, name, folder):
                remove.append(folder)
            return
        owner = next((m for m in data["models"] if name in (m.get("aliases") or [])), None)
        if owner is not None:
            owner["aliases"] = [a for a in owner["aliases"] if a != name]
            return
        if name in found:
            raise invalid(f"model '{name}' is served in place from {found[name].source}; delete it there", "model")
        folder = _own_folder(request, name)
        if folder is None:
            raise ServiceError(ErrorCode.MODEL_NOT_FOUND, f"model '{name}' not found")
        if _served_elsewhere(request, data, listed_before, name, folder):
            raise invalid(f"another model serves from the folder of '{name}'; delete that model first", "model")
        remove.append(folder)

    trash: list[Path] = []
    # The reload that follows the edit sees the folder gone already (set aside under the lock).
    await edit_registry(request.app, change, lambda: _set_aside(remove, trash))
    # Unlinked files stay readable by a worker that has them open: its requests in flight
    # finish while the reload drains it.
    for aside in trash:
        await asyncio.to_thread(shutil.rmtree, aside, True)
    return web.json_response({})


# -- copy -----------------------------------------------------------------------------------------
# Fields that belong to the served name, not to the weights: a copy or a create starts without
# them. Adapters: in Ollama's terms each is a model of its own made FROM this one (/api/tags
# lists it with this as parent_model), and `ollama cp` copies no model derived from its
# source; copied, their names would collide (they are unique across the registry) and their
# access would follow the new name's key patterns. The copy's users reach them by their names.
SERVED_ONCE = ("aliases", "preload", "pin", "adapters", "resident_adapters", "adapter_memory_mb", "owns")


def entry_like(request: web.Request, data: dict, base: str, new_name: str) -> dict:
    """A models.yaml entry for new_name serving what `base` (a name or alias) serves: the
    listed entry's settings copied, pointing at the same weights, owning none of them. The
    key must be allowed every model served from those weights (may_start_from)."""
    registry = request.app[MANAGER].registry
    slot_entry = registry.entry(base) or registry.entry(base.removesuffix(":latest"))
    if slot_entry is None:
        raise ServiceError(ErrorCode.MODEL_NOT_FOUND, f"model '{base}' not found")
    may_start_from(request, ownership.served_paths(slot_entry, registry.models_dir)[:1])
    listed = listed_entry(data, slot_entry.name)
    entry = copy.deepcopy(listed) if listed is not None else {"kind": slot_entry.kind.value}
    entry["source"] = (listed or {}).get("source") or slot_entry.source or slot_entry.name
    for served_once in SERVED_ONCE:
        entry.pop(served_once, None)
    return {"name": new_name, **{k: v for k, v in entry.items() if k != "name"}}


def may_start_from(request: web.Request, folders: list[Path]) -> None:
    """A copy or create shares the folder it starts from: a key that is not an admin must be
    allowed every model served from it, or a folder path would reach a model its patterns
    keep it from (the model itself is not named: the key may not know of it)."""
    key = request.get("key")
    if key is None or key.admin:
        return
    registry = request.app[MANAGER].registry
    for folder in folders:
        for e in ownership.users(registry.models, registry.models_dir, folder):
            if not key.allows(e.name, *e.aliases):
                raise ServiceError(
                    ErrorCode.PERMISSION,
                    f"API key '{key.name}' may not start from that folder: a model it may not manage serves "
                    "from it (an admin key may)",
                    param="from",
                )


def refuse_existing(request: web.Request, data: dict, name: str) -> None:
    if listed_entry(data, name) is not None or request.app[MANAGER].registry.entry(name) is not None:
        raise invalid(f"a model or alias named '{name}' exists; delete it first", "destination")


@routes.post("/api/copy")
async def copy_model(request: web.Request) -> web.Response:
    body = await read_body(request)
    source = body.get("source")
    if not isinstance(source, str) or not source.strip():
        raise invalid("missing required parameter: 'source'", "source")
    destination = model_name(body.get("destination"), "destination")
    request["model"] = destination
    may_manage(request, source.strip(), destination)

    def change(data: dict) -> None:
        refuse_existing(request, data, destination)
        data["models"].append(entry_like(request, data, source.strip(), destination))

    await edit_registry(request.app, change)
    return web.json_response({})
