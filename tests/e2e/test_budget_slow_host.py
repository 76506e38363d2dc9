"""The memory budget holds on a busy host, counting every process a worker runs.

Three tiny models, a budget with room for two, requests alternating and concurrent: the
summed memory of every process under the gateway (and of what its workers left behind)
must stay within the budget. A host made slow on purpose (MLXGW_TEST_SLOW_PREFILL_MS), and
each worker runs a helper process holding memory, lingering after the worker exits
(MLXGW_TEST_CHILD_MB/_LINGER_S: what MLX's g++ compiles are: 100-112 MB cc1plus processes,
which a worker killed mid-compile leaves running). Before the fix the gateway counted each
worker's own RSS from its last heartbeat: all three were admitted, and a load started while
an evicted worker's helper still held its memory."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import yaml
from helpers import openai_client, start_gateway, wait_for

CHILD_MB = 120
MODELS = ("tiny-a", "tiny-b", "tiny-c")
TOLERANCE = 16 << 20  # a tiny worker's growth between two of the gateway's readings


class TreeSampler:
    """Sums the RSS of every process ever seen under the gateway that still runs (orphans
    included: they are re-parented away from it); a fork that has not exec'd shares its
    parent's pages and counts nothing."""

    def __init__(self, gw):
        self.root = psutil.Process(gw.proc.pid)
        self.seen: dict[int, psutil.Process] = {}
        self.peak = 0
        self.at_peak: list[tuple[int, str, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for child in self.root.children(recursive=True):
            self.seen.setdefault(child.pid, child)
        rows = []
        for proc in list(self.seen.values()):
            try:
                if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                parent = self.seen.get(proc.ppid())
                if parent is not None and parent.cmdline() == proc.cmdline():
                    continue  # forked, not yet exec'd
                rows.append((proc.pid, " ".join(proc.cmdline())[-40:], proc.memory_info().rss))
            except psutil.Error:
                continue
        total = sum(r[2] for r in rows)
        if total > self.peak:
            self.peak, self.at_peak = total, rows

    def _run(self) -> None:
        while not self.stop.is_set():
            self._sample()
            time.sleep(0.02)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


@pytest.fixture
def slow_env():
    knobs = {"MLXGW_TEST_SLOW_PREFILL_MS": "2", "MLXGW_TEST_CHILD_MB": str(CHILD_MB), "MLXGW_TEST_CHILD_LINGER_S": "20"}
    os.environ.update(knobs)
    yield
    for k in knobs:
        del os.environ[k]


def _tree_rss(pid: int) -> int:
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def test_three_models_under_a_budget_for_two_stay_within_it_on_a_slow_host(home, tiny_dir, slow_env):
    config = {
        "manager": {"auto_discover": False, "memory_budget": str(8 << 30), "wait_timeout_s": 120},
        "models": [{"name": n, "source": "tiny"} for n in MODELS],
    }
    gw = start_gateway(home, config, "budget-slow-host")
    client = openai_client(gw, timeout=300)
    prompt = " ".join(f"w{i}" for i in range(300))

    def ask(i: int) -> None:
        out = client.chat.completions.create(
            model=MODELS[i % 3], messages=[{"role": "user", "content": prompt}], max_tokens=4, temperature=0
        )
        assert out.choices[0].message.content

    try:
        ask(0)
        pid = gw.worker_pid("tiny-a")
        wait_for(lambda: len(psutil.Process(pid).children()) == 1, 30)
        one = _tree_rss(pid)  # one worker and its helper
        budget = int(2.4 * one)
        own = psutil.Process(pid).memory_info().rss
        assert 3 * own < budget < 3 * one, "the budget must hold two workers, and three by their own RSS"
        config["manager"]["memory_budget"] = str(budget)
        gw.config_path.write_text(yaml.safe_dump(config))
        gw.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: gw.status()["memory"]["budget_bytes"] == budget, 10)
        with TreeSampler(gw) as sampler, ThreadPoolExecutor(6) as pool:
            list(pool.map(ask, range(36)))
        memory = gw.status()["memory"]
    finally:
        gw.stop()
    shown = [(p, c, r >> 20) for p, c, r in sampler.at_peak]
    assert sampler.peak <= budget + TOLERANCE, (sampler.peak >> 20, budget >> 20, shown, memory)
    assert memory["evictions"] >= 3, memory
