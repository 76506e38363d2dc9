"""mlx_lm.server's own decode loop, driven in-process beside mlxgw's for bench/step/breakdown.py.

One turn of `ResponseGenerator._generate` (mlx_lm/server.py, 0.32.2) as it runs once a
batch is decoding: `BatchGenerator.next()`, then for every generated token the
detokenizer, `logprobs[token].item()`, top-logprobs formatting and a `Response` put on the
request's queue. Built as the server builds it: one BatchGenerator with completion and
prefill batch = the batch measured, mlx_lm.server's default prefill step (2048), one sampler
object per request (mlx_lm.server makes one per request, so GenerationBatch samples row by
row). Left out, because they run on other threads or not per step: the HTTP handler thread
that reads the queue (text state machine, tool parsing, SSE), the prompt cache's
bookkeeping when a request ends, and the `TimeBudget` loop around turns (it only decides
how many turns run before the loop looks for new requests)."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

SERVER_PREFILL_STEP = 2048  # mlx_lm.server --prefill-step-size default


def timed_sampler(sampler: Callable, timers, mx) -> Callable:
    """A request's sampler with the batch's logsumexp (evaluated first: "normalize") and the
    draw itself ("sampling") timed while the timers are on."""

    def run(logprobs):
        if not timers.on:
            return sampler(logprobs)
        t0 = time.perf_counter()
        mx.eval(logprobs)
        t1 = time.perf_counter()
        out = sampler(logprobs)
        mx.eval(out)
        timers.add("normalize", t1 - t0)
        timers.add("sampling", time.perf_counter() - t1)
        return out

    return run


class MlxLmLoop:
    """Keeps `batch` rows decoding in mlx-lm's BatchGenerator, the server's way: a row that
    finishes is replaced by a fresh request."""

    name = "mlx_lm.server loop"

    def __init__(self, model, tokenizer, batch: int, args, timers, prompts: list[list[dict]]):
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator
        from mlx_lm.sample_utils import make_sampler

        self.mx, self.timers, self.batch, self.args = mx, timers, batch, args
        self.tokenizer = tokenizer
        self.make_sampler = lambda: timed_sampler(make_sampler(temp=args.temperature), timers, mx)
        self.generator = BatchGenerator(
            model,  # the same (timed) model object mlxgw's runner calls: one set of weights
            stop_tokens=[[t] for t in tokenizer.eos_token_ids],
            completion_batch_size=batch,
            prefill_batch_size=batch,
            prefill_step_size=SERVER_PREFILL_STEP,
        )
        self.prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in prompts]
        self.next_prompt = 0
        self.live: dict[int, dict] = {}

    def enter(self) -> None:
        """This loop has its own generator; its model calls get mlx-lm's own attention, as
        in mlx_lm.server (the worker's CPU attention is routed in process-wide)."""
        from ...worker.model.cpu.cpu_attention import settings

        settings.enabled = False

    def top_up(self) -> None:
        while len(self.live) < self.batch:
            tokens = self.prompts[self.next_prompt % len(self.prompts)]
            self.next_prompt += 1
            (uid,) = self.generator.insert([tokens], max_tokens=[self.args.max_tokens], samplers=[self.make_sampler()])
            self.live[uid] = {"detokenizer": self.tokenizer.detokenizer, "rqueue": queue.SimpleQueue()}

    def step(self) -> tuple[float, bool]:
        """One turn of the server's loop: seconds, and whether the whole batch decoded."""
        self.top_up()
        t0 = time.perf_counter()
        prompt_responses, gen_responses = self.generator.next()
        h0 = time.perf_counter()
        finished = self._serve(gen_responses)
        end = time.perf_counter()
        if self.timers.on:
            self.timers.add("host", end - h0)
        pure = not prompt_responses and len(gen_responses) == self.batch and not finished
        return end - t0, pure

    def _serve(self, gen_responses) -> int:
        """The server's per-token work for one turn (server.py, `for r in gen_responses`)."""
        from mlx_lm.server import Response, _format_top_logprobs

        finished = 0
        for r in gen_responses:
            result = self.live[r.uid]
            if r.finish_reason == "stop":
                result["detokenizer"].finalize()
            elif r.finish_reason == "length":
                result["detokenizer"].add_token(r.token)
                result["detokenizer"].finalize()
            else:
                result["detokenizer"].add_token(r.token)
            text = result["detokenizer"].last_segment
            result["rqueue"].put(
                Response(
                    text,
                    r.token,
                    r.logprobs[r.token].item(),
                    r.finish_reason,
                    _format_top_logprobs(r.logprobs, 0, self.tokenizer),
                )
            )
            if r.finish_reason is not None:
                result["rqueue"].put(None)
                del self.live[r.uid]
                finished += 1
        return finished

    def decode_batch(self):
        return self.generator._generation_batch

    def split(self, acc: dict[str, float], wall: float) -> dict[str, float]:
        """This turn's pieces: forward, normalize, sampling, host (the per-token loop), rest
        (mlx-lm's batch bookkeeping inside next())."""
        from .mlxgw_loop import PIECES

        out = {k: acc.get(k, 0.0) for k in PIECES}  # mlxgw's own pieces stay 0 here
        out["rest"] = max(0.0, wall - sum(v for k, v in out.items() if k != "rest"))
        return out

    def close(self) -> None:
        self.generator.remove(list(self.live))
        self.live.clear()
        self.generator.close()
