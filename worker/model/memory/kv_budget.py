"""Admission by memory: what a batch's rows hold, and the budget rows are admitted within.

Rows are counted in tokens (worker/schedule/kv_rows.py: a row that can be paused reserves what
it holds plus DECODE_ALLOWANCE, one that cannot its whole reach, prompt + max_tokens), and
tokens in bytes per kind of layer cache, as mlx-lm lays them out in a batch:
- full attention (KVCache, kv_bits' quantized KVCache): grows with every token; the batch is
  one left-padded rectangle, so every row takes the longest row's length, in steps of 256
  tokens (mlx-lm allocates KV that way);
- sliding-window (RotatingKVCache, ChunkedKVCache): at most its window plus the prompt chunk
  a step reads past it;
- recurrent (ArraysCache: Mamba, gated DeltaNet, short convolutions): the same bytes at any
  length.
The bytes per token of each layer are measured once, from a fresh cache after one forward
pass of the loaded model (`probe`), so kv_bits and every family's own head shapes are what
they really are; a draft model's per-row KV (speculative mode draft) is added to the target's.

The budget covers the rows and the prefix cache together: the cache is evicted to what the
rows hold (it never holds a row back), a row that does not fit beside the others waits in
the queue, rows that outgrow the budget are paused to the prefix store (`preempted`), and
only a request that cannot fit even alone is refused (or its max_tokens cut, under
max_tokens_policy clamp), with the numbers. The budget is measured at
load: a share of RAM, and a share of what the process's limits (RLIMIT_AS, RLIMIT_DATA, a
cgroup's memory.max, Metal's working set) leave after the weights; models.yaml's
kv_memory_mb sets it outright. Resident LoRA adapters take their bytes out of it as they load
(`taken`), unless adapter_memory_mb reserved their bound up front (worker/process/main.py)."""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ....shared.errors import ErrorCode, ServiceError

GROWS, WINDOW, FIXED = "grows", "window", "fixed"
ALLOC_STEP = 256  # tokens: mlx-lm's KVCache and BatchKVCache grow their buffers in steps of this
DRAFT_SLACK = 16  # tokens a speculative verification may hold past a row's last one
# Growth a pausable row reserves past what it holds: two prefix-store blocks (32 tokens each).
# Rows run at least this many steps before their growth alone can pause one, so a row that
# was just admitted is not paused at once; a larger allowance admits fewer rows.
DECODE_ALLOWANCE = 64
RAM_SHARE = 0.25  # live rows + prefix cache: the rows' eighth and the cache's tenth of RAM, rounded up
# Of what a process limit leaves after loading, KV may take half: a step's activations
# (attention scores, logits), MLX's buffer pool and new threads' allocator arenas need the rest.
HEADROOM_SHARE = 0.5
MB = 1 << 20


def _round_up(tokens: int, step: int = ALLOC_STEP) -> int:
    return -(-max(0, tokens) // step) * step


@dataclass(frozen=True)
class LayerKV:
    """One layer cache's footprint per row: bytes per token held (grows, window), the tokens
    a window holds at most, or a constant (fixed)."""

    kind: str
    bytes_per_token: int = 0
    window: int = 0
    fixed_bytes: int = 0


@dataclass
class KVProfile:
    layers: list[LayerKV]

    def rows_bytes(self, reaches: list[int], chunk: int = 0) -> int:
        """Bytes of a batch whose rows may reach these lengths (tokens); chunk: prompt tokens
        a step may read at once (a window layer holds them past its window)."""
        if not reaches:
            return 0
        rows, longest = len(reaches), _round_up(max(reaches) + DRAFT_SLACK)
        total = 0
        for layer in self.layers:
            if layer.kind == GROWS:
                total += rows * longest * layer.bytes_per_token
            elif layer.kind == WINDOW:
                total += rows * min(longest, _round_up(layer.window + chunk)) * layer.bytes_per_token
            else:
                total += rows * layer.fixed_bytes
        return total

    @property
    def grows(self) -> bool:
        return any(layer.kind == GROWS for layer in self.layers)

    def bytes_per_token(self) -> int:
        """Of the layers that grow with every token (what a long context costs)."""
        return sum(layer.bytes_per_token for layer in self.layers if layer.kind == GROWS)

    def as_dict(self) -> dict:
        kinds: dict[str, int] = {}
        for layer in self.layers:
            kinds[layer.kind] = kinds.get(layer.kind, 0) + 1
        return {
            "layers": kinds,
            "bytes_per_token": self.bytes_per_token(),
            "window_bytes_per_token": sum(la.bytes_per_token for la in self.layers if la.kind == WINDOW),
            "fixed_bytes_per_row": sum(la.fixed_bytes for la in self.layers if la.kind == FIXED),
        }


def _nbytes(x) -> int:
    if x is None:
        return 0
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return int(x.nbytes)


def _tokens_held(keys) -> int:
    """Token slots of a cache's key buffer (a quantized one is a tuple of arrays)."""
    first = keys[0] if isinstance(keys, (list, tuple)) else keys
    return int(first.shape[-2])


def describe_layer(cache) -> list[LayerKV]:
    """The footprint of one layer cache of a fresh cache after a forward pass."""
    if hasattr(cache, "caches"):  # CacheList: several caches in one layer
        return [layer for inner in cache.caches for layer in describe_layer(inner)]
    keys = getattr(cache, "keys", None)
    if keys is not None:
        per_token = -(-(_nbytes(keys) + _nbytes(getattr(cache, "values", None))) // max(1, _tokens_held(keys)))
        window = getattr(cache, "max_size", None) or getattr(cache, "chunk_size", None)
        if window:
            return [LayerKV(WINDOW, per_token, window=int(window))]
        return [LayerKV(GROWS, per_token)]
    if hasattr(cache, "cache"):  # ArraysCache: recurrent state, the same at any length
        return [LayerKV(FIXED, fixed_bytes=_nbytes([a for a in cache.cache if a is not None]))]
    return [LayerKV(FIXED, fixed_bytes=int(getattr(cache, "nbytes", 0) or 0))]


def probe(model, fresh_cache: list) -> KVProfile:
    """Measure each layer's footprint: one forward pass of two tokens into a fresh cache."""
    import mlx.core as mx

    model(mx.array([[0, 0]]), cache=fresh_cache)
    mx.eval([c.state for c in fresh_cache])
    return KVProfile([layer for c in fresh_cache for layer in describe_layer(c)])


# -- a prefill step's activations ---------------------------------------------------------------
# While a step reads a chunk of prompt tokens, each layer's activations live until the next
# layer has used them (mlx-lm evaluates only the cache state, so no logits): per chunk token
# about ACT_HIDDEN x hidden + ACT_INTERMEDIATE x intermediate elements, and where attention
# is not fused (the CPU) its scores, their base-2 exponentials and the split halves' partial
# results (worker/model/cpu/cpu_attention.py): PAIR_PER_HEAD x heads + PAIR_EXTRA elements per
# (chunk token, context token). Calibrated with mx.get_peak_memory less what stays after one
# forward pass into a cache, with the CPU attention installed (float32, Linux CPU): the tiny
# llama (hidden 64, 4 heads), 512 tokens: 9.8 MiB measured, 12.8 estimated, 512 after 4,096:
# 80.8 measured, 97 estimated; SmolLM2-135M (hidden 576, 9 heads), 2,048 tokens: 352
# measured, 428 estimated, 512 after 4,096: 186 measured, 207 estimated. Metal's fused
# attention (mx.fast.scaled_dot_product_attention) holds no scores: no pair term there.
ACT_HIDDEN = 16
ACT_INTERMEDIATE = 3
PAIR_PER_HEAD = 2
PAIR_EXTRA = 2
# Every step also computes each running row's logits and their log-probabilities (float32).
LOGIT_COPIES = 2


@dataclass(frozen=True)
class PrefillActivations:
    per_token: int  # bytes per chunk token: hidden states, projections, the MLP
    per_pair: int  # bytes per (chunk token, context token): attention scores of every head and the mask
    per_row: int = 0  # bytes per running row: its logits and log-probabilities at each step

    def bytes(self, chunk: int, context: int, rows: int = 1) -> int:
        return chunk * self.per_token + chunk * context * self.per_pair + rows * self.per_row


def activations_of(model) -> PrefillActivations | None:
    """A loaded model's prefill activations per token, from its hidden and intermediate
    sizes, its heads and its compute dtype; None where its args do not say them."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..model_info import model_arg

    hidden, heads = model_arg(model, "hidden_size"), model_arg(model, "num_attention_heads")
    if hidden is None or heads is None:
        return None
    intermediate = model_arg(model, "intermediate_size") or 4 * hidden
    floats = (mx.float32, mx.float16, mx.bfloat16)
    dtype = next((v.dtype for _, v in tree_flatten(model.parameters()) if v.dtype in floats), mx.float32)
    size = dtype.size
    fused = mx.default_device() == mx.gpu
    return PrefillActivations(
        per_token=(ACT_HIDDEN * hidden + ACT_INTERMEDIATE * intermediate) * size,
        per_pair=0 if fused else (PAIR_PER_HEAD * heads + PAIR_EXTRA) * size,
        per_row=LOGIT_COPIES * 4 * (model_arg(model, "vocab_size") or 0),
    )


# -- the budget ------------------------------------------------------------------------------
@dataclass
class Measured:
    bytes: int
    source: str
    candidates: dict[str, int] = field(default_factory=dict)


def _status_kb(field_name: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _rlimit_headroom() -> dict[str, int]:
    out: dict[str, int] = {}
    for name, status in (("RLIMIT_AS", "VmSize"), ("RLIMIT_DATA", "VmData")):
        limit = getattr(resource, name, None)
        if limit is None:
            continue
        soft, _ = resource.getrlimit(limit)
        used = _status_kb(status)
        if soft != resource.RLIM_INFINITY and used is not None:
            out[name] = max(0, soft - used)
    return out


def _cgroup_headroom() -> dict[str, int]:
    """memory.max - memory.current of this process's cgroup (v2), or v1's limit - usage; in
    a container whose cgroup path is not mounted as such, the mount's root is its own."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            root, files = Path("/sys/fs/cgroup"), ("memory.max", "memory.current")
        elif "memory" in parts[1].split(","):
            root, files = Path("/sys/fs/cgroup/memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        for base in (root / parts[2].lstrip("/"), root):
            try:
                limit, used = ((base / f).read_text().strip() for f in files)
            except OSError:
                continue
            if limit.isdigit() and used.isdigit() and int(limit) < 1 << 60:
                return {"cgroup": max(0, int(limit) - int(used))}
            break
    return {}


def _metal_headroom() -> dict[str, int]:
    try:
        import mlx.core as mx

        info = mx.device_info()
        working_set = int(info.get("max_recommended_working_set_size") or 0)
        return {"metal working set": max(0, working_set - int(mx.get_active_memory()))} if working_set else {}
    except Exception:  # no Metal, or another MLX's API: RAM and the process limits decide
        return {}


def measure_budget(configured_mb: int | None, total_ram_bytes: int) -> Measured:
    """The KV budget: models.yaml's kv_memory_mb, else the smallest of RAM_SHARE of RAM and
    HEADROOM_SHARE of what each process limit leaves now (call it after loading the weights)."""
    if configured_mb is not None:
        return Measured(configured_mb * MB, "models.yaml kv_memory_mb")
    candidates = {"RAM": int(total_ram_bytes * RAM_SHARE)} if total_ram_bytes else {}
    for name, room in {**_rlimit_headroom(), **_cgroup_headroom(), **_metal_headroom()}.items():
        candidates[name] = int(room * HEADROOM_SHARE)
    if not candidates:
        return Measured(0, "unknown")
    source = min(candidates, key=lambda k: candidates[k])
    return Measured(candidates[source], source, candidates)


# -- the ledger admission keeps --------------------------------------------------------------
@dataclass
class KVBudget:
    """The rows' reservations against the measured budget."""

    profile: KVProfile
    measured: Measured
    chunk: int = 0  # the most prompt tokens one row reads in a step
    refused: int = 0  # requests that could not fit even alone
    clamped: int = 0  # requests whose max_tokens was cut to what fits alone
    preempted: int = 0  # rows paused to the prefix store because the rows outgrew the budget
    decode_allowance: int = DECODE_ALLOWANCE  # tokens of growth a pausable row reserves
    waiting_for_memory: bool = False  # the next waiting row did not fit at the last admission
    # Memory taken from the same budget as it changes (the resident LoRA adapters' weights,
    # where no adapter_memory_mb reserves them up front); read at every admission.
    taken: Callable[[], int] | None = None
    activations: PrefillActivations | None = None  # a prefill step's transient memory, reserved too
    _alone: tuple[int, int] | None = None  # (budget, the longest row that fits it alone)

    @property
    def budget_bytes(self) -> int:
        return max(0, self.measured.bytes - (self.taken() if self.taken is not None else 0))

    def set_chunk(self, tokens: int) -> None:
        """The most prompt tokens a step reads (the scheduler's prefill budget)."""
        self.chunk = tokens
        self._alone = None  # what fits alone depends on it

    def bytes_for(self, reaches: list[int]) -> int:
        """The rows' KV, and one prefill step's activations beside it (a step reads at most
        `chunk` prompt tokens, each attending to at most the longest row)."""
        return self.profile.rows_bytes(reaches, self.chunk) + self.prefill_bytes(reaches)

    def prefill_bytes(self, reaches: list[int]) -> int:
        if self.activations is None or not reaches or not self.chunk:
            return 0
        longest = max(reaches)
        return self.activations.bytes(min(self.chunk, longest), longest, len(reaches))

    def tokens_alone(self) -> int:
        """The longest row (prompt + answer, tokens) that fits the budget alone."""
        budget = self.budget_bytes
        if self._alone is None or self._alone[0] != budget:
            lo, hi = 0, 1 << 24 if self.profile.grows else 1 << 30
            if not self.profile.grows:  # windows and state: any length fits, or none does
                lo = hi if self.bytes_for([hi]) <= budget else 0
            while lo < hi:  # the largest reach whose rows_bytes fits
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self.bytes_for([mid]) <= budget else (lo, mid - 1)
            self._alone = (budget, lo)
        return self._alone[1]

    def check_alone(self, prompt_tokens: int, max_tokens: int, policy: str) -> int:
        """The max_tokens a row may keep (cut to fit alone under policy clamp), or a 400 that
        names the tokens asked, the bytes they need and the budget."""
        need = self.bytes_for([prompt_tokens + max_tokens])
        if need <= self.budget_bytes:
            return max_tokens
        alone = self.tokens_alone()
        if policy != "reject" and prompt_tokens < alone:
            self.clamped += 1
            return alone - prompt_tokens
        self.refused += 1
        asked = "the prompt" if prompt_tokens >= alone else "the prompt and max_tokens"
        raise ServiceError(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"This request needs more memory than this model's KV budget: {prompt_tokens} prompt tokens + "
            f"max_tokens {max_tokens} need {need // MB} MiB of KV cache, and the budget is "
            f"{self.budget_bytes // MB} MiB ({self.measured.source}), which holds at most {alone} tokens "
            f"for one request. Shorten {asked}, or raise kv_memory_mb in models.yaml if the machine has the memory.",
            param="messages" if prompt_tokens >= alone else "max_tokens",
            details={
                "prompt_tokens": prompt_tokens,
                "max_tokens": max_tokens,
                "context_length": alone,
                "kv_bytes_needed": need,
                "kv_budget_bytes": self.budget_bytes,
            },
        )

    def counters(self, reserves: list[int], holds: list[int], cache_bytes: int) -> dict:
        """reserves: the tokens admission counts per row; holds: those each row holds after
        the next step (worker/schedule/kv_rows.py)."""
        reserved = self.bytes_for(reserves)
        return {
            "budget_bytes": self.budget_bytes,
            "reserved_bytes": reserved,
            "held_bytes": self.bytes_for(holds),
            "free_bytes": max(0, self.budget_bytes - reserved),
            "prefill_reserve_bytes": self.prefill_bytes(reserves),
            "prefix_cache_bytes": cache_bytes,
            "rows": len(reserves),
            "tokens_alone": self.tokens_alone(),
            "decode_allowance": self.decode_allowance,
            "waiting_for_memory": self.waiting_for_memory,
            "preempted": self.preempted,
            "refused": self.refused,
            "clamped": self.clamped,
            "source": self.measured.source,
            "taken_bytes": self.taken() if self.taken is not None else 0,
            "measured": dict(self.measured.candidates),
            **self.profile.as_dict(),
        }


def runner_profile(model, fresh_cache: list, draft_model=None) -> KVProfile:
    """Each layer's KV per row, measured on a fresh cache; with a draft model (only a
    DraftModelDrafter has one), its per-row KV too."""
    profile = probe(model, fresh_cache)
    if draft_model is None:
        return profile
    from mlx_lm.models.cache import make_prompt_cache

    return KVProfile(profile.layers + probe(draft_model, make_prompt_cache(draft_model)).layers)
