"""models.yaml: the registry of models and the manager's policy, validated once, here.

Errors name the file, the model and the field, and unknown keys are errors: a typo in a
config must not silently fall back to a default."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import discovery, model_store
from .config_checks import at_least, check_adapter_names, check_entry, check_gateway, parse_memory_budget
from .gateway_config import GatewayConfig
from .mcp_config import McpConfig, parse_mcp
from .model_sections import KINDS, AdapterEntry, Contention, ModelEntry, ModelKind
from .schema import ConfigError, from_mapping

log = logging.getLogger(__name__)


@dataclass
class ManagerConfig:
    memory_budget: str = "75%"  # of RAM, or "12GB"
    idle_unload_s: float = 0  # 0: never unload
    contention: Contention = "wait"
    wait_timeout_s: float = 60
    max_loaded_models: int = 8
    auto_discover: bool = True
    models_dir: str | None = None
    # Folders scanned for MLX models (hub cache, LM Studio); None: the platform's defaults.
    discover_paths: list[str] | None = None
    heartbeat_s: float = 1.0
    liveness: int = 5  # missed heartbeats before a worker is declared dead
    # A worker busy this long without progress (a step, or a layer group of a prefill) is hung.
    hang_timeout_s: float = 120
    load_timeout_s: float = 300
    failed_retry_s: float = 300  # a crash-looping model is tried again after this (doubling)
    restart_backoff_s: float = 1.0  # a crashed worker restarts after this (doubling per crash in the window)
    usage_ledger: bool = True  # record every API request in $MLXGW_HOME/usage.db (gateway/access/ledger.py)
    usage_retention_days: float = 90  # ledger rows older than this are deleted; 0: keep forever
    # Folders Ollama's /api/create may take a `FROM` path from (the models directory always);
    # a request can name nothing outside them.
    allowed_import_paths: list[str] = field(default_factory=list)


def check_manager(m: ManagerConfig, where: str) -> None:
    strictly_positive = ("heartbeat_s", "load_timeout_s", "failed_retry_s", "hang_timeout_s", "restart_backoff_s")
    at_least(where, m, 0, strictly_positive, strict=True)
    at_least(where, m, 0, ("idle_unload_s", "wait_timeout_s", "usage_retention_days"))
    at_least(where, m, 1, ("liveness", "max_loaded_models"))
    try:
        budget = parse_memory_budget(m.memory_budget, 1 << 30)
    except ConfigError as e:
        raise ConfigError(f"{where}: field 'memory_budget': {e}") from None
    if budget <= 0:
        raise ConfigError(f"{where}: field 'memory_budget': must be more than 0, got {m.memory_budget!r}")


MOVED_TO_GATEWAY = {"request_timeout_seconds": "request_timeout_s", "max_body_bytes": "max_body_bytes"}


@dataclass
class Registry:
    manager: ManagerConfig
    models: list[ModelEntry]
    path: Path | None = None
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    mcp: McpConfig = field(default_factory=McpConfig)
    # Models found in the hub cache and LM Studio's folder (auto_discover), servable or not:
    # /v1/models lists each with its source, and the broken ones with their reason.
    discovered: list[discovery.FoundModel] = field(default_factory=list)

    @property
    def models_dir(self) -> Path:
        if self.manager.models_dir:
            return Path(self.manager.models_dir).expanduser()
        return model_store.models_dir()

    def entry(self, name: str) -> ModelEntry | None:
        """Exact names first, then exact aliases, then glob aliases, in file order."""
        for e in self.models:
            if e.name == name:
                return e
        for e in self.models:
            if name in e.aliases:
                return e
        for e in self.models:
            if e.matches(name):
                return e
        return None

    def adapter(self, name: str) -> tuple[ModelEntry, AdapterEntry] | None:
        """The LoRA adapter a requested model name addresses, `adapter` or `<base>:<adapter>`
        (SGLang's spelling; the base by its name or an alias), with its model's entry."""
        base, sep, short = name.rpartition(":")
        if short in AdapterEntry.RESERVED:  # `<model>:latest` is the model itself (Ollama's tag)
            return None
        for e in self.models:
            for a in e.adapters:
                if name == a.name or name in a.aliases or (sep and a.name == short and e.matches(base)):
                    return e, a
        return None


def parse_registry(data: Any, path: Path | None = None) -> Registry:
    src = str(path) if path else "<config>"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{src}: expected a mapping with 'gateway', 'manager', 'models' and 'mcp'")
    unknown = sorted(set(data) - {"gateway", "manager", "models", "mcp"})
    if unknown:
        raise ConfigError(f"{src}: unknown top-level key {unknown[0]!r} (known: gateway, manager, models, mcp)")
    mcp = parse_mcp(data.get("mcp"), src)
    raw_manager, raw_gateway = _split_moved(data.get("manager"), data.get("gateway"), src)
    manager = from_mapping(ManagerConfig, raw_manager, f"{src}: manager")
    check_manager(manager, f"{src}: manager")
    gateway = from_mapping(GatewayConfig, raw_gateway, f"{src}: gateway")
    check_gateway(gateway, f"{src}: gateway")
    raw_models = data.get("models") or []
    if not isinstance(raw_models, list):
        raise ConfigError(f"{src}: 'models' must be a list")
    models: list[ModelEntry] = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_models):
        label = raw.get("name") if isinstance(raw, dict) else None
        where = f"{src}: models[{i}]" + (f" ({label})" if label else "")
        if isinstance(raw, dict) and "name" not in raw:
            raise ConfigError(f"{where}: field 'name' is required")
        entry = from_mapping(ModelEntry, raw, where)
        check_entry(entry, where)
        if entry.name in seen:
            raise ConfigError(f"{where}: field 'name': duplicate model name {entry.name!r}")
        seen.add(entry.name)
        models.append(entry)
        for label in entry.mcp_servers:
            if mcp.server(label) is None:
                raise ConfigError(f"{where}: field 'mcp_servers': no MCP server labelled {label!r} in mcp.servers")
    check_adapter_names(models, src)
    return Registry(manager=manager, models=models, path=path, gateway=gateway, mcp=mcp)


def _split_moved(manager: Any, gateway: Any, src: str) -> tuple[Any, Any]:
    """HTTP settings that used to sit under manager: move them to gateway, with a note."""
    if not isinstance(manager, dict) or not any(k in manager for k in MOVED_TO_GATEWAY):
        return manager, gateway
    manager = dict(manager)
    gateway = {} if gateway is None else gateway
    if not isinstance(gateway, dict):
        return manager, gateway  # from_mapping reports it
    gateway = dict(gateway)
    for old, new in MOVED_TO_GATEWAY.items():
        if old in manager:
            if new in gateway:
                raise ConfigError(f"{src}: manager: field {old!r}: already set as gateway: {new}")
            log.warning("%s: manager: field %r is deprecated; set gateway: %s instead", src, old, new)
            gateway[new] = manager.pop(old)
    return manager, gateway


def load_registry(path: Path) -> Registry:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    return parse_registry(data, Path(path))


def _kind(found: str) -> ModelKind:
    """A discovered model's kind; one this version does not know is served as chat."""
    return ModelKind(found) if found in KINDS else ModelKind.CHAT


def with_discovered_models(registry: Registry) -> Registry:
    """Add imported models that models.yaml does not list (manager.auto_discover)."""
    if not registry.manager.auto_discover:
        return registry
    listed = {e.name for e in registry.models}
    extra = [
        ModelEntry(name=m.name, kind=_kind(m.kind))
        for m in model_store.list_models(registry.models_dir)
        if m.name not in listed
    ]
    found = discovery.found_models(registry.manager.discover_paths, listed | {e.name for e in extra})
    extra += [  # the servable ones, served in place
        ModelEntry(name=m.name, source=str(m.path), kind=_kind(m.kind)) for m in found if m.error is None
    ]
    return dataclasses.replace(registry, models=registry.models + extra, discovered=found)
