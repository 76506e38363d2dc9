"""`mlxgw up` and `mlxgw reload` as processes: the port is checked before any worker starts,
run files a killed gateway left behind are cleaned at start, and reload finds the gateway
even when its pid file is stale (or says clearly that none runs)."""

from __future__ import annotations

import signal
import socket
import time

import psutil
import pytest
from helpers import start_gateway
from helpers.mlxgw_cli import mlxgw

NULL_CONFIG = {
    "manager": {"auto_discover": False},
    "models": [{"name": "null", "engine": "null", "preload": True}],
}


@pytest.fixture(scope="module")
def null_gateway(home):
    gw = start_gateway(home, NULL_CONFIG, "hygiene-gateway")
    yield gw
    gw.stop()


def test_up_on_a_busy_port_exits_before_starting_any_worker(home, null_gateway):
    pid_file = home / "run" / f"gateway-{null_gateway.port}.pid"
    config, port = str(null_gateway.config_path), str(null_gateway.port)
    result = mlxgw("up", "--config", config, "--port", port, home=home, timeout=120)
    assert result.returncode == 2
    assert "in use" in result.stderr and "Traceback" not in result.stderr
    assert "started worker" not in result.stderr
    assert pid_file.read_text().strip() == str(null_gateway.proc.pid)  # the running gateway's stays


def test_stale_sockets_and_pid_files_are_removed_at_start(home, tmp_path):
    run = home / "run"
    run.mkdir(parents=True, exist_ok=True)
    stale_sock = run / "gateway-deadbeef.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale_sock))  # closed without unlinking: what a kill -9 leaves
    stale_pid = run / "gateway-1.pid"
    stale_pid.write_text("4194303")
    gw = start_gateway(home, NULL_CONFIG, "cleaning-gateway")
    try:
        assert not stale_sock.exists() and not stale_pid.exists()
        assert (run / f"gateway-{gw.port}.pid").read_text().strip() == str(gw.proc.pid)
    finally:
        gw.stop()
    assert not (run / f"gateway-{gw.port}.pid").exists()


def test_reload_finds_the_gateway_by_its_port_when_the_pid_file_is_stale(home, null_gateway):
    pid_file = home / "run" / f"gateway-{null_gateway.port}.pid"
    pid_file.write_text("4194303")  # left by a killed predecessor
    result = mlxgw("reload", "--port", str(null_gateway.port), home=home, timeout=120)
    assert result.returncode == 0, result.stderr
    assert str(null_gateway.proc.pid) in result.stdout
    assert pid_file.read_text().strip() == str(null_gateway.proc.pid)
    deadline = time.monotonic() + 10
    while "reloaded registry" not in null_gateway.log():
        assert time.monotonic() < deadline, "the gateway did not reload"
        time.sleep(0.1)


def test_reload_says_clearly_that_no_gateway_runs_after_one_was_killed(home):
    gw = start_gateway(home, NULL_CONFIG, "killed-gateway")
    gw.stop(signal.SIGKILL)
    pid_file = home / "run" / f"gateway-{gw.port}.pid"
    assert pid_file.exists()  # kill -9 leaves it
    result = mlxgw("reload", "--port", str(gw.port), home=home, timeout=120)
    assert result.returncode == 2
    assert f"no mlxgw gateway is running on port {gw.port}" in result.stderr
    assert "stale pid file" in result.stderr and not pid_file.exists()


def test_sigterm_stops_an_idle_gateway_and_its_workers_at_once(home):
    """What `mlxgw restart`, launchd and systemd send. A graceful stop that lost its own
    cancellation (the batch runner's loop) once left the gateway running after its log said
    "shutting down", and a restarted one beside it."""
    gw = start_gateway(home, NULL_CONFIG, "sigterm-gateway")
    time.sleep(1.5)  # the batch runner has started its loop
    workers = gw.descendants()
    started = time.monotonic()
    assert gw.stop(signal.SIGTERM, timeout=20) == 0, "the gateway did not exit on SIGTERM"
    assert time.monotonic() - started < 20
    alive = [pid for pid in workers if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not alive, f"workers left running: {alive}"
