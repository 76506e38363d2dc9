"""Model residency: which models have a worker, loading on demand, restarts after crashes.

Each configured model has a slot with a state: unloaded -> loading -> ready, and back to
unloaded when its worker stops; failed after a crash loop. Concurrent first requests
share one load. A crashed worker's requests already ended with an error (the broker saw
to that); the slot restarts it with exponential backoff."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from shared.config import ModelEntry, Registry
from shared.errors import ErrorCode, ServiceError

from .broker import Broker, WorkerConn
from .supervisor import WorkerProcess, spawn_worker

log = logging.getLogger("mlxgw.manager")

CRASH_WINDOW_S = 120.0
MAX_CRASHES = 4  # within the window -> failed
STOP_GRACE_S = 10.0


@dataclass
class ModelSlot:
    entry: ModelEntry
    state: str = "unloaded"  # unloaded | loading | ready | restarting | failed | draining
    process: WorkerProcess | None = None
    loading: asyncio.Future | None = None
    last_error: str | None = None
    crashes: deque = field(default_factory=deque)
    restarts: int = 0
    loads: int = 0
    last_used: float = 0.0
    load_seconds: float | None = None

    @property
    def name(self) -> str:
        return self.entry.name


class ModelManager:
    def __init__(self, registry: Registry, broker: Broker):
        self.registry = registry
        self.broker = broker
        self.slots: dict[str, ModelSlot] = {e.name: ModelSlot(e) for e in registry.models}
        self._tasks: set[asyncio.Task] = set()
        self.closing = False
        broker.on_ready = self._on_ready
        broker.on_lost = self._on_lost
        broker.on_load_failed = self._on_load_failed

    # -- lookup ------------------------------------------------------------------------------
    def resolve(self, requested: str) -> ModelSlot:
        entry = self.registry.entry(requested)
        if entry is None:
            raise ServiceError(
                ErrorCode.MODEL_NOT_FOUND,
                f"The model '{requested}' does not exist. GET /v1/models lists the models served here.",
                param="model",
            )
        return self.slots[entry.name]

    async def acquire(self, slot: ModelSlot) -> WorkerConn:
        """A ready worker for the model, loading it first if needed."""
        slot.last_used = time.monotonic()
        conn = self.broker.least_loaded(slot.name)
        if conn is not None:
            return conn
        if self.closing:
            raise ServiceError(ErrorCode.MODEL_UNAVAILABLE, "the server is shutting down", retry_after=5)
        if slot.state == "failed":
            raise ServiceError(
                ErrorCode.MODEL_UNAVAILABLE, f"model {slot.name} failed: {slot.last_error}", retry_after=30
            )
        if slot.loading is None or slot.loading.done():
            self._start_load(slot)
        timeout = self.registry.manager.load_timeout_seconds
        try:
            await asyncio.wait_for(asyncio.shield(slot.loading), timeout)
        except asyncio.TimeoutError:
            raise ServiceError(
                ErrorCode.MODEL_UNAVAILABLE, f"model {slot.name} did not load within {timeout:g} s", retry_after=10
            ) from None
        conn = self.broker.least_loaded(slot.name)
        if conn is None:
            raise ServiceError(ErrorCode.MODEL_UNAVAILABLE, f"model {slot.name} is not available", retry_after=2)
        return conn

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        for slot in self.slots.values():
            if slot.entry.preload:
                self._start_load(slot)

    async def wait_preloaded(self) -> None:
        for slot in self.slots.values():
            if slot.entry.preload and slot.loading is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(slot.loading), self.registry.manager.load_timeout_seconds)
                except Exception as e:  # reported in /health; the gateway still serves the rest
                    log.error("preloading %s failed: %s", slot.name, e)

    async def close(self) -> None:
        self.closing = True
        for t in list(self._tasks):
            t.cancel()
        procs = [s.process for s in self.slots.values() if s.process and s.process.running]
        for s in self.slots.values():
            s.state = "draining" if s.process else s.state
        await asyncio.gather(*(p.stop(STOP_GRACE_S) for p in procs), return_exceptions=True)

    def _spawn_task(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start_load(self, slot: ModelSlot, delay: float = 0.0) -> None:
        slot.loading = asyncio.get_running_loop().create_future()
        slot.loading.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)
        slot.state = "loading" if delay == 0 else "restarting"
        self._spawn_task(self._load(slot, delay))

    async def _load(self, slot: ModelSlot, delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)
            slot.state = "loading"
        path = slot.entry.model_path(self.registry.models_dir)
        if slot.entry.engine == "mlx" and not (path / "config.json").exists():
            self._fail_load(slot, f"no model at {path} (import it with `mlxgw models import`)", permanent=True)
            return
        m = self.registry.manager
        slot.loads += 1
        proc = await spawn_worker(
            self.broker.endpoint, slot.entry, path, heartbeat_s=m.heartbeat_s, liveness=m.liveness
        )
        slot.process = proc
        code = await proc.wait()
        # The process ended: whatever it was doing is over.
        if slot.process is proc:
            slot.process = None
        for conn in [c for c in self.broker.conns.values() if c.worker_id == proc.worker_id]:
            self.broker.drop(conn, f"process exited with code {code}", notify=False)
        self._after_exit(slot, code)

    def _after_exit(self, slot: ModelSlot, code: int) -> None:
        if self.closing or slot.state in ("draining", "unloaded"):
            slot.state = "unloaded"
            return
        if slot.state == "failed":
            return
        was_loading = slot.loading is not None and not slot.loading.done()
        now = time.monotonic()
        slot.crashes.append(now)
        while slot.crashes and now - slot.crashes[0] > CRASH_WINDOW_S:
            slot.crashes.popleft()
        slot.last_error = slot.last_error if was_loading and slot.last_error else f"worker exited with code {code}"
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
            # Waiters keep waiting on the same future across the restart.
            slot.state = "restarting"
            self._spawn_task(self._load(slot, backoff))
        else:
            self._start_load(slot, delay=backoff)

    def _fail_load(self, slot: ModelSlot, message: str, permanent: bool) -> None:
        slot.last_error = message
        if permanent:
            slot.state = "failed"
        if slot.loading is not None and not slot.loading.done():
            slot.loading.set_exception(
                ServiceError(ErrorCode.MODEL_UNAVAILABLE, f"model {slot.name}: {message}", retry_after=30)
            )

    # -- broker callbacks ----------------------------------------------------------------------------
    def _slot_for(self, conn: WorkerConn) -> ModelSlot | None:
        return self.slots.get(conn.model)

    def _on_ready(self, conn: WorkerConn) -> None:
        slot = self._slot_for(conn)
        if slot is None:
            log.warning("worker %s serves unknown model %s; ignoring it", conn.worker_id, conn.model)
            return
        slot.state = "ready"
        slot.last_error = None
        slot.load_seconds = conn.info.get("load_seconds")
        if slot.loading is not None and not slot.loading.done():
            slot.loading.set_result(conn)

    def _on_load_failed(self, conn: WorkerConn, error: dict) -> None:
        slot = self._slot_for(conn)
        if slot is not None:
            slot.last_error = str(error.get("message", "load failed"))

    def _on_lost(self, conn: WorkerConn, reason: str) -> None:
        slot = self._slot_for(conn)
        if slot is None:
            return
        slot.last_error = reason
        proc = slot.process
        if proc is not None and proc.worker_id == conn.worker_id and proc.running:
            # Silent or hung: make sure the process is really gone; _load sees it exit.
            import signal

            proc.signal(signal.SIGKILL)

    # -- reporting ---------------------------------------------------------------------------------
    def describe(self, slot: ModelSlot) -> dict:
        workers = [c for c in self.broker.conns.values() if c.model == slot.name]
        return {
            "name": slot.name,
            "kind": slot.entry.kind,
            "state": slot.state,
            "loaded": any(c.state == "ready" for c in workers),
            "aliases": slot.entry.aliases,
            "last_error": slot.last_error,
            "restarts": slot.restarts,
            "load_seconds": slot.load_seconds,
            "workers": [
                {
                    "worker_id": c.worker_id,
                    "pid": c.pid,
                    "state": c.state,
                    "in_flight": c.load,
                    "context_length": c.info.get("context_length"),
                    "stats": c.stats,
                }
                for c in workers
            ],
        }
