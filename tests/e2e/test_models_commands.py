"""`mlxgw models show` and `mlxgw models rm`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

from helpers.mlxgw_cli import assert_clean_error, mlxgw


def test_show_describes_architecture_context_template_and_size(tmp_path, tiny_dir):
    shutil.copytree(tiny_dir, tmp_path / "models" / "tiny")
    result = mlxgw("models", "show", "tiny", home=tmp_path)
    assert result.returncode == 0, result.stderr
    fields = dict(line.split(None, 1) for line in result.stdout.splitlines() if " " in line.strip())
    assert fields["architecture"].strip() == "llama"
    assert fields["context"].strip() == "32768"
    assert fields["template"].strip() == "chat"
    assert fields["size"].startswith("on disk") and "MB" in fields["size"]


def test_show_of_an_unknown_model_is_a_clear_error(tmp_path):
    assert_clean_error(mlxgw("models", "show", "nope", home=tmp_path), "no model 'nope'")


def test_rm_removes_a_model(tmp_path, tiny_dir):
    shutil.copytree(tiny_dir, tmp_path / "models" / "tiny")
    result = mlxgw("models", "rm", "tiny", home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "models" / "tiny").exists()


def test_rm_refuses_a_model_a_worker_serves_unless_forced(tmp_path, tiny_dir):
    folder = tmp_path / "models" / "tiny"
    shutil.copytree(tiny_dir, folder)
    # A real worker process for the model (its gateway is absent; it waits to connect).
    worker = subprocess.Popen(
        [sys.executable, "-m", "mlxgw.worker", "--connect", f"ipc://{tmp_path}/gw.sock", "--model", "tiny",
         "--model-path", str(folder), "--orphan-after", "120"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(0.5)
        assert worker.poll() is None
        assert_clean_error(mlxgw("models", "rm", "tiny", home=tmp_path), "being served", str(worker.pid))
        assert folder.is_dir()
        forced = mlxgw("models", "rm", "tiny", "--force", home=tmp_path)
        assert forced.returncode == 0, forced.stderr
        assert not folder.exists()
    finally:
        worker.kill()
        worker.wait()


def test_rm_of_an_unknown_or_invalid_name_is_a_clear_error(tmp_path):
    assert_clean_error(mlxgw("models", "rm", "nope", home=tmp_path), "no model 'nope'")
    assert_clean_error(mlxgw("models", "rm", "../x", home=tmp_path), "invalid model name")
