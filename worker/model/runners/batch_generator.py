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
private state (mlx-lm 0.32.2 has no public reading of it): others read it through its properties.

Two decode batches. mlx-lm keeps one decode batch, its KV left-padded to its longest row, so
every row attends over that length, and a row joining or leaving copies the whole batch's KV
to the new width. An editor's keystroke carries its file (~4,000 tokens): beside 24 agent rows
of ~600 tokens, their decode step went from 0.37-0.41 s to 0.81 s, and with keystrokes joining
and leaving five times a second, to 1.9-3.4 s (measured in-process on Qwen2.5-Coder-0.5B;
docs/benchmarks.md, "Why no keystroke was answered"). So a starting row may decode in a second
batch beside mlx-lm's: one more forward a step (`forward_tokens`, its fixed cost in tokens of
attention) where that costs less than padding the other rows to it (`side_is_cheaper`). The
side batch decodes without drafts (the speculator wraps mlx-lm's batch only)."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch

from .batch_sampler import VectorGenerationBatch


def side_is_cheaper(length: int, main: tuple[int, int], side: tuple[int, int], forward_tokens: int) -> bool:
    """Whether a row of `length` tokens adds less to a decode step in the side batch than in
    mlx-lm's. A batch is (rows, width): a step attends over rows x width (the KV is padded to
    the widest row); an empty batch costs a forward of its own, `forward_tokens`."""

    def added(rows: int, width: int) -> int:
        if rows == 0:
            return forward_tokens + length
        return (rows + 1) * max(width, length) - rows * width

    return added(*side) < added(*main)


def _shape(batch) -> tuple[int, int]:
    # tokens: each row's tokens in the KV (mlx-lm keeps them so), so the widest is the padded width
    return len(batch), max((len(t) for t in batch.tokens), default=0)


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
    # A decode forward's fixed cost in tokens of attention (one row attending over one token),
    # or None: one decode batch, as mlx-lm's (worker/process/build_mlx.py sets it).
    forward_tokens: int | None = None

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self._generation_batch = VectorGenerationBatch.empty(self.model, self.sampler)
        self._side_batch = VectorGenerationBatch.empty(self.model, self.sampler)
        self.side_started = 0  # rows that started in the side batch, in all (the runner's stats)

    # mlx-lm 0.32.2 BatchGenerator._generation_batch: the decode batch the speculator wraps and the trace reads
    @property
    def decode_batch(self):
        return self._generation_batch

    @property
    def decoding(self) -> int:  # rows decoding, in both batches
        return len(self._generation_batch) + len(self._side_batch)

    @property
    def side_rows(self) -> int:
        return len(self._side_batch)

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
        self._generation_batch.vectorized = self._side_batch.vectorized = on

    @property
    def prompt_cache_nbytes(self) -> int:
        return super().prompt_cache_nbytes + sum(c.nbytes for c in self._side_batch.prompt_cache)

    def _in_side(self, uids) -> dict[int, int]:  # uid -> its index in the side batch
        wanted = set(uids)
        return {uid: i for i, uid in enumerate(self._side_batch.uids) if uid in wanted}

    def extract_cache(self, uids):
        side = self._in_side(uids)
        found = super().extract_cache([uid for uid in uids if uid not in side])
        batch = self._side_batch
        return found | {uid: (batch.extract_cache(i), batch.tokens[i]) for uid, i in side.items()}

    def remove(self, uids, return_prompt_caches=False):
        caches = self.extract_cache(uids) if return_prompt_caches else {}
        side = self._in_side(uids)
        super().remove([uid for uid in uids if uid not in side])
        if side:
            self._side_batch.filter(sorted(set(range(len(self._side_batch))) - set(side.values())))
        return caches

    def _next(self):
        if not self.reads_first:
            prompt_responses, generation_responses = super()._next()
            if self.after_prompt_chunk is not None:
                self.after_prompt_chunk(self._prompt_batch, prompt_responses)
            return prompt_responses, generation_responses
        prompt_responses = []
        if self.decoding < self.completion_batch_size:  # else mlx-lm only decodes
            n = min(
                self.prefill_batch_size - len(self._prompt_batch),
                self.completion_batch_size - self.decoding,
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
        if self.decoding > 0:
            tic = time.perf_counter()
            for batch in (self._generation_batch, self._side_batch):
                if len(batch) > 0:
                    with self._rows(batch.uids):
                        generation_responses += batch.next()
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
        to_side = self._place([len(self._prompt_batch.tokens[i]) + 1 for i in ready])
        taken = self._prompt_batch.split(ready)  # the ready rows, in their order
        side = [k for k, s in enumerate(to_side) if s]
        parts = [(self._generation_batch, taken, [k for k, s in enumerate(to_side) if not s])]
        if side:  # taken keeps the others
            parts.append((self._side_batch, taken.split(side), side))
            self.side_started += len(side)
        responses = []
        for batch, part, rows in parts:
            if not rows:
                continue
            with self._rows(part.uids):
                started = part.generate([last_inputs[k] for k in rows])
            batch.extend(started)
            done = [(totals[k], totals[k]) for k in rows]
            responses += [PromptProcessingBatch.Response(u, d, True, True) for u, d in zip(started.uids, done)]
        return responses

    def _place(self, lengths: list[int]) -> list[bool]:
        """Which starting rows decode in the side batch (True), in order, each decided with
        the rows placed before it."""
        if self.forward_tokens is None:
            return [False] * len(lengths)
        main, side, placed = _shape(self._generation_batch), _shape(self._side_batch), []
        for n in lengths:
            to_side = side_is_cheaper(n, main, side, self.forward_tokens)
            rows, width = side if to_side else main
            grown = (rows + 1, max(width, n))
            main, side = (main, grown) if to_side else (grown, side)
            placed.append(to_side)
        return placed

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
