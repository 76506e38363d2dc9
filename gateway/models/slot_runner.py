"""The lifecycle half of the model manager: the one task per slot that makes every load.

It asks for room (Residency), spawns the worker, waits for it to exit, and then either ends
(a planned stop: evict, idle, reload, shutdown), restarts it with backoff (a crash), or
marks the model failed after a crash loop and tries again after a long backoff. ModelManager
(gateway/models/manager.py) mixes it in and provides the fields listed in SlotRunner's body."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from ...shared.config import Registry
from ...shared.errors import ErrorCode, ServiceError
from ...shared.model_sections import ModelKind
from ...shared.protocol import EXIT_UNSERVABLE
from ..link.broker import Broker
from .lifecycle import ModelSlot, Pulse, SlotState
from .rank_group import sharding_refusal
from .residency import Occupant, Residency
from .worker_memory import Leftovers, ProcessTree

# Exits a request in flight may have caused: native faults, and SIGKILL that the gateway did
# not send (the kernel's out-of-memory killer); a Python-level failure of the batched step
# exits non-zero. SIGTERM/SIGINT from someone else, or a clean exit, blame nobody.
REQUEST_FAULT_SIGNALS = frozenset(
    {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT, signal.SIGKILL}
)


def request_may_have_caused(code: int | None) -> bool:
    if code is None or code == 0:
        return False
    if code < 0:
        return -code in REQUEST_FAULT_SIGNALS
    return True


log = logging.getLogger(__name__)

STOP_GRACE_S = 30.0
RELEASE_POLL_S = 0.05  # how often a load waiting for an exited worker's memory looks again
FAILED_RETRY_MAX_S = 3600.0


class WorkerHandle(Protocol):
    """What the manager needs of a spawned worker (supervisor.WorkerProcess, or a fake)."""

    worker_id: str

    @property
    def pid(self) -> int: ...

    @property
    def running(self) -> bool: ...

    async def wait(self) -> int: ...

    def signal(self, sig: int) -> None: ...

    async def stop(self, grace_s: float) -> int: ...


Spawner = Callable[..., Awaitable[WorkerHandle]]


class SlotRunner:
    """State transitions of model slots. Needs, from the class that mixes it in:"""

    registry: Registry
    broker: Broker
    spawner: Spawner
    residency: Residency
    leftovers: Leftovers
    changed: Pulse
    closing: bool
    _admit_lock: asyncio.Lock

    def _own(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task: ...

    def occupants(self, exclude: ModelSlot | None = None) -> list[Occupant]: ...

    # -- transitions -------------------------------------------------------------------------------
    def _set(self, slot: ModelSlot, state: SlotState) -> None:
        if slot.state is not state:
            log.debug("%s: %s -> %s", slot.name, slot.state, state)
            if state is SlotState.LOADING:
                slot.loading_since = time.monotonic()
            slot.state = state
        self.changed.fire()

    def _ensure_started(self, slot: ModelSlot) -> None:
        """UNLOADED -> LOADING: start the lifecycle task of each of the slot's replicas that
        runs none."""
        for replica in slot.replicas:
            self._start_one(replica)

    def _start_one(self, slot: ModelSlot) -> None:
        if slot.task is not None or slot.retired or self.closing or slot.entry.remote_only:
            return
        if slot.state is not SlotState.UNLOADED:
            return
        slot.attempts += 1
        slot.stop_reason = None
        self._set(slot, SlotState.LOADING)
        slot.task = self._own(self._lifecycle(slot), f"lifecycle-{slot.name}")

    async def _lifecycle(self, slot: ModelSlot) -> None:
        again = False
        try:
            while True:
                code = await self._run_worker(slot)
                if code is None or slot.stopping or slot.retired or self.closing:
                    return
                if code == EXIT_UNSERVABLE:  # the model itself cannot load: restarts would fail alike
                    again = await self._failed(slot, unservable=True)
                    return
                delay = self._crashed(slot, code)
                if delay is None:
                    again = await self._failed(slot)
                    return
                self._set(slot, SlotState.RESTARTING)
                await self._sleep(slot, delay)
                if slot.stopping or slot.retired or self.closing:
                    return
                self._set(slot, SlotState.LOADING)
        finally:
            slot.task = None
            slot.admitted = False
            self._set(slot, SlotState.UNLOADED)
            if again:
                self._ensure_started(slot)

    async def _run_worker(self, slot: ModelSlot) -> int | None:
        """Admit, spawn, and wait for the worker to exit: its exit code, or None when no
        worker was started (the reason is in slot.load_error)."""
        if slot.predecessor is not None:
            while slot.predecessor.task is not None:  # a reload's old worker drains first
                await self.changed.wait()
            slot.predecessor = None
        path = slot.entry.model_path(self.registry.models_dir)
        # Diffusers-layout image models keep their configs in model_index.json and per-part folders.
        markers = ("config.json", "model_index.json") if slot.entry.kind == ModelKind.IMAGE else ("config.json",)
        if slot.entry.engine == "mlx" and not any((path / m).exists() for m in markers):
            return self._not_started(slot, f"no model at {path} (import it with `mlxgw models import`)")
        if slot.entry.distributed is not None and (refusal := await sharding_refusal(slot.entry, path)):
            return self._not_started(slot, refusal, retry_after=None)
        try:
            await self._admit(slot)
        except ServiceError as e:
            return self._not_started(slot, e.message, e.retry_after)
        m = self.registry.manager
        slot.loads += 1
        slot.kill_reason = None
        proc = await self.spawner(
            self.broker.endpoint,
            slot.entry,
            path,
            heartbeat_s=m.heartbeat_s,
            liveness=m.liveness,
            hang_timeout_s=m.hang_timeout_s,
            replica=slot.replica,
        )
        slot.process = proc
        slot.tree = ProcessTree(proc.pid)
        self.broker.registry.expect_local(proc.worker_id, proc.pid, slot.label)
        try:
            if slot.stopping or self.closing:  # a stop came while it was being spawned
                code = await proc.stop(STOP_GRACE_S)
            else:
                code = await proc.wait()
        finally:
            if proc.running:  # cancelled: never leave a process behind
                proc.signal(signal.SIGKILL)
                await proc.wait()
            # What the worker left running is killed and counted until gone, before the slot
            # stops counting: a load never starts on memory that is not yet released.
            if isinstance(slot.tree, ProcessTree):
                self.leftovers.add(slot.tree.end_leftovers())
            slot.tree = None
        planned = slot.stopping or slot.retired or self.closing
        fps = self.broker.registry.release_local(proc.worker_id, f"process exited with code {code}", planned=planned)
        slot.process = None
        slot.admitted = False
        if planned:
            slot.unloads += 1
        elif fps and slot.kill_reason is None and request_may_have_caused(code):
            self.broker.registry.quarantine.record_crash(slot.name, fps)
        return code

    def _not_started(self, slot: ModelSlot, message: str, retry_after: float | None = 30) -> None:
        slot.load_error = ServiceError(
            ErrorCode.MODEL_UNAVAILABLE, f"model {slot.name}: {message}", retry_after=retry_after
        )
        slot.failed_attempt = slot.attempts
        slot.last_error = message
        return None

    async def _admit(self, slot: ModelSlot) -> None:
        """Return once the slot's expected footprint fits; evict idle models if needed."""
        m = self.registry.manager
        async with self._admit_lock:
            deadline = time.monotonic() + m.wait_timeout_s
            while True:
                if slot.stopping or slot.retired or self.closing:
                    raise ServiceError(ErrorCode.MODEL_UNAVAILABLE, "the model was unloaded while loading")
                others = self.occupants(exclude=slot)
                plan = self.residency.plan(slot, others, self.leftovers.rss_bytes())
                if plan.refusal is not None:
                    raise plan.refusal
                if plan.fits:
                    slot.admitted = True
                    return
                if plan.releasing and time.monotonic() < deadline:
                    await asyncio.sleep(RELEASE_POLL_S)  # an exited worker's processes: their exit frees it
                    continue
                if plan.victim is not None:
                    self.residency.evictions += 1
                    await self.unload(plan.victim, f"evicted to make room for {slot.name}")
                    continue
                remaining = deadline - time.monotonic()
                if m.contention == "fail" or remaining <= 0:
                    raise self.residency.no_room(slot, others)
                await self.changed.wait(remaining)

    def _crashed(self, slot: ModelSlot, code: int) -> float | None:
        """Count an exit nobody asked for (a crash, or the watchdog's kill: counted apart);
        the backoff before the restart, None for a loop."""
        now = time.monotonic()
        if slot.ready_since is not None and now - slot.ready_since > slot.crashes.window_s:
            slot.crashes.loops = 0  # it had been healthy for a while
        slot.ready_since = None
        n = slot.crashes.record(now)  # either way a restart: the backoff bounds how often
        killed, slot.kill_reason = slot.kill_reason, None
        if killed is None:
            slot.crash_count += 1
        else:
            slot.watchdog_kills += 1
        if slot.state is not SlotState.LOADING or not slot.last_error:
            slot.last_error = f"worker exited with code {code}"
        if slot.crashes.looping:
            return None
        delay = slot.crashes.backoff_s(self.registry.manager.restart_backoff_s)
        if killed is not None:
            log.warning(
                "worker for %s killed by the watchdog (%s; watchdog kill %d, not a crash); restarting in %g s",
                slot.name,
                killed,
                slot.watchdog_kills,
                delay,
            )
        else:
            log.warning("worker for %s exited (code %s, crash %d); restarting in %g s", slot.name, code, n, delay)
        slot.restarts += 1
        return delay

    async def _failed(self, slot: ModelSlot, unservable: bool = False) -> bool:
        """A crash loop, or a model that cannot load (unservable: its worker said why, once):
        refuse requests for a long backoff (doubling per loop), then try again; `mlxgw
        reload` ends the wait early. True when it should load again now."""
        slot.crashes.loops += 1
        wait = min(self.registry.manager.failed_retry_s * 2 ** (slot.crashes.loops - 1), FAILED_RETRY_MAX_S)
        slot.failed_until = time.monotonic() + wait
        if unservable:
            slot.last_error = f"cannot load: {slot.last_error or 'the worker gave no reason'}"
        else:
            slot.last_error = (
                f"crash loop: {len(slot.crashes.times)} exits in {slot.crashes.window_s:g} s; last: {slot.last_error}"
            )
        slot.load_error = ServiceError(ErrorCode.MODEL_UNAVAILABLE, f"model {slot.name} failed: {slot.last_error}")
        slot.failed_attempt = slot.attempts
        log.error("%s: %s; next try in %g s", slot.name, slot.last_error, wait)
        self._set(slot, SlotState.FAILED)
        await self._sleep(slot, wait, lambda: slot.retry_now)
        slot.retry_now = False
        slot.crashes.clear()
        return slot.entry.preload and not (slot.stopping or slot.retired or self.closing)

    async def _sleep(self, slot: ModelSlot, seconds: float, done: Callable[[], bool] = lambda: False) -> None:
        """Wait, but wake early for a planned stop, a shutdown or `done`."""
        until = time.monotonic() + seconds
        while not (done() or slot.stopping or slot.retired or self.closing):
            remaining = until - time.monotonic()
            if remaining <= 0:
                return
            await slot.wake.wait(remaining)

    # -- planned stops ----------------------------------------------------------------------------------
    async def unload(self, slot: ModelSlot, reason: str) -> None:
        """A planned stop: the worker finishes its requests in flight, then exits (SIGTERM,
        then SIGKILL after STOP_GRACE_S). Returns once the slot's lifecycle has ended, and
        its other replicas' too."""
        if slot.extra:
            await asyncio.gather(*(self.unload(r, reason) for r in slot.extra))
        task = slot.task
        if task is None:
            return
        if not slot.stopping:
            slot.stop_reason = reason
            log.info("unloading %s: %s", slot.name, reason)
            if slot.process is not None:
                self.broker.registry.drain_local(slot.process.worker_id)
                self._set(slot, SlotState.DRAINING)
            slot.wake.fire()
            self.changed.fire()
        if slot.process is not None:
            await slot.process.stop(STOP_GRACE_S)
        await asyncio.wait({task})
