"""Admin routes for LoRA adapters: add one to a model, or remove one, while its
worker runs. The change is written to models.yaml (gateway/models/registry_edit.py: the gateway
must run from the operator's own file) and applied as a reload is: the running worker
takes the new list without a restart (gateway/models/adapters.py). An adapter added to a running
model is loaded by its worker first, so a folder that is not an adapter of this model is
refused here, with the reason, and nothing changes.

The folder path comes from an admin key and, as Ollama's FROM paths, must lie in the models
directory or `manager.allowed_import_paths` (gateway/models/import_roots.py); models.yaml's
own paths are the operator's and are not confined."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from ....shared import model_store
from ....shared.adapter_folder import read_config, scale_of
from ....shared.errors import ErrorCode, ServiceError, invalid
from ....shared.model_sections import AdapterEntry, ModelKind
from ...models import adapters
from ...models.import_roots import confined
from ...models.registry_edit import edit_registry, listed_entry, registry_file
from ...web.state import MANAGER
from .keys import _json_object, require_admin

routes = web.RouteTableDef()


def check_folder(folder: Path) -> None:
    """What the gateway can check without loading weights: an adapter folder (mlx_lm.lora's
    or PEFT's) with a LoRA config."""
    if not folder.is_absolute():
        raise invalid(f"'path' must be an absolute folder, got {str(folder)!r}", "path")
    try:
        scale_of(*read_config(folder))
    except ValueError as e:
        raise invalid(str(e), "path") from None


def _apply(request: web.Request, base: str, edit: Callable[[list], list]):
    """Edit the model's adapters list in models.yaml (gateway/models/registry_edit.py: checked,
    backed up, then reloaded, which hands the running workers the new list)."""

    def change(data: dict) -> None:
        entry = listed_entry(data, base)
        if entry is None:
            raise invalid(f"model '{base}' is not listed in models.yaml; list it there to give it adapters", "model")
        entry["adapters"] = edit(list(entry.get("adapters") or []))

    return edit_registry(request.app, change)


@routes.post("/v1/adapters")
async def add_adapter(request: web.Request) -> web.Response:
    """{"model": base, "name": adapter name, "path": its mlx_lm.lora folder}."""
    require_admin(request)
    body = await _json_object(request)
    base, name, raw_path = body.get("model"), body.get("name"), body.get("path")
    for field, value in (("model", base), ("name", name), ("path", raw_path)):
        if not isinstance(value, str) or not value:
            raise invalid(f"'{field}' must be a non-empty string", field)
    manager = request.app[MANAGER]
    slot = manager.slots.get(base)
    if slot is None:
        raise ServiceError(ErrorCode.MODEL_NOT_FOUND, f"The model '{base}' does not exist.", param="model")
    if slot.entry.kind != ModelKind.CHAT or slot.entry.engine != "mlx" or slot.entry.distributed is not None:
        raise invalid(f"model '{base}' does not take adapters (chat models on the mlx engine only)", "model")
    try:
        model_store.validate_model_name(name)
    except model_store.InvalidModelName as e:
        raise invalid(str(e), "name") from None
    if name in AdapterEntry.RESERVED:  # `<model>:latest` is Ollama's name for the model itself
        raise invalid(f"'{name}' is reserved: {base}:{name} names the model {base} itself", "name")
    if manager.registry.entry(name) is not None or manager.registry.adapter(name) is not None:
        raise invalid(f"'{name}' already names a model or an adapter", "name")
    registry_file(request.app)  # a gateway whose models.yaml cannot be edited changes nothing
    # Confined as Ollama's FROM paths are: inside the models directory or allowed_import_paths.
    folder = confined(manager.registry, raw_path, "an adapter's path", "path")
    await asyncio.to_thread(check_folder, folder)
    added = AdapterEntry(name=name, path=str(folder))
    # A running worker loads it first: weights that do not fit this model are refused here.
    await adapters.push(manager, slot, dataclasses.replace(slot.entry, adapters=[*slot.entry.adapters, added]), name)
    try:
        await _apply(request, base, lambda listed: [*listed, {"name": name, "path": str(folder)}])
    except BaseException:
        await adapters.push(manager, slot)  # the registry did not change: neither do the workers
        raise
    return web.json_response({"object": "adapter", "id": name, "parent": base, "path": str(folder)}, status=201)


@routes.delete("/v1/adapters/{name}")
async def remove_adapter(request: web.Request) -> web.Response:
    """Rows using it finish with it; new requests naming it get a 404."""
    require_admin(request)
    name = request.match_info["name"]
    found = adapters.find(request.app[MANAGER], name)
    if found is None:
        raise ServiceError(ErrorCode.MODEL_NOT_FOUND, f"The adapter '{name}' does not exist.", param="name")
    slot, adapter = found
    registry_file(request.app)

    def without(listed: list) -> list:
        return [a for a in listed if not isinstance(a, dict) or a.get("name") != adapter.name]

    await _apply(request, slot.name, without)
    return web.json_response({"object": "adapter", "id": adapter.name, "deleted": True})
