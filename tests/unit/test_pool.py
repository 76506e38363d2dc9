"""The pool's choice of a replica (gateway/link/pool.py) over real WorkerConns and real
requests' route keys: prefix first, the load guard, a client's session id, namespaces kept
apart, the circuit breaker, and a departed worker's index forgotten."""

from __future__ import annotations

import time

from mlxgw.gateway.link.pool import BREAKER_FAILURES, Pool
from mlxgw.gateway.link.route_key import route_key
from mlxgw.gateway.link.worker_conn import ConnState, RequestStream, WorkerConn
from mlxgw.shared import protocol as p
from mlxgw.shared.errors import ErrorCode


def pool_of(n: int) -> tuple[Pool, list[WorkerConn]]:
    conns = {}
    made = []
    for i in range(n):
        conn = WorkerConn(identity=f"w{i}".encode(), worker_id=f"w{i}", model="m", kind="chat", pid=None)
        conn.state = ConnState.READY
        conn.replica.label = f"m#{i}"
        conns[conn.identity] = conn
        made.append(conn)
    return Pool(conns), made


def chat(*turns: str, namespace: str | None = None) -> p.GenerateRequest:
    messages = [{"role": "system", "content": "be brief"}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return p.GenerateRequest(rid="r", messages=messages, cache_namespace=namespace)


def busy(conn: WorkerConn, n: int) -> None:
    for i in range(n):
        conn.streams[f"x{i}"] = RequestStream(f"x{i}", "x", conn)


def test_a_sessions_next_turn_follows_its_prefix_even_against_the_anchor():
    pool, (a, b) = pool_of(2)
    first = pool.pick("m", route_key(chat("session one")))
    other = b if first is a else a
    # the next turn's prefix lives on `first`: it goes there although another replica is idle
    busy(first, 2)
    assert pool.pick("m", route_key(chat("session one", "ok", "more"))) is first
    assert first.replica.by_prefix == 1 and first.replica.by_session == 1 and other.replica.by_prefix == 0


def test_the_load_guard_sends_a_request_to_the_least_loaded_past_the_margin():
    pool, (a, b) = pool_of(2)
    home = pool.pick("m", route_key(chat("hot session")))
    busy(home, 5)
    chosen = pool.pick("m", route_key(chat("hot session", "ok", "more")), margin=4)
    assert chosen is not home and chosen.replica.by_load == 1


def test_a_client_session_id_keeps_a_new_sessions_first_turns_together():
    pool, _ = pool_of(4)
    homes = {pool.pick("m", route_key(chat(f"opening {i}"), session="claude-session-7")).worker_id for i in range(8)}
    assert len(homes) == 1  # different first turns, one session id: one replica
    spread = {pool.pick("m", route_key(chat(f"opening {i}"))).worker_id for i in range(16)}
    assert len(spread) > 1  # without one, distinct sessions spread


def test_no_chain_entry_or_session_is_shared_across_namespaces():
    same = chat("the same words", "ok", "more")
    ka, kb = route_key(same, session="s1"), route_key(chat("the same words", "ok", "more", namespace="team-b"), "s1")
    assert not set(ka.chain) & set(kb.chain) and ka.anchor != kb.anchor and ka.session != kb.session
    pool, _ = pool_of(2)
    pool.pick("m", ka)
    chosen = pool.pick("m", kb)
    assert chosen.replica.by_prefix == 0  # decided by its own anchor: nothing of team a's counts


def test_the_circuit_breaker_takes_a_failing_replica_out_then_lets_it_back():
    pool, (a, b) = pool_of(2)
    route = route_key(chat("breaker session"))
    home = pool.pick("m", route)
    other = b if home is a else a
    pool.failed(home, ErrorCode.INVALID_REQUEST)  # the request's fault: not counted
    for _ in range(BREAKER_FAILURES):
        pool.failed(home, ErrorCode.INTERNAL)
    assert home.replica.open_until > time.monotonic()
    assert pool.pick("m", route) is other  # its sessions go elsewhere meanwhile
    home.replica.open_until = time.monotonic() - 1  # cool-down over: probed again
    assert pool.pick("m", route_key(chat("breaker session", "ok", "again"))) in (home, other)
    pool.finished(home, 10, 5)
    assert home.replica.failures == 0 and home.replica.hit_rate == 0.5


def test_a_departed_workers_index_routes_nothing():
    pool, (a, b) = pool_of(2)
    route = route_key(chat("moving session"))
    home = pool.pick("m", route)
    del pool.conns[home.identity]
    stayed = pool.pick("m", route_key(chat("moving session", "ok", "more")))
    assert stayed is not home and home.worker_id not in pool._index


def test_the_session_ids_clients_send_are_read_body_first_then_headers():
    from multidict import CIMultiDict

    from mlxgw.gateway.pipeline.cache_hints import session_id

    headers = CIMultiDict({"X-Claude-Code-Session-Id": "cc-1", "x-session-affinity": "crush-1"})
    assert session_id(headers, {"prompt_cache_key": "pk"}) == "pk"
    assert session_id(headers, {"metadata": {"user_id": "user_abc_session_9"}}) == "user_abc_session_9"
    assert session_id(headers, {}) == "cc-1"
    assert session_id(CIMultiDict({"X-Qwen-Code-Session-Id": "q"}), None) == "q"
    assert session_id(CIMultiDict(), {"prompt_cache_key": 7, "metadata": "x"}) is None
    assert len(session_id(CIMultiDict(), {"prompt_cache_key": "k" * 1000})) == 256
