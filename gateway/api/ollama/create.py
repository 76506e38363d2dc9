"""Ollama's POST /api/create: a models.yaml entry from a Modelfile (gateway/api/ollama/modelfile.py).

FROM a served model shares its folder; FROM a folder under the operator's allowed folders
serves it in place; FROM a .gguf file imports it into the models directory, and only that
import's folder is the new entry's own (`owns`: its delete removes it). A key that is not an
admin starts only from folders whose every model it may manage. A TEMPLATE is the entry's
own chat template (the worker renders it as the model's); requests still may not send
templates unless the operator turns `allow_request_chat_template` on."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from aiohttp import web

from ....shared import model_store
from ....shared.errors import ErrorCode, ServiceError, invalid
from ...access import audit
from ...access.auth import may_manage
from ...models import ownership
from ...models.registry_edit import edit_registry, listed_entry, registry_file
from ...web.state import MANAGER
from .manage import (
    SERVED_ONCE,
    entry_like,
    may_start_from,
    named_model,
    read_body,
    run_cli,
    stream_lines,
)
from .modelfile import CreateSpec, parse_create

routes = web.RouteTableDef()

# Names a create of this gateway is importing into: a second create of the same name waits
# for nothing and is refused, instead of two imports racing for one folder.
_IMPORTING: set[str] = set()


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
        may_start_from(request, [path])
        return {"name": spec.name, "source": str(path), "parent": str(path)}
    if path.is_file() and path.suffix == ".gguf":
        return await _import_gguf(request, spec, path)
    raise invalid("FROM must name a model folder (with config.json) or a .gguf file", "from")


async def _import_gguf(request: web.Request, spec: CreateSpec, path: Path) -> dict:
    """`mlxgw models import` into the models directory's folder of the new name, which is then
    the entry's own; refused when another entry serves from that folder (the import would
    replace its weights), or while another create imports under the name."""
    registry = request.app[MANAGER].registry
    target = model_store.models_dir() / spec.name
    others = [e for e in registry.models if e.name != spec.name]
    if ownership.users(others, registry.models_dir, target):
        raise invalid(f"another model serves from the models directory's folder '{spec.name}'; pick another name")
    if spec.name in _IMPORTING:
        raise invalid(f"model '{spec.name}' is being created by another request; try again when it ends", "model")
    _IMPORTING.add(spec.name)
    try:
        code, message = await run_cli(["models", "import", str(path), "--name", spec.name, "--force"], _ignore)
    finally:
        _IMPORTING.discard(spec.name)
    if code != 0:
        raise invalid(f"importing the GGUF failed: {message}", "from")
    entry = {"name": spec.name, "owns": str(ownership.real(target)), "parent": str(path)}
    if registry.models_dir.resolve() != model_store.models_dir().resolve():
        entry["source"] = str(target)  # the import wrote where `mlxgw models` writes
    return entry


async def _ignore(_: str) -> None:
    return None


def _apply_spec(entry: dict, spec: CreateSpec) -> dict:
    for key, value in spec.settings.items():
        if isinstance(value, dict):
            entry[key] = {**(entry.get(key) or {}), **value}
        else:
            entry[key] = value
    chat = {"system": spec.system, "messages": spec.messages or None, "chat_template": spec.template}
    chat = {key: value for key, value in chat.items() if value is not None}
    if chat:  # the template is the model's own: no request templates needed
        entry["chat"] = {**(entry.get("chat") or {}), **chat}
    return entry


def _model_context(entry: dict, models_dir: Path) -> int | None:
    """The context length the model's own config.json states (None: no config, an echo model)."""
    source = Path(str(entry.get("source") or entry["name"])).expanduser()
    folder = source if source.is_absolute() else models_dir / source
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    value = text.get("max_position_embeddings") if isinstance(text, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _check_context(entry: dict, spec: CreateSpec, models_dir: Path) -> None:
    asked = spec.settings.get("context_length")
    own = _model_context(entry, models_dir) if asked is not None else None
    if own is not None and asked > own:
        raise invalid(f"PARAMETER num_ctx {asked} is over the model's own context length ({own})", "parameters")


def _replacing(existing: dict, new: dict) -> dict:
    """A create over an entry of the same name keeps what belongs to the name (its aliases,
    adapters, the folder its own import wrote), whatever it now starts from."""
    for field in SERVED_ONCE:
        if field in existing and field not in new:
            new[field] = copy.deepcopy(existing[field])
    return new


@routes.post("/api/create")
async def create(request: web.Request) -> web.StreamResponse:
    body = await read_body(request)
    name = named_model(body)
    request["model"] = name
    spec = parse_create(body, name)
    may_manage(request, name, *(() if not spec.base or _is_path(spec.base) else (spec.base.removesuffix(":latest"),)))
    registry_file(request.app)
    from_path = await _path_entry(request, spec)
    models_dir = request.app[MANAGER].registry.models_dir

    def change(data: dict) -> None:
        existing = listed_entry(data, name)
        if existing is None and request.app[MANAGER].registry.entry(name) is not None:
            raise invalid(f"a model or alias named '{name}' exists outside models.yaml; pick another name", "model")
        if from_path is not None:
            base = copy.deepcopy(from_path)
        else:
            parent = spec.base.removesuffix(":latest")
            parent = (existing or {}).get("parent") if parent == name else parent  # re-created over itself
            base = {**entry_like(request, data, spec.base, name), **({"parent": parent} if parent else {})}
        new = _apply_spec(base, spec)
        _check_context(new, spec, models_dir)
        if existing is not None:
            data["models"].remove(existing)
            new = _replacing(existing, new)
        data["models"].append(new)

    await edit_registry(request.app, change)
    await audit.record(request, status=200)  # before the stream: its first bytes are the answer
    lines = [{"status": "reading model metadata"}, {"status": "writing manifest"}, {"status": "success"}]
    if body.get("stream") is False:
        return web.json_response(lines[-1])
    return await stream_lines(request, lines)
