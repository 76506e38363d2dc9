"""Bounded places for the CPU-heavy work a request starts in the gateway.

`asyncio.to_thread` shares one default executor (a few threads on a small host) among every
caller: six requests whose PDFs took hours each held all of it, and the admin routes, the
ledger flush, large JSON bodies and audio decoding waited behind them. So each kind of request
work gets its own small pool here, and the default executor is left to the admin routes and
the ledger:

- `THREAD_POOLS[kind].run(fn, ...)`: a few daemon threads per kind (json, audio, speech, batch
  input, batch storage) and a
  bounded wait list; past it the caller gets a 429 to retry, never an unbounded queue. The
  work itself must be bounded by its caller (a body size, a measured audio length): a thread
  cannot be stopped, only kept from starving others. Daemon threads never hold up shutdown.
- `run_process_job(module, data, deadline_s)`: work that cannot be bounded beforehand (PDF
  text extraction) runs in a child process with a memory limit, killed at its deadline or
  when its request is cancelled: nothing runs on after the answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ...shared.errors import ErrorCode, ServiceError

log = logging.getLogger(__name__)


class BoundedPool:
    """`threads` daemon threads and at most `max_waiting` jobs queued behind them."""

    def __init__(self, kind: str, threads: int, max_waiting: int) -> None:
        self.kind = kind
        self.threads = threads
        self.max_waiting = max_waiting
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._admitted = 0  # running + waiting
        self._started = False
        self._lock = threading.Lock()

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            for i in range(self.threads):
                threading.Thread(target=self._serve, name=f"mlxgw-{self.kind}-{i}", daemon=True).start()
            self._started = True

    def _serve(self) -> None:
        while True:
            loop, future, fn, args = self._jobs.get()
            if future.cancelled():
                continue
            try:
                result, error = fn(*args), None
            except BaseException as e:  # handed to the awaiting request, whatever it is
                result, error = None, e
            loop.call_soon_threadsafe(_settle, future, result, error)

    @property
    def busy(self) -> int:
        return self._admitted

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._admitted >= self.threads + self.max_waiting:
            raise ServiceError(
                ErrorCode.OVERLOADED, f"the gateway's {self.kind} work is at capacity; retry in a few seconds"
            )
        self._start()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._admitted += 1
        try:
            self._jobs.put((loop, future, fn, args))
            return await future
        finally:
            self._admitted -= 1


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # its request was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


_CORES = os.cpu_count() or 2
THREAD_POOLS: dict[str, BoundedPool] = {
    "json": BoundedPool("json", threads=max(1, _CORES // 2), max_waiting=64),
    "audio": BoundedPool("audio", threads=max(1, _CORES // 2), max_waiting=32),
    "speech": BoundedPool("speech", threads=max(1, _CORES // 2), max_waiting=32),
    "image": BoundedPool("image", threads=max(1, _CORES // 2), max_waiting=32),  # edits' uploads, base64
    # Batch input files, checked line by line as a batch is created: one thread, so creations
    # never hold more than one core, and a burst of them waits here or gets a 429.
    "batch": BoundedPool("batch", threads=1, max_waiting=16),
    # The Files and Batch APIs' SQLite and file reads and writes, and each batch request's
    # line parsed as it is sent (at most BACKGROUND_IN_FLIGHT at once): off the default
    # executor, which the admin routes and the usage ledger keep.
    "batch_io": BoundedPool("batch_io", threads=2, max_waiting=256),
}


# -- child processes ---------------------------------------------------------------------------

PROCESS_JOBS = max(1, _CORES // 2)  # at most this many job processes at once, all kinds together
PROCESS_MEMORY_BYTES = 1 << 30  # address-space limit a job sets on itself
_process_slots: asyncio.Semaphore | None = None


class JobFailed(Exception):
    """The job refused its input (the message says why) or died."""


class JobTimeout(Exception):
    pass


def _slots() -> asyncio.Semaphore:
    global _process_slots
    if _process_slots is None:
        _process_slots = asyncio.Semaphore(PROCESS_JOBS)
    return _process_slots


async def run_process_job(module: str, data: bytes, deadline_s: float) -> Any:
    """Run `python -m module` with `data` on stdin; its JSON answer on stdout. The deadline
    covers the wait for a slot too; past it (or on cancellation) the child is killed."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(deadline_s):
            async with _slots():
                return await _run_child(module, data)
    except TimeoutError:
        raise JobTimeout(f"{time.monotonic() - start:.0f} s") from None


async def _run_child(module: str, data: bytes) -> Any:
    env = dict(os.environ, MLXGW_JOB_MEMORY_BYTES=str(PROCESS_MEMORY_BYTES))
    env.pop("LD_PRELOAD", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        out, err = await proc.communicate(data)
    except BaseException:  # deadline, cancellation: the child must not run on
        _kill(proc)
        await proc.wait()
        raise
    if proc.returncode != 0:
        log.warning("job %s exited with %s: %s", module, proc.returncode, err[-500:].decode(errors="replace"))
        if proc.returncode < 0 or not out:
            raise JobFailed("it ran out of memory or crashed")
    answer = json.loads(out)
    if "error" in answer:
        raise JobFailed(answer["error"])
    return answer["result"]


def _kill(proc: asyncio.subprocess.Process) -> None:
    try:
        proc.kill()
    except ProcessLookupError:
        pass


def job_main(work: Callable[[bytes], Any]) -> None:
    """The child's side: limit memory, read stdin, write {"result"} or {"error"} as JSON."""
    import resource

    limit = int(os.environ.get("MLXGW_JOB_MEMORY_BYTES") or 0)
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    data = sys.stdin.buffer.read()
    try:
        answer = {"result": work(data)}
    except MemoryError:
        answer = {"error": "it needs more memory than a request may use"}
    except Exception as e:  # the job's refusal, or a parser's error on damaged input
        answer = {"error": str(e) or type(e).__name__}
    sys.stdout.write(json.dumps(answer))
    sys.stdout.flush()
