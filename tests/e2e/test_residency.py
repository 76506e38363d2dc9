"""Registry and residency: memory budget with LRU eviction, shared first loads, idle
unload, hung and crashing workers, hot reload, remote workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import openai
import psutil
import pytest
import yaml
from helpers import NO_EOS, REPO, free_port, http, openai_client, start_gateway, wait_for
from helpers.mlxgw_cli import mlxgw

from mlxgw.gateway.models.residency import PROCESS_OVERHEAD_BYTES, WEIGHTS_FACTOR

MSGS = [{"role": "user", "content": "Say something."}]


def rss_of_workers(gw) -> int:
    total = 0
    for pid in gw.descendants():
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def greedy(gw, model: str, max_tokens: int = 8) -> str:
    out = openai_client(gw).chat.completions.create(model=model, messages=MSGS, max_tokens=max_tokens, temperature=0)
    return out.choices[0].message.content


@pytest.fixture(scope="module")
def one_worker_rss(residency_gateway) -> int:
    """Measured RSS of one fresh tiny worker (the module gateway's `probe`, loaded for this
    alone and unloaded after), to size a budget that fits exactly one."""
    gw = residency_gateway
    greedy(gw, "probe")
    rss = psutil.Process(gw.worker_pid("probe")).memory_info().rss
    status, _, body = http(f"{gw.url}/v1/models/probe/unload", "POST", {})
    assert status == 200 and body["loaded"] is False, body
    return rss


def test_budget_that_fits_one_model_evicts_the_least_recently_used(home, tiny_dir, one_worker_rss):
    weights = sum(f.stat().st_size for f in tiny_dir.glob("*.safetensors"))
    estimate = int(weights * WEIGHTS_FACTOR) + PROCESS_OVERHEAD_BYTES
    budget = max(int(1.6 * one_worker_rss), estimate + (16 << 20))
    assert 2 * one_worker_rss > budget, "budget would fit two workers; the test would prove nothing"
    config = {
        "manager": {"auto_discover": False, "memory_budget": f"{budget}", "wait_timeout_s": 30},
        "models": [{"name": n, "source": "tiny"} for n in ("tiny-a", "tiny-b", "tiny-c")],
    }
    gw = start_gateway(home, config, "budget-gateway")
    samples: list[int] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            samples.append(rss_of_workers(gw))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        reference = greedy(gw, "tiny-a")
        for name in ("tiny-b", "tiny-a", "tiny-c", "tiny-b", "tiny-a"):
            assert greedy(gw, name) == reference
        status = gw.status()
    finally:
        stop.set()
        sampler.join()
        gw.stop()
    assert status["memory"]["evictions"] >= 5
    assert len(status["memory"]["resident_models"]) == 1
    assert max(samples) <= budget, (max(samples), budget)


def test_concurrent_first_requests_share_one_load(residency_gateway):
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outputs = list(pool.map(lambda _: greedy(residency_gateway, "lazy"), range(8)))
    assert len(set(outputs)) == 1
    model = residency_gateway.model_status("lazy")
    assert model["loads"] == 1 and len(model["workers"]) == 1


def test_idle_model_is_unloaded_and_its_memory_returned(residency_gateway):
    greedy(residency_gateway, "idle")
    pid = residency_gateway.worker_pid("idle")
    rss = psutil.Process(pid).memory_info().rss
    before = rss_of_workers(residency_gateway)
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 20)
    wait_for(lambda: residency_gateway.model_status("idle")["state"] == "unloaded", 5)
    assert residency_gateway.model_status("idle")["last_error"] is None  # an unload is not an error
    assert rss_of_workers(residency_gateway) <= before - 0.9 * rss
    greedy(residency_gateway, "idle")  # loads again on demand
    assert residency_gateway.model_status("idle")["loads"] == 2


def test_hung_worker_is_detected_restarted_and_others_are_untouched(residency_gateway):
    client = openai_client(residency_gateway)
    greedy(residency_gateway, "steady")
    steady_pid = residency_gateway.worker_pid("steady")
    stream = client.chat.completions.create(
        model="hang", messages=MSGS, max_tokens=30000, stream=True, extra_body={"logit_bias": NO_EOS}
    )
    next(iter(stream))
    os.kill(residency_gateway.worker_pid("hang"), signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(openai.APIError, match="stopped"):
        for _ in stream:
            pass
    detected = time.monotonic() - started
    assert detected < 15
    assert greedy(residency_gateway, "steady")  # served while the other model was down
    assert greedy(residency_gateway, "hang")  # restarted
    assert residency_gateway.model_status("hang")["restarts"] >= 1
    assert residency_gateway.worker_pid("steady") == steady_pid


def test_a_folder_that_cannot_load_marks_the_model_failed_with_its_reason(residency_gateway):
    """A folder without weights is not a crash loop: the worker says it cannot load and the
    model is failed at the first try, with the reason; crash loops: test below."""
    with pytest.raises(openai.APIStatusError) as info:
        greedy(residency_gateway, "broken")
    assert info.value.status_code == 503
    wait_for(lambda: residency_gateway.model_status("broken")["state"] == "failed", 60)
    models = {m.id: m for m in openai_client(residency_gateway).models.list().data}
    assert models["broken"].state == "failed", models["broken"]
    assert "cannot load" in models["broken"].last_error and "safetensors" in models["broken"].last_error
    with pytest.raises(openai.APIStatusError, match="failed") as info:
        greedy(residency_gateway, "broken")
    assert info.value.status_code == 503
    assert greedy(residency_gateway, "steady")


def test_a_failed_models_errors_show_no_server_paths(residency_gateway, home):
    """Error messages once showed server paths (user names, the machine's layout)."""
    wait_for(lambda: residency_gateway.model_status("broken")["state"] == "failed", 60)
    with pytest.raises(openai.APIStatusError) as info:
        greedy(residency_gateway, "broken")
    shown = [str(info.value), json.dumps(http(f"{residency_gateway.url}/v1/models")[2], ensure_ascii=False)]
    shown.append(json.dumps(residency_gateway.model_status("broken"), ensure_ascii=False))
    assert all("…/broken" in text for text in shown), shown  # the error names the folder, not where it is
    for text in shown:
        assert str(home) not in text and "/tmp/" not in text, text


def test_reload_adds_and_removes_models_while_a_stream_completes(residency_gateway, home):
    client = openai_client(residency_gateway)
    greedy(residency_gateway, "retiring")
    pid = residency_gateway.worker_pid("retiring")
    stream = client.chat.completions.create(
        model="retiring", messages=MSGS, max_tokens=1500, temperature=0, stream=True, extra_body={"logit_bias": NO_EOS}
    )
    first = next(iter(stream))
    config = yaml.safe_load(residency_gateway.config_path.read_text())
    config["models"] = [m for m in config["models"] if m["name"] != "retiring"] + [
        {"name": "newcomer", "source": "tiny"}
    ]
    residency_gateway.config_path.write_text(yaml.safe_dump(config))
    residency_gateway.proc.send_signal(signal.SIGHUP)
    chunks = [first, *stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    wait_for(lambda: "newcomer" in {m["name"] for m in residency_gateway.status()["models"]}, 10)
    assert greedy(residency_gateway, "newcomer")
    with pytest.raises(openai.NotFoundError):
        greedy(residency_gateway, "retiring")
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 20)


def test_a_registry_file_with_errors_is_rejected_whole(residency_gateway):
    original = residency_gateway.config_path.read_text()
    residency_gateway.config_path.write_text(original + "\n  - name: bad\n    max_num_seqs: lots\n")
    try:
        residency_gateway.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "reload rejected" in residency_gateway.log(), 10)
        assert "bad" not in {m["name"] for m in residency_gateway.status()["models"]}
        assert greedy(residency_gateway, "steady")
    finally:
        residency_gateway.config_path.write_text(original)


@pytest.fixture(scope="module")
def residency_gateway(home, tiny_dir):
    broken = home / "models" / "broken"
    broken.mkdir(parents=True, exist_ok=True)
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    config = {
        "manager": {"auto_discover": False, "heartbeat_s": 0.5, "liveness": 6, "restart_backoff_s": 0.1},
        "models": [
            {"name": "lazy", "source": "tiny"},
            {"name": "idle", "source": "tiny", "idle_unload_s": 2},
            {"name": "steady", "source": "tiny"},
            {"name": "hang", "source": "tiny"},
            {"name": "broken"},
            {"name": "retiring", "source": "tiny"},
            {"name": "probe", "source": "tiny"},  # one_worker_rss
        ],
    }
    gw = start_gateway(home, config, "residency-gateway")
    yield gw
    gw.stop()


def test_remote_worker_with_a_shared_secret_serves_through_the_gateway(home, tiny_dir):
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    secret = "correct-horse-battery-staple"
    config = {"manager": {"auto_discover": False}, "models": [{"name": "far", "source": "tiny", "remote_only": True}]}
    os.environ["MLXGW_SECRET"] = secret
    try:
        gw = start_gateway(home, config, "remote-gateway", extra_args=("--worker-listen", endpoint))
    finally:
        del os.environ["MLXGW_SECRET"]

    def remote_worker(key: str) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlxgw.worker",
                "--connect",
                endpoint,
                "--model",
                "far",
                "--model-path",
                str(tiny_dir),
                "--orphan-after",
                "0",
            ],
            cwd=REPO,
            env=dict(os.environ, MLXGW_SECRET=key),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    good = bad = None
    try:
        with pytest.raises(openai.APIStatusError) as info:
            greedy(gw, "far")
        assert info.value.status_code == 503
        good = remote_worker(secret)
        wait_for(lambda: gw.model_status("far")["loaded"], 60)
        assert greedy(gw, "far")
        bad = remote_worker("wrong-secret-wrong-secret")
        wait_for(lambda: "wrong secret" in gw.log(), 60)
        assert len(gw.model_status("far")["workers"]) == 1
        good.send_signal(signal.SIGTERM)  # a remote worker that leaves is handled like a crash
        good.wait(30)
        wait_for(lambda: not gw.model_status("far")["loaded"], 15)
        with pytest.raises(openai.APIStatusError):
            greedy(gw, "far")
    finally:
        for p in (good, bad):
            if p is not None and p.poll() is None:
                p.kill()
        gw.stop()


def workers_of(gw) -> list[int]:
    """The gateway's own children: its workers (what a worker starts itself is the worker's)."""
    try:
        return [c.pid for c in psutil.Process(gw.proc.pid).children()]
    except psutil.NoSuchProcess:
        return []


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:300]
    except psutil.Error:
        return "?"


class Watcher:
    """Samples every 50 ms: summed worker RSS, and the gateway's child processes against the
    processes /v1/status says it owns (a child it does not list is an untracked worker)."""

    def __init__(self, gw):
        self.gw = gw
        self.rss: list[int] = []
        self.untracked: list[tuple[int, dict]] = []
        self.most_per_model: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _owned(self) -> dict[int, str]:
        return {p["pid"]: p["model"] for p in self.gw.status()["processes"]}

    def _run(self):
        while not self._stop.is_set():
            children = workers_of(self.gw)
            self.rss.append(rss_of_workers(self.gw))
            owned = self._owned()
            missing = [pid for pid in children if pid not in owned]
            if missing:  # spawned between the two reads? ask once more
                owned = self._owned()
                for pid in missing:
                    if pid not in owned and psutil.pid_exists(pid):
                        self.untracked.append((pid, owned, _cmdline(pid)))
            for model in set(owned.values()):
                n = sum(1 for m in owned.values() if m == model)
                self.most_per_model[model] = max(self.most_per_model.get(model, 0), n)
            time.sleep(0.05)


def test_concurrent_requests_to_three_models_under_a_two_model_budget(home, tiny_dir, one_worker_rss):
    weights = sum(f.stat().st_size for f in tiny_dir.glob("*.safetensors"))
    estimate = int(weights * WEIGHTS_FACTOR) + PROCESS_OVERHEAD_BYTES
    # Two fit: a resident one as measured plus the next one's estimate. Three never do.
    budget = max(int(2.6 * one_worker_rss), one_worker_rss + estimate + (16 << 20))
    assert 3 * one_worker_rss > budget, "budget would fit three workers; the test would prove nothing"
    config = {
        "manager": {"auto_discover": False, "memory_budget": f"{budget}", "wait_timeout_s": 120},
        "models": [{"name": n, "source": "tiny"} for n in ("tri-a", "tri-b", "tri-c")],
    }
    gw = start_gateway(home, config, "three-models-gateway")
    import concurrent.futures

    try:
        with Watcher(gw) as watch, concurrent.futures.ThreadPoolExecutor(6) as pool:
            order = ["tri-a", "tri-b", "tri-c", "tri-b", "tri-c", "tri-a", "tri-c", "tri-a", "tri-b"]
            outputs = list(pool.map(lambda name: greedy(gw, name, 4), order))
        status = gw.status()
    finally:
        gw.stop()
    assert len(set(outputs)) == 1, "same weights, greedy: every model answers the same"
    assert max(watch.rss) <= budget, (max(watch.rss), budget)
    assert watch.untracked == []
    assert all(n == 1 for n in watch.most_per_model.values()), watch.most_per_model
    assert len(status["processes"]) <= 2 and status["memory"]["evictions"] >= 1
    # Each load serves a request before it may be evicted (on main, 43 loads for these 9)
    assert sum(m["loads"] for m in status["models"]) <= len(order), status["models"]
    for model in status["models"]:
        assert model["restarts"] == 0 and model["last_error"] is None, model  # evictions are not crashes
        assert model["in_flight"] == 0


def test_a_hot_reload_under_traffic_starts_the_changed_model_once(home, tiny_dir):
    config = {"manager": {"auto_discover": False}, "models": [{"name": "hot", "source": "tiny", "preload": True}]}
    gw = start_gateway(home, config, "hot-reload-gateway")
    stop = threading.Event()
    errors: list[Exception] = []

    def traffic():
        while not stop.is_set():
            try:
                greedy(gw, "hot", 2)
            except openai.APIStatusError as e:  # a request cut by the drain may fail; none may hang
                errors.append(e)

    threads = [threading.Thread(target=traffic) for _ in range(3)]
    try:
        with Watcher(gw) as watch:
            for t in threads:
                t.start()
            for seqs in (4, 6):
                time.sleep(1)  # traffic in flight when the reload comes
                changed = yaml.safe_load(gw.config_path.read_text())
                changed["models"][0]["max_num_seqs"] = seqs
                gw.config_path.write_text(yaml.safe_dump(changed))
                gw.proc.send_signal(signal.SIGHUP)
                wait_for(lambda: len(gw.status()["processes"]) == 1 and gw.model_status("hot")["loaded"], 60)
            time.sleep(0.5)
            stop.set()
            for t in threads:
                t.join(60)
        status = gw.status()
    finally:
        stop.set()
        gw.stop()
    assert watch.untracked == []
    assert watch.most_per_model["hot"] <= 2  # the draining one and its successor, never a third
    model = next(m for m in status["models"] if m["name"] == "hot")
    assert model["loads"] == 1 and model["restarts"] == 0, model  # the slot after the last reload loaded once
    assert len(status["processes"]) == 1 and model["in_flight"] == 0
    assert "lost worker" not in gw.log()
    assert all(e.status_code in (502, 503) for e in errors), errors


def crash_loop(gw, model: str) -> None:
    """Kill the model's worker four times, each time once it is ready again: a crash loop."""
    for _ in range(4):
        pid = gw.worker_pid(model, timeout=60)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda p=pid: all(w["pid"] != p for w in gw.model_status(model)["workers"]), 30)
    wait_for(lambda: gw.model_status(model)["state"] == "failed", 30)


def test_a_crash_looping_model_is_retried_after_a_backoff_and_at_once_on_reload(home):
    """Four crashes in 120 s once marked a model failed for good (still 503 twelve
    minutes later). Now it is refused for failed_retry_s, then loads again; `mlxgw reload`
    retries it at once."""
    config = {
        # Restarts 0.1, 0.2, 0.4 s apart (1, 2, 4 s by default): the same loop, 13 s sooner.
        "manager": {"auto_discover": False, "failed_retry_s": 4, "restart_backoff_s": 0.1},
        "models": [{"name": "looping", "engine": "null", "preload": True}, {"name": "bystander", "engine": "null"}],
    }
    gw = start_gateway(home, config, "crash-loop-gateway")
    client = openai_client(gw)
    try:
        crash_loop(gw, "looping")
        with pytest.raises(openai.APIStatusError, match="failed") as info:
            greedy(gw, "looping")
        assert info.value.status_code == 503
        assert greedy(gw, "bystander")  # the rest of the server is untouched
        wait_for(lambda: gw.model_status("looping")["state"] != "failed", 30)
        assert client.chat.completions.create(model="looping", messages=MSGS, max_tokens=3).usage.completion_tokens == 3
        crash_loop(gw, "looping")  # the second loop waits twice as long: reload does not
        result = mlxgw("reload", "--port", str(gw.port), home=home, timeout=120)
        assert result.returncode == 0, result.stderr
        wait_for(lambda: gw.model_status("looping")["state"] != "failed", 10)
        assert client.chat.completions.create(model="looping", messages=MSGS, max_tokens=3).usage.completion_tokens == 3
        assert gw.model_status("looping")["in_flight"] == 0
    finally:
        gw.stop()
