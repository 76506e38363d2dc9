"""Range and consistency checks of a parsed models.yaml's model entries and gateway section, run
by shared/config.py:parse_registry (the manager's section is checked beside its class there):
each error names the file, the model and the field."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from . import model_store
from .gateway_config import GatewayConfig
from .model_sections import ENCODER_KINDS, MAX_RANKS, AdapterEntry, ModelEntry, ModelKind, SamplingDefaults
from .schema import ConfigError

# The longest context an entry may set: 16M tokens, past every released model's own (a
# worker clamps to the model's, but a bigger number would still be reported and planned for).
MAX_CONTEXT_LENGTH = 1 << 24


def at_least(where: str, obj: Any, minimum: float, names: tuple[str, ...], strict: bool = False) -> None:
    """Range checks: each named field (when set) must be >= minimum (> when strict)."""
    for name in names:
        value = getattr(obj, name)
        if value is None:
            continue
        if value < minimum or (strict and value == minimum):
            need = f"greater than {minimum:g}" if strict else f"at least {minimum:g}"
            raise ConfigError(f"{where}: field {name!r}: must be {need}, got {value!r}")


def check_gateway(g: GatewayConfig, where: str) -> None:
    at_least(where, g, 1, ("port", "max_body_bytes", "max_connections", "max_tokens_cap", "max_tokens_default"))
    at_least(where, g, 1, ("max_images", "audit_max_bytes"))
    at_least(where, g, 0, ("audit_retention_days", "oidc_session_hours"), strict=True)
    if g.oidc_issuer and not g.oidc_client_id:
        raise ConfigError(f"{where}: field 'oidc_issuer' needs 'oidc_client_id' (the gateway's client at the provider)")
    at_least(where, g, 0, ("request_timeout_s", "prefill_timeout_s", "max_image_mb"), strict=True)
    at_least(where, g, 0, ("header_timeout_s", "body_timeout_s", "idle_timeout_s"), strict=True)
    targets = ("ttft_target_editor_s", "ttft_target_chat_s", "ttft_target_agent_s", "ttft_target_background_s")
    at_least(where, g, 0, targets, strict=True)
    if g.port > 65535:
        raise ConfigError(f"{where}: field 'port': must be at most 65535, got {g.port}")
    group = g.default_cache_group
    if group is not None and not (isinstance(group, str) and re.match(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$", group)):
        raise ConfigError(f"{where}: field 'default_cache_group': 1-64 letters, digits or ._@-, got {group!r}")


def check_entry(e: ModelEntry, where: str) -> None:
    def bad(field_name: str, why: str) -> ConfigError:
        return ConfigError(f"{where}: field {field_name!r}: {why}")

    try:
        model_store.validate_model_name(e.name)
    except model_store.InvalidModelName as err:
        raise bad("name", str(err)) from None
    at_least(where, e, 0, ("idle_unload_s",))
    at_least(f"{where}: field 'cache'", e.cache, 1, ("prefix_memory_mb", "kv_memory_mb"))
    at_least(f"{where}: field 'cache'", e.cache, 0, ("prefix_disk_mb",))
    check_source_and_aliases(e, bad)
    check_defaults(e.defaults, f"{where}: field 'defaults'")
    at_least(where, e, 1, ("max_num_seqs", "max_queue", "stream_interval", "prefill_step_size"))
    at_least(f"{where}: field 'encoder'", e.encoder, 1, ("max_batch_inputs",))
    at_least(f"{where}: field 'encoder'", e.encoder, 512, ("max_batch_tokens",))
    if e.kind in ENCODER_KINDS and e.engine not in ("mlx", "mlx-embeddings"):
        raise bad("engine", f"{e.kind} models run on the mlx or mlx-embeddings engine")
    if e.kind in (ModelKind.AUDIO, ModelKind.SPEECH, ModelKind.IMAGE) and e.engine != "mlx":
        raise bad("engine", f"{e.kind} models run on the default engine (mlx)")
    if e.engine == "mlx-embeddings" and e.kind != ModelKind.EMBEDDING:
        raise bad("engine", "mlx-embeddings serves kind: embedding models only")
    sp = e.speculative
    if not 1 <= sp.max_draft <= 16:
        raise bad("speculative.max_draft", f"must be between 1 and 16, got {sp.max_draft}")
    if sp.max_rows is not None and sp.max_rows < 1:
        raise bad("speculative.max_rows", f"must be at least 1, got {sp.max_rows}")
    if not 1 <= sp.min_ngram <= sp.max_ngram <= 8:
        raise bad("speculative", "needs 1 <= min_ngram <= max_ngram <= 8")
    if sp.mode == "draft" and not sp.draft_model:
        raise bad("speculative.draft_model", "mode draft needs a draft model (a models-dir folder or a path)")
    if sp.draft_model and sp.mode != "draft":
        raise bad("speculative.draft_model", f"is only used with mode: draft (mode is {sp.mode})")
    if e.context_length is not None and not 16 <= e.context_length <= MAX_CONTEXT_LENGTH:
        raise bad("context_length", f"must be between 16 and {MAX_CONTEXT_LENGTH}, got {e.context_length}")
    if e.owns is not None and not Path(e.owns).is_absolute():
        raise bad("owns", f"must be an absolute folder, got {e.owns!r}")
    if e.distributed is not None:
        check_distributed(e, where)
    if not 1 <= e.routing.replicas <= MAX_RANKS or e.routing.load_margin < 0:
        raise bad("routing", f"replicas: 1 to {MAX_RANKS}, load_margin: 0 or more")
    if e.routing.replicas > 1 and e.distributed is not None:
        raise bad("routing.replicas", "a sharded model runs one group of ranks")
    if e.fim is not None and e.fim.max_tokens < 1:
        raise bad("fim.max_tokens", f"must be at least 1, got {e.fim.max_tokens}")
    if e.fim is not None and e.fim.kv_shift_min_tokens < 0:
        raise bad("fim.kv_shift_min_tokens", f"must be 0 (off) or more, got {e.fim.kv_shift_min_tokens}")
    check_adapters(e, bad)


def check_adapters(e: ModelEntry, bad) -> None:
    if e.adapters and (e.kind != ModelKind.CHAT or e.engine != "mlx" or e.distributed is not None):
        raise bad("adapters", "only chat models on the mlx engine, not sharded, take LoRA adapters")
    if e.resident_adapters < 1:
        raise bad("resident_adapters", f"must be at least 1, got {e.resident_adapters}")
    if e.adapter_memory_mb is not None and not e.adapter_memory_mb > 0:
        raise bad("adapter_memory_mb", f"must be more than 0 (MB), got {e.adapter_memory_mb}")
    seen: set[str] = set()
    for a in e.adapters:
        try:
            model_store.validate_model_name(a.name)
        except model_store.InvalidModelName as err:
            raise bad("adapters", f"{a.name!r}: {err}") from None
        if a.name in AdapterEntry.RESERVED:
            raise bad("adapters", f"{a.name!r} is reserved: <model>:{a.name} names the model itself")
        if a.name in seen:
            raise bad("adapters", f"duplicate adapter name {a.name!r}")
        if any(not isinstance(alias, str) or not alias.strip() or ":" in alias for alias in a.aliases):
            raise bad("adapters", f"{a.name!r}: an alias is a non-empty exact name without ':'")
        if not a.path.strip() or not a.folder().is_absolute():
            raise bad("adapters", f"{a.name!r}: path must be an absolute folder (or start with ~), got {a.path!r}")
        seen.add(a.name)


# The ranges the APIs accept in a request (gateway/pipeline/fields.py): a default outside them
# would be a value no request could send.
_DEFAULT_RANGES = {
    "temperature": (0, 2),
    "top_p": (0, 1),
    "top_k": (0, 2**31 - 1),
    "min_p": (0, 1),
    "repetition_penalty": (0.01, 10),
    "max_tokens": (1, 2**31 - 1),
}


def check_defaults(d: SamplingDefaults, where: str) -> None:
    for name, (low, high) in _DEFAULT_RANGES.items():
        value = getattr(d, name)
        if value is not None and not low <= value <= high:  # NaN fails too
            raise ConfigError(f"{where}: {name!r} must be between {low:g} and {high:g}, got {value!r}")


def check_source_and_aliases(e: ModelEntry, bad) -> None:
    if e.source is not None:
        if not e.source.strip():
            raise bad("source", "must name a folder (empty)")
        if not Path(e.source).expanduser().is_absolute() and ".." in Path(e.source).parts:
            raise bad("source", f"a relative source is a folder in the models dir; '..' leaves it ({e.source!r})")
    for alias in e.aliases:
        if not isinstance(alias, str) or not alias.strip():
            raise bad("aliases", "an alias must be a non-empty name or glob")


def check_distributed(e: ModelEntry, where: str) -> None:
    d = e.distributed
    assert d is not None

    def bad(field_name: str, why: str) -> ConfigError:
        return ConfigError(f"{where}: field 'distributed.{field_name}': {why}")

    if e.kind != ModelKind.CHAT or e.engine != "mlx" or e.remote_only:
        raise ConfigError(
            f"{where}: field 'distributed': only chat models on the mlx engine, spawned here, can be sharded"
        )
    at_least(f"{where}: field 'distributed'", d, 0, ("start_timeout_s",), strict=True)
    if not 2 <= d.ranks <= MAX_RANKS:
        raise bad("ranks", f"must be between 2 and {MAX_RANKS}, got {d.ranks}")
    if d.hosts and len(d.hosts) != d.ranks:
        raise bad("hosts", f"needs one host:port per rank ({d.ranks}), got {len(d.hosts)}")
    for i, host in enumerate(d.hosts):
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise bad(f"hosts[{i}]", f"expected host:port (e.g. 192.168.1.10:52000), got {host!r}")
    if d.hosts and e.max_num_seqs is None:
        # Without it each rank derives max_num_seqs from its own machine's memory, and ranks
        # that batch differently leave lockstep.
        raise ConfigError(f"{where}: field 'max_num_seqs': set it for a model whose ranks run on other hosts")


def parse_memory_budget(text: str, total_bytes: int) -> int:
    t = text.strip().upper().replace(" ", "")
    try:
        if t.endswith("%"):
            return int(total_bytes * float(t[:-1]) / 100)
        for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("G", 1 << 30), ("M", 1 << 20)):
            if t.endswith(unit):
                return int(float(t[: -len(unit)]) * scale)
        return int(t)
    except ValueError:
        raise ConfigError(f"memory_budget: cannot parse {text!r} (use '75%' or '12GB')") from None


def check_adapter_names(models: list[ModelEntry], src: str) -> None:
    """Adapters are called by name like models: a name must address one thing."""
    taken = {e.name for e in models} | {a for e in models for a in e.aliases}
    for e in models:
        for a in e.adapters:
            for name in (a.name, *a.aliases):
                if name in taken:
                    raise ConfigError(f"{src}: model {e.name}: adapter {a.name!r}: {name!r} already names something")
                taken.add(name)
