"""The remote-worker port faces the network: a maximum message size before authentication,
rate-limited logs of rejected frames, and every field a worker sends checked, so that a
worker (even one that knows the secret) cannot break /v1/status, /v1/models or /metrics."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import zmq
from helpers import free_port, http, start_gateway

from mlxgw.shared import protocol as p

SECRET = "correct-horse-battery-staple-2"


@pytest.fixture(scope="module")
def remote_gateway(home):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = {"manager": {"auto_discover": False}, "models": [{"name": "far", "engine": "null", "remote_only": True}]}
    os.environ["MLXGW_SECRET"] = SECRET
    try:
        gw = start_gateway(home, config, "socket-gateway", extra_args=("--worker-listen", endpoint))
    finally:
        del os.environ["MLXGW_SECRET"]
    ctx = zmq.Context()
    yield gw, endpoint, ctx
    ctx.destroy(linger=0)
    gw.stop()


def dealer(ctx, endpoint):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def test_oversized_frames_before_authentication_are_refused_without_buffering(remote_gateway):
    gw, endpoint, ctx = remote_gateway
    before = psutil.Process(gw.proc.pid).memory_info().rss
    big = b"\x00" * (100 << 20)
    for _ in range(4):
        sock = dealer(ctx, endpoint)
        sock.send(big)
        time.sleep(0.5)
        sock.close()
    del big
    time.sleep(1)
    grown = psutil.Process(gw.proc.pid).memory_info().rss - before
    assert grown < 64 << 20, f"the gateway grew by {grown >> 20} MB"
    assert http(f"{gw.url}/health")[0] == 200


def test_a_flood_of_bad_hellos_is_logged_a_few_times_only(remote_gateway):
    gw, endpoint, ctx = remote_gateway
    sock = dealer(ctx, endpoint)
    for i in range(2000):
        sock.send(p.encode(p.HELLO, worker_id=f"w{i}", model="far", secret="wrong-secret-wrong-secret"))
    deadline = time.monotonic() + 20
    while gw.status()["dropped_messages"] < 2000 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gw.status()["dropped_messages"] >= 2000
    assert gw.log().count("wrong secret") <= 3
    sock.close()


def test_a_worker_sending_malformed_info_and_stats_cannot_break_status_routes(remote_gateway):
    gw, endpoint, ctx = remote_gateway
    sock = dealer(ctx, endpoint)
    sock.send(p.encode(p.HELLO, worker_id="odd", model="far", secret=SECRET, state="ready", info="a string", pid="x"))
    sock.send(p.encode(p.READY, info=["not", "a", "map"]))
    sock.send(
        p.encode(
            p.HEARTBEAT,
            stats={"running": "lots", "waiting": None, "rss_bytes": "x", "cache": "y", "requests": 5, "z": b"\x01"},
            step_busy_s="long",
        )
    )
    sock.send(p.encode(p.EVENTS, items="nonsense"))
    deadline = time.monotonic() + 10
    while not any(w["worker_id"] == "odd" for m in gw.status()["models"] for w in m["workers"]):
        assert time.monotonic() < deadline, "the worker was not registered"
        time.sleep(0.1)
    time.sleep(0.5)
    for path in ("/v1/status", "/v1/models", "/metrics", "/health"):
        status, _, body = http(f"{gw.url}{path}")
        assert status == 200, (path, body)
    sock.send(p.encode(p.BYE))
    sock.close()
