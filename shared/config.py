"""models.yaml: the registry of models and the manager's policy, validated once, here.

Errors name the file, the model and the field, and unknown keys are errors: a typo in a
config must not silently fall back to a default."""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from . import discovery, model_store
from .events import WireEnum
from .mcp_config import McpConfig, parse_mcp
from .schema import ConfigError, from_mapping

log = logging.getLogger("mlxgw.config")


class ModelKind(WireEnum):
    """What a model entry serves (`kind:` in models.yaml, `/v1/models?kind=`), and so which
    APIs route to it and which worker class runs it."""

    CHAT = "chat"
    EMBEDDING = "embedding"
    RERANK = "rerank"
    VISION = "vision"
    AUDIO = "audio"  # speech to text
    SPEECH = "speech"  # text to speech


Kind = ModelKind  # the older name
Engine = Literal["mlx", "null", "echo", "mlx-embeddings"]
MaxTokensPolicy = Literal["clamp", "reject"]
Contention = Literal["wait", "fail"]
LogFormat = Literal["text", "json"]
Strategy = Literal["pipeline", "tensor"]
DistributedBackend = Literal["ring", "jaccl", "mpi"]
MAX_RANKS = 16
KINDS: tuple[str, ...] = tuple(k.value for k in ModelKind)
ENCODER_KINDS = (ModelKind.EMBEDDING, ModelKind.RERANK)  # served by /v1/embeddings and /v1/rerank
CHAT_KINDS = (ModelKind.CHAT, ModelKind.VISION)  # served by the generating APIs
ENGINES: tuple[str, ...] = typing.get_args(Engine)


@dataclass
class SamplingDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None


@dataclass
class DistributedConfig:
    """One model sharded over several ranks on MLX's distributed layer (worker/distributed.py).

    hosts: one "host:port" per rank (rank 0 first, the machine running the gateway); empty:
    every rank on this machine over 127.0.0.1 with free ports. The gateway starts the ranks
    whose host is this machine; the others run `mlxgw worker --rank N` on their own host."""

    strategy: Strategy = "pipeline"
    ranks: int = 2
    hosts: list[str] = field(default_factory=list)
    backend: DistributedBackend = "ring"
    # The group must form (every rank connected, weights loaded) within this; a rank whose
    # peer never starts would otherwise wait in accept() forever.
    start_timeout_s: float = 300


@dataclass
class SpeculativeConfig:
    """Speculative decoding (worker/speculative.py). prompt_lookup: greedy requests verify
    drafts copied from their own context in the batch's forward pass; draft: drafts decoded
    greedily by a smaller model sharing the tokenizer (worker/draft_model.py); off: never."""

    mode: Literal["prompt_lookup", "draft", "off"] = "prompt_lookup"
    max_draft: int = 8  # tokens drafted per row and step, at most
    max_ngram: int = 3  # the longest suffix looked up in the context (prompt_lookup)
    min_ngram: int = 1  # the shortest
    draft_model: str | None = None  # mode draft: folder name in the models dir, or a path
    # Speculate only while the batch has at most this many rows (vLLM's
    # speculative_disable_by_batch_size). Default: 2 on the CPU device, where a verification
    # pays for every position of its rows x width rectangle, gained nothing at 4 rows and lost
    # at 8 and 16 (worker/speculative.py, CPU_MAX_ROWS); unbounded on a GPU.
    max_rows: int | None = None

    def draft_model_path(self, models_dir: Path) -> Path | None:
        """Resolved like a model's source: an absolute path as is, else a models-dir folder."""
        if self.draft_model is None:
            return None
        path = Path(self.draft_model).expanduser()
        return path if path.is_absolute() else models_dir / self.draft_model


@dataclass
class AdapterEntry:
    """A LoRA adapter served on its model's worker (worker/adapters.py): an `mlx_lm.lora`
    output folder (adapters.safetensors + adapter_config.json). Requests name it as a model:
    `name`, or `<base>:<name>`."""

    name: str
    path: str
    aliases: list[str] = field(default_factory=list)  # other exact names it answers to

    def folder(self) -> Path:
        return Path(self.path).expanduser()


@dataclass
class FimConfig:
    """Fill-in-the-middle (`fim:`; shared/fim.py). Unset token fields come from the format
    found in the model's vocabulary; naming prefix and suffix defines one for a model
    without a known format; enabled: false refuses FIM even where tokens exist."""

    enabled: bool = True
    prefix: str | None = None  # control tokens, spelled as in the tokenizer
    suffix: str | None = None
    middle: str | None = None
    order: Literal["psm", "spm"] | None = None  # prefix-suffix-middle or suffix-first
    repo_name: str | None = None  # repository-level context (input_extra)
    file_sep: str | None = None
    stop: list[str] = field(default_factory=list)  # more tokens that end a middle
    max_tokens: int = 128  # a FIM request's max_tokens when it sends none


@dataclass
class PresetMessage:
    """A turn put before every conversation with the model (Ollama's Modelfile MESSAGE)."""

    role: Literal["system", "user", "assistant"]
    content: str


@dataclass
class ModelEntry:
    name: str
    source: str | None = None  # folder name in the models dir, or a path; default: name
    kind: ModelKind = ModelKind.CHAT
    engine: Engine = "mlx"  # "null": tokens without a model (capacity tests); "echo": repeats the last message
    aliases: list[str] = field(default_factory=list)  # exact names or glob patterns
    preload: bool = False
    pin: bool = False
    remote_only: bool = False  # never spawned here: served by `mlxgw worker --connect` elsewhere
    idle_unload_s: float | None = None  # None: the manager's default; 0: never
    # Sequences decoded together; None: from the model's KV bytes per token and the machine's
    # RAM (worker/capacity.py), reported in /v1/status.
    max_num_seqs: int | None = None
    max_queue: int = 64
    context_length: int | None = None  # None: the model's own
    max_tokens_policy: MaxTokensPolicy = "clamp"
    stream_interval: int = 1
    prefill_step_size: int = 512
    cache_memory_mb: int | None = None  # prefix cache bound; None: a share of RAM
    # KV of admitted rows + prefix cache (worker/kv_budget.py); None: measured at load
    kv_memory_mb: int | None = None
    prefix_cache_disk_mb: int = 1024  # hottest prefixes kept on disk across unloads; 0: off
    kv_bits: Literal[4, 8] | None = None  # quantized KV cache (worker/quantized_kv.py); None: the model's dtype
    kv_group_size: Literal[32, 64, 128] = 64  # elements per quantization scale and bias
    use_openblas: bool = True  # Linux CPU only, see shared/platform.py
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    # Constrain a tool call's name to the offered tools once the model opens a call
    # (worker/tool_name_guard.py): for small models that invent names. Such rows do not
    # speculate and are not preempted.
    tool_name_guard: bool = False
    # A request may replace the chat template (chat_template_kwargs.chat_template): off by
    # default, a template is a program (it still renders sandboxed and budgeted when on).
    allow_request_chat_template: bool = False
    # embedding / rerank workers
    truncate: bool = False  # inputs over the model's limit: cut (true) or refuse with a 400 (false)
    max_batch_inputs: int = 64  # inputs per forward pass
    max_batch_tokens: int = 8192  # padded tokens per forward pass
    mcp_servers: list[str] = field(default_factory=list)  # MCP servers offered by default (shared/mcp_config.py)
    distributed: DistributedConfig | None = None  # shard the model over several ranks
    adapters: list[AdapterEntry] = field(default_factory=list)  # LoRA adapters on this model
    resident_adapters: int = 8  # adapters kept loaded on the worker at once (LRU; rows in use never leave)
    fim: FimConfig | None = None  # fill-in-the-middle overrides; None: as the tokenizer says
    # Set by Ollama's /api/create from a Modelfile: a system prompt for requests that bring
    # none (SYSTEM), turns put before every conversation (MESSAGE), and a Jinja chat template
    # (TEMPLATE, sent as the request's template: it needs allow_request_chat_template and
    # renders in the worker's budgeted sandbox like any template).
    system: str | None = None
    messages: list[PresetMessage] = field(default_factory=list)
    chat_template: str | None = None

    def model_path(self, models_dir: Path) -> Path:
        source = self.source or self.name
        path = Path(source).expanduser()
        return path if path.is_absolute() else models_dir / source

    def matches(self, requested: str) -> bool:
        if requested == self.name:
            return True
        return any(
            requested == a or (any(c in a for c in "*?[") and fnmatch.fnmatchcase(requested, a)) for a in self.aliases
        )


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
    usage_ledger: bool = True  # record every API request in $MLXGW_HOME/usage.db (gateway/ledger.py)
    usage_retention_days: float = 90  # ledger rows older than this are deleted; 0: keep forever
    # Folders Ollama's /api/create may take a `FROM` path from (the models directory always);
    # a request can name nothing outside them.
    allowed_import_paths: list[str] = field(default_factory=list)


@dataclass
class GatewayConfig:
    """The HTTP side; each field has a `mlxgw up` flag that overrides it."""

    host: str = "127.0.0.1"
    port: int = 8000
    request_timeout_s: float = 300  # the answer, counted from its first token
    # Queue + prompt processing until the first token: agents send 5-10k-token prompts, which a
    # slow host may take minutes to prefill (kept apart so prefill never eats the answer's time).
    prefill_timeout_s: float = 900
    max_body_bytes: int = 10 * 1024 * 1024
    max_connections: int = 1024
    header_timeout_s: float = 10  # a request head must be complete this long after its first byte
    body_timeout_s: float = 60  # a body, this long after its head (408)
    idle_timeout_s: float = 30  # a keep-alive connection with no request is closed after this
    cors_origins: list[str] = field(default_factory=list)
    max_tokens_cap: int | None = None  # server-wide ceiling on max_tokens
    max_tokens_default: int | None = None  # when neither the request nor the model sets one
    max_image_mb: float = 8
    max_images: int = 16  # per request
    allow_image_urls: bool = False
    log_format: LogFormat = "text"
    log_prompts: bool = False


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
        for e in self.models:
            for a in e.adapters:
                if name == a.name or name in a.aliases or (sep and a.name == short and e.matches(base)):
                    return e, a
        return None


def _at_least(where: str, obj: Any, minimum: float, names: tuple[str, ...], strict: bool = False) -> None:
    """Range checks: each named field (when set) must be >= minimum (> when strict)."""
    for name in names:
        value = getattr(obj, name)
        if value is None:
            continue
        if value < minimum or (strict and value == minimum):
            need = f"greater than {minimum:g}" if strict else f"at least {minimum:g}"
            raise ConfigError(f"{where}: field {name!r}: must be {need}, got {value!r}")


def _check_manager(m: ManagerConfig, where: str) -> None:
    _at_least(where, m, 0, ("heartbeat_s", "load_timeout_s", "failed_retry_s", "hang_timeout_s"), strict=True)
    _at_least(where, m, 0, ("idle_unload_s", "wait_timeout_s", "usage_retention_days"))
    _at_least(where, m, 1, ("liveness", "max_loaded_models"))
    try:
        budget = parse_memory_budget(m.memory_budget, 1 << 30)
    except ConfigError as e:
        raise ConfigError(f"{where}: field 'memory_budget': {e}") from None
    if budget <= 0:
        raise ConfigError(f"{where}: field 'memory_budget': must be more than 0, got {m.memory_budget!r}")


def _check_gateway(g: GatewayConfig, where: str) -> None:
    _at_least(where, g, 1, ("port", "max_body_bytes", "max_connections", "max_tokens_cap", "max_tokens_default"))
    _at_least(where, g, 1, ("max_images",))
    _at_least(where, g, 0, ("request_timeout_s", "prefill_timeout_s", "max_image_mb"), strict=True)
    _at_least(where, g, 0, ("header_timeout_s", "body_timeout_s", "idle_timeout_s"), strict=True)
    if g.port > 65535:
        raise ConfigError(f"{where}: field 'port': must be at most 65535, got {g.port}")


def _check_entry(e: ModelEntry, where: str) -> None:
    def bad(field_name: str, why: str) -> ConfigError:
        return ConfigError(f"{where}: field {field_name!r}: {why}")

    try:
        model_store.validate_model_name(e.name)
    except model_store.InvalidModelName as err:
        raise bad("name", str(err)) from None
    _at_least(where, e, 0, ("idle_unload_s",))
    _at_least(where, e, 1, ("cache_memory_mb", "kv_memory_mb"))
    _check_source_and_aliases(e, bad)
    _check_defaults(e.defaults, f"{where}: field 'defaults'")
    _at_least(where, e, 0, ("prefix_cache_disk_mb",))
    for name in ("max_num_seqs", "max_queue", "stream_interval", "prefill_step_size", "max_batch_inputs"):
        if getattr(e, name) is not None and getattr(e, name) < 1:
            raise bad(name, f"must be at least 1, got {getattr(e, name)}")
    if e.max_batch_tokens < 512:
        raise bad("max_batch_tokens", f"must be at least 512, got {e.max_batch_tokens}")
    if e.kind in ENCODER_KINDS and e.engine not in ("mlx", "mlx-embeddings"):
        raise bad("engine", f"{e.kind} models run on the mlx or mlx-embeddings engine")
    if e.kind in (ModelKind.AUDIO, ModelKind.SPEECH) and e.engine != "mlx":
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
    if e.context_length is not None and e.context_length < 16:
        raise bad("context_length", f"must be at least 16, got {e.context_length}")
    if e.distributed is not None:
        _check_distributed(e, where)
    if e.fim is not None and e.fim.max_tokens < 1:
        raise bad("fim.max_tokens", f"must be at least 1, got {e.fim.max_tokens}")
    _check_adapters(e, bad)


def _check_adapters(e: ModelEntry, bad) -> None:
    if e.adapters and (e.kind != ModelKind.CHAT or e.engine != "mlx" or e.distributed is not None):
        raise bad("adapters", "only chat models on the mlx engine, not sharded, take LoRA adapters")
    if e.resident_adapters < 1:
        raise bad("resident_adapters", f"must be at least 1, got {e.resident_adapters}")
    seen: set[str] = set()
    for a in e.adapters:
        try:
            model_store.validate_model_name(a.name)
        except model_store.InvalidModelName as err:
            raise bad("adapters", f"{a.name!r}: {err}") from None
        if a.name in seen:
            raise bad("adapters", f"duplicate adapter name {a.name!r}")
        if any(not isinstance(alias, str) or not alias.strip() or ":" in alias for alias in a.aliases):
            raise bad("adapters", f"{a.name!r}: an alias is a non-empty exact name without ':'")
        if not a.path.strip() or not a.folder().is_absolute():
            raise bad("adapters", f"{a.name!r}: path must be an absolute folder (or start with ~), got {a.path!r}")
        seen.add(a.name)


# The ranges the APIs accept in a request (gateway/api/fields.py): a default outside them
# would be a value no request could send.
_DEFAULT_RANGES = {
    "temperature": (0, 2),
    "top_p": (0, 1),
    "top_k": (0, 2**31 - 1),
    "min_p": (0, 1),
    "repetition_penalty": (0.01, 10),
    "max_tokens": (1, 2**31 - 1),
}


def _check_defaults(d: SamplingDefaults, where: str) -> None:
    for name, (low, high) in _DEFAULT_RANGES.items():
        value = getattr(d, name)
        if value is not None and not low <= value <= high:  # NaN fails too
            raise ConfigError(f"{where}: {name!r} must be between {low:g} and {high:g}, got {value!r}")


def _check_source_and_aliases(e: ModelEntry, bad) -> None:
    if e.source is not None:
        if not e.source.strip():
            raise bad("source", "must name a folder (empty)")
        if not Path(e.source).expanduser().is_absolute() and ".." in Path(e.source).parts:
            raise bad("source", f"a relative source is a folder in the models dir; '..' leaves it ({e.source!r})")
    for alias in e.aliases:
        if not isinstance(alias, str) or not alias.strip():
            raise bad("aliases", "an alias must be a non-empty name or glob")


def _check_distributed(e: ModelEntry, where: str) -> None:
    d = e.distributed
    assert d is not None

    def bad(field_name: str, why: str) -> ConfigError:
        return ConfigError(f"{where}: field 'distributed.{field_name}': {why}")

    if e.kind != ModelKind.CHAT or e.engine != "mlx" or e.remote_only:
        raise ConfigError(
            f"{where}: field 'distributed': only chat models on the mlx engine, spawned here, can be sharded"
        )
    _at_least(f"{where}: field 'distributed'", d, 0, ("start_timeout_s",), strict=True)
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
    _check_manager(manager, f"{src}: manager")
    gateway = from_mapping(GatewayConfig, raw_gateway, f"{src}: gateway")
    _check_gateway(gateway, f"{src}: gateway")
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
        _check_entry(entry, where)
        if entry.name in seen:
            raise ConfigError(f"{where}: field 'name': duplicate model name {entry.name!r}")
        seen.add(entry.name)
        models.append(entry)
        for label in entry.mcp_servers:
            if mcp.server(label) is None:
                raise ConfigError(f"{where}: field 'mcp_servers': no MCP server labelled {label!r} in mcp.servers")
    _check_adapter_names(models, src)
    return Registry(manager=manager, models=models, path=path, gateway=gateway, mcp=mcp)


def _check_adapter_names(models: list[ModelEntry], src: str) -> None:
    """Adapters are called by name like models: a name must address one thing."""
    taken = {e.name for e in models} | {a for e in models for a in e.aliases}
    for e in models:
        for a in e.adapters:
            for name in (a.name, *a.aliases):
                if name in taken:
                    raise ConfigError(f"{src}: model {e.name}: adapter {a.name!r}: {name!r} already names something")
                taken.add(name)


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
