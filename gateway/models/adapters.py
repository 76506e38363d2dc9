"""LoRA adapters in the gateway: the model names that address an adapter of a
model (`support-bot`, or `<base>:support-bot`), their listings, and telling a model's running
workers when its adapters change, so adding or removing one never restarts them.

An adapter runs on its base model's worker: a request naming it resolves to the base's slot
and carries the adapter's name in `GenerateRequest.adapter` (worker/model/adapters/bank.py applies it
per row)."""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections.abc import Iterator

from ...shared.errors import ServiceError
from ...shared.model_sections import AdapterEntry, ModelEntry

log = logging.getLogger(__name__)


def find(manager, requested: str) -> tuple[object, AdapterEntry] | None:
    """(the base model's slot, the adapter) a requested model name addresses, or None."""
    found = manager.registry.adapter(requested)
    if found is None:
        return None
    slot = manager.slots.get(found[0].name)
    return (slot, found[1]) if slot is not None else None


def names(slot, adapter: AdapterEntry) -> tuple[str, ...]:
    """The names an adapter answers to (its name first)."""
    return adapter.name, f"{slot.name}:{adapter.name}", *adapter.aliases


def allowed(key, slot, adapter: AdapterEntry) -> bool:
    """Whether a key's model patterns reach an adapter: by its own name or an alias, as any
    model's; by `<base>:<adapter>` only through a pattern that has a ':' itself (`tiny:*`,
    `tiny:hr-*`). A pattern written for model names (`tiny*`) then never reaches the
    adapters of the models it matches: `tiny:hr-bot` matches the glob `tiny*`, but a key
    limited to `tiny*` was given the model, not every fine-tune anyone adds to it."""
    if key is None or not key.models:
        return True
    if key.allows(adapter.name, *adapter.aliases):
        return True
    qualified = f"{slot.name}:{adapter.name}"
    return any(":" in pattern and fnmatch.fnmatchcase(qualified, pattern) for pattern in key.models)


def listed(manager, key) -> Iterator[tuple[object, AdapterEntry]]:
    """Every adapter of every model, those the key may use."""
    for slot in manager.slots.values():
        for adapter in slot.entry.adapters:
            if allowed(key, slot, adapter):
                yield slot, adapter


def sources(entry: ModelEntry) -> dict[str, str]:
    """What the worker needs: each adapter's folder by name."""
    return {a.name: str(a.folder()) for a in entry.adapters}


def only_adapters_changed(old: ModelEntry, new: ModelEntry) -> bool:
    """A registry change the running worker takes without a restart."""
    return old != new and dataclasses.replace(old, adapters=new.adapters) == new


async def push(manager, slot, entry: ModelEntry | None = None, check: str | None = None) -> None:
    """Send the model's adapters (entry's, else its slot's) to its running workers; check: an
    adapter each worker loads now, refusing the change (a ServiceError) when it cannot."""
    for conn in manager.conns(slot):
        args: dict = {"adapters": sources(entry or slot.entry)}
        if check is not None:
            args["check"] = check
        try:
            await manager.broker.call(conn, "adapters", args, timeout=60.0)
        except ServiceError:
            if check is not None:
                raise
            log.exception("%s: worker %s did not take the new adapters", slot.name, conn.worker_id)
