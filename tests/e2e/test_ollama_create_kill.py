"""kill -9 of a real `mlxgw up` in the middle of Ollama's /api/create of a GGUF import: the
next start serves, models.yaml lists no half entry, no orphan model folder appears, and what
a killed edit or import left beside models.yaml and in the models directory is removed."""

from __future__ import annotations

import signal
import threading
import time

import psutil
import yaml
from helpers.gateway import start_gateway
from helpers.gguf_models import write_twice
from helpers.http import http


def _import_child(gw, timeout: float = 60) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(gw.proc.pid).children():
            try:
                if "import" in child.cmdline() and "models" in child.cmdline():
                    return child
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.01)
    raise AssertionError("the create never started its import")


def test_kill_during_a_gguf_create_leaves_nothing_that_breaks_the_next_start(tmp_path):
    allowed = tmp_path / "allowed"
    _, gguf = write_twice("llama", allowed)
    config = {
        "manager": {"auto_discover": True, "allowed_import_paths": [str(allowed)]},
        "models": [{"name": "echo-agent", "engine": "echo"}],
    }
    gw = start_gateway(tmp_path, config, "kill-gateway")
    body = {"model": "made", "from": str(gguf), "stream": False}
    sent = threading.Thread(target=lambda: http(f"{gw.url}/api/create", "POST", body, timeout=120), daemon=True)
    sent.start()
    child = _import_child(gw)  # the request is accepted and its import runs
    gw.proc.send_signal(signal.SIGKILL)
    gw.proc.wait(30)
    started = time.monotonic()
    psutil.wait_procs([child], timeout=120)  # a child left running would finish its import
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    models = tmp_path / "models"
    assert not (models / "made").exists()  # no import finished after the gateway died
    assert time.monotonic() - started < 20  # it went with its gateway
    # What a kill in the middle of an edit or an import leaves (planted where they would be):
    (gw.config_path.parent / f".{gw.config_path.name}.abc123.tmp").write_text("models: [half")
    (models / ".import-other-x1-999999999").mkdir(parents=True)
    registry = yaml.safe_load(gw.config_path.read_text())
    assert [m["name"] for m in registry["models"]] == ["echo-agent"]  # no half entry
    again = start_gateway(tmp_path, registry, "kill-gateway")
    try:
        assert not list(gw.config_path.parent.glob(f".{gw.config_path.name}.*.tmp"))
        assert not list(models.glob(".import-*")) and not list(models.glob(".trash-*"))
        status, _, out = http(f"{again.url}/api/create", "POST", body, timeout=120)
        assert status == 200, out
        chat = {"model": "made", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert http(f"{again.url}/v1/chat/completions", "POST", chat)[0] == 200
    finally:
        again.stop()
