"""A models.yaml model entry (`ModelEntry`) and its parts: its kind, sampling defaults, its
cache, chat and encoder sections, speculation, sharding, fill-in-the-middle, adapters and
preset turns."""

from __future__ import annotations

import fnmatch
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from .events import WireEnum


class ModelKind(WireEnum):
    """What a model entry serves (`kind:` in models.yaml, `/v1/models?kind=`), and so which
    APIs route to it and which worker class runs it."""

    CHAT = "chat"
    EMBEDDING = "embedding"
    RERANK = "rerank"
    VISION = "vision"
    AUDIO = "audio"  # speech to text
    SPEECH = "speech"  # text to speech
    IMAGE = "image"  # text to image, and image edits (mlx-vlm's image models)


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
    """One model sharded over several ranks on MLX's distributed layer (worker/process/distributed.py).

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
class RoutingConfig:
    """`routing:` how many workers serve the model here and how a request picks one of them
    (gateway/link/pool.py). Remote workers of the same model join the same pool."""

    replicas: int = 1  # local workers of this model, each with its own KV, prefix cache and health
    # prefix: the replica holding the request's longest prefix (sticky per session), unless
    # its load exceeds the least loaded's by load_margin; load: least loaded; round_robin.
    policy: Literal["prefix", "load", "round_robin"] = "prefix"
    load_margin: int = 4  # requests in flight


@dataclass
class CacheConfig:
    """`cache:` the KV a model keeps: the prefix cache's bounds in memory and on disk, the
    budget of admitted rows' KV, and its quantization."""

    prefix_memory_mb: int | None = None  # prefix cache bound; None: a share of RAM
    # KV of admitted rows + prefix cache (worker/model/memory/kv_budget.py); None: measured at load
    kv_memory_mb: int | None = None
    # the prefix cache's disk tiers, one bound; 0: off; None: a tenth of the disk's free space
    # at the worker's start, at most 64 GiB
    prefix_disk_mb: int | None = None
    kv_bits: Literal[4, 8] | None = None  # quantized KV (worker/model/cache/quantized_kv.py); None: the model's dtype
    kv_group_size: Literal[32, 64, 128] = 64  # elements per quantization scale and bias


@dataclass
class ChatConfig:
    """`chat:` how a generating model's conversations are read and written: parsers, the
    template and the turns put before every conversation."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None
    # Constrain a tool call's name to the offered tools once the model opens a call
    # (worker/text/tool_name_guard.py): for small models that invent names. Such rows do not
    # speculate and are not preempted.
    tool_name_guard: bool = False
    # A request may replace the chat template (chat_template_kwargs.chat_template): off by
    # default, a template is a program (it still renders sandboxed and budgeted when on).
    allow_request_chat_template: bool = False
    # Set by Ollama's /api/create from a Modelfile: a system prompt for requests that bring
    # none (SYSTEM), turns put before every conversation (MESSAGE), and a Jinja chat template
    # (TEMPLATE: the model's own, in place of its tokenizer's; the worker renders it in its
    # budgeted sandbox like any template, and request templates stay off).
    system: str | None = None
    messages: list[PresetMessage] = field(default_factory=list)
    chat_template: str | None = None
    # A speech-to-text model (`kind: audio`) that transcribes audio parts sent to this model,
    # their text put in their place (gateway/pipeline/audio_parts.py); unset: audio parts are
    # refused, except by vision models whose mlx-vlm family reads audio.
    audio_model: str | None = None


@dataclass
class EncoderConfig:
    """`encoder:` embedding and rerank workers' batches."""

    truncate: bool = False  # inputs over the model's limit: cut (true) or refuse with a 400 (false)
    max_batch_inputs: int = 64  # inputs per forward pass
    max_batch_tokens: int = 8192  # padded tokens per forward pass


# models.yaml keys from before the sections, refused at the top of an entry with the place to
# write them (`kv_bits: 8` -> `cache: {kv_bits: 8}`; shared/schema.py).
FLAT_KEYS: dict[str, tuple[str, str]] = {
    "cache_memory_mb": ("cache", "prefix_memory_mb"),
    "kv_memory_mb": ("cache", "kv_memory_mb"),
    "prefix_cache_disk_mb": ("cache", "prefix_disk_mb"),
    "kv_bits": ("cache", "kv_bits"),
    "kv_group_size": ("cache", "kv_group_size"),
    **{name: ("chat", name) for name in ChatConfig.__dataclass_fields__},
    **{name: ("encoder", name) for name in EncoderConfig.__dataclass_fields__},
}


@dataclass
class SpeculativeConfig:
    """Speculative decoding (worker/model/speculation/speculative.py). prompt_lookup: greedy requests verify
    drafts copied from their own context in the batch's forward pass; draft: drafts decoded
    greedily by a smaller model sharing the tokenizer (worker/model/speculation/draft_model.py); off: never."""

    mode: Literal["prompt_lookup", "draft", "off"] = "prompt_lookup"
    max_draft: int = 8  # tokens drafted per row and step, at most
    max_ngram: int = 3  # the longest suffix looked up in the context (prompt_lookup)
    min_ngram: int = 1  # the shortest
    draft_model: str | None = None  # mode draft: folder name in the models dir, or a path
    # Speculate only while the batch has at most this many rows (vLLM's
    # speculative_disable_by_batch_size). Default: 2 on the CPU device, where a verification
    # pays for every position of its rows x width rectangle, gained nothing at 4 rows and lost
    # at 8 and 16 (worker/model/speculation/speculative.py, CPU_MAX_ROWS); unbounded on a GPU.
    max_rows: int | None = None

    def draft_model_path(self, models_dir: Path) -> Path | None:
        """Resolved like a model's source: an absolute path as is, else a models-dir folder."""
        if self.draft_model is None:
            return None
        path = Path(self.draft_model).expanduser()
        return path if path.is_absolute() else models_dir / self.draft_model


@dataclass
class AdapterEntry:
    """A LoRA adapter served on its model's worker (worker/model/adapters/bank.py): an `mlx_lm.lora`
    output folder (adapters.safetensors + adapter_config.json). Requests name it as a model:
    `name`, or `<base>:<name>`."""

    # Names an adapter may not take: `<base>:latest` is Ollama's spelling of the base itself
    # (every Ollama client sends it), so an adapter named so would capture the base's requests.
    RESERVED: ClassVar[frozenset[str]] = frozenset({"latest"})

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
    # The shortest run of tokens after the cursor whose KV a keystroke's prompt reuses where
    # it moved (llama.cpp's --cache-reuse; worker/model/cache/kv_shift.py); 0: off. Off by
    # default, as in llama.cpp: the moved suffix keeps what it saw of the old text before the
    # cursor, and Qwen2.5-Coder-0.5B then completed from the old cursor in 4 of 4 holes.
    kv_shift_min_tokens: int = 0


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
    # RAM (worker/model/memory/capacity.py), reported in /v1/status.
    max_num_seqs: int | None = None
    max_queue: int = 64
    context_length: int | None = None  # None: the model's own
    max_tokens_policy: MaxTokensPolicy = "clamp"
    stream_interval: int = 1
    prefill_step_size: int = 512
    cache: CacheConfig = field(default_factory=CacheConfig)
    use_openblas: bool = True  # Linux CPU only, see shared/platform.py
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)  # parsers, template, preset turns
    encoder: EncoderConfig = field(default_factory=EncoderConfig)  # embedding / rerank workers
    mcp_servers: list[str] = field(default_factory=list)  # MCP servers offered by default (shared/mcp_config.py)
    distributed: DistributedConfig | None = None  # shard the model over several ranks
    routing: RoutingConfig = field(default_factory=RoutingConfig)  # replicas and how requests pick one
    adapters: list[AdapterEntry] = field(default_factory=list)  # LoRA adapters on this model
    resident_adapters: int = 8  # adapters kept loaded on the worker at once (LRU; rows in use never leave)
    # The resident adapters' weights, bounded in MB (LRU by bytes, in place of resident_adapters'
    # count) and taken out of the measured KV budget; None: bounded by count, bytes reported only.
    adapter_memory_mb: float | None = None
    fim: FimConfig | None = None  # fill-in-the-middle overrides; None: as the tokenizer says
    # Written by Ollama's /api/pull and /api/create, read by /api/delete and /api/show:
    # the folder this entry's own pull or import produced (resolved), the only one a delete of
    # the entry may remove (and only while no other entry serves from it); and what the entry
    # was made from (a model name or a path), as `ollama show` reports it.
    owns: str | None = None
    parent: str | None = None
    # Keys from before the sections, refused with the section key to write (shared/schema.py).
    FLAT_KEYS: ClassVar[dict[str, tuple[str, str]]] = FLAT_KEYS

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
