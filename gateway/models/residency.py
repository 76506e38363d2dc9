"""Residency policy: what may be loaded, what must leave to make room, what is idle.

The budget counts measured memory: a worker reports its RSS with every heartbeat, and a
model's expected footprint is the peak it reached on its last load (else an estimate from
its weight files plus the runtime's own overhead). This module only decides; the manager
acts (it admits loads one at a time under a lock, so two loads never race past the budget,
and it ends the processes the policy picks, which gives their memory back to the OS).
The policy sees resident models as Occupants, a snapshot the manager builds."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ...shared.config import Registry
from ...shared.config_checks import parse_memory_budget
from ...shared.errors import ErrorCode, ServiceError
from ...shared.platform import total_memory_bytes
from .lifecycle import ModelSlot, SlotState

# A worker process costs this much before its weights: Python, MLX, transformers' tokenizer
# (measured ~150-200 MB RSS for a tiny model on Linux).
PROCESS_OVERHEAD_BYTES = 256 << 20
WEIGHTS_FACTOR = 1.2  # weights in memory plus activations and the first KV blocks
NULL_ENGINE_BYTES = 128 << 20
TICK_S = 1.0


def _weights_bytes(path) -> int:
    if not path.is_dir():
        return 0
    top = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    # A Diffusers-layout image model keeps its weights in a folder per part (transformer/,
    # text_encoder/, vae/): counted too, so it is admitted by what it weighs.
    return top or sum(f.stat().st_size for f in path.glob("*/*.safetensors"))


@dataclass(frozen=True)
class Occupant:
    """A model with a worker process (or one starting): what the policy needs to know."""

    slot: ModelSlot
    rss_bytes: int  # the worker's last reported RSS, 0 when not yet known
    in_flight: int


@dataclass(frozen=True)
class Plan:
    fits: bool = False
    victim: ModelSlot | None = None  # stop this one, then ask again
    releasing: bool = False  # fits once an exited worker's leftover processes are gone: wait
    refusal: ServiceError | None = None  # can never fit


class Residency:
    def __init__(self, registry: Registry):
        self.registry = registry
        self.evictions = 0
        self.idle_unloads = 0

    def configure(self, registry: Registry) -> None:
        self.registry = registry

    @property
    def budget_bytes(self) -> int:
        return parse_memory_budget(self.registry.manager.memory_budget, total_memory_bytes())

    # -- accounting -------------------------------------------------------------------------------
    def estimate(self, slot: ModelSlot) -> int:
        if slot.entry.engine in ("null", "echo"):
            return NULL_ENGINE_BYTES
        path = slot.entry.model_path(self.registry.models_dir)
        ranks = slot.entry.distributed.ranks if slot.entry.distributed else 1  # each rank is a process
        return int(_weights_bytes(path) * WEIGHTS_FACTOR) + PROCESS_OVERHEAD_BYTES * ranks

    def expected(self, slot: ModelSlot) -> int:
        return slot.measured_bytes or self.estimate(slot)

    def footprint(self, o: Occupant) -> int:
        """What a resident (or loading) model counts against the budget now."""
        if o.slot.state is SlotState.READY:
            return max(o.rss_bytes, o.slot.measured_bytes or 0) or self.expected(o.slot)
        return max(o.rss_bytes, self.expected(o.slot))

    def used_bytes(self, occupants: list[Occupant]) -> int:
        return sum(self.footprint(o) for o in occupants)

    # -- decisions ----------------------------------------------------------------------------------
    def plan(self, slot: ModelSlot, others: list[Occupant], exiting: int = 0) -> Plan:
        """Whether `slot` may start now, given the other resident models and the memory that
        exited workers' processes still hold (`exiting`: counted until it is released)."""
        m = self.registry.manager
        budget, need = self.budget_bytes, self.expected(slot)
        if need > budget:
            return Plan(
                refusal=ServiceError(
                    ErrorCode.MODEL_UNAVAILABLE,
                    f"model {slot.name} needs about {need >> 20} MB, more than the whole memory budget "
                    f"({budget >> 20} MB)",
                )
            )
        room = len(others) < m.max_loaded_models
        used = self.used_bytes(others)
        if used + exiting + need <= budget and room:
            return Plan(fits=True)
        if exiting and used + need <= budget and room:
            return Plan(releasing=True)  # evicting more would not be needed: wait for the release
        candidates = [
            o.slot
            for o in others
            if o.slot.state is SlotState.READY
            and not o.slot.entry.pin
            and not o.slot.retired
            and o.in_flight == 0
            and o.slot.waiters == 0
            and time.monotonic() >= o.slot.keep_until
        ]
        return Plan(victim=min(candidates, key=lambda s: s.last_used) if candidates else None)

    def no_room(self, slot: ModelSlot, others: list[Occupant]) -> ServiceError:
        m = self.registry.manager
        used, budget = self.used_bytes(others), self.budget_bytes
        return ServiceError(
            ErrorCode.MODEL_UNAVAILABLE,
            f"not enough memory to load {slot.name}: it needs about {self.expected(slot) >> 20} MB and "
            f"{used >> 20} of {budget >> 20} MB are held by busy or pinned models",
            retry_after=max(5.0, m.wait_timeout_s / 4),
        )

    def is_idle(self, o: Occupant, now: float) -> bool:
        slot = o.slot
        idle_after = slot.entry.idle_unload_s
        idle_after = self.registry.manager.idle_unload_s if idle_after is None else idle_after
        return bool(
            idle_after
            and slot.state is SlotState.READY
            and not slot.entry.pin
            and o.in_flight == 0
            and slot.waiters == 0
            and now >= slot.keep_until
            and now - slot.last_used > idle_after
        )

    def snapshot(self, occupants: list[Occupant], exiting: int = 0) -> dict:
        return {
            "budget_bytes": self.budget_bytes,
            "used_bytes": self.used_bytes(occupants) + exiting,
            "exiting_bytes": exiting,
            "resident_models": [o.slot.name for o in occupants],
            "evictions": self.evictions,
            "idle_unloads": self.idle_unloads,
        }
