"""mlxgw's engine loop for bench/step/breakdown.py: the real worker Scheduler + MLXRunner kept
at a full batch of decoding rows, and a view that runs its other sampler path on the same
rows (two Schedulers on one runner would share its generator, and so each other's rows)."""

from __future__ import annotations

import time

from ...shared.events import EventKind
from .timers import Timers

PIECES = ["forward", "processors", "normalize", "sampling", "detokenize", "parse", "events", "encode", "host", "rest"]


def make_request(
    rid: str, messages: list[dict], max_tokens: int, temperature: float, stop: list[str], penalty: float = 0.0
):
    from ...shared import protocol as p

    return p.GenerateRequest(
        rid=rid,
        messages=messages,
        sampling=p.SamplingParams(temperature=temperature, frequency_penalty=penalty),
        max_tokens=max_tokens,
        stop=stop,
    )


# mlxgw's step paths, by engine name: (batch-wide sampler, log-softmax of every row, the
# worker's CPU attention (worker/model/cpu/cpu_attention.py) rather than mlx-lm's)
PATHS = {
    "mlxgw": (True, False, True),
    "mlxgw-per-row": (False, False, True),
    "mlxgw-normalise-all": (True, True, True),
    "mlxgw-mlx-attention": (True, False, False),
}
LABELS = {
    "mlxgw": "mlxgw",
    "mlxgw-per-row": "mlxgw per-row sampler",
    "mlxgw-normalise-all": "mlxgw, every row normalised",
    "mlxgw-mlx-attention": "mlxgw, mlx-lm's attention",
}


def enter_path(runner, path: str) -> None:
    from ...worker.model.cpu.cpu_attention import settings

    vectorized, normalise_all, settings.enabled = PATHS[path]
    runner.generator.vectorized, runner.generator.decode_batch.normalise_every_row = vectorized, normalise_all


class MlxgwLoop:
    """Keeps `batch` rows decoding in mlxgw's Scheduler: a row that finishes is replaced."""

    def __init__(self, runner, batch: int, args, timers: Timers, prompts: list[list[dict]], path: str):
        from ...worker.schedule.scheduler import Scheduler

        self.runner, self.batch, self.args, self.path = runner, batch, args, path
        self.name = LABELS[path]
        self.scheduler = Scheduler(runner, max_num_seqs=batch, max_queue=4 * batch)
        runner.generator.completion_batch_size = batch
        runner.generator.prefill_batch_size = batch
        # _on_token's time is the scheduler's per-token work; the text stream and parser it
        # calls are subtracted from it in split().
        self.scheduler._on_token = timers.timed("events", self.scheduler._on_token)
        self.prompts = prompts
        self.next_prompt = 0
        self.live: set[str] = set()

    def enter(self) -> None:
        enter_path(self.runner, self.path)

    def top_up(self) -> None:

        while len(self.live) < self.batch:
            i = self.next_prompt
            self.next_prompt += 1
            rid = f"b{self.batch}-{i}"
            a = self.args
            req = make_request(
                rid, self.prompts[i % len(self.prompts)], a.max_tokens, a.temperature, a.stop, a.frequency_penalty
            )
            for _, ev in self.scheduler.submit(req):
                if ev.KIND == EventKind.ERROR:
                    raise RuntimeError(f"request refused: {ev}")
            self.live.add(rid)

    def step(self) -> tuple[float, bool]:
        """One scheduler step plus the engine's encoding of its events: seconds, and whether
        it was a pure decode step of the full batch."""
        from ...worker.process.link import encode_events

        self.top_up()
        before = self.scheduler.running
        t0 = time.perf_counter()
        events = self.scheduler.step()
        if events:
            encode_events(items=events, seq=0)
        wall = time.perf_counter() - t0
        ended = {rid for rid, ev in events if ev.KIND in (EventKind.FINISH, EventKind.ERROR)}
        self.live -= ended
        decoding = sum(1 for s in self.scheduler._seqs.values() if s.phase == "decode")
        progress = any(ev.KIND == EventKind.PROGRESS for _, ev in events)
        pure = before == self.batch and decoding + len(ended) == self.batch and not ended and not progress
        return wall, pure

    def decode_batch(self):
        return self.runner.generator.decode_batch

    def split(self, acc: dict[str, float], wall: float) -> dict[str, float]:
        out = {k: acc.get(k, 0.0) for k in PIECES}
        # _on_token's timer includes the text stream and the parser it calls.
        out["events"] = max(0.0, out["events"] - out["detokenize"] - out["parse"])
        out["rest"] = max(0.0, wall - sum(out[k] for k in PIECES if k != "rest"))
        return out

    def close(self) -> None:
        for rid in list(self.live):
            self.scheduler.cancel(rid)
        self.live.clear()
        enter_path(self.runner, "mlxgw")


class SamplerView:
    """mlxgw's other sampler path on the same Scheduler and batch: two Schedulers on one
    runner would share its generator (and so each other's rows), so the paths take turns
    on one workload, switching the generator's path."""

    def __init__(self, loop: MlxgwLoop, path: str):
        self.loop, self.path = loop, path
        self.name = LABELS[path]

    def enter(self) -> None:
        enter_path(self.loop.runner, self.path)

    def step(self) -> tuple[float, bool]:
        return self.loop.step()

    def decode_batch(self):
        return self.loop.decode_batch()

    def split(self, acc: dict[str, float], wall: float) -> dict[str, float]:
        return self.loop.split(acc, wall)

    def close(self) -> None:
        """The loop it views is closed once, by make_loops's owner."""
