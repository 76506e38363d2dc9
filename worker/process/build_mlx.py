"""The MLX runner's parts, built and wired to each other here, then handed to MLXRunner,
which only stores them (worker/model/runners/mlx_runner.py).

The order matters where parts touch the same model: the adapters wrap its layers before the
output head is transposed, and the CPU attention is routed in after both the model and a
draft model are loaded (their modules are what it routes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from ...shared.config import ModelEntry
from ...shared.model_sections import CacheConfig, ChatConfig, FimConfig, SpeculativeConfig
from ...shared.platform import on_cpu_device, total_memory_bytes
from ..model import model_info
from ..model.adapters.bank import AdapterBank, AdapterSet
from ..model.cache import state_checkpoints as sc
from ..model.cache.kv_shift import ShiftReuse
from ..model.cache.prefix_cache import PrefixCache
from ..model.cache.prefix_store import PrefixStore
from ..model.cpu import cpu_attention
from ..model.cpu.blas_threads import policy_for
from ..model.cpu.output_head import transpose_head
from ..model.memory.capacity import activation_dtype_bytes, kv_bytes_per_token
from ..model.runners.batch_generator import VectorBatchGenerator
from ..model.runners.logprobs import TokenBytes
from ..model.runners.mlx_runner import MLXRunner, fresh_cache
from ..model.runners.step_trace import StepTrace
from ..model.speculation.draft_model import load_drafter
from ..model.speculation.speculative import Speculator
from ..text.chat_text import ChatText
from ..text.fim import FimPrompts

# Default prefix-cache bound when the entry sets none: a share of RAM.
DEFAULT_CACHE_SHARE = 0.10


def entry_runner(entry: ModelEntry, model_path: Path, **how: Any) -> MLXRunner:
    """A models.yaml entry's MLX runner, from its sizes and sections; how: the prefix store, or
    a sharded rank's loader, runner class and group (worker/process/distributed.py)."""
    folders = {a.name: str(a.folder()) for a in entry.adapters}
    adapters = AdapterSet(folders, entry.resident_adapters, adapter_bytes(entry))
    sizes = {"max_num_seqs": entry.max_num_seqs, "prefill_step_size": entry.prefill_step_size}
    sections = {"cache": entry.cache, "chat": entry.chat, "speculative": entry.speculative, "fim": entry.fim}
    options = {"adapters": adapters, "cache_bytes": prefix_cache_bytes(entry), **sizes, **sections, **how}
    return build_mlx_runner(model_path, context_length=entry.context_length, **options)


def prefix_cache_bytes(entry: ModelEntry) -> int:
    if entry.cache.prefix_memory_mb is not None:
        return entry.cache.prefix_memory_mb * (1 << 20)
    return int(total_memory_bytes() * DEFAULT_CACHE_SHARE)


def adapter_bytes(entry: ModelEntry) -> int | None:
    """The resident adapters' byte bound (models.yaml adapter_memory_mb); None: bounded by count."""
    if not entry.adapters or entry.adapter_memory_mb is None:
        return None
    return int(entry.adapter_memory_mb * (1 << 20))


def build_mlx_runner(
    model_path: Path | str,
    *,
    context_length: int | None,
    max_num_seqs: int,
    prefill_step_size: int,
    cache_bytes: int,
    cache: CacheConfig | None = None,
    chat: ChatConfig | None = None,
    speculative: SpeculativeConfig | None = None,
    fim: FimConfig | None = None,  # the entry's FIM settings, or None: as the tokenizer says
    adapters: AdapterSet | None = None,  # LoRA adapters (worker/model/adapters/bank.py)
    prefix_store: PrefixStore | None = None,
    loader=None,  # (path, return_config=True) -> (model, tokenizer, config); default mlx_lm.load
    runner_cls: type[MLXRunner] = MLXRunner,
    **runner_extra: Any,  # what a subclass takes besides the parts (ShardedRunner: its group)
) -> MLXRunner:
    """Load the model at model_path and build an MLX runner over it, from the entry's sizes
    and sections (models.yaml; shared/model_sections.py)."""
    model_path, cache, chat = Path(model_path), cache or CacheConfig(), chat or ChatConfig()  # benches pass text
    kv_bits, kv_group_size = cache.kv_bits, cache.kv_group_size
    model, tokenizer, config, context = _load(model_path, loader, context_length)
    # A code model's FIM controls (file separator, pad, ...) end an answer like its EOS:
    # one of them in the output is the model starting another file or hole.
    fim_prompts = FimPrompts(tokenizer, fim)
    generator = _batch_generator(model, tokenizer.eos_token_ids, fim_prompts, max_num_seqs, prefill_step_size)
    # Per-row LoRA adapters over the one copy of the base weights (worker/model/adapters/bank.py).
    bank = AdapterBank(model, *(adapters or AdapterSet()))
    generator.route_rows = bank.rows
    # The CPU BLAS's thread count per kind of step, measured (worker/model/cpu/blas_threads.py).
    blas = policy_for(mx, generator)
    prefix_cache = PrefixCache(cache_bytes)
    prefix_cache.describe(fresh_cache(model, kv_bits, kv_group_size))  # what its blocks assemble into
    # Memory per token of a plain-attention layer stack, as /v1/status reports it.
    per_token = kv_bytes_per_token(config, activation_dtype_bytes(model_path, config), kv_bits, kv_group_size)
    if runner_cls is MLXRunner:  # not on a group of ranks, whose batches must stay the same on each
        generator.forward_tokens = _forward_tokens(model, per_token)
    speculative = speculative or SpeculativeConfig()
    vocab_size = model_info.vocab_size(model, tokenizer)
    speculator = _speculator(speculative, model_path, tokenizer, vocab_size, generator)
    # FIM prompts reuse the suffix they moved (worker/model/cache/kv_shift.py); not on a group
    # of ranks, where a read at admission would have to run on every rank in lockstep.
    shift = _shift_reuse(model, cache, fim_prompts, fim) if runner_cls is MLXRunner else None
    return runner_cls(
        model=model,
        tokenizer=tokenizer,
        context_length=context,
        vocab_size=vocab_size,
        generator=generator,
        prefix_cache=prefix_cache,
        cache_bytes=cache_bytes,
        text=_chat_text(tokenizer, vocab_size, context, chat, fim_prompts),
        fim=fim_prompts,
        adapters=bank,
        speculator=speculator,
        token_bytes=TokenBytes(tokenizer),
        cache=cache,
        kv_bytes_per_token=per_token,
        prefix_store=prefix_store,
        blas=blas,
        # MLXGW_STEP_TRACE: one line per step, for diagnosis (worker/model/runners/step_trace.py)
        trace=StepTrace.from_env({"model": str(model_path), "speculative": speculative.mode}),
        **_cpu_kernels(model),
        # Families with recurrent or sliding-window layers keep state checkpoints while
        # prefilling (worker/model/cache/state_checkpoints.py).
        checkpointing=sc.needs_checkpoints(make_prompt_cache(model)),
        turn_openers=sc.turn_opener_ids(tokenizer),
        shift_reuse=shift,
        **runner_extra,
    )


def _load(model_path: Path, loader, context_length: int | None) -> tuple[Any, Any, dict, int]:
    """The model, its tokenizer and config, and the context served (the entry's, at most the model's)."""
    model, tokenizer, config = (loader or load)(str(model_path), return_config=True)
    model_info.check_servable(model)
    model_context = model_info.context_length(config)
    return model, tokenizer, config, min(context_length or model_context, model_context)


def _chat_text(tokenizer, vocab_size: int, context: int, chat: ChatConfig, fim: FimPrompts) -> ChatText:
    """The entry's chat section over this tokenizer: parsers, template and tool-name guard."""
    options = {"tool_parser": chat.tool_parser, "reasoning_parser": chat.reasoning_parser, "fim": fim}
    options |= {"allow_request_chat_template": chat.allow_request_chat_template}
    options |= {"tool_name_guard": chat.tool_name_guard, "chat_template": chat.chat_template}
    return ChatText(tokenizer, vocab_size, context_length=context, **options)


def _shift_reuse(model, cache: CacheConfig, fim_prompts: FimPrompts, fim: FimConfig | None) -> ShiftReuse | None:
    if fim_prompts.ids is None:
        return None
    layers = fresh_cache(model, cache.kv_bits, cache.kv_group_size)
    return ShiftReuse.for_model(model, layers, fim_prompts.ids.middle, (fim or FimConfig()).kv_shift_min_tokens)


def _batch_generator(
    model, eos_ids, fim: FimPrompts, max_num_seqs: int, prefill_step_size: int
) -> VectorBatchGenerator:
    """mlx-lm's BatchGenerator, sampling and penalising the whole batch in one call per step."""
    stops = sorted(set(eos_ids) | fim.stop_ids)
    return VectorBatchGenerator(
        model,
        stop_tokens=[[t] for t in stops],
        completion_batch_size=max_num_seqs,
        prefill_batch_size=max_num_seqs,
        prefill_step_size=prefill_step_size,
    )


def _forward_tokens(model, kv_bytes_per_token: int | None) -> int | None:
    """A decode forward's fixed cost in tokens of attention, for placing rows in a second decode
    batch (worker/model/runners/batch_generator.py): a decode step reads every weight once and
    each row's KV once, so the weights' bytes over a token's KV bytes (on the CPU device, its
    attention's measured cost per byte: worker/model/cpu/cpu_attention.py). None (one batch): the
    model has no attention layer whose KV a long row would pad."""
    if not kv_bytes_per_token or not any(isinstance(c, (KVCache, QuantizedKVCache)) for c in make_prompt_cache(model)):
        return None
    kv_byte_cost = cpu_attention.KV_BYTE_COST if on_cpu_device() else 1
    return sum(p.nbytes for _, p in tree_flatten(model.parameters())) // (kv_bytes_per_token * kv_byte_cost)


def _speculator(
    speculative: SpeculativeConfig, model_path: Path, tokenizer, vocab_size: int, generator: VectorBatchGenerator
) -> Speculator:
    """The speculator, routing the generator's decode steps (a draft model is loaded for mode draft)."""
    drafter = load_drafter(speculative, model_path, tokenizer, vocab_size)
    speculator = Speculator(speculative, drafter=drafter)
    speculator.attach(generator)
    return speculator


def _cpu_kernels(model) -> dict[str, Any]:
    """CPU device only: attention with a base-2 softmax and long rows over two cores, and the
    output head's weight stored for the faster GEMM (worker/model/cpu/cpu_attention.py,
    worker/model/cpu/output_head.py). Called after the model, its adapters and a draft model
    are loaded: their modules are what these route."""
    return {
        "cpu_attention": cpu_attention if cpu_attention.install() else None,
        "transposed_head": transpose_head(model),
    }
