"""The worker-fed prefix index: a request routed by prefix carries its route entries, the
worker's prefix cache notes them against the prompt's deepest block and reports them evicted
only when that block leaves memory and disk (worker/model/cache/prefix_events.py), the map
survives a graceful stop, and the gateway's pool drops, adds or replaces entries as reported
(gateway/link/pool.py). Real PrefixCache, BlockDisk, PrefixStore and Pool; MLX on the CPU."""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxgw.gateway.link import wire_checks as wc
from mlxgw.gateway.link.pool import Pool
from mlxgw.gateway.link.route_key import REPORTED_ENTRIES, LazyRoute, route_key
from mlxgw.gateway.link.worker_conn import ConnState, WorkerConn
from mlxgw.shared import protocol as p
from mlxgw.worker.model.cache.block_disk import BlockDisk
from mlxgw.worker.model.cache.prefix_cache import PrefixCache
from mlxgw.worker.model.cache.prefix_events import PrefixEvents
from mlxgw.worker.model.cache.prefix_store import PrefixStore

E1, E2, E3 = b"1" * 16, b"2" * 16, b"3" * 16


def pool_of(n: int) -> tuple[Pool, list[WorkerConn]]:
    made = [WorkerConn(f"w{i}".encode(), f"w{i}", model="m", kind="chat", pid=None) for i in range(n)]
    for i, conn in enumerate(made):
        conn.state, conn.replica.label = ConnState.READY, f"m#{i}"
    return Pool({c.identity: c for c in made}), made


def chat(*turns: str) -> p.GenerateRequest:
    messages = [{"role": "system", "content": "be brief"}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return p.GenerateRequest(rid="r", messages=messages)


def kv(length: int) -> list:
    layer = KVCache()
    x = mx.arange(length * 8, dtype=mx.float32).reshape(1, 1, length, 8)
    layer.update_and_fetch(x, x + 1)
    return [layer]


def stored(cache: PrefixCache, tokens: list[int], prompt: int, route: list[bytes]) -> None:
    last = cache.insert(tokens, kv(len(tokens)))
    cache.routed(route, last, prompt)


def test_an_entry_is_held_while_a_block_it_was_noted_on_is_held():
    events = PrefixEvents()
    events.note([E1, E2], b"block-a")
    events.note([E1], b"block-b")  # a shared head, stored by another session too
    held, evicted = events.drain()
    assert set(held) == {E1, E2} and evicted == []
    events.gone(b"block-a")
    assert events.drain() == ([], [E2])  # E1 is still held by block-b
    events.gone(b"block-b")
    assert events.drain() == ([], [E1])
    assert events.snapshot() == []


def test_the_bound_reports_what_it_forgets_as_evicted():
    events = PrefixEvents(limit=2)
    events.note([E1, E2, E3], b"block")
    held, evicted = events.drain()
    assert evicted == [E1] and set(held) == {E2, E3} and list(events.blocks) == [E2, E3]


def test_a_prompt_evicted_from_memory_without_a_disk_tier_is_reported():
    cache = PrefixCache(64 << 20)
    stored(cache, list(range(100)), 90, [E1, E2])  # prompt 90 tokens + 10 answer
    assert set(cache.events.drain()[0]) == {E1, E2}
    assert len(cache.events.entries) == 1  # noted on one block: the deepest whole one in the prompt
    (key,) = cache.events.entries
    assert cache.tree.blocks[key].end == 64
    cache.trim_to(0)
    assert set(cache.events.drain()[1]) == {E1, E2}


def test_a_block_moved_to_the_disk_tier_stays_held_until_it_leaves_the_disk(tmp_path):
    cache = PrefixCache(64 << 20)
    cache.disk_tier = BlockDisk(tmp_path, "f" * 32, 64 << 20)
    cache.disk_tier.on_gone = cache.left
    stored(cache, list(range(70)), 70, [E1])
    cache.events.drain()
    cache.trim_to(0)  # to disk: still held
    assert cache.events.drain() == ([], [])
    cache.disk_tier.clear()
    assert cache.events.drain() == ([], [E1])


def test_short_or_cut_prompts_note_nothing():
    cache = PrefixCache(64 << 20)
    stored(cache, list(range(20)), 20, [E1])  # shorter than a block
    stored(cache, list(range(1000, 1040)), 200, [E2])  # a row cut in its prefill: 40 of 200 stored
    assert cache.events is None


def test_the_map_survives_a_graceful_stop_for_the_blocks_on_disk(tmp_path):
    store = PrefixStore(tmp_path, "f" * 32, 64 << 20)
    cache = PrefixCache(64 << 20)
    store.attach(cache)
    stored(cache, list(range(70)), 70, [E1, E2])
    store.save(cache)
    again = PrefixCache(64 << 20)
    store.restore(again)
    assert set(again.events.snapshot()) == {E1, E2}
    assert again.events.drain() == ([], [])  # known by the snapshot, not reported as news
    store.clear()
    assert not (tmp_path / "routes.msgpack").exists()


def test_a_request_carries_its_route_only_once_the_pool_hashes_it():
    messages = [{"role": "user", "content": f"turn {i}"} for i in range(REPORTED_ENTRIES + 10)]
    req = p.GenerateRequest(rid="r", messages=[{"role": "system", "content": "s"}, *messages])
    route = LazyRoute(req, None)
    assert req.route is None  # a model with one worker never hashes: nothing is reported
    key = route()
    assert req.route == list(key.chain[-REPORTED_ENTRIES:]) and len(req.route) == REPORTED_ENTRIES
    assert p.GenerateRequest.from_wire(req.to_wire()).route == req.route


def test_the_pool_drops_an_evicted_prefix_and_places_the_session_by_its_anchor():
    pool, conns = pool_of(2)
    home = pool.pick("m", route_key(chat("evicted session")))
    second = route_key(chat("evicted session", "ok", "more"))
    assert pool.pick("m", second) is home and home.replica.by_prefix == 1
    by_session = sum(c.replica.by_session for c in conns)
    pool.reported(home, [], list(second.chain[second.lead :]), snapshot=False)  # what its request carried
    pool.pick("m", route_key(chat("evicted session", "ok", "more", "ok", "and")))
    assert home.replica.by_prefix == 1  # not by a prefix it lost: by the session's anchor
    assert sum(c.replica.by_session for c in conns) == by_session + 1 and home.replica.reported_evicted == 3


def test_a_snapshot_replaces_the_index_but_keeps_what_was_routed_since_the_connect():
    pool, (a, b) = pool_of(2)
    old = route_key(chat("before the connect"))
    pool._hold(a.worker_id, old.chain)
    a.connected_at = time.monotonic()
    routed = route_key(chat("routed since"))
    pool._hold(a.worker_id, routed.chain)
    held = route_key(chat("held by the worker"))
    pool.reported(a, list(held.chain), [], snapshot=True)
    index = set(pool._index[a.worker_id])
    assert set(held.chain) <= index and set(routed.chain) <= index and not set(old.chain[1:]) & index
    assert a.replica.snapshots == 1 and pool.report("m")[0]["indexed_prefixes"] == len(index)
    # a restarted gateway: the index comes from the snapshot, before any request
    assert pool.pick("m", route_key(chat("held by the worker", "ok", "next"))) is a and a.replica.by_prefix == 1


def test_a_malformed_prefixes_list_is_left_out():
    assert wc.prefix_entries([E1, b"short", "text", 7, E2]) == [E1, E2]
    assert wc.prefix_entries("not a list") == [] and wc.prefix_entries(None) == []
