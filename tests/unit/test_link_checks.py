"""What a worker says is checked before the gateway keeps it, and liveness is judged from a
worker's own evidence (its process state, its engine watchdog), not from silence alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from mlxgw.gateway.link import liveness as live
from mlxgw.gateway.link import wire_checks as wc

LIMITS = live.Limits(window_s=5, hang_timeout_s=120)


def test_non_numeric_stats_are_dropped_and_the_rest_is_plain_json():
    stats = wc.clean_stats(
        {"running": "lots", "waiting": 2, "rss_bytes": float("nan"), "cache": "big", "blob": b"\x00", "x": {1: 2}}
    )
    assert stats == {"waiting": 2, "x": {}}
    json.dumps(stats)


def test_info_that_is_not_a_mapping_becomes_empty():
    assert wc.clean_info("a string") == {}
    assert wc.clean_info({"context_length": "long", "load_seconds": 1.5, "engine": 3}) == {"load_seconds": 1.5}


def test_malformed_event_items_are_counted_not_delivered():
    good, bad = wc.event_items([["r1", {"e": "delta"}], ["r2"], [3, {"e": "x"}], ["r3", {"no": "kind"}], "junk"])
    assert good == [("r1", {"e": "delta"})] and bad == 4


def test_a_stopped_process_is_hung_once_silent_past_the_window():
    assert live.verdict(6, 0, live.ProcessState.STOPPED, LIMITS, host_stall=False) is not None
    assert live.verdict(4, 0, live.ProcessState.STOPPED, LIMITS, host_stall=False) is None


def test_a_silent_but_running_local_process_is_slow_not_dead():
    assert live.verdict(20, 0, live.ProcessState.RUNNING, LIMITS, host_stall=False) is None
    assert live.verdict(31, 0, live.ProcessState.RUNNING, LIMITS, host_stall=False) is not None  # hard bound


def test_a_silent_process_whose_watchdog_fired_is_hung():
    assert "watchdog" in live.verdict(10, 115, live.ProcessState.RUNNING, LIMITS, host_stall=False)


def test_a_silent_remote_worker_is_dead_unless_every_worker_is_silent():
    assert live.verdict(6, 0, live.ProcessState.UNKNOWN, LIMITS, host_stall=False) is not None
    assert live.verdict(6, 0, live.ProcessState.UNKNOWN, LIMITS, host_stall=True) is None
    assert live.verdict(31, 0, live.ProcessState.UNKNOWN, LIMITS, host_stall=True) is not None


def test_probe_reads_a_stopped_and_a_gone_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert live.probe(proc.pid) is live.ProcessState.RUNNING
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while live.probe(proc.pid) is not live.ProcessState.STOPPED and time.monotonic() < deadline:
            time.sleep(0.02)
        assert live.probe(proc.pid) is live.ProcessState.STOPPED
    finally:
        proc.kill()
        proc.wait()
    assert live.probe(proc.pid) is live.ProcessState.GONE
