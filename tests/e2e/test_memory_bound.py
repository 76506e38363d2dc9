"""The prefix cache's bound is a bound on real memory, and clearing it returns the memory.

A worker once grew to 14 GB while its cache reported 2 GB: cached KV slices kept whole batch
buffers alive. Here real requests through `mlxgw up` push several times the cache bound
through a small-bounded worker, and MLX's own allocator counters (what the process really
holds) must stay within the weights + the bound, and drop back when the cache is cleared.
The same gateway checks that a model without max_num_seqs gets the KV formula's value
(worker/model/memory/capacity.py) and that /v1/status says so."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import openai_client, start_gateway
from helpers.http import http

BOUND_MB = 8  # small, so 4x the bound is 32 requests (64 took a minute of the suite)
MB = 1 << 20
HEARTBEAT_S = 0.5  # stats travel with heartbeats: half the default, so idle samples come sooner


@pytest.fixture(scope="module")
def gateway(home, tiny_dir):
    config = {
        "manager": {"auto_discover": False, "heartbeat_s": HEARTBEAT_S},
        "models": [
            {"name": "tiny-bounded", "source": "tiny", "preload": True, "cache": {"prefix_memory_mb": BOUND_MB}}
        ],
    }
    gw = start_gateway(home, config, "memory-bound-gateway")
    yield gw
    gw.stop()


def _idle_stats(gw, model: str = "tiny-bounded", timeout: float = 60) -> dict:
    """Worker stats sampled after the worker went idle (stats travel with heartbeats)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        (worker,) = gw.model_status(model)["workers"]
        stats = worker.get("stats") or {}
        if stats and not stats.get("running") and not stats.get("waiting"):
            time.sleep(2.5 * HEARTBEAT_S)  # one more heartbeat, so the sample is from the idle worker
            (worker,) = gw.model_status(model)["workers"]
            return worker["stats"]
        time.sleep(0.2)
    raise AssertionError(f"{model} still busy after {timeout} s")


def _fill(gw, requests: int, words: int) -> None:
    client = openai_client(gw, timeout=120)

    def one(i: int) -> None:
        # Rows of different lengths finish at different steps of one batch: what made cached
        # slices keep whole batch buffers alive.
        content = " ".join(f"fill{i}x{j % 89}" for j in range(words + 37 * (i % 9)))
        client.chat.completions.create(
            model="tiny-bounded", messages=[{"role": "user", "content": content}], max_tokens=2 + 5 * (i % 8)
        )

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(requests)))


def test_the_cache_bound_bounds_mlx_memory_after_many_times_the_bound_went_through(gateway):
    _fill(gateway, 1, 20)
    base = _idle_stats(gateway)
    _fill(gateway, 32, 400)  # 1,100-2,000 tokens x 512 bytes each: ~30 MB of KV, 4x the bound
    stats = _idle_stats(gateway)
    cache = stats["cache"]
    assert cache["max_bytes"] == BOUND_MB * MB
    assert cache["bytes"] <= cache["max_bytes"]
    assert cache["entries"] >= 1
    grown = stats["mlx_active_bytes"] - base["mlx_active_bytes"]
    # Idle: no live KV, so what MLX holds beyond the start is the cache, within its bound.
    assert grown <= BOUND_MB * MB * 1.25 + MB, (grown, cache)
    # Freed buffers are not kept in MLX's buffer pool once the worker is idle (RSS would show them).
    assert stats["mlx_cache_bytes"] <= MB, stats["mlx_cache_bytes"]  # idle: handed back


def test_clearing_the_cache_returns_its_memory(gateway):
    _fill(gateway, 8, 400)
    full = _idle_stats(gateway)
    assert full["cache"]["bytes"] > 0
    status, _, body = http(f"{gateway.url}/v1/cache", method="DELETE")
    assert status == 200, body
    cleared = _idle_stats(gateway)
    assert cleared["cache"]["bytes"] == 0
    returned = full["mlx_active_bytes"] - cleared["mlx_active_bytes"]
    assert returned >= full["cache"]["bytes"] * 0.9, (returned, full["cache"]["bytes"])
    assert cleared["mlx_cache_bytes"] == 0  # handed back to the system, not kept in MLX's pool


def test_a_model_without_max_num_seqs_gets_the_kv_formula_and_status_reports_it(gateway, tiny_dir):
    from mlxgw.worker.model.memory.capacity import MAX_SEQS, kv_bytes_per_token

    config = json.loads((tiny_dir / "config.json").read_text())
    stats = _idle_stats(gateway)
    basis = stats["max_num_seqs_basis"]
    assert basis["source"] == "kv formula"
    assert basis["kv_bytes_per_token"] == kv_bytes_per_token(config, 4)  # float32 weights
    # A tiny model's KV per token is a few hundred bytes: the formula hits the ceiling.
    assert stats["max_num_seqs"] == basis["value"] == MAX_SEQS
