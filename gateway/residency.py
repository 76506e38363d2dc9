"""Residency policy: what may be loaded, what must leave to make room, what is idle.

The budget counts measured memory: a worker reports its RSS with every heartbeat, and a
model's expected footprint is the peak it reached on its last load (else an estimate from
its weight files plus the runtime's own overhead). Loads are admitted one at a time
under a lock, so two loads can never race past the budget; to make room, idle unpinned
models leave in least-recently-used order by ending their process, which is what gives
their memory back to the operating system."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from mlxgw.shared.config import parse_memory_budget
from mlxgw.shared.errors import ErrorCode, ServiceError
from mlxgw.shared.platform import total_memory_bytes

if TYPE_CHECKING:
    from .manager import ModelManager, ModelSlot

log = logging.getLogger("mlxgw.residency")

# A worker process costs this much before its weights: Python, MLX, transformers' tokenizer
# (measured ~150-200 MB RSS for a tiny model on Linux).
PROCESS_OVERHEAD_BYTES = 256 << 20
WEIGHTS_FACTOR = 1.2  # weights in memory plus activations and the first KV blocks
NULL_ENGINE_BYTES = 128 << 20
TICK_S = 1.0


def _weights_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else 0


class Residency:
    def __init__(self, manager: ModelManager):
        self.manager = manager
        self._lock = asyncio.Lock()
        self.evictions = 0
        self.idle_unloads = 0

    @property
    def budget_bytes(self) -> int:
        return parse_memory_budget(self.manager.registry.manager.memory_budget, total_memory_bytes())

    # -- accounting -------------------------------------------------------------------------------
    def estimate(self, slot: ModelSlot) -> int:
        if slot.entry.engine in ("null", "echo"):
            return NULL_ENGINE_BYTES
        path = slot.entry.model_path(self.manager.registry.models_dir)
        return int(_weights_bytes(path) * WEIGHTS_FACTOR) + PROCESS_OVERHEAD_BYTES

    def expected(self, slot: ModelSlot) -> int:
        return slot.measured_bytes or self.estimate(slot)

    def rss(self, slot: ModelSlot) -> int:
        return max((int(c.stats.get("rss_bytes", 0)) for c in self.manager.local_conns(slot)), default=0)

    def footprint(self, slot: ModelSlot) -> int:
        """What a resident (or loading) model counts against the budget now."""
        if slot.state == "ready":
            return max(self.rss(slot), slot.measured_bytes or 0) or self.expected(slot)
        return max(self.rss(slot), self.expected(slot))

    def resident(self, exclude: ModelSlot | None = None) -> list[ModelSlot]:
        slots = [*self.manager.slots.values(), *self.manager.retiring]
        return [s for s in slots if s is not exclude and s.process is not None]

    def used_bytes(self, exclude: ModelSlot | None = None) -> int:
        return sum(self.footprint(s) for s in self.resident(exclude))

    # -- admission ----------------------------------------------------------------------------------
    def _victim(self, exclude: ModelSlot) -> ModelSlot | None:
        candidates = [
            s
            for s in self.resident(exclude)
            if s.state == "ready"
            and not s.entry.pin
            and not s.retired
            and self.manager.in_flight(s) == 0
            and time.monotonic() >= s.keep_until
        ]
        return min(candidates, key=lambda s: s.last_used) if candidates else None

    async def admit(self, slot: ModelSlot) -> None:
        """Return once the slot's expected footprint fits; evict idle models if needed."""
        m = self.manager.registry.manager
        async with self._lock:
            deadline = time.monotonic() + m.wait_timeout_seconds
            while True:
                budget, need = self.budget_bytes, self.expected(slot)
                if need > budget:
                    raise ServiceError(
                        ErrorCode.MODEL_UNAVAILABLE,
                        f"model {slot.name} needs about {need >> 20} MB, more than the whole memory budget "
                        f"({budget >> 20} MB)",
                    )
                used, count = self.used_bytes(exclude=slot), len(self.resident(exclude=slot))
                if used + need <= budget and count < m.max_loaded_models:
                    return
                victim = self._victim(slot)
                if victim is not None:
                    self.evictions += 1
                    await self.manager.unload(victim, f"evicted to make room for {slot.name}")
                    continue
                if m.contention == "fail" or time.monotonic() >= deadline:
                    raise ServiceError(
                        ErrorCode.MODEL_UNAVAILABLE,
                        f"not enough memory to load {slot.name}: it needs about {need >> 20} MB and "
                        f"{used >> 20} of {budget >> 20} MB are held by busy or pinned models",
                        retry_after=max(5.0, m.wait_timeout_seconds / 4),
                    )
                await asyncio.sleep(0.25)

    # -- background: measure, and unload what is idle ------------------------------------------------------
    async def run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self._tick()
            except Exception:  # the policy loop must outlive any one bad tick
                log.exception("residency tick failed")

    async def _tick(self) -> None:
        default_idle = self.manager.registry.manager.idle_unload_seconds
        now = time.monotonic()
        for slot in list(self.manager.slots.values()):
            if slot.process is None or slot.state != "ready":
                continue
            rss = self.rss(slot)
            if rss:
                slot.measured_bytes = max(slot.measured_bytes or 0, rss)
            idle_after = slot.entry.idle_unload_seconds
            idle_after = default_idle if idle_after is None else idle_after
            if (
                idle_after
                and not slot.entry.pin
                and self.manager.in_flight(slot) == 0
                and now >= slot.keep_until
                and now - slot.last_used > idle_after
            ):
                self.idle_unloads += 1
                self.manager._spawn_task(self.manager.unload(slot, f"idle for {now - slot.last_used:.0f} s"))

    def snapshot(self) -> dict:
        return {
            "budget_bytes": self.budget_bytes,
            "used_bytes": self.used_bytes(),
            "resident_models": [s.name for s in self.resident()],
            "evictions": self.evictions,
            "idle_unloads": self.idle_unloads,
        }
