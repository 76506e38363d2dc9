"""Request preparation off the engine thread.

Templating a chat, tokenizing a prompt of megabytes, compiling a grammar: each can take
seconds, and on the engine thread they would stall every running stream of the model for
that long. A small pool prepares requests between `submit` and admission; the engine
collects what is ready at each loop turn. Tokenizers (Rust) and MLX release the GIL, and a
Jinja render yields it every switch interval, so decoding continues meanwhile.

The watchdog sees this phase too: `busy_s` is how long the oldest preparation in progress
has run, and the link reports it in each heartbeat like an engine step."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Job:
    future: Future
    started: list[float] = field(default_factory=list)  # set by the pool thread when it begins


class Preprocessor:
    def __init__(self, threads: int = 1):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="worker-prepare")
        self._jobs: dict[str, _Job] = {}
        self._calls: list[_Job] = []  # worker calls (tokenize) queued or running
        self._fresh: list[Future] = []  # preparations submitted since the last settle

    def submit(self, rid: str, fn: Callable[[], Any]) -> None:
        job = _Job(Future())

        def run() -> Any:
            job.started.append(time.monotonic())
            return fn()

        job.future = self._pool.submit(run)
        self._jobs[rid] = job
        self._fresh.append(job.future)

    def settle(self, timeout_s: float) -> None:
        """Wait up to timeout_s for the preparations submitted since the last settle (each
        is waited for once: a long one does not hold every step)."""
        fresh, self._fresh = self._fresh, []
        if fresh and timeout_s > 0:
            wait(fresh, timeout=timeout_s)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run a worker call (tokenize) on the preparation thread: the engine thread never
        tokenizes megabytes, and one thread keeps the tokenizer single-user. Watched as a
        preparation (busy_s); the engine replies once the future is done."""
        job = _Job(Future())

        def run() -> Any:
            job.started.append(time.monotonic())
            try:
                return fn()
            finally:
                self._calls.remove(job)

        self._calls.append(job)
        job.future = self._pool.submit(run)
        return job.future

    def discard(self, rid: str) -> bool:
        """Forget a request (cancelled); a preparation already running finishes unseen."""
        job = self._jobs.pop(rid, None)
        if job is None:
            return False
        job.future.cancel()
        return True

    def ready(self) -> list[tuple[str, Any, BaseException | None]]:
        """(request id, result, exception) of every finished preparation, in submit order."""
        done = [(rid, job) for rid, job in self._jobs.items() if job.future.done()]
        out = []
        for rid, job in done:
            del self._jobs[rid]
            error = job.future.exception()
            out.append((rid, None if error else job.future.result(), error))
        return out

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, rid: str) -> bool:
        return rid in self._jobs

    def busy_s(self) -> float:
        now = time.monotonic()
        jobs = [*self._jobs.values(), *list(self._calls)]
        running = [now - job.started[0] for job in jobs if job.started and not job.future.done()]
        return max(running, default=0.0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
