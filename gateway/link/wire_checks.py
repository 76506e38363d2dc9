"""Schema checks for what a worker sends. A worker is a separate process, maybe on another
host: whatever it says is checked here before the gateway keeps it, so that a worker
sending a string `info` or non-numeric stats cannot make /v1/status, /v1/models or
/metrics fail. Unknown fields are kept only when they are plain JSON data."""

from __future__ import annotations

import math
from typing import Any

from .worker_conn import ConnState, WorkerConn

# Stats the gateway adds up or compares: numbers or nothing.
NUMERIC_STATS = (
    "running",
    "waiting",
    "generated_tokens",
    "finished_requests",
    "steps",
    "rss_bytes",
    "mlx_active_bytes",
    "mlx_peak_bytes",
    "mlx_cache_bytes",
    "tokens_per_s",
)
NUMERIC_CACHE = ("lookups", "hits", "bytes", "entries", "tokens", "max_bytes", "hit_tokens")
INFO_INTS = ("context_length", "model_context_length", "max_num_seqs", "max_queue", "dimensions", "protocol")
INFO_NUMBERS = ("load_seconds",)
INFO_STRINGS = ("engine",)
MAX_DEPTH = 6
MAX_ITEMS = 256
MAX_TEXT = 4096


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def json_safe(value: Any, depth: int = 0) -> tuple[bool, Any]:
    """(True, a JSON-encodable copy) for plain bounded data, else (False, None)."""
    if value is None or isinstance(value, (bool, str)):
        return (not isinstance(value, str) or len(value) <= MAX_TEXT), value
    if isinstance(value, int):
        return abs(value) < 2**63, value
    if isinstance(value, float):
        return math.isfinite(value), value
    if depth >= MAX_DEPTH:
        return False, None
    if isinstance(value, list) and len(value) <= MAX_ITEMS:
        out = []
        for v in value:
            ok, clean = json_safe(v, depth + 1)
            if ok:
                out.append(clean)
        return True, out
    if isinstance(value, dict) and len(value) <= MAX_ITEMS:
        out_map = {}
        for k, v in value.items():
            ok, clean = json_safe(v, depth + 1)
            if isinstance(k, str) and ok:
                out_map[k] = clean
        return True, out_map
    return False, None


def clean_stats(raw: Any) -> dict:
    if not isinstance(raw, dict):
        return {}
    _, stats = json_safe(raw)
    stats = stats or {}
    for key in NUMERIC_STATS:
        if key in stats and not _number(stats[key]):
            del stats[key]
    cache = stats.get("cache")
    if cache is not None:
        if not isinstance(cache, dict):
            del stats["cache"]
        else:
            for key in NUMERIC_CACHE:
                if key in cache and not _number(cache[key]):
                    del cache[key]
    if "requests" in stats and not (
        isinstance(stats["requests"], list) and all(isinstance(r, dict) for r in stats["requests"])
    ):
        del stats["requests"]
    return stats


def clean_info(raw: Any) -> dict:
    if not isinstance(raw, dict):
        return {}
    _, info = json_safe(raw)
    info = info or {}
    for key in INFO_INTS:
        if key in info and not (isinstance(info[key], int) and not isinstance(info[key], bool) and info[key] >= 0):
            del info[key]
    for key in INFO_NUMBERS:
        if key in info and not _number(info[key]):
            del info[key]
    for key in INFO_STRINGS:
        if key in info and not isinstance(info[key], str):
            del info[key]
    return info


def clean_busy(raw: Any) -> float:
    return float(raw) if _number(raw) and raw >= 0 else 0.0


def event_items(raw: Any) -> tuple[list[tuple[str, dict]], int]:
    """The well-formed [rid, event] pairs of an EVENTS message, and how many were not."""
    if not isinstance(raw, list):
        return [], 1
    good, bad = [], 0
    for item in raw:
        if (
            isinstance(item, (list, tuple))
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], dict)
            and isinstance(item[1].get("e"), str)
        ):
            good.append((item[0], item[1]))
        else:
            bad += 1
    return good, bad


def short_text(raw: Any, limit: int = 200) -> str | None:
    return raw[:limit] if isinstance(raw, str) and raw else None


def conn_from_hello(msg: dict, identity: bytes, remote: bool, sock, local_pid: int | None, label: str):
    """The connection a worker's HELLO announces; None without a model name or worker id."""
    model, worker_id, pid = msg.get("model"), msg.get("worker_id"), msg.get("pid")
    if not isinstance(model, str) or not model or not isinstance(worker_id, str) or not worker_id:
        return None
    conn = WorkerConn(
        identity=identity,
        worker_id=worker_id[:64],
        model=model[:128],
        kind=msg.get("kind") if isinstance(msg.get("kind"), str) else "chat",
        pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
        state=ConnState.READY if msg.get("state") == "ready" else ConnState.LOADING,
        info=clean_info(msg.get("info")),
        remote=remote,
        sock=sock,
        local_pid=local_pid,
    )
    conn.replica.label = label or conn.worker_id
    return conn


MAX_PREFIX_ENTRIES = 1 << 17  # per PREFIXES list: twice what a worker keeps (prefix_events.ENTRIES)
PREFIX_ENTRY_BYTES = 16  # a route chain entry (gateway/link/route_key.py)


def prefix_entries(raw: Any) -> list[bytes]:
    """A PREFIXES list: route chain entries, anything else left out; empty when malformed."""
    if not isinstance(raw, list) or len(raw) > MAX_PREFIX_ENTRIES:
        return []
    return [e for e in raw if type(e) is bytes and len(e) == PREFIX_ENTRY_BYTES]
