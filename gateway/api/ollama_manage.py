"""Ollama's model management: POST /api/pull, DELETE /api/delete, POST /api/copy, POST /api/create.

Admin routes (gateway/web/routes.py), recorded in the usage ledger. Each change is written to
models.yaml with a backup and the registry reloaded (gateway/models/registry_edit.py). Pulls and
GGUF imports run `mlxgw models pull/import` as a child process: the same code as the CLI, and
the gateway never imports worker code. No request names a path outside the models directory
and `manager.allowed_import_paths`; model names are folder-safe (no `/`, no `..`)."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shutil
import sys
import time
from pathlib import Path

from aiohttp import web

from mlxgw.gateway.access.auth import may_manage
from mlxgw.gateway.api.modelfile import CreateSpec, parse_create
from mlxgw.gateway.models.registry_edit import edit_registry, listed_entry, registry_file, reload_registry
from mlxgw.gateway.pipeline.body import read_object
from mlxgw.gateway.web.state import MANAGER
from mlxgw.shared import model_store
from mlxgw.shared.errors import ErrorCode, ServiceError, invalid

routes = web.RouteTableDef()

PROGRESS_INTERVAL_S = 0.5  # at most this often a progress line (tqdm redraws far more often)
MAX_LINE_CHARS = 300
_HUB_PREFIX = re.compile(r"^(?:https?://)?(?:hf\.co|huggingface\.co)/")
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(?:@[A-Za-z0-9._-]+)?$")


async def _body(request: web.Request) -> dict:
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


def _named(body: dict, field: str = "model") -> str:
    return model_name(body.get(field) if body.get(field) is not None else body.get("name"), field)


def _ndjson(line: dict) -> bytes:
    return (json.dumps(line) + "\n").encode()


async def _stream_lines(request: web.Request, lines: list[dict]) -> web.StreamResponse:
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


async def _run_cli(args: list[str], on_line) -> tuple[int, str]:
    """`mlxgw ARGS` as a child; each output line (tqdm's \\r redraws split) to on_line.
    Returns (exit code, the last `error:` line or the last line). Killed if the request ends."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mlxgw", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
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
            data["models"].append({"name": name} if same_dir else {"name": name, "source": str(pulled)})

    return change


@routes.post("/api/pull")
async def pull(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
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

    code, message = await _run_cli(["models", "pull", repo, "--name", name], progress)
    if code == 0:
        await edit_registry(request.app, _ensure_listed(request, name))
    if response is None:
        if code != 0:
            return web.json_response({"error": f"pull {repo}: {message}"}, status=502)
        return web.json_response({"status": "success"})
    await response.write(_ndjson({"status": "success"} if code == 0 else {"error": f"pull {repo}: {message}"}))
    await response.write_eof()
    return response


# -- delete ---------------------------------------------------------------------------------------
def _own_folder(request: web.Request, source: str) -> Path | None:
    """The model folder a models.yaml source names when it is one of mlxgw's own (directly in
    the registry's models directory or the one `mlxgw models pull` writes to); None otherwise."""
    registry_dir = request.app[MANAGER].registry.models_dir.resolve()
    path = Path(source)
    folder = path.resolve() if path.is_absolute() else (registry_dir / source).resolve()
    own = folder.parent in (registry_dir, model_store.models_dir().resolve())
    return folder if own and folder.is_dir() else None


@routes.delete("/api/delete")
async def delete(request: web.Request) -> web.Response:
    name = _named(await _body(request))
    request["model"] = name
    may_manage(request, name)
    registry = request.app[MANAGER].registry
    found = {m.name: m for m in registry.discovered}
    remove: list[Path] = []

    def change(data: dict) -> None:
        entry = listed_entry(data, name)
        if entry is not None:
            data["models"].remove(entry)
            source = entry.get("source") or name
            still_used = any((m.get("source") or m.get("name")) == source for m in data["models"])
            folder = _own_folder(request, source)
            if folder is not None and not still_used:
                remove.append(folder)
            return
        owner = next((m for m in data["models"] if name in (m.get("aliases") or [])), None)
        if owner is not None:
            owner["aliases"] = [a for a in owner["aliases"] if a != name]
            return
        if name in found:
            raise invalid(f"model '{name}' is served in place from {found[name].source}; delete it there", "model")
        folder = _own_folder(request, name)
        if folder is None or model_store.read_import_record(folder) is None and not (folder / "config.json").exists():
            raise ServiceError(ErrorCode.MODEL_NOT_FOUND, f"model '{name}' not found")
        remove.append(folder)

    await edit_registry(request.app, change)
    for folder in remove:
        await asyncio.to_thread(shutil.rmtree, folder, True)
    if remove:
        await reload_registry(request.app)  # a folder the models directory listed is gone
    return web.json_response({})


# -- copy -----------------------------------------------------------------------------------------
def _entry_like(request: web.Request, data: dict, base: str, new_name: str) -> dict:
    """A models.yaml entry for new_name serving what `base` (a name or alias) serves: the
    listed entry's settings copied, pointing at the same weights."""
    slot_entry = request.app[MANAGER].registry.entry(base) or request.app[MANAGER].registry.entry(
        base.removesuffix(":latest")
    )
    if slot_entry is None:
        raise ServiceError(ErrorCode.MODEL_NOT_FOUND, f"model '{base}' not found")
    listed = listed_entry(data, slot_entry.name)
    entry = copy.deepcopy(listed) if listed is not None else {"kind": slot_entry.kind.value}
    entry["source"] = (listed or {}).get("source") or slot_entry.source or slot_entry.name
    for served_once in ("aliases", "preload", "pin"):
        entry.pop(served_once, None)
    entry["name"] = new_name
    return {"name": new_name, **{k: v for k, v in entry.items() if k != "name"}}


def _refuse_existing(request: web.Request, data: dict, name: str) -> None:
    if listed_entry(data, name) is not None or request.app[MANAGER].registry.entry(name) is not None:
        raise invalid(f"a model or alias named '{name}' exists; delete it first", "destination")


@routes.post("/api/copy")
async def copy_model(request: web.Request) -> web.Response:
    body = await _body(request)
    source = body.get("source")
    if not isinstance(source, str) or not source.strip():
        raise invalid("missing required parameter: 'source'", "source")
    destination = model_name(body.get("destination"), "destination")
    request["model"] = destination
    may_manage(request, source.strip(), destination)

    def change(data: dict) -> None:
        _refuse_existing(request, data, destination)
        data["models"].append(_entry_like(request, data, source.strip(), destination))

    await edit_registry(request.app, change)
    return web.json_response({})


# -- create ---------------------------------------------------------------------------------------
def _allowed_roots(request: web.Request) -> list[Path]:
    registry = request.app[MANAGER].registry
    roots = [registry.models_dir, *(Path(p).expanduser() for p in registry.manager.allowed_import_paths)]
    return [r.resolve() for r in roots]


def confined_path(request: web.Request, text: str) -> Path:
    """FROM's path, resolved (links followed) inside an allowed folder; refused before anything
    about it (even whether it exists) is looked at otherwise."""
    path = Path(text).expanduser()
    if not path.is_absolute():
        raise invalid("a FROM path must be absolute", "from")
    resolved = path.resolve()
    if not any(resolved.is_relative_to(root) for root in _allowed_roots(request)):
        raise ServiceError(
            ErrorCode.PERMISSION,
            "FROM names a path outside the folders the operator allows (the models directory and "
            "manager.allowed_import_paths)",
        )
    return resolved


def _is_path(base: str) -> bool:
    return base.startswith(("/", "./", "../", "~")) or base.endswith(".gguf")


async def _path_entry(request: web.Request, spec: CreateSpec) -> dict | None:
    """The entry for a FROM path (a GGUF file imported into the models directory first);
    None when FROM names a served model."""
    if not _is_path(spec.base):
        return None
    path = confined_path(request, spec.base)
    if path.is_dir() and (path / "config.json").is_file():
        return {"name": spec.name, "source": str(path)}
    if path.is_file() and path.suffix == ".gguf":
        code, message = await _run_cli(["models", "import", str(path), "--name", spec.name, "--force"], _ignore)
        if code != 0:
            raise invalid(f"importing the GGUF failed: {message}", "from")
        return {"name": spec.name}
    raise invalid("FROM must name a model folder (with config.json) or a .gguf file", "from")


async def _ignore(_: str) -> None:
    return None


def _apply_spec(entry: dict, spec: CreateSpec) -> dict:
    for key, value in spec.settings.items():
        if isinstance(value, dict):
            entry[key] = {**(entry.get(key) or {}), **value}
        else:
            entry[key] = value
    if spec.system is not None:
        _set_chat(entry, "system", spec.system)
    if spec.messages:
        _set_chat(entry, "messages", spec.messages)
    if spec.template is not None:
        _set_chat(entry, "chat_template", spec.template)
        _set_chat(entry, "allow_request_chat_template", True)  # the gateway sends the entry's template per request
    return entry


def _set_chat(entry: dict, key: str, value: object) -> None:
    """A chat field, where the base entry's YAML already spells it: in its chat: section, else
    at the top (the flat key models.yaml still accepts); never both, which would be an error."""
    section = entry.get("chat")
    if isinstance(section, dict) and key in section:
        section[key] = value
    else:
        entry[key] = value


@routes.post("/api/create")
async def create(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    name = _named(body)
    request["model"] = name
    spec = parse_create(body, name)
    may_manage(request, name, *(() if not spec.base or _is_path(spec.base) else (spec.base.removesuffix(":latest"),)))
    registry_file(request.app)
    from_path = await _path_entry(request, spec)

    def change(data: dict) -> None:
        existing = listed_entry(data, name)
        if existing is None and request.app[MANAGER].registry.entry(name) is not None:
            raise invalid(f"a model or alias named '{name}' exists outside models.yaml; pick another name", "model")
        base = from_path if from_path is not None else _entry_like(request, data, spec.base, name)
        if existing is not None:
            data["models"].remove(existing)
        data["models"].append(_apply_spec(copy.deepcopy(base), spec))

    await edit_registry(request.app, change)
    lines = [{"status": "reading model metadata"}, {"status": "writing manifest"}, {"status": "success"}]
    if body.get("stream") is False:
        return web.json_response(lines[-1])
    return await _stream_lines(request, lines)
