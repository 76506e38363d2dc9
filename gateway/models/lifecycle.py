"""The model lifecycle's vocabulary: slot states, the slot record, crash history, and a
Pulse that wakes waiters on every transition (instead of polling).

A slot moves only along these edges (manager.py makes each one):

    UNLOADED --start--> LOADING --worker ready--> READY
    LOADING/READY --planned stop (evict, idle, reload, shutdown)--> DRAINING --exit--> UNLOADED
    LOADING/READY --crash--> RESTARTING --backoff--> LOADING
    LOADING/READY --crash loop--> FAILED --long backoff, or `mlxgw reload`--> UNLOADED

One lifecycle task per slot makes every LOADING edge, so a model never loads twice at once;
a planned stop is recorded before its signal is sent, so it is never counted as a crash."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from ...shared.errors import ServiceError
from ...shared.model_sections import ModelEntry


class SlotState(str, Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    RESTARTING = "restarting"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


class Pulse:
    """Wakes every waiter at the next fire. Check the condition, then wait: with one event
    loop nothing can fire between the two, so no wake-up is lost."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float | None = None) -> bool:
        """True when fired, False when the timeout passed first."""
        event = self._event
        try:
            await asyncio.wait_for(event.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


@dataclass
class CrashHistory:
    """Exits nobody asked for, in a sliding window; too many in it is a crash loop."""

    window_s: float = 120.0
    max_crashes: int = 4
    max_backoff_s: float = 30.0
    times: deque = field(default_factory=deque)
    loops: int = 0  # crash loops in a row (each one doubles the wait before the next try)

    def record(self, now: float) -> int:
        self.times.append(now)
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        return len(self.times)

    @property
    def looping(self) -> bool:
        return len(self.times) >= self.max_crashes

    def backoff_s(self, base_s: float) -> float:
        """base_s (the manager's restart_backoff_s), doubled per crash in the window."""
        return min(base_s * 2 ** (len(self.times) - 1), self.max_backoff_s)

    def clear(self) -> None:
        self.times.clear()


@dataclass(eq=False)
class ModelSlot:
    entry: ModelEntry
    state: SlotState = SlotState.UNLOADED
    process: object | None = None  # the WorkerProcess this slot's lifecycle task started
    task: asyncio.Task | None = None  # the lifecycle task: the only one that spawns for this slot
    stop_reason: str | None = None  # set before a planned stop's signal: its exit is not a crash
    admitted: bool = False  # counted against the memory budget (from admission to exit)
    predecessor: ModelSlot | None = None  # a reload's old slot: load only once it has drained
    attempts: int = 0  # lifecycle runs started
    failed_attempt: int = 0  # the run whose load_error waiters should see
    load_error: ServiceError | None = None
    last_error: str | None = None
    crashes: CrashHistory = field(default_factory=CrashHistory)
    failed_until: float = 0.0
    retry_now: bool = False  # `mlxgw reload` asks a failed slot to try again
    restarts: int = 0
    crash_count: int = 0  # exits nobody asked for, watchdog kills not included
    watchdog_kills: int = 0  # workers killed for no progress or silence (never a request's fault)
    decode_tokens_per_s: float | None = None  # one stream's decode rate, smoothed (generation.py)
    kill_reason: str | None = None  # set when the watchdog kills this slot's worker
    loads: int = 0
    unloads: int = 0
    last_used: float = field(default_factory=time.monotonic)
    ready_since: float | None = None
    loading_since: float | None = None  # monotonic time of the last UNLOADED/RESTARTING -> LOADING
    load_seconds: float | None = None
    measured_bytes: int | None = None  # peak RSS seen for this model's worker (its process tree)
    tree: object | None = None  # the worker's processes, measured by the gateway (worker_memory.py)
    context_warning: str | None = None  # context_length above what the model supports
    retired: bool = False  # removed or replaced by a reload: never started again
    # Monotonic time before which idle unloading and eviction leave the model (Ollama's
    # keep_alive, through ModelManager.keep_loaded).
    keep_until: float = 0.0
    # Requests inside ModelManager.acquire for this model. A ready model that requests are
    # waiting for is about to be used: evicting it before they start made loads thrash.
    waiters: int = 0
    wake: Pulse = field(default_factory=Pulse)  # interrupts the lifecycle task's waits
    # `routing.replicas`: this slot runs replica 0 and holds the others (each a slot of its
    # own: its own worker, lifecycle, health and memory budget; one pool for requests).
    replica: int = 0
    extra: list[ModelSlot] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def worker_id(self) -> str | None:
        return getattr(self.process, "worker_id", None)

    @property
    def label(self) -> str:
        """Its worker's name in the model's pool (stable over restarts: gateway/link/pool.py)."""
        return f"{self.name}#{self.replica}"

    @property
    def replicas(self) -> list[ModelSlot]:
        return [self, *self.extra]

    @property
    def stopping(self) -> bool:
        return self.stop_reason is not None


def new_slot(entry: ModelEntry, predecessor: ModelSlot | None = None) -> ModelSlot:
    """A model's slot with its other replicas (each waits for the same replica of a reload's
    old slot to drain)."""
    slot = ModelSlot(entry, predecessor=predecessor)
    old = predecessor.replicas if predecessor is not None else []
    for i in range(1, entry.routing.replicas):
        before = old[i] if i < len(old) and old[i].task is not None else None
        slot.extra.append(ModelSlot(entry, predecessor=before, replica=i))
    return slot
