"""Two local replicas of one model as one pool (`routing: {replicas: 2}`): a session's turns
meet on the replica that holds its prefix (`cached_tokens` proves it), distinct sessions
spread over both, a replica killed with `kill -9` loses no request it had not started, and
no routing decision crosses cache namespaces. Real `mlxgw up`, real workers, the tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import http, start_gateway
from helpers.http import free_port

from mlxgw.shared.platform import worker_environment

CONFIG = {
    "manager": {"auto_discover": False},
    "models": [{"name": "tiny", "preload": True, "max_num_seqs": 4, "routing": {"replicas": 2}}],
}
SYSTEM = "You answer questions about the fleet's maintenance records briefly."


SECRET = "replica-pool-secret-0123456789"


@pytest.fixture(scope="module")
def pool(home, tiny_dir):
    listen = f"tcp://127.0.0.1:{free_port()}"
    os.environ["MLXGW_SECRET"] = SECRET  # read at start only
    try:
        gw = start_gateway(home, CONFIG, "replicas-gateway", extra_args=("--worker-listen", listen))
    finally:
        del os.environ["MLXGW_SECRET"]
    gw.listen = listen
    wait_ready(gw)
    yield gw
    gw.stop()


def wait_ready(gw, replicas: int = 2) -> None:
    deadline = time.monotonic() + 120
    while len(ready(gw)) < replicas and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(ready(gw)) == replicas, gw.model_status("tiny")


def ready(gw) -> list[dict]:
    return [r for r in gw.model_status("tiny")["replicas"] if r.get("state") == "ready"]


def opening(session: int) -> str:
    """A first turn of its own per session, several cache blocks long."""
    return f"Session {session}: " + " ".join(f"record {session}-{i} lists part {i * 7 + session}." for i in range(24))


def turn(gw, messages: list[dict], **extra) -> dict:
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "messages": messages, **extra}
    status, _, answer = http(gw.url + "/v1/chat/completions", "POST", body)
    assert status == 200, answer
    return answer


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def routed(gw) -> dict[str, dict]:
    return {r["replica"]: r for r in ready(gw)}


def test_a_sessions_turns_stay_on_one_replica_and_sessions_spread(pool):
    before = routed(pool)
    for session in range(8):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening(session)}]
        first = turn(pool, messages)
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
        messages += [{"role": "user", "content": "And the next record?"}]
        second = turn(pool, messages)
        # the second turn read the whole first prompt from cache (but its last partial block):
        # it reached the replica that computed it
        assert cached(second) >= first["usage"]["prompt_tokens"] - 32, (session, first["usage"], second["usage"])
    after = routed(pool)
    used = [name for name, r in after.items() if r["routed_by_prefix"] + r["routed_by_session"] > 0]
    assert len(used) == 2, after  # the sessions' first turns spread over both replicas
    assert sum(r["routed_by_prefix"] - before[n]["routed_by_prefix"] for n, r in after.items()) >= 8
    assert all(r["cache_hit_rate"] is not None and r["cold_warm_turns"] == 0 for r in after.values())
    status, _, metrics = http(pool.url + "/metrics")
    assert status == 200 and 'mlxgw_replica_routed_total{by="prefix",model="tiny",replica="tiny#0"}' in metrics


def test_no_routing_decision_crosses_cache_namespaces(pool):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening(100)}]
    turn(pool, messages, cache_salt="team-a")
    turn(pool, messages, cache_salt="team-a")  # the same namespace: routed by its prefix
    mid = routed(pool)
    other = turn(pool, messages, cache_salt="team-b")  # the same text in another namespace
    after = routed(pool)
    # chosen by its own session's anchor, not by the prefix the other namespace left behind
    assert sum(r["routed_by_prefix"] for r in after.values()) == sum(r["routed_by_prefix"] for r in mid.values())
    assert sum(r["routed_by_session"] for r in after.values()) == sum(r["routed_by_session"] for r in mid.values()) + 1
    assert cached(other) < 32


def test_kill_9_of_a_replica_loses_no_request_it_had_not_started(pool):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening(200)}]
    first = turn(pool, messages)
    before = routed(pool)
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
    messages += [{"role": "user", "content": "And the next record?"}]
    turn(pool, messages)
    home = next(n for n, r in routed(pool).items() if r["routed_by_prefix"] > before[n]["routed_by_prefix"])
    worker = routed(pool)[home]["worker_id"]
    pid = next(w["pid"] for w in pool.model_status("tiny")["workers"] if w["worker_id"] == worker)
    os.kill(pid, signal.SIGSTOP)  # it takes nothing in from here on
    results: list[dict] = []
    follow = [*messages, {"role": "user", "content": "Which part was replaced?"}]
    threads = [threading.Thread(target=lambda: results.append(turn(pool, follow))) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # both sent to the stopped replica (its session's prefix lives there)
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(60)
    assert len(results) == 2  # answered by the other replica
    survivor = next(r for n, r in routed(pool).items() if n != home)
    assert survivor["cold_warm_turns"] >= 1  # the moved session's turn read its prompt again: shown
    # the session re-homed: its next turn lands on one replica and reads its own prefix there
    again = turn(pool, follow)
    assert cached(again) >= again["usage"]["prompt_tokens"] - 40, again["usage"]
    wait_ready(pool)  # the killed replica restarts


def test_a_remote_worker_joins_the_pool_and_keeps_its_sessions(pool, tiny_dir, tmp_path):
    """`mlxgw worker --connect tcp://...` with the secret and a stable --worker-id: a third
    replica, named by its id, that sessions are placed on and come back to."""
    env = worker_environment() | {"MLXGW_SECRET": SECRET, "MLXGW_HOME": str(tmp_path)}
    command = [sys.executable, "-m", "mlxgw.worker", "--connect", pool.listen, "--model", "tiny"]
    command += ["--model-path", str(tiny_dir), "--worker-id", "mac2-tiny", "--orphan-after", "0"]
    worker = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while "mac2-tiny" not in routed(pool) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert routed(pool)["mac2-tiny"]["remote"] is True
        for session in range(300, 316):  # until a session's anchor places it on the remote worker
            before = routed(pool)["mac2-tiny"]
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening(session)}]
            first = turn(pool, messages)
            if routed(pool)["mac2-tiny"]["routed_by_session"] > before["routed_by_session"]:
                break
        else:
            raise AssertionError(f"no session was placed on the remote worker: {routed(pool)}")
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
        second = turn(pool, [*messages, {"role": "user", "content": "And the next record?"}])
        assert cached(second) >= first["usage"]["prompt_tokens"] - 32
        assert routed(pool)["mac2-tiny"]["routed_by_prefix"] == before["routed_by_prefix"] + 1
    finally:
        worker.terminate()
        worker.wait(30)


def test_a_gateway_restart_sends_each_session_back_to_its_replica(tmp_path, tiny_dir):
    """The index lives in the gateway and is gone after a restart; each replica's worker,
    started again, reads its disk tier (written at its graceful stop) and the route entries
    it held, and sends them as a snapshot: the index is rebuilt before any request, and the
    session's next turn goes to its replica by its prefix."""
    config = {
        "manager": {"auto_discover": False},
        "models": [{"name": "tiny", "source": str(tiny_dir), "preload": True, "routing": {"replicas": 2}}],
    }
    gw = start_gateway(tmp_path, config, "restart-gateway")
    try:
        wait_ready(gw)
        for session in range(400, 416):  # one placed on the second replica (the first is least loaded on ties)
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening(session)}]
            first = turn(gw, messages)
            if routed(gw)["tiny#1"]["routed_by_session"]:
                break
        else:
            raise AssertionError(routed(gw))
    finally:
        gw.stop()
    gw = start_gateway(tmp_path, config, "restart-gateway")
    try:
        wait_ready(gw)
        deadline = time.monotonic() + 10
        while not routed(gw)["tiny#1"]["indexed_prefixes"] and time.monotonic() < deadline:
            time.sleep(0.1)
        home = routed(gw)["tiny#1"]  # rebuilt from its worker's snapshot, before any request
        assert home["indexed_prefixes"] > 0 and home["index_snapshots"] == 1, routed(gw)
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
        second = turn(gw, [*messages, {"role": "user", "content": "And the next record?"}])
        assert routed(gw)["tiny#1"]["routed_by_prefix"] == 1  # by the prefix its worker said it holds
        assert cached(second) >= first["usage"]["prompt_tokens"] - 32
    finally:
        gw.stop()
