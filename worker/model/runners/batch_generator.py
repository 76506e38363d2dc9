"""The engine's batch generator: mlx-lm's BatchGenerator, its step in the order that gives a
prompt its first token in the step that finishes reading it.

mlx-lm's `_next` runs the decode step first, then moves rows whose prompt is read down to
its last token into the decode batch (which starts their first forward), then reads the
next prompt chunk. A prompt whose last chunk is read in step k is therefore moved at step
k + 1, after that step's decode, and its first token reaches the host at the end of step
k + 2; step k + 1 also reads the next arriving prompts' chunks, so the first token waits for
them as well. A burst of 16 prompts split into two groups then gave the first group nothing:
its first token came after the second group's prefill either way (bench/HISTORY.md at 3b9d616, "First
tokens in the step that reads the prompt").

Here a step reads the prompt chunk first, moves the rows that reached their last token into
the decode batch at once, and then runs the decode step, which returns their first token
with everyone else's: a prompt's first token comes at the end of the step that read its last
chunk. Everything else is mlx-lm's: the same batches, segments, counters and early exit
when the decode batch is full; what a step costs is unchanged (the same chunk, the same
forwards), only when tokens come out.

`after_prompt_chunk(prompt_batch, responses)`, when set, runs after the chunk is read and
before any row leaves the prompt batch: the runner takes recurrent-state checkpoints there
(worker/model/cache/state_checkpoints.py), at the end of a segment, which for a prompt's last segment is
the only moment that row's prefill state exists on its own. This module alone reads BatchGenerator's
private state (mlx-lm 0.32.2 has no public reading of it): others read it through its properties."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch

from .batch_sampler import VectorGenerationBatch


class VectorBatchGenerator(BatchGenerator):
    """mlx-lm's BatchGenerator whose decode batch is a VectorGenerationBatch (the batch it
    creates once here lives as long as the generator; mlx-lm extends and filters it) and
    whose step reads prompts before it decodes."""

    after_prompt_chunk: Callable | None = None
    # Set around every forward of this step's order with the uids of the rows it runs, in
    # batch order: the per-row LoRA adapters (worker/model/adapters/bank.py) select their rows from it.
    route_rows: Callable[[list[int]], AbstractContextManager] | None = None
    # False: mlx-lm's own order (the control, for bench/team/admission.py), where LoRA rows are not routed
    reads_first = True

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self._generation_batch = VectorGenerationBatch.empty(self.model, self.sampler)

    # mlx-lm 0.32.2 BatchGenerator._generation_batch: the decode batch the speculator wraps and the trace reads
    @property
    def decode_batch(self):
        return self._generation_batch

    @property
    def queued(self) -> int:  # _unprocessed_sequences: inserted rows not yet reading, for the BLAS policy
        return len(self._unprocessed_sequences)

    @property
    def reading(self) -> int:  # _prompt_batch: rows reading their prompt, for the BLAS policy
        return len(self._prompt_batch)

    @property
    def prompt_tokens_read(self) -> int:  # _counters.prompt_tokens: the running total (stats() gives a window)
        return self._counters.prompt_tokens

    @property
    def prompt_seconds(self) -> float:  # _counters.prompt_time: seconds spent reading prompt chunks, in all
        return self._counters.prompt_time

    @property
    def vectorized(self) -> bool:
        return self._generation_batch.vectorized

    @vectorized.setter
    def vectorized(self, on: bool) -> None:
        self._generation_batch.vectorized = on

    def _next(self):
        if not self.reads_first:
            prompt_responses, generation_responses = super()._next()
            if self.after_prompt_chunk is not None:
                self.after_prompt_chunk(self._prompt_batch, prompt_responses)
            return prompt_responses, generation_responses
        prompt_responses = []
        if len(self._generation_batch) < self.completion_batch_size:  # else mlx-lm only decodes
            n = min(
                self.prefill_batch_size - len(self._prompt_batch),
                self.completion_batch_size - len(self._generation_batch),
                len(self._unprocessed_sequences),
            )
            if n > 0:
                self._prompt_batch.extend(self._make_batch(n))
            # A row whose whole prompt came from the prefix cache has only its last token:
            # it starts at once, as the rows that finish reading below do.
            prompt_responses += self._start_generating()
            chunk = self._read_prompt_chunk()
            if self.after_prompt_chunk is not None:
                self.after_prompt_chunk(self._prompt_batch, chunk)
            started = self._start_generating()
            done = {r.uid for r in started}
            prompt_responses += [r for r in chunk if r.uid not in done] + started
        generation_responses = []
        if len(self._generation_batch) > 0:
            tic = time.perf_counter()
            with self._rows(self._generation_batch.uids):
                generation_responses = self._generation_batch.next()
            self._counters.decode_time += time.perf_counter() - tic
            self._counters.generation_tokens += len(generation_responses)
            self._counters.generation_steps += 1
            if self._counters.generation_steps % 512 == 0:  # as mlx-lm's step
                mx.clear_cache()
        return prompt_responses, generation_responses

    def _start_generating(self) -> list:
        """Rows read down to their last token leave the prompt batch for the decode batch;
        building their part of it runs their first forward (mlx-lm's GenerationBatch)."""
        ready = [i for i, seq in enumerate(self._currently_processing) if len(seq[0]) == 1 and len(seq[0][0]) == 1]
        if not ready:
            return []
        last_inputs = [self._currently_processing[i][0][0] for i in ready]
        totals = [self._currently_processing[i][2] for i in ready]
        keep = set(range(len(self._currently_processing))) - set(ready)
        self._currently_processing = [s for i, s in enumerate(self._currently_processing) if i in keep]
        with self._rows([self._prompt_batch.uids[i] for i in ready]):
            started = self._prompt_batch.split(ready).generate(last_inputs)
        self._generation_batch.extend(started)
        return [PromptProcessingBatch.Response(uid, (t, t), True, True) for uid, t in zip(started.uids, totals)]

    def _read_prompt_chunk(self) -> list:
        """One chunk (at most prefill_step_size tokens, within one segment) of every row
        still reading its prompt, as mlx-lm's step reads it."""
        prompts, responses = [], []
        for uid, seq in zip(self._prompt_batch.uids, self._currently_processing):
            segments = seq[0]
            n = min(len(segments[0]), self.prefill_step_size)
            prompts.append(segments[0][:n])
            segments[0] = segments[0][n:]
            response = PromptProcessingBatch.Response(uid, 0, False, False)
            if not segments[0]:
                segments.pop(0)
                response.end_of_segment = True
            seq[1] += n
            response.progress = (seq[1], seq[2])
            responses.append(response)
        self._counters.prompt_tokens += sum(len(p) for p in prompts)
        tic = time.perf_counter()
        with self._rows(self._prompt_batch.uids):
            self._prompt_batch.prompt(prompts)
        self._counters.prompt_time += time.perf_counter() - tic
        return responses

    def _rows(self, uids: list[int]) -> AbstractContextManager:
        return nullcontext() if self.route_rows is None else self.route_rows(uids)
