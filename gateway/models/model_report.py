"""What /v1/status and /v1/models say of a model: its state, counters, memory, load progress
and workers, read from the manager's slots and the workers' heartbeats."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..link.worker_conn import ConnState
from .lifecycle import ModelSlot, SlotState
from .residency import Occupant

if TYPE_CHECKING:
    from .manager import ModelManager


def load_progress(manager: ModelManager, slot: ModelSlot) -> dict:
    """How far a loading model has got, from its worker's heartbeats (worker/process/load_progress.py):
    bytes of weights read so far and the weight files' total (our own estimate where the
    worker knows none, e.g. before its first heartbeat)."""
    report = next((r for c in manager.conns(slot) if isinstance(r := c.stats.get("load"), dict)), {})

    def count(key: str) -> int:
        value = report.get(key)
        return int(value) if isinstance(value, (int, float)) and value >= 0 else 0

    since = slot.loading_since
    return {
        "loaded_bytes": count("loaded_bytes"),
        "expected_bytes": count("expected_bytes") or manager.residency.expected(slot),
        "rss_bytes": count("rss_bytes"),
        "elapsed_s": round(time.monotonic() - since, 1) if since is not None else 0.0,
    }


def describe_slot(manager: ModelManager, slot: ModelSlot) -> dict:
    workers = manager.conns(slot)
    in_flight = manager.in_flight(slot)
    resident = slot.process is not None or slot.admitted
    return {
        "name": slot.name,
        "kind": slot.entry.kind,
        "state": slot.state.value,
        "loaded": any(c.state is ConnState.READY for c in workers),
        "aliases": slot.entry.aliases,
        "pinned": slot.entry.pin,
        "last_error": slot.last_error,
        "loads": slot.loads,
        "unloads": slot.unloads,
        "restarts": slot.restarts,
        "crashes": slot.crash_count,
        "watchdog_kills": slot.watchdog_kills,
        "load_seconds": slot.load_seconds,
        "in_flight": in_flight,
        "idle_s": round(time.monotonic() - slot.last_used, 1) if in_flight == 0 else 0.0,
        "memory_bytes": manager.residency.footprint(Occupant(slot, manager.rss(slot), in_flight)) if resident else 0,
        "expected_bytes": manager.residency.expected(slot),
        "load": load_progress(manager, slot) if slot.state is SlotState.LOADING else None,
        "context_warning": slot.context_warning,
        "retry_in_s": round(max(0.0, slot.failed_until - time.monotonic()), 1)
        if slot.state is SlotState.FAILED
        else None,
        "replicas": replicas(manager, slot) if not slot.replica else None,
        "workers": [
            {
                "worker_id": c.worker_id,
                "pid": c.pid,
                "state": c.state.value,
                "in_flight": c.load,
                "local": not c.remote and c.worker_id == slot.worker_id,
                "context_length": c.info.get("context_length"),
                "stats": c.stats,
            }
            for c in workers
        ],
    }


def replicas(manager: ModelManager, slot: ModelSlot) -> list[dict]:
    """The model's pool, one row per replica: its worker's load, cache hit rate and how
    requests came to it (gateway/link/pool.py), with its local slot's state and restarts.
    A local replica with no worker connected (loading, restarting, failed) is listed too."""
    rows = manager.broker.pool.report(slot.name)
    by_worker = {r.worker_id: r for r in slot.replicas if r.worker_id is not None}
    for row in rows:
        local = by_worker.pop(row["worker_id"], None)
        row["slot_state"] = local.state.value if local is not None else None
        row["restarts"] = local.restarts if local is not None else None
    listed = {row["replica"] for row in rows}
    for r in slot.replicas:
        if r.label not in listed and (len(slot.replicas) > 1 or r.state is not SlotState.UNLOADED):
            rows.append({"replica": r.label, "slot_state": r.state.value, "restarts": r.restarts, "load": 0})
    return rows
