"""Model slots: which models have a worker, loading on demand, unloading, restarts.

Each configured model has a slot (gateway/models/lifecycle.py has its states and edges). One
lifecycle task per slot makes every load (gateway/models/slot_runner.py): it asks for room,
spawns the worker, waits for it to exit, and then ends (a planned stop), restarts it with
backoff (a crash), or marks the model failed after a crash loop. So a model never loads
twice at once, a planned stop is never a crash, and every worker process belongs to a slot
until it has exited. This module handles requests, reloads, worker events and reporting.

The broker tells the manager what its workers do through a queue of events; what may be
resident is the Residency policy's call, made on snapshots the manager hands it."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from ...shared.config import Registry
from ...shared.errors import ErrorCode, ServiceError
from ..link import liveness as live
from ..link.broker import Broker
from ..link.pool import Route
from ..link.worker_conn import (
    ConnState,
    WorkerBack,
    WorkerConn,
    WorkerEvent,
    WorkerIdle,
    WorkerLoadFailed,
    WorkerLost,
    WorkerReady,
)
from . import adapters
from .lifecycle import ModelSlot, Pulse, SlotState, new_slot
from .residency import TICK_S, Occupant, Residency
from .slot_runner import SlotRunner, Spawner
from .supervisor import spawn_worker
from .worker_memory import Leftovers, ProcessTree

log = logging.getLogger(__name__)


class _Replaced(Exception):
    """The slot a request waits for was replaced by a reload: wait for the successor."""

    def __init__(self, successor: ModelSlot):
        self.successor = successor


class ModelManager(SlotRunner):
    def __init__(self, registry: Registry, broker: Broker, spawner: Spawner = spawn_worker):
        self.registry = registry
        self.broker = broker
        self.spawner = spawner
        self.slots: dict[str, ModelSlot] = {e.name: new_slot(e) for e in registry.models}
        self.retiring: set[ModelSlot] = set()  # replaced or removed by a reload, still draining
        self.residency = Residency(registry)
        self.leftovers = Leftovers()  # processes of exited workers, counted until gone
        self.changed = Pulse()  # fires on every slot transition and when a worker goes idle
        self._admit_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.closing = False

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
        """The model's pool for its slot (replica 0), the replica's own worker for the others."""
        if slot.retired or slot.replica:
            return self.local_conns(slot)
        return self.broker.pool.workers(slot.name)

    def local_conns(self, slot: ModelSlot) -> list[WorkerConn]:
        wid = slot.worker_id
        pool = self.broker.pool.workers(slot.name)
        return [c for c in pool if wid is not None and c.worker_id == wid and not c.remote]

    def in_flight(self, slot: ModelSlot) -> int:
        return sum(c.load for c in self.conns(slot))

    def keep_loaded(self, slot: ModelSlot, seconds: float) -> None:
        """Hold the model against idle unloading and eviction for `seconds` from now (Ollama's
        keep_alive; math.inf: until unloaded explicitly). The latest request's value wins."""
        for replica in slot.replicas:
            replica.keep_until = time.monotonic() + seconds

    def all_slots(self) -> list[ModelSlot]:
        return [*(r for s in self.slots.values() for r in s.replicas), *self.retiring]

    # -- requests ----------------------------------------------------------------------------
    async def acquire(
        self,
        slot: ModelSlot,
        on_wait: Callable[[], Awaitable[None]] | None = None,
        wait_tick_s: float = 5.0,
        route: Route = None,
    ) -> WorkerConn:
        """A ready worker for the model, loading it first if needed (once, however many ask).
        A model that is draining is waited for, then loaded. on_wait runs every wait_tick_s
        while the request waits (streaming clients get keep-alives)."""
        current = slot
        while True:
            current.waiters += 1  # a ready model with waiters is not evicted before they start
            try:
                return await self._acquire(current, on_wait, wait_tick_s, route)
            except _Replaced as replaced:
                successor = replaced.successor
            finally:
                current.waiters -= 1
            current = successor  # a reload replaced the slot while this request waited: wait for the new one

    async def _acquire(
        self, slot: ModelSlot, on_wait: Callable[[], Awaitable[None]] | None, wait_tick_s: float, route: Route
    ) -> WorkerConn:
        for replica in slot.replicas:
            replica.last_used = time.monotonic()
        deadline = slot.last_used + self.registry.manager.load_timeout_s
        next_tick = slot.last_used + wait_tick_s
        attempt = 0  # the lifecycle run this request waits for
        while True:
            routing = slot.entry.routing
            conn = self.broker.pool.pick(slot.name, route, routing.policy, routing.load_margin)
            if conn is not None:
                return conn
            successor = self.slots.get(slot.name)
            if slot.retired and not self.closing and successor is not None and successor is not slot:
                raise _Replaced(successor)  # reloads queue behind a reload; its waiters move along
            self._refuse_if_unavailable(slot)
            if slot.state is SlotState.UNLOADED:
                if attempt and slot.failed_attempt >= attempt and slot.load_error is not None:
                    raise slot.load_error
                self._ensure_started(slot)
            if slot.state is not SlotState.DRAINING:
                attempt = attempt or slot.attempts
            now = time.monotonic()
            if now >= deadline:
                raise ServiceError(
                    ErrorCode.MODEL_UNAVAILABLE, f"model {slot.name} did not load in time", retry_after=10
                )
            await self.changed.wait(min(next_tick, deadline) - now)
            if on_wait is not None and time.monotonic() >= next_tick:
                await on_wait()
                next_tick = time.monotonic() + wait_tick_s

    def _refuse_if_unavailable(self, slot: ModelSlot) -> None:
        if self.closing or slot.retired:
            raise ServiceError(ErrorCode.MODEL_UNAVAILABLE, f"model {slot.name} is going away", retry_after=5)
        if slot.state is SlotState.FAILED:
            wait = max(1.0, slot.failed_until - time.monotonic())
            raise ServiceError(
                ErrorCode.MODEL_UNAVAILABLE,
                f"model {slot.name} failed: {slot.last_error}; next try in {wait:.0f} s (or on `mlxgw reload`)",
                retry_after=min(wait, 300),
            )
        if slot.entry.remote_only:
            raise ServiceError(
                ErrorCode.MODEL_UNAVAILABLE,
                f"no worker is connected for model {slot.name} (it is served by remote workers)",
                retry_after=10,
            )

    # -- gateway start and stop ------------------------------------------------------------------
    async def start(self) -> None:
        self._own(self._consume_worker_events(), "manager-events")
        self._own(self._tick_loop(), "manager-residency")
        for slot in self.slots.values():
            if slot.entry.preload:
                self._ensure_started(slot)

    async def close(self) -> None:
        self.closing = True
        self.changed.fire()
        await asyncio.gather(*(self.unload(s, "gateway shutting down") for s in self.all_slots()))
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        left = {s.name: self.in_flight(s) for s in self.all_slots() if self.in_flight(s)}
        if left:
            log.error("requests still in flight after every worker stopped: %s", left)

    def _own(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task:
        """Every background task is kept here, and cancelled and awaited by close()."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- reload -------------------------------------------------------------------------------------
    async def reload(self, registry: Registry) -> dict:
        """Apply a new registry: added models appear, removed ones drain and stop, changed
        ones drain and come back with their new settings (once the old worker is gone);
        failed models try again."""
        self.registry = registry
        self.residency.configure(registry)
        added, removed, changed = [], [], []
        for name, slot in list(self.slots.items()):
            entry = next((e for e in registry.models if e.name == name), None)
            if entry is not None and adapters.only_adapters_changed(slot.entry, entry):
                slot.entry = entry  # LoRA adapters added or removed: the worker takes them as it runs
                self._own(adapters.push(self, slot))
            if entry == slot.entry:
                if slot.state is SlotState.FAILED:
                    slot.retry_now = True
                    slot.wake.fire()
                continue
            was_resident = slot.task is not None
            self._retire(slot)
            if entry is None:
                removed.append(name)
                continue
            changed.append(name)
            self.broker.registry.quarantine.forget_model(name)
            self.slots[name] = fresh = new_slot(entry, predecessor=slot if slot.task else None)
            if was_resident or entry.preload:
                self._ensure_started(fresh)
        for entry in registry.models:
            if entry.name not in self.slots:
                added.append(entry.name)
                self.slots[entry.name] = new_slot(entry)
                if entry.preload:
                    self._ensure_started(self.slots[entry.name])
        log.info("reloaded registry: added %s, removed %s, changed %s", added, removed, changed)
        self.changed.fire()
        return {"added": added, "removed": removed, "changed": changed}

    def _retire(self, slot: ModelSlot) -> None:
        del self.slots[slot.name]
        for conn in [c for c in self.broker.pool.workers(slot.name) if c.remote]:  # remote workers leave too
            self._own(self.broker.shutdown_worker(conn))
        for replica in slot.replicas:
            replica.retired = True
            if replica.task is not None:
                self.retiring.add(replica)
                self._own(self._drain_retired(replica))

    async def _drain_retired(self, slot: ModelSlot) -> None:
        try:
            await self.unload(slot, "removed or changed by a registry reload")
        finally:
            self.retiring.discard(slot)
            self.changed.fire()

    # -- what the workers say ------------------------------------------------------------------------
    async def _consume_worker_events(self) -> None:
        while True:
            event = await self.broker.registry.events.get()
            try:
                self.on_worker_event(event)
            except Exception:  # one bad event must not stop the manager hearing the rest
                log.exception("error handling %s", type(event).__name__)

    def _slot_of(self, conn: WorkerConn) -> ModelSlot | None:
        if not conn.remote:
            for slot in self.all_slots():
                if slot.worker_id == conn.worker_id:
                    return slot
            return None
        return self.slots.get(conn.model)

    def on_worker_event(self, event: WorkerEvent) -> None:
        self.changed.fire()  # whatever it was, waiters for a worker or for room look again
        if isinstance(event, (WorkerIdle, WorkerBack)):
            return
        slot = self._slot_of(event.conn)
        if slot is None:
            if isinstance(event, WorkerReady):
                log.warning("worker %s serves unknown model %s; ignoring it", event.conn.worker_id, event.conn.model)
            return
        if isinstance(event, WorkerReady):
            self._on_ready(slot, event.conn)
        elif isinstance(event, WorkerLoadFailed):
            slot.last_error = event.message
        elif isinstance(event, WorkerLost):
            self._on_lost(slot, event)

    def _on_ready(self, slot: ModelSlot, conn: WorkerConn) -> None:
        if conn.state is not ConnState.READY or slot.stopping or slot.retired:
            return  # already gone again, or leaving
        slot.last_error = None
        slot.load_error = None
        slot.ready_since = time.monotonic()
        slot.load_seconds = conn.info.get("load_seconds", slot.load_seconds)
        self._check_context(slot, conn)
        if slot.entry.adapters:  # adapters added while it loaded from an older entry
            self._own(adapters.push(self, slot))
        if slot.state in (SlotState.LOADING, SlotState.RESTARTING, SlotState.UNLOADED):
            self._set(slot, SlotState.READY)

    def _check_context(self, slot: ModelSlot, conn: WorkerConn) -> None:
        wanted, serving = slot.entry.context_length, conn.info.get("context_length")
        if wanted and serving and wanted > serving:
            slot.context_warning = (
                f"context_length {wanted} in models.yaml exceeds what the model supports; serving {serving} tokens"
            )
            log.warning("%s: %s", slot.name, slot.context_warning)

    def _on_lost(self, slot: ModelSlot, event: WorkerLost) -> None:
        if slot.stopping or slot.retired:
            return  # leaving because we asked it to: not an error
        slot.last_error = event.reason
        proc = slot.process
        ours = proc is not None and proc.worker_id == event.conn.worker_id
        # An exit's requests in flight are judged by its exit code (broker.registry.release_local
        # returns them to the lifecycle); watchdog kills and silence never blame them.
        if ours and proc.running:
            if event.kind in (live.LossKind.NO_PROGRESS, live.LossKind.SILENT):
                slot.kill_reason = event.reason  # the watchdog's kill, not a crash
            proc.signal(signal.SIGKILL)  # silent or hung: make sure it is gone; the lifecycle sees it exit
        elif event.conn.remote and not self.broker.pool.ready_workers(slot.name) and slot.process is None:
            self._set(slot, SlotState.UNLOADED)  # its last remote worker left

    # -- residency ---------------------------------------------------------------------------------
    def occupants(self, exclude: ModelSlot | None = None) -> list[Occupant]:
        return [
            Occupant(s, self.rss(s), self.in_flight(s))
            for s in self.all_slots()
            if s is not exclude and (s.process is not None or s.admitted)
        ]

    def rss(self, slot: ModelSlot) -> int:
        """The worker's memory: its process tree read now (worker_memory.py), or what its last
        heartbeat said where that is more (a remote worker: the heartbeat alone)."""
        reported = max((int(c.stats.get("rss_bytes", 0)) for c in self.local_conns(slot)), default=0)
        tree = slot.tree.rss_bytes() if isinstance(slot.tree, ProcessTree) else 0
        return max(reported, tree)

    def memory_snapshot(self) -> dict:
        return self.residency.snapshot(self.occupants(), self.leftovers.rss_bytes())

    def processes(self) -> list[dict]:
        """Every worker process this gateway spawned and has not yet seen exit, retiring ones
        included: a process not listed here is not one of ours."""
        return [
            {"model": s.name, "pid": s.process.pid, "worker_id": s.worker_id, "state": s.state.value}
            for s in self.all_slots()
            if s.process is not None
        ]

    def health(self) -> dict:
        return {
            "host_stalls": self.broker.registry.host_stalls,
            "quarantined_requests": self.broker.registry.quarantine.quarantined(),
            "in_flight": sum(c.load for c in self.broker.conns.values()),
        }

    async def _tick_loop(self) -> None:
        """Measure resident models and unload the idle ones (time-based: a periodic tick)."""
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            for o in self.occupants():
                if o.rss_bytes and o.slot.state is SlotState.READY:
                    o.slot.measured_bytes = max(o.slot.measured_bytes or 0, o.rss_bytes)
                if self.residency.is_idle(o, now) and not o.slot.stopping:
                    self.residency.idle_unloads += 1
                    self._own(self.unload(o.slot, f"idle for {now - o.slot.last_used:.0f} s"))
