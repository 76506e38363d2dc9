"""Progress on long work: `mlxgw models import` reports its phases on stderr (stdout keeps only
the result line), and a lazy load's progress shows in /v1/status and `mlxgw ps`."""

from __future__ import annotations

import re
import threading
import time

from helpers import http, start_gateway
from helpers.gguf_models import write_twice
from helpers.mlxgw_cli import mlxgw

RESULT_LINE = re.compile(r"^t: imported -> .+ \(llama, float32, \d+ MB, [\d.]+ s\)\n$")


def test_gguf_import_prints_plain_progress_lines_on_stderr_and_only_the_result_on_stdout(tmp_path):
    _, gguf = write_twice("llama", tmp_path / "src")
    result = mlxgw("models", "import", str(gguf), "--name", "t", home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert RESULT_LINE.match(result.stdout), result.stdout
    lines = result.stderr.splitlines()
    assert "\r" not in result.stderr and "\x1b" not in result.stderr  # not a terminal: no redraws
    for phase in ("hashing source", "reading tensors", "strict load check", "converting tensors", "writing weights"):
        assert any(line.startswith(phase) for line in lines), (phase, result.stderr)
        assert any(line.startswith(phase) and line.endswith(("done", " s")) for line in lines), (phase, lines)
    assert re.search(r"^reading tensors: 21/21 tensors \(100%\), [\d.]+ s done$", result.stderr, re.M), lines
    # The strict load check comes after the tensors are read and before anything is written.
    order = [
        next(i for i, line in enumerate(lines) if line.startswith(p))
        for p in ("reading tensors", "strict load check", "writing weights")
    ]
    assert order == sorted(order), lines


def test_folder_import_prints_hashing_and_copying_progress(tmp_path):
    folder, _ = write_twice("llama", tmp_path / "src")
    result = mlxgw("models", "import", str(folder), "--name", "t", home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert RESULT_LINE.match(result.stdout), result.stdout
    assert re.search(r"^copying files: [\d.]+/[\d.]+ MB \(100%\), [\d.]+ s done$", result.stderr, re.M), result.stderr


def _load_in_background(gw, model: str) -> threading.Thread:
    """POST /v1/models/NAME/load answers once the model is ready: run it beside the polling."""
    thread = threading.Thread(target=http, args=(f"{gw.url}/v1/models/{model}/load", "POST", {}), daemon=True)
    thread.start()
    return thread


def test_a_loading_model_reports_the_bytes_read_so_far_in_status(home, smollm2_dir):
    config = {
        "manager": {"auto_discover": False, "heartbeat_s": 0.2},
        "models": [{"name": "smollm2-135m"}],
    }
    gw = start_gateway(home, config, "load-progress-gateway")
    try:
        weights = sum(f.stat().st_size for f in smollm2_dir.glob("*.safetensors"))
        loader = _load_in_background(gw, "smollm2-135m")
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            m = gw.model_status("smollm2-135m")
            if m["state"] == "ready":
                break
            if m["state"] == "loading":
                seen.append(m["load"])
            time.sleep(0.05)
        loader.join(timeout=60)
        assert gw.model_status("smollm2-135m")["state"] == "ready"
        assert gw.model_status("smollm2-135m")["load"] is None  # only a loading model has one
        reported = [s for s in seen if s["loaded_bytes"] > 0 and s["expected_bytes"] == weights]
        assert reported, seen
        assert all(s["loaded_bytes"] <= s["expected_bytes"] for s in seen)
        elapsed = [s["elapsed_s"] for s in seen]
        assert elapsed == sorted(elapsed) and elapsed[-1] > 0
    finally:
        gw.stop()


def test_mlxgw_ps_shows_how_far_a_load_has_got(home, monkeypatch):
    # The null engine honours this test-only delay, so the load lasts long enough to look at.
    # 5 s: a few times what `mlxgw ps` takes to start on a busy 2-core host.
    monkeypatch.setenv("MLXGW_TEST_NULL_LOAD_S", "5")
    config = {
        "manager": {"auto_discover": False, "heartbeat_s": 0.2},
        "models": [{"name": "slow-null", "engine": "null"}],
    }
    gw = start_gateway(home, config, "ps-progress-gateway")
    try:
        _load_in_background(gw, "slow-null")
        deadline = time.monotonic() + 30
        while gw.model_status("slow-null")["state"] != "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        ps = mlxgw("ps", "--url", gw.url, home=home)
        assert ps.returncode == 0, ps.stderr
        row = next(line for line in ps.stdout.splitlines() if line.startswith("slow-null"))
        assert re.search(r"\bloading \d+/\d+ MB\b", row), ps.stdout
        load = gw.model_status("slow-null")["load"]
        assert load["expected_bytes"] > 0 and load["elapsed_s"] > 0, load
    finally:
        gw.stop()
