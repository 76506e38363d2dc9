"""Field checks for the few bodies no msgspec struct declares yet (batches, MCP server
links: both read a couple of required strings). Every generating API, Ollama, embeddings,
rerank, tokenize and speech decode their whole body once into a struct (fields.py,
ollama_fields.py, aux_fields.py), read by body.read_object."""

from __future__ import annotations

from typing import Any

from ...shared.errors import invalid

_MISSING = object()


def required(body: dict, name: str) -> Any:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        raise invalid(f"missing required parameter: '{name}'", name)
    return value


def string(body: dict, name: str, *, required_: bool = False, default: str | None = None) -> str | None:
    value = required(body, name) if required_ else body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise invalid(f"'{name}' must be a string, got {type(value).__name__}", name)
    return value
