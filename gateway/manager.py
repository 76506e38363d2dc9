"""Model slots: which models have a worker, loading on demand, unloading, restarts.

Each configured model has a slot: unloaded -> loading -> ready -> draining -> unloaded,
with restarting after a crash and failed after a crash loop. Concurrent first requests
share one load. A crashed worker's requests have already ended with an error (the broker
saw to that); the slot restarts it with exponential backoff. What may be resident, and
what must leave to make room, is the Residency policy's call (gateway/residency.py)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from mlxgw.shared.config import ModelEntry, Registry
from mlxgw.shared.errors import ErrorCode, ServiceError

from .broker import Broker, WorkerConn
from .residency import Residency
from .supervisor import WorkerProcess, spawn_worker

log = logging.getLogger("mlxgw.manager")

CRASH_WINDOW_S = 120.0
MAX_CRASHES = 4  # within the window -> failed
STOP_GRACE_S = 30.0


@dataclass(eq=False)
class ModelSlot:
    entry: ModelEntry
    state: str = "unloaded"  # unloaded | loading | ready | restarting | draining | failed
    process: WorkerProcess | None = None
    exited: asyncio.Event | None = None  # set when the current local process has ended
    loading: asyncio.Future | None = None
    last_error: str | None = None
    crashes: deque = field(default_factory=deque)
    restarts: int = 0
    loads: int = 0
    unloads: int = 0
    last_used: float = field(default_factory=time.monotonic)
    load_seconds: float | None = None
    measured_bytes: int | None = None  # peak RSS seen for this model's worker
    retired: bool = False  # removed or replaced by a reload: never restarted
    keep_until: float = 0.0  # monotonic time before which idle unloading and eviction leave it (keep_loaded)

    @property
    def name(self) -> str:
        return self.entry.name


class ModelManager:
    def __init__(self, registry: Registry, broker: Broker):
        self.registry = registry
        self.broker = broker
        self.slots: dict[str, ModelSlot] = {e.name: ModelSlot(e) for e in registry.models}
        self.retiring: set[ModelSlot] = set()
        self.residency = Residency(self)
        self._tasks: set[asyncio.Task] = set()
        self.closing = False
        broker.on_ready = self._on_ready
        broker.on_lost = self._on_lost
        broker.on_load_failed = self._on_load_failed

    # -- lookup ------------------------------------------------------------------------------
    def resolve(self, requested: str) -> ModelSlot:
        entry = self.registry.entry(requested)
        if entry is None or entry.name not in self.slots:
            raise ServiceError(
                ErrorCode.MODEL_NOT_FOUND,
                f"The model '{requested}' does not exist. GET /v1/models lists the models served here.",
                param="model",
            )
        return self.slots[entry.name]

    def conns(self, slot: ModelSlot) -> list[WorkerConn]:
        return [c for c in self.broker.conns.values() if c.model == slot.name]

    def local_conns(self, slot: ModelSlot) -> list[WorkerConn]:
        wid = slot.process.worker_id if slot.process else None
        return [c for c in self.conns(slot) if c.worker_id == wid]

    def keep_loaded(self, slot: ModelSlot, seconds: float) -> None:
        """Hold the model against idle unloading and eviction for `seconds` from now (Ollama's
        keep_alive; math.inf: until unloaded explicitly). The latest request's value wins."""
        slot.keep_until = time.monotonic() + seconds

    def in_flight(self, slot: ModelSlot) -> int:
        return sum(c.load for c in self.conns(slot))

    async def acquire(
        self, slot: ModelSlot, on_wait: Callable[[], Awaitable[None]] | None = None, wait_tick_s: float = 5.0
    ) -> WorkerConn:
        """A ready worker for the model, loading it first if needed. on_wait runs every
        wait_tick_s while the load is under way (streaming clients get keep-alives)."""
        slot.last_used = time.monotonic()
        conn = self.broker.least_loaded(slot.name)
        if conn is not None:
            return conn
        if self.closing or slot.retired:
            raise ServiceError(ErrorCode.MODEL_UNAVAILABLE, f"model {slot.name} is going away", retry_after=5)
        if slot.state == "failed":
            raise ServiceError(
                ErrorCode.MODEL_UNAVAILABLE, f"model {slot.name} failed: {slot.last_error}", retry_after=30
            )
        if slot.entry.remote_only:
            raise ServiceError(
                ErrorCode.MODEL_UNAVAILABLE,
                f"no worker is connected for model {slot.name} (it is served by remote workers)",
                retry_after=10,
            )
        if slot.state == "draining" and slot.exited is not None:
            # A new process must not start while the last one exits: its exit would read as a
            # crash of the new one (a restart, and an orphaned worker). unload() bounds the wait.
            await slot.exited.wait()
        if slot.loading is None or slot.loading.done():
            self._start_load(slot)
        deadline = time.monotonic() + self.registry.manager.load_timeout_seconds
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ServiceError(
                    ErrorCode.MODEL_UNAVAILABLE, f"model {slot.name} did not load in time", retry_after=10
                )
            done, _ = await asyncio.wait({slot.loading}, timeout=min(wait_tick_s, remaining))
            if done:
                slot.loading.result()  # raises the load's error
                break
            if on_wait is not None:
                await on_wait()
        conn = self.broker.least_loaded(slot.name)
        if conn is None:
            raise ServiceError(ErrorCode.MODEL_UNAVAILABLE, f"model {slot.name} is not available", retry_after=2)
        return conn

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        for slot in self.slots.values():
            if slot.entry.preload and not slot.entry.remote_only:
                self._start_load(slot)
        self._spawn_task(self.residency.run())

    async def wait_preloaded(self) -> None:
        for slot in list(self.slots.values()):
            if slot.entry.preload and slot.loading is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(slot.loading), self.registry.manager.load_timeout_seconds)
                except (ServiceError, asyncio.TimeoutError) as e:  # reported in /health; the rest still serve
                    log.error("preloading %s failed: %s", slot.name, e)

    async def close(self) -> None:
        self.closing = True
        slots = [s for s in (*self.slots.values(), *self.retiring) if s.process and s.process.running]
        await asyncio.gather(*(self.unload(s, "gateway shutting down") for s in slots), return_exceptions=True)
        for t in list(self._tasks):  # after the unloads: the load tasks are what see processes exit
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def unload(self, slot: ModelSlot, reason: str) -> None:
        """End the slot's local worker: it finishes its requests in flight, then exits."""
        proc, exited = slot.process, slot.exited
        if proc is None or exited is None:
            return
        log.info("unloading %s: %s", slot.name, reason)
        slot.state = "draining"
        for conn in self.local_conns(slot):
            conn.state = "draining"  # route nothing new to it
        proc.signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(exited.wait(), STOP_GRACE_S)
        except asyncio.TimeoutError:
            log.warning("worker for %s did not drain in %g s; killing it", slot.name, STOP_GRACE_S)
            proc.signal(signal.SIGKILL)
            await proc.wait()
        slot.unloads += 1

    async def reload(self, registry: Registry) -> dict:
        """Apply a new registry: added models appear, removed ones drain and stop, changed
        ones drain and come back with their new settings."""
        self.registry = registry
        added, removed, changed = [], [], []
        for name, slot in list(self.slots.items()):
            entry = next((e for e in registry.models if e.name == name), None)
            if entry == slot.entry:
                continue
            was_resident = slot.process is not None
            self._retire(slot)
            if entry is None:
                removed.append(name)
                continue
            changed.append(name)
            self.slots[name] = fresh = ModelSlot(entry)
            self._spawn_task(self._replace(slot, fresh, was_resident or entry.preload))
        for entry in registry.models:
            if entry.name not in self.slots:
                added.append(entry.name)
                self.slots[entry.name] = ModelSlot(entry)
                if entry.preload and not entry.remote_only:
                    self._start_load(self.slots[entry.name])
        log.info("reloaded registry: added %s, removed %s, changed %s", added, removed, changed)
        return {"added": added, "removed": removed, "changed": changed}

    def _retire(self, slot: ModelSlot) -> None:
        slot.retired = True
        del self.slots[slot.name]
        for conn in self.conns(slot):
            if conn not in self.local_conns(slot):  # remote workers drain and exit too
                self._spawn_task(self.broker.shutdown_worker(conn))
        if slot.process is not None:
            self.retiring.add(slot)
            self._spawn_task(self._drain_retired(slot))

    async def _drain_retired(self, slot: ModelSlot) -> None:
        try:
            await self.unload(slot, "removed or changed by a registry reload")
        finally:
            self.retiring.discard(slot)

    async def _replace(self, old: ModelSlot, fresh: ModelSlot, load: bool) -> None:
        while old in self.retiring:
            await asyncio.sleep(0.1)
        if load and not fresh.retired and not fresh.entry.remote_only:
            self._start_load(fresh)

    def _spawn_task(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start_load(self, slot: ModelSlot, delay: float = 0.0) -> None:
        slot.loading = asyncio.get_running_loop().create_future()
        slot.loading.add_done_callback(lambda f: f.cancelled() or f.exception())
        slot.state = "loading" if delay == 0 else "restarting"
        self._spawn_task(self._load(slot, delay))

    async def _load(self, slot: ModelSlot, delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)
        if slot.retired or self.closing:
            self._fail_load(slot, "model removed", permanent=False)
            return
        slot.state = "loading"
        path = slot.entry.model_path(self.registry.models_dir)
        if slot.entry.engine == "mlx" and not (path / "config.json").exists():
            self._fail_load(slot, f"no model at {path} (import it with `mlxgw models import`)", permanent=True)
            return
        try:
            await self.residency.admit(slot)
        except ServiceError as e:
            slot.state = "unloaded"
            self._fail_load(slot, e.message, permanent=False, retry_after=e.retry_after)
            return
        m = self.registry.manager
        slot.loads += 1
        slot.exited = asyncio.Event()
        proc = await spawn_worker(
            self.broker.endpoint, slot.entry, path, heartbeat_s=m.heartbeat_s, liveness=m.liveness
        )
        slot.process = proc
        code = await proc.wait()
        slot.process = None
        for conn in [c for c in self.broker.conns.values() if c.worker_id == proc.worker_id]:
            self.broker.drop(conn, f"process exited with code {code}", notify=False)
        slot.exited.set()
        self._after_exit(slot, code)

    def _after_exit(self, slot: ModelSlot, code: int) -> None:
        if self.closing or slot.retired or slot.state in ("draining", "unloaded"):
            slot.state = "unloaded"
            if slot.loading is not None and not slot.loading.done():
                self._fail_load(slot, "the model was unloaded while loading", permanent=False)
            return
        if slot.state == "failed":
            return
        was_loading = slot.loading is not None and not slot.loading.done()
        now = time.monotonic()
        slot.crashes.append(now)
        while slot.crashes and now - slot.crashes[0] > CRASH_WINDOW_S:
            slot.crashes.popleft()
        if not (was_loading and slot.last_error):
            slot.last_error = f"worker exited with code {code}"
        if len(slot.crashes) >= MAX_CRASHES:
            self._fail_load(
                slot,
                f"crash loop: {len(slot.crashes)} exits in {CRASH_WINDOW_S:g} s; last: {slot.last_error}",
                permanent=True,
            )
            return
        backoff = min(2 ** (len(slot.crashes) - 1), 30)
        log.warning("worker for %s exited (code %s); restarting in %d s", slot.name, code, backoff)
        slot.restarts += 1
        if was_loading:
            slot.state = "restarting"  # waiters keep waiting on the same future
            self._spawn_task(self._load(slot, backoff))
        else:
            self._start_load(slot, delay=backoff)

    def _fail_load(self, slot: ModelSlot, message: str, permanent: bool, retry_after: float | None = 30) -> None:
        if permanent:
            slot.state = "failed"
            slot.last_error = message
        elif slot.last_error is None:
            slot.last_error = message
        if slot.loading is not None and not slot.loading.done():
            slot.loading.set_exception(
                ServiceError(ErrorCode.MODEL_UNAVAILABLE, f"model {slot.name}: {message}", retry_after=retry_after)
            )

    # -- broker callbacks ----------------------------------------------------------------------------
    def _on_ready(self, conn: WorkerConn) -> None:
        slot = self.slots.get(conn.model)
        if slot is None:
            log.warning("worker %s serves unknown model %s; ignoring it", conn.worker_id, conn.model)
            return
        if slot.state != "draining":
            slot.state = "ready"
        slot.last_error = None
        slot.load_seconds = conn.info.get("load_seconds", slot.load_seconds)
        if slot.loading is not None and not slot.loading.done():
            slot.loading.set_result(conn)

    def _on_load_failed(self, conn: WorkerConn, error: dict) -> None:
        slot = self.slots.get(conn.model)
        if slot is not None:
            slot.last_error = str(error.get("message", "load failed"))

    def _on_lost(self, conn: WorkerConn, reason: str) -> None:
        slot = self.slots.get(conn.model)
        if slot is None or slot.state == "draining":
            return  # gone, or leaving because we asked it to: not an error
        slot.last_error = reason
        proc = slot.process
        if proc is not None and proc.worker_id == conn.worker_id and proc.running:
            # Silent or hung: make sure the process is really gone; _load sees it exit.
            proc.signal(signal.SIGKILL)
        elif proc is None and not self.conns(slot) and slot.state == "ready":
            slot.state = "unloaded"  # its last remote worker left

    # -- reporting ---------------------------------------------------------------------------------
    def describe(self, slot: ModelSlot) -> dict:
        workers = self.conns(slot)
        in_flight = self.in_flight(slot)
        return {
            "name": slot.name,
            "kind": slot.entry.kind,
            "state": slot.state,
            "loaded": any(c.state == "ready" for c in workers),
            "aliases": slot.entry.aliases,
            "pinned": slot.entry.pin,
            "last_error": slot.last_error,
            "loads": slot.loads,
            "unloads": slot.unloads,
            "restarts": slot.restarts,
            "load_seconds": slot.load_seconds,
            "in_flight": in_flight,
            "idle_s": round(time.monotonic() - slot.last_used, 1) if in_flight == 0 else 0.0,
            "memory_bytes": self.residency.footprint(slot) if slot.process else 0,
            "expected_bytes": self.residency.expected(slot),
            "workers": [
                {
                    "worker_id": c.worker_id,
                    "pid": c.pid,
                    "state": c.state,
                    "in_flight": c.load,
                    "local": slot.process is not None and c.worker_id == slot.process.worker_id,
                    "context_length": c.info.get("context_length"),
                    "stats": c.stats,
                }
                for c in workers
            ],
        }
