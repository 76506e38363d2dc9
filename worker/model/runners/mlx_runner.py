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

from ....shared.protocol import GenerateRequest, SamplingParams
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
from ..interfaces import StepOutput, TokenOut
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
        kv_bits: int | None = None,
        kv_group_size: int = 64,
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
        self.kv_bits, self.kv_group_size, self.kv_bytes_per_token = kv_bits, kv_group_size, kv_bytes_per_token
        self.blas, self.trace = blas, trace
        self.cpu_attention, self.transposed_head = cpu_attention, transposed_head
        self._covered: dict[int, int] = {}  # uid -> prompt tokens its cache lookup covered
        self.shift_reuse = shift_reuse
        self._checkpointing, self._turn_openers = checkpointing, turn_openers
        self._checkpoints: dict[int, sc.Checkpoints] = {}  # uid -> the state checkpoints taken so far
        if checkpointing:  # at a segment's end, before a finished prompt leaves its batch
            self.generator.after_prompt_chunk = self._take_checkpoints
        self._boundaries: dict[int, set[int]] = {}  # uid -> its prompt's message boundaries
        self._logprobs: dict[int, int] = {}  # uid -> alternatives per token, for those that ask
        self._keep_prompt: set[int] = set()  # uids whose prompt KV is stored once prefilled
        # uids with a seed: while any is in the batch the BLAS keeps one thread count, since a
        # different count rounds the logits differently and can move a seeded draw
        self._seeded: set[int] = set()
        self._hold_s: dict[int, float] = {}  # uid -> a client's caching hint, seconds
        self._scope: dict[int, int] = {}  # uid -> its cache scope, where not the base's (cache/scopes.py)
        scopes.check_vocabulary(vocab_size)
        self._guards: dict = {}  # uid -> its request's SequenceGuard

    def encode(self, req: GenerateRequest) -> list[int]:
        # Every sequence (each choice too) is prepared here, off the engine thread: an unknown
        # adapter is refused before it queues, a known one is remembered for its admission.
        self.adapters.note(req.rid, req.adapter, req.prompt_logprobs)
        return super().encode(req)

    # -- execution ----------------------------------------------------------------------
    def insert(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        constraint=None,
        guard=None,
        logprobs: int | None = None,
        keep_prompt: bool = False,
        adapter: str | None = None,
        hold_s: float | None = None,
        namespace: str | None = None,
    ) -> tuple[int, int]:
        """adapter: a LoRA adapter's name; None: the one its request named at preparation
        (found by the guard's request id), if any. namespace: the request's cache namespace
        (its key's cache group): its row reads and writes only that scope's blocks."""
        processors = guarded_processors(sampling, constraint, guard)
        sampler = build_sampler(sampling, wants_logprobs=logprobs is not None)
        if guard is not None:
            sampler = guard_sampler(sampler, guard)
        lora = self.adapters.for_row(adapter, guard)
        scope = scopes.scope_of(namespace, lora.tag if lora is not None else 0)
        cache, cached = self.prefix_cache.longest_match(scopes.scoped(prompt, scope))
        if self.shift_reuse is not None and cache is not None and lora is None:  # its edit runs on the base
            cache, cached = self.shift_reuse.extend(self.model, self.prefix_cache.tree, prompt, cache, cached, scope)
        if cache is None and self.kv_bits is not None:
            cache = self._fresh_cache()
        segments, boundaries = self._segments(prompt, cached)
        (uid,) = self.generator.insert_segments(
            [segments],
            max_tokens=[max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[prompt[:cached]],
            samplers=[sampler],
            logits_processors=[processors],
        )
        self._covered[uid] = cached
        if scope != scopes.BASE:
            self._scope[uid] = scope
        self.adapters.bind(uid, lora)
        if guard is not None:
            self._guards[uid] = guard  # its error if its logits stop being finite
        if self._checkpointing:
            self._checkpoints[uid] = sc.Checkpoints(list(prompt))
            self._boundaries[uid] = boundaries
        # Drafts are verified against the argmax: only for greedy rows with nothing reshaping it.
        self.speculator.admit(uid, sampling.temperature <= 0 and not processors and logprobs is None)
        if logprobs is not None:
            self._logprobs[uid] = logprobs
        if keep_prompt:
            self._keep_prompt.add(uid)
        if sampling.seed is not None:
            self._seeded.add(uid)
        if hold_s:
            self._hold_s[uid] = hold_s
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
                len(gen._generation_batch),
                bool(gen._unprocessed_sequences or len(gen._prompt_batch)),
                pinned=bool(self._seeded),
            )
        if self.cpu_attention is not None and self.blas is not None:
            # a second stream is one more thread: not while the BLAS policy finds one faster
            self.cpu_attention.settings.parallel = self.blas.threads > 1
        counters = self.speculator.counters
        started, verified, read = time.monotonic(), counters.speculative_steps, gen._counters.prompt_tokens
        rows = len(gen._generation_batch)
        prompt_responses, gen_responses = gen.next()
        speculative, read = counters.speculative_steps > verified, gen._counters.prompt_tokens - read
        if self.blas is not None:
            self.blas.done(rows + read, sample=not speculative)
        if self.trace is not None:
            threads = None if self.blas is None else self.blas.threads
            self.trace.record(gen, started, rows, len(gen_responses), read, speculative, threads)
        if self.blas is not None and not (len(gen._generation_batch) or gen._unprocessed_sequences):
            self.blas.idle()
        out = StepOutput()
        for r in prompt_responses:
            done, total = r.progress if isinstance(r.progress, tuple) else (0, 0)
            out.prefill.append((r.uid, done, total))
        fault_non_finite(gen_responses, self._guards, self.adapters.name_of)
        self._keep_prompts(gen_responses)
        logprobs = self._logprob_entries(gen_responses)
        for r in gen_responses:
            if r.finish_reason is not None:
                self._covered.pop(r.uid, None)
                self._logprobs.pop(r.uid, None)
                self._seeded.discard(r.uid)
                self._boundaries.pop(r.uid, None)
                marks = self._checkpoints.pop(r.uid, None)
                if r.prompt_cache is not None:
                    # The finished sequence's KV (prompt + answer) seeds the next turn's prompt.
                    self._keep_kv(r.all_tokens, r.prompt_cache, marks, uid=r.uid)
                self.adapters.release(r.uid)
                self._guards.pop(r.uid, None)
                self._hold_s.pop(r.uid, None)
                self._scope.pop(r.uid, None)
            out.tokens.append(TokenOut(r.uid, int(r.token), r.finish_reason, logprobs.get(r.uid)))
        return out

    def _take_checkpoints(self, prompt_batch, responses) -> None:
        if self._checkpoints:
            sc.take_checkpoints(prompt_batch, responses, self._checkpoints, self._boundaries)

    def _logprob_entries(self, responses) -> dict[int, dict]:
        """Logprob entries for the sequences that asked; the others are not touched."""
        asked = [r for r in responses if r.uid in self._logprobs]
        if not asked:
            return {}
        rows = [(int(r.token), r.logprobs, self._logprobs[r.uid]) for r in asked]
        return {r.uid: e for r, e in zip(asked, entries(rows, self.token_bytes))}

    def prefix_ready(self, prompt, namespace: str | None = None) -> bool:  # its disk blocks read off the engine thread
        # An adapter row's blocks are not prefetched: its scope is known once the adapter is loaded.
        return type(prompt) is not list or self.prefix_cache.prefetch(scopes.scoped(prompt, scopes.scope_of(namespace)))

    def publish_prompt(self, uid: int) -> None:  # others wait on its prefix (worker/schedule/prefix_inflight.py)
        self._keep_prompt.add(uid)

    def _keep_prompts(self, responses) -> None:
        """Prompt KV others wait on (sibling choices, a shared prefix) is cached with its first token."""
        for r in responses:
            if r.uid in self._keep_prompt:
                self._keep_prompt.discard(r.uid)
                if r.prompt_cache is None:  # still running: copy its row out of the batch
                    extracted = self.generator.extract_cache([r.uid]).get(r.uid)
                    if extracted:
                        self._keep_kv(list(extracted[1]), extracted[0], self._checkpoints.get(r.uid), uid=r.uid)

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
            self._logprobs.pop(uid, None)
            self._seeded.discard(uid)
            self._keep_prompt.discard(uid)
            covered = self._covered.pop(uid, 0)
            self._boundaries.pop(uid, None)
            marks = self._checkpoints.pop(uid, None)
            cache, tokens = removed.get(uid, (None, None))
            if cache and tokens and len(tokens) > covered:
                self._keep_kv(tokens, cache, marks, uid=uid)
            self.adapters.release(uid)
            self._guards.pop(uid, None)
            self._hold_s.pop(uid, None)
            self._scope.pop(uid, None)

    def _keep_kv(
        self,
        tokens: list[int],
        cache: list,
        checkpoints: sc.Checkpoints | None = None,
        uid: int | None = None,
        scope: int | None = None,
    ) -> None:
        # The KV extracted from the batch is a lazy slice whose graph still references the
        # whole batch's buffers (every row, the full allocation). Unevaluated, a cached entry
        # kept all of that alive while counting only its own slice: a worker reached 14 GB
        # with a cache that reported 2 GB. Evaluating makes it the compact copy it claims to be.
        mx.eval([c.state for c in cache])
        # Keyed in the row's scope: its namespace's and adapter's own (worker/model/cache/scopes.py).
        tokens = scopes.scoped(tokens, scope if scope is not None else self._scope.get(uid, scopes.BASE))
        if checkpoints is not None:  # those of a prompt the tokens begin with
            checkpoints = checkpoints.for_entry(tokens)
        self.prefix_cache.insert(tokens, cache, checkpoints=checkpoints, hold_s=self._hold_s.get(uid))
        self._bound_cache()

    def _bound_cache(self, room: int | None = None) -> None:
        # Live sequences' KV and checkpoints count against the same budget as the stored prefixes;
        # room: what the admitted rows' reservations leave of the KV budget (limit_prefix_cache).
        checkpoints = self._live_checkpoint_bytes()
        bound = self.cache_bytes - self.generator.prompt_cache_nbytes - checkpoints
        self.prefix_cache.trim_to(bound if room is None else min(bound, room - checkpoints))

    def _live_checkpoint_bytes(self) -> int:
        return sum(c.nbytes for c in self._checkpoints.values())

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
        }

    def cache_stats(self) -> dict:
        return self.prefix_cache.snapshot()

    def cache_clear(self) -> None:
        self.prefix_cache.clear()
        if self.prefix_store is not None:  # a cleared cache must not come back at the next start
            self.prefix_store.clear()
        gc.collect()
        mx.clear_cache()
