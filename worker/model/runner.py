"""Model runners: what turns admitted prompts into tokens, one engine step at a time.

The scheduler owns policy (who runs, when, cancellation); a runner owns execution, under the
contract in worker/model/interfaces.py (TextRunner). The MLX runner drives mlx-lm's BatchGenerator,
which interleaves one decode step of the running batch with one prefill chunk
(`prefill_step_size` tokens) of arriving prompts, so a long prompt never freezes the streams
already decoding; a prompt's first token comes out in the step that reads its last chunk
(worker/model/batch_generator.py)."""

from __future__ import annotations

import gc
import time
from pathlib import Path

from mlxgw.shared.config import SpeculativeConfig
from mlxgw.shared.protocol import GenerateRequest, SamplingParams
from mlxgw.worker.model.cache import state_checkpoints as sc
from mlxgw.worker.model.chat_runner import ChatTextRunner
from mlxgw.worker.model.interfaces import StepOutput, TokenOut
from mlxgw.worker.text.chat_text import ChatText


class MLXRunner(ChatTextRunner):
    supports_choices = True
    supports_prompt_logprobs = True
    supports_prefill_chunk = True
    supports_layer_progress = True
    supports_shared_prefill = True

    def __init__(
        self,
        model_path: Path | str,
        *,
        context_length: int | None,
        max_num_seqs: int,
        prefill_step_size: int,
        cache_bytes: int,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        allow_request_chat_template: bool = False,
        loader=None,  # (path, return_config=True) -> (model, tokenizer, config); default mlx_lm.load
        prefix_store=None,
        speculative: SpeculativeConfig | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        tool_name_guard: bool = False,
        adapters: dict[str, str] | None = None,  # LoRA adapters: name -> mlx_lm.lora folder
        resident_adapters: int = 8,
        fim=None,  # the entry's FimConfig (shared/config.py), or None: as the tokenizer says
    ):
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.models.cache import make_prompt_cache

        from mlxgw.worker.model.batch_generator import VectorBatchGenerator
        from mlxgw.worker.model.cache.prefix_cache import PrefixCache

        self._mx = mx
        from mlxgw.worker.model import model_info

        model_path = Path(model_path)  # the benches pass a folder as text
        self.model, self.tokenizer, config = (loader or load)(str(model_path), return_config=True)
        model_info.check_servable(self.model)
        model_context = model_info.context_length(config)
        self.context_length = min(context_length or model_context, model_context)
        from mlxgw.worker.text.fim import FimPrompts

        # A code model's FIM controls (file separator, pad, ...) end an answer like its EOS:
        # one of them in the output is the model starting another file or hole.
        self.fim = FimPrompts(self.tokenizer, fim)
        stops = sorted(set(self.tokenizer.eos_token_ids) | self.fim.stop_ids)
        # mlx-lm's BatchGenerator, sampling and penalising the whole batch in one call per step.
        self.generator = VectorBatchGenerator(
            self.model,
            stop_tokens=[[t] for t in stops],
            completion_batch_size=max_num_seqs,
            prefill_batch_size=max_num_seqs,
            prefill_step_size=prefill_step_size,
        )
        self.prefix_cache = PrefixCache(cache_bytes)
        from mlxgw.worker.model.adapters import AdapterBank

        # Per-row LoRA adapters over the one copy of the base weights (worker/model/adapters.py).
        self.adapters = AdapterBank(self.model, adapters, resident_adapters)
        self.generator.route_rows = self.adapters.rows
        from mlxgw.worker.model.cpu.blas_threads import policy_for

        # The CPU BLAS's thread count per kind of step, measured (worker/model/cpu/blas_threads.py).
        self.blas = policy_for(mx, self.generator)
        # The prefix cache's disk copy (worker/model/cache/prefix_store.py), or None: main.serve restores
        # it before the first request and saves it when the worker stops gracefully.
        self.prefix_store = prefix_store
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.prefix_cache.describe(self._fresh_cache())  # what its blocks assemble into (kv_bits too)
        from mlxgw.worker.model.capacity import activation_dtype_bytes, kv_bytes_per_token

        # Memory per token of a plain-attention layer stack, as /v1/status reports it.
        self.kv_bytes_per_token = kv_bytes_per_token(
            config, activation_dtype_bytes(model_path, config), kv_bits, kv_group_size
        )
        from mlxgw.worker.model.speculation.draft_model import load_drafter
        from mlxgw.worker.model.speculation.speculative import Speculator

        speculative = speculative or SpeculativeConfig()
        vocab_size = model_info.vocab_size(self.model, self.tokenizer)
        drafter = load_drafter(speculative, model_path, self.tokenizer, vocab_size)  # mode draft only
        self.speculator = Speculator(speculative, drafter=drafter)
        self.speculator.attach(self.generator)
        from mlxgw.worker.model.step_trace import StepTrace

        # MLXGW_STEP_TRACE: one line per step, for diagnosis (worker/model/step_trace.py)
        self.trace = StepTrace.from_env({"model": str(model_path), "speculative": speculative.mode})
        from mlxgw.worker.model.cpu import cpu_attention
        from mlxgw.worker.model.cpu.output_head import transpose_head

        # CPU device only: attention with a base-2 softmax and long rows over two cores, and
        # the output head's weight stored for the faster GEMM (worker/model/cpu/cpu_attention.py,
        # worker/model/cpu/output_head.py). After both models loaded: their modules are routed.
        self.cpu_attention = cpu_attention if cpu_attention.install() else None
        self.transposed_head = transpose_head(self.model)
        self._covered: dict[int, int] = {}  # uid -> prompt tokens its cache lookup covered
        # Families with recurrent or sliding-window layers keep state checkpoints while
        # prefilling (worker/model/cache/state_checkpoints.py): uid -> those taken so far.
        self._checkpointing = sc.needs_checkpoints(make_prompt_cache(self.model))
        self._turn_openers = sc.turn_opener_ids(self.tokenizer)
        self._checkpoints: dict[int, sc.Checkpoints] = {}
        if self._checkpointing:  # at a segment's end, before a finished prompt leaves its batch
            self.generator.after_prompt_chunk = self._take_checkpoints
        self._boundaries: dict[int, set[int]] = {}  # uid -> its prompt's message boundaries
        self._logprobs: dict[int, int] = {}  # uid -> alternatives per token, for those that ask
        self._keep_prompt: set[int] = set()  # uids whose prompt KV is stored once prefilled
        # uids with a seed: while any is in the batch the BLAS keeps one thread count, since a
        # different count rounds the logits differently and can move a seeded draw
        self._seeded: set[int] = set()
        self.cache_bytes = cache_bytes
        self.vocab_size = vocab_size
        from mlxgw.worker.model.logprobs import TokenBytes

        self.token_bytes = TokenBytes(self.tokenizer)
        self.text = ChatText(
            self.tokenizer,
            self.vocab_size,
            tool_parser=tool_parser,
            reasoning_parser=reasoning_parser,
            allow_request_chat_template=allow_request_chat_template,
            context_length=self.context_length,
            tool_name_guard=tool_name_guard,
            fim=self.fim,
        )

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
    ) -> tuple[int, int]:
        """adapter: a LoRA adapter's name; None: the one its request named at preparation
        (found by the guard's request id), if any."""
        from mlxgw.worker.model.sampling import build_sampler, guard_sampler, guarded_processors

        processors = guarded_processors(sampling, constraint, guard)
        sampler = build_sampler(sampling, wants_logprobs=logprobs is not None)
        if guard is not None:
            sampler = guard_sampler(sampler, guard)
        lora = self.adapters.for_row(adapter, guard)
        cache, cached = self.prefix_cache.longest_match(self.adapters.cache_tokens(prompt, lora))
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
        self.adapters.bind(uid, lora)
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
        return uid, cached

    def _fresh_cache(self) -> list:
        """A new sequence's cache: the model's own, its KV layers quantized with kv_bits
        (worker/model/cache/quantized_kv.py: they stay quantized through batching, the prefix cache and
        speculation)."""
        from mlx_lm.models.cache import make_prompt_cache

        from mlxgw.worker.model.cache.quantized_kv import quantize_layers

        cache = make_prompt_cache(self.model)
        return cache if self.kv_bits is None else quantize_layers(cache, self.kv_group_size, self.kv_bits)

    def _segments(self, prompt: list[int], cached: int) -> tuple[list[list[int]], set[int]]:
        if not self._checkpointing:
            return [prompt[cached:]], set()
        # junctions: where the prompt leaves a stored one (the next prompt sharing it resumes there)
        return sc.prompt_segments(prompt, cached, self._turn_openers, self.prefix_cache.junctions())

    def prompt_scorer(self, prompt: list[int], top: int):
        """A PromptScorer of this model for one request's prompt logprobs (worker/model/prompt_logprobs.py)."""
        from mlxgw.worker.model.prompt_logprobs import PromptScorer

        return PromptScorer(self.model, prompt, top, self.token_bytes, keep_kv=self._keep_kv)

    def set_prefill_chunk(self, tokens: int) -> None:
        """Prompt tokens each prefilling row reads in the next step (the scheduler shares
        a per-step budget among them: worker/schedule/prefill_plan.py)."""
        self.generator.prefill_step_size = max(1, int(tokens))

    def release_idle_memory(self) -> None:
        """Nothing runs: hand MLX's pool of freed buffers back to the system. While busy the
        pool saves allocations; idle, it is memory no counter shows but RSS."""
        self._mx.clear_cache()

    def kv_profile(self):
        from mlxgw.worker.model.kv_budget import runner_profile

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
        from mlxgw.worker.model.logprobs import entries

        rows = [(int(r.token), r.logprobs, self._logprobs[r.uid]) for r in asked]
        return {r.uid: e for r, e in zip(asked, entries(rows, self.token_bytes))}

    def prefix_ready(self, prompt) -> bool:  # its disk blocks read off the engine thread
        return type(prompt) is not list or self.prefix_cache.prefetch(prompt)

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

    def _keep_kv(
        self, tokens: list[int], cache: list, checkpoints: sc.Checkpoints | None = None, uid: int | None = None
    ) -> None:
        # The KV extracted from the batch is a lazy slice whose graph still references the
        # whole batch's buffers (every row, the full allocation). Unevaluated, a cached entry
        # kept all of that alive while counting only its own slice: a worker reached 14 GB
        # with a cache that reported 2 GB. Evaluating makes it the compact copy it claims to be.
        self._mx.eval([c.state for c in cache])
        # An adapter row's KV is keyed apart from the base's and other adapters' (worker/model/adapters.py).
        tokens = self.adapters.cache_tokens(tokens, self.adapters.by_uid.get(uid))
        if checkpoints is not None:  # those of a prompt the tokens begin with
            checkpoints = checkpoints.for_entry(tokens)
        self.prefix_cache.insert(tokens, cache, checkpoints=checkpoints)
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
        mx = self._mx
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
        }

    def cache_stats(self) -> dict:
        return self.prefix_cache.snapshot()

    def cache_clear(self) -> None:
        self.prefix_cache.clear()
        if self.prefix_store is not None:  # a cleared cache must not come back at the next start
            self.prefix_store.clear()
        gc.collect()
        self._mx.clear_cache()
