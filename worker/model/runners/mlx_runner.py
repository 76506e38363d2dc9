"""Model runners: what turns admitted prompts into tokens, one engine step at a time.

The scheduler owns policy (who runs, when, cancellation); a runner owns execution, under the
contract in worker/model/interfaces.py (TextRunner). The MLX runner drives mlx-lm's BatchGenerator,
which interleaves one decode step of the running batch with one prefill chunk
(`prefill_step_size` tokens) of arriving prompts, so a long prompt never freezes the streams
already decoding; a prompt's first token comes out in the step that reads its last chunk
(worker/model/runners/batch_generator.py)."""

from __future__ import annotations

import gc
import time
from dataclasses import asdict
from types import ModuleType

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ....shared.model_sections import CacheConfig
from ....shared.protocol import GenerateRequest
from ...text.chat_text import ChatText
from ...text.fim import FimPrompts
from ..adapters.bank import AdapterBank
from ..cache import scopes
from ..cache import state_checkpoints as sc
from ..cache.kv_shift import ShiftReuse
from ..cache.prefix_cache import PrefixCache
from ..cache.prefix_store import PrefixStore
from ..cache.quantized_kv import quantize_layers
from ..cpu.blas_threads import BlasThreadPolicy
from ..interfaces import Row, StepOutput, TokenOut
from ..memory.kv_budget import runner_profile
from ..speculation.speculative import Speculator
from .batch_generator import VectorBatchGenerator
from .chat_runner import ChatTextRunner
from .finite_rows import fault_non_finite
from .logprobs import TokenBytes, entries
from .prompt_logprobs import PromptScorer
from .sampling import build_sampler, guard_sampler, guarded_processors
from .step_trace import StepTrace


def fresh_cache(model, kv_bits: int | None, kv_group_size: int) -> list:
    """A new sequence's cache: the model's own, its KV layers quantized with kv_bits
    (worker/model/cache/quantized_kv.py: they stay quantized through batching, the prefix cache
    and speculation)."""
    cache = make_prompt_cache(model)
    return cache if kv_bits is None else quantize_layers(cache, kv_group_size, kv_bits)


class MLXRunner(ChatTextRunner):
    supports_choices = True
    supports_prompt_logprobs = True
    supports_prefill_chunk = True
    supports_layer_progress = True
    supports_shared_prefill = True
    supports_cache_hints = True
    supports_cache_scopes = True

    def __init__(
        self,
        *,
        model,
        tokenizer,
        context_length: int,
        vocab_size: int,
        generator: VectorBatchGenerator,
        prefix_cache: PrefixCache,
        cache_bytes: int,
        text: ChatText,
        fim: FimPrompts,
        adapters: AdapterBank,
        speculator: Speculator,
        token_bytes: TokenBytes,
        cache: CacheConfig,
        kv_bytes_per_token: int | None = None,
        prefix_store: PrefixStore | None = None,
        blas: BlasThreadPolicy | None = None,
        trace: StepTrace | None = None,
        cpu_attention: ModuleType | None = None,
        transposed_head: str | None = None,
        checkpointing: bool = False,
        turn_openers: frozenset[int] = frozenset(),
        shift_reuse: ShiftReuse | None = None,
    ):
        """The parts, composed and wired to each other by worker/process/build_mlx.py
        (build_mlx_runner): the generator routes rows through the adapters and speculates
        with the speculator; the prefix cache knows what its blocks assemble into.
        prefix_store: the prefix cache's disk copy (worker/model/cache/prefix_store.py), or None:
        main.serve restores it before the first request and saves it at a graceful stop.
        blas: the CPU BLAS's thread count per kind of step (worker/model/cpu/blas_threads.py).
        trace: MLXGW_STEP_TRACE's line per step (worker/model/runners/step_trace.py), or None.
        cpu_attention: the CPU attention module when installed (worker/model/cpu/cpu_attention.py).
        checkpointing: the family has recurrent or sliding-window layers, which keep state
        checkpoints while prefilling (worker/model/cache/state_checkpoints.py).
        shift_reuse: FIM prompts reuse the moved suffix's KV (worker/model/cache/kv_shift.py), or None."""
        self.model, self.tokenizer, self.text, self.fim = model, tokenizer, text, fim
        self.context_length, self.vocab_size, self.token_bytes = context_length, vocab_size, token_bytes
        self.generator, self.speculator, self.adapters = generator, speculator, adapters
        self.prefix_cache, self.prefix_store, self.cache_bytes = prefix_cache, prefix_store, cache_bytes
        self.kv_bits, self.kv_group_size = cache.kv_bits, cache.kv_group_size  # the entry's KV quantization
        self.blas, self.trace, self.kv_bytes_per_token = blas, trace, kv_bytes_per_token
        self.cpu_attention, self.transposed_head = cpu_attention, transposed_head
        self.shift_reuse = shift_reuse
        self._checkpointing, self._turn_openers = checkpointing, turn_openers
        if checkpointing:  # at a segment's end, before a finished prompt leaves its batch
            self.generator.after_prompt_chunk = self._take_checkpoints
        self._rows: dict[int, Row] = {}  # uid -> the row in the batch
        scopes.check_vocabulary(vocab_size)

    def encode(self, req: GenerateRequest) -> list[int]:
        # Every sequence (each choice too) is prepared here, off the engine thread: an unknown
        # adapter is refused before it queues, a known one is remembered for its admission.
        self.adapters.note(req.rid, req.adapter, req.prompt_logprobs)
        return super().encode(req)

    # -- execution ----------------------------------------------------------------------
    def insert(self, row: Row) -> tuple[int, int]:
        """The row's adapter, where None: the one its request named at preparation (found by
        the guard's request id), if any. Its namespace (its key's cache group): the row reads
        and writes only that scope's blocks."""
        prompt, sampling, guard = row.prompt, row.sampling, row.guard
        processors = guarded_processors(sampling, row.constraint, guard)
        sampler = build_sampler(sampling, wants_logprobs=row.logprobs is not None)
        if guard is not None:
            sampler = guard_sampler(sampler, guard)
        lora = self.adapters.for_row(row.adapter, guard)
        row.scope = scopes.scope_of(row.namespace, lora.tag if lora is not None else 0)
        cache, cached = self.prefix_cache.longest_match(scopes.scoped(prompt, row.scope))
        if self.shift_reuse is not None and cache is not None and lora is None:  # its edit runs on the base
            tree = self.prefix_cache.tree
            cache, cached = self.shift_reuse.extend(self.model, tree, prompt, cache, cached, row.scope)
        if cache is None and self.kv_bits is not None:
            cache = self._fresh_cache()
        segments, row.boundaries = self._segments(prompt, cached)
        (uid,) = self.generator.insert_segments(
            [segments],
            max_tokens=[row.max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[prompt[:cached]],
            samplers=[sampler],
            logits_processors=[processors],
        )
        row.covered, self._rows[uid] = cached, row
        self.adapters.bind(uid, lora)
        if self._checkpointing:
            row.checkpoints = sc.Checkpoints(list(prompt))
        # Drafts are verified against the argmax: only for greedy rows with nothing reshaping it.
        self.speculator.admit(uid, sampling.temperature <= 0 and not processors and row.logprobs is None)
        return uid, cached

    def _fresh_cache(self) -> list:
        return fresh_cache(self.model, self.kv_bits, self.kv_group_size)

    def _segments(self, prompt: list[int], cached: int) -> tuple[list[list[int]], set[int]]:
        if not self._checkpointing:
            return [prompt[cached:]], set()
        # junctions: where the prompt leaves a stored one (the next prompt sharing it resumes there)
        return sc.prompt_segments(prompt, cached, self._turn_openers, self.prefix_cache.junctions())

    def prompt_scorer(self, prompt: list[int], top: int, namespace: str | None = None):
        """A PromptScorer of this model for one request's prompt logprobs (worker/model/runners/prompt_logprobs.py);
        the prompt's KV it leaves goes to the request's own cache scope."""
        scope = scopes.scope_of(namespace)

        def keep(tokens: list[int], cache: list) -> None:
            self._keep_kv(tokens, cache, scope=scope)

        return PromptScorer(self.model, prompt, top, self.token_bytes, keep_kv=keep)

    def set_prefill_chunk(self, tokens: int) -> None:
        """Prompt tokens each prefilling row reads in the next step (the scheduler shares
        a per-step budget among them: worker/schedule/prefill_plan.py)."""
        self.generator.prefill_step_size = max(1, int(tokens))

    def release_idle_memory(self) -> None:
        """Nothing runs: hand MLX's pool of freed buffers back to the system. While busy the
        pool saves allocations; idle, it is memory no counter shows but RSS."""
        mx.clear_cache()

    def kv_profile(self):
        return runner_profile(self.model, self._fresh_cache(), getattr(self.speculator.drafter, "model", None))

    def limit_prefix_cache(self, max_bytes: int) -> None:
        # Not remembered: a finishing row's KV enters the cache while its reservation still
        # counts, and replaces that row's memory; the scheduler applies the new limit as soon
        # as the row is released.
        self._bound_cache(max_bytes)

    def step(self) -> StepOutput:
        gen = self.generator
        if self.blas is not None:
            self.blas.start(
                gen.decoding,
                bool(gen.queued or gen.reading),
                # a seeded row keeps one thread count: another rounds the logits differently
                pinned=any(r.sampling.seed is not None for r in self._rows.values()),
            )
        if self.cpu_attention is not None and self.blas is not None:
            # a second stream is one more thread: not while the BLAS policy finds one faster
            self.cpu_attention.settings.parallel = self.blas.threads > 1
        counters = self.speculator.counters
        started, verified, read = time.monotonic(), counters.speculative_steps, gen.prompt_tokens_read
        reading_s = gen.prompt_seconds
        rows = gen.decoding
        prompt_responses, gen_responses = gen.next()
        speculative, read = counters.speculative_steps > verified, gen.prompt_tokens_read - read
        if self.blas is not None:
            self.blas.done(rows + read, sample=not speculative)
        if self.trace is not None:
            threads = None if self.blas is None else self.blas.threads
            self.trace.record(gen, started, rows, len(gen_responses), read, speculative, threads)
        if self.blas is not None and not (gen.decoding or gen.queued):
            self.blas.idle()
        out = StepOutput(prompt_s=gen.prompt_seconds - reading_s)
        for r in prompt_responses:
            done, total = r.progress if isinstance(r.progress, tuple) else (0, 0)
            out.prefill.append((r.uid, done, total))
        fault_non_finite(gen_responses, self._rows, self.adapters.name_of)
        self._keep_prompts(gen_responses)
        logprobs = self._logprob_entries(gen_responses)
        for r in gen_responses:
            if r.finish_reason is not None:
                row = self._rows.pop(r.uid, None)
                if r.prompt_cache is not None:
                    # The finished sequence's KV (prompt + answer) seeds the next turn's prompt.
                    self._keep_kv(r.all_tokens, r.prompt_cache, row)
                self.adapters.release(r.uid)
            out.tokens.append(TokenOut(r.uid, int(r.token), r.finish_reason, logprobs.get(r.uid)))
        return out

    def _take_checkpoints(self, prompt_batch, responses) -> None:
        if self._rows:
            sc.take_checkpoints(prompt_batch, responses, self._rows)

    def _logprob_entries(self, responses) -> dict[int, dict]:
        """Logprob entries for the sequences that asked; the others are not touched."""
        top = {r.uid: row.logprobs for r in responses if (row := self._rows.get(r.uid)) and row.logprobs is not None}
        asked = [r for r in responses if r.uid in top]
        if not asked:
            return {}
        rows = [(int(r.token), r.logprobs, top[r.uid]) for r in asked]
        return {r.uid: e for r, e in zip(asked, entries(rows, self.token_bytes))}

    def prefix_ready(self, prompt, namespace: str | None = None) -> bool:  # its disk blocks read off the engine thread
        # An adapter row's blocks are not prefetched: its scope is known once the adapter is loaded.
        return type(prompt) is not list or self.prefix_cache.prefetch(scopes.scoped(prompt, scopes.scope_of(namespace)))

    def cached_tokens(self, prompt, namespace: str | None = None) -> int:  # orders the waiting queue
        if type(prompt) is not list:
            return 0  # a vision prompt: its media's blocks are keyed by the runner at insert
        return self.prefix_cache.cached_tokens(scopes.scoped(prompt, scopes.scope_of(namespace)))

    def publish_prompt(self, uid: int) -> None:  # others wait on its prefix (worker/schedule/prefix_inflight.py)
        if uid in self._rows:
            self._rows[uid].keep_prompt = True

    def _keep_prompts(self, responses) -> None:
        """Prompt KV others wait on (sibling choices, a shared prefix) is cached with its first token."""
        for r in responses:
            row = self._rows.get(r.uid)
            if row is not None and row.keep_prompt:
                row.keep_prompt = False
                if r.prompt_cache is None:  # still running: copy its row out of the batch
                    extracted = self.generator.extract_cache([r.uid]).get(r.uid)
                    if extracted:
                        self._keep_kv(list(extracted[1]), extracted[0], row)

    def remove(self, uids: list[int]) -> None:
        """Drop sequences that end early (cancelled, timed out, client gone, stop string).

        Their KV so far (the prompt chunks already prefilled, plus any answer) goes to the
        prefix cache: an agent client that gives up on a long prefill and retries resumes
        where the last try stopped instead of starting from zero. The batch's KV is always
        consistent with its token list between steps, so this is a chunk boundary."""
        if not uids:
            return
        removed = self.generator.remove(uids, return_prompt_caches=True)
        for uid in uids:
            row = self._rows.pop(uid, None)
            cache, tokens = removed.get(uid, (None, None))
            if cache and tokens and len(tokens) > (row.covered if row else 0):
                self._keep_kv(tokens, cache, row)
            self.adapters.release(uid)

    def _keep_kv(self, tokens: list[int], cache: list, row: Row | None = None, scope: int = scopes.BASE) -> None:
        """row: the row the KV is of (its scope, checkpoints and caching hint), or None."""
        # The KV extracted from the batch is a lazy slice whose graph still references the
        # whole batch's buffers (every row, the full allocation). Unevaluated, a cached entry
        # kept all of that alive while counting only its own slice: a worker reached 14 GB
        # with a cache that reported 2 GB. Evaluating makes it the compact copy it claims to be.
        mx.eval([c.state for c in cache])
        # Keyed in the row's scope: its namespace's and adapter's own (worker/model/cache/scopes.py).
        tokens = scopes.scoped(tokens, row.scope if row is not None else scope)
        checkpoints = row.checkpoints if row is not None else None
        if checkpoints is not None:  # those of a prompt the tokens begin with
            checkpoints = checkpoints.for_entry(tokens)
        hold_s = (row.hold_s or None) if row else None
        last = self.prefix_cache.insert(tokens, cache, checkpoints=checkpoints, hold_s=hold_s)
        if row is not None and row.route:  # the gateway routes by prefix: it hears what is held
            self.prefix_cache.routed(row.route, last, len(row.prompt))
        self._bound_cache()

    def _bound_cache(self, room: int | None = None) -> None:
        # Live sequences' KV and checkpoints count against the same budget as the stored prefixes;
        # room: what the admitted rows' reservations leave of the KV budget (limit_prefix_cache).
        checkpoints = self._live_checkpoint_bytes()
        bound = self.cache_bytes - self.generator.prompt_cache_nbytes - checkpoints
        self.prefix_cache.trim_to(bound if room is None else min(bound, room - checkpoints))

    def _live_checkpoint_bytes(self) -> int:
        return sum(r.checkpoints.nbytes for r in self._rows.values() if r.checkpoints is not None)

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "mlx_active_bytes": int(mx.get_active_memory()),
            "mlx_peak_bytes": int(mx.get_peak_memory()),
            "mlx_cache_bytes": int(mx.get_cache_memory()),
            "kv_bytes": int(self.generator.prompt_cache_nbytes),
            "live_checkpoint_bytes": self._live_checkpoint_bytes(),
            "kv_bits": self.kv_bits,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "speculative": self.speculator.stats(),
            "blas_threads": None if self.blas is None else self.blas.summary(),
            "adapters": self.adapters.stats(),
            "kv_shift": None if self.shift_reuse is None else asdict(self.shift_reuse.stats),
            # rows decoding beside the batch rather than widening it (worker/model/runners/batch_generator.py)
            "side_batch": {"rows": self.generator.side_rows, "started": self.generator.side_started},
        }

    def cache_stats(self) -> dict:
        return self.prefix_cache.snapshot()

    def cache_clear(self) -> None:
        self.prefix_cache.clear()
        if self.prefix_store is not None:  # a cleared cache must not come back at the next start
            self.prefix_store.clear()
        gc.collect()
        mx.clear_cache()
