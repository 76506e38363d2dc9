"""Where a request may point the gateway at files on this machine: the models directory and
the operator's `manager.allowed_import_paths`, compared after links are followed. Ollama's
`FROM <path>` (gateway/api/ollama/manage.py) and an adapter's folder added over HTTP
(gateway/api/admin/adapters.py) are held to the same folders: a key that may add one must not get
the gateway to open (and report on) any file its process can read. Paths in models.yaml
are the operator's own and are not confined."""

from __future__ import annotations

from pathlib import Path

from ...shared.errors import ErrorCode, ServiceError, invalid


def allowed_roots(registry) -> list[Path]:
    roots = [registry.models_dir, *(Path(p).expanduser() for p in registry.manager.allowed_import_paths)]
    return [r.resolve() for r in roots]


def confined(registry, text: str, what: str, field: str) -> Path:
    """`text` resolved (links followed) inside an allowed folder; refused (a 403) before
    anything about it, even whether it exists, is looked at otherwise. what: how the error
    names the path ("FROM", "an adapter's path")."""
    path = Path(text).expanduser()
    if not path.is_absolute():
        raise invalid(f"{what} must be an absolute path, got {text!r}", field)
    resolved = path.resolve()
    if not any(resolved.is_relative_to(root) for root in allowed_roots(registry)):
        raise ServiceError(
            ErrorCode.PERMISSION,
            f"{what} names a path outside the folders the operator allows (the models directory and "
            "manager.allowed_import_paths)",
            param=field,
        )
    return resolved
