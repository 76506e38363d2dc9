"""`mlxgw models pull` against a local fake hub (HF_ENDPOINT on 127.0.0.1): MLX repositories
referenced in place in the hub cache, GGUF repositories converted, resumed downloads,
revision pinning, and clear errors for a missing repo, a gated repo, a repo of neither kind
and no network. Nothing reaches the internet."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from helpers.fake_hub import FakeHub, FakeRepo
from helpers.mlxgw_cli import assert_clean_error, mlxgw

SHA1, SHA2 = "1" * 40, "2" * 40


def _mlx_files(tiny_dir: Path) -> dict[str, bytes]:
    names = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return {n: (tiny_dir / n).read_bytes() for n in names}


@pytest.fixture()
def hub(tiny_dir, tmp_path):
    files = _mlx_files(tiny_dir)
    older = dict(files, **{"config.json": files["config.json"].replace(b"{", b'{"pinned": "old", ', 1)})
    fake = FakeHub(
        repos={
            "org/tiny-mlx": FakeRepo([(SHA1, older), (SHA2, files)]),
            "org/gated": FakeRepo([(SHA1, files)], gated=True),
            "org/docs": FakeRepo([(SHA1, {"README.md": b"# nothing to serve"})]),
        }
    ).start()
    yield fake
    fake.stop()


def _pull(hub: FakeHub, home: Path, *args: str, token: str | None = None):
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(home / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    env["HF_TOKEN"] = token or ""
    return mlxgw("models", "pull", *args, home=home, env=env, timeout=300)


def test_pull_of_an_mlx_repo_references_the_hub_cache(hub, tmp_path):
    result = _pull(hub, tmp_path, "org/tiny-mlx", "--name", "tiny-pulled")
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "models" / "tiny-pulled"
    weights = folder / "model.safetensors"
    assert weights.is_symlink() and (tmp_path / "hf" / "hub") in weights.resolve().parents
    record = json.loads((folder / "mlxgw.json").read_text())
    assert record["source_spec"] == f"hf:org/tiny-mlx@{SHA2}" and record["reference"] is True
    listing = mlxgw("models", "list", home=tmp_path)
    assert "tiny-pulled" in listing.stdout and f"hf:org/tiny-mlx@{SHA2}" in listing.stdout


def test_pulled_model_loads_with_mlx_lm(hub, tmp_path):
    assert _pull(hub, tmp_path, "org/tiny-mlx").returncode == 0
    from mlx_lm.utils import load_model

    model, config = load_model(tmp_path / "models" / "tiny-mlx")
    assert config["model_type"] == "llama"


def test_revision_pinning_takes_that_commit(hub, tmp_path):
    result = _pull(hub, tmp_path, f"org/tiny-mlx@{SHA1}", "--name", "pinned")
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "models" / "pinned" / "config.json").read_text())
    assert config["pinned"] == "old"


def test_pulling_the_same_revision_again_is_a_no_op(hub, tmp_path):
    assert _pull(hub, tmp_path, "org/tiny-mlx").returncode == 0
    again = _pull(hub, tmp_path, "org/tiny-mlx")
    assert again.returncode == 0 and "already pulled" in again.stdout


def test_interrupted_download_resumes_with_a_range_request(hub, tmp_path):
    hub.interrupt_once.add("model.safetensors")
    result = _pull(hub, tmp_path, "org/tiny-mlx")
    if result.returncode != 0:  # the library may not retry by itself: the next pull resumes
        result = _pull(hub, tmp_path, "org/tiny-mlx")
    assert result.returncode == 0, result.stderr
    ranges = [r for method, path, r in hub.log if path.endswith("model.safetensors") and method == "GET" and r]
    assert ranges and int(ranges[-1].removeprefix("bytes=").rstrip("-")) > 0
    weights = tmp_path / "models" / "tiny-mlx" / "model.safetensors"
    assert weights.read_bytes() == hub.repos["org/tiny-mlx"].commits[-1][1]["model.safetensors"]


def test_missing_repo_is_a_clear_error(hub, tmp_path):
    assert_clean_error(_pull(hub, tmp_path, "org/nothing-here"), "not found")


def test_unknown_revision_is_a_clear_error(hub, tmp_path):
    assert_clean_error(_pull(hub, tmp_path, "org/tiny-mlx@" + "f" * 40), "no revision")


def test_gated_repo_without_a_token_is_a_clear_error(hub, tmp_path):
    assert_clean_error(_pull(hub, tmp_path, "org/gated"), "gated", "HF_TOKEN")


def test_gated_repo_with_a_token_pulls(hub, tmp_path):
    assert _pull(hub, tmp_path, "org/gated", token="hf_test").returncode == 0


def test_repo_that_is_neither_mlx_nor_gguf_is_a_clear_error(hub, tmp_path):
    assert_clean_error(_pull(hub, tmp_path, "org/docs"), "neither an MLX model")


def test_no_network_says_so_and_points_to_hf_endpoint(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = mlxgw(
        "models", "pull", "org/x", home=tmp_path,
        env={"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "hf")},
    )  # fmt: skip
    assert_clean_error(result, "HF_ENDPOINT")


def test_gguf_repo_pull_converts_the_file(tmp_path):
    pytest.importorskip("gguf")
    from helpers.gguf_models import write_twice

    _, gguf_file = write_twice("qwen3", tmp_path / "src")
    fake = FakeHub(repos={"org/tiny-gguf": FakeRepo([(SHA1, {"tiny.gguf": gguf_file.read_bytes()})])}).start()
    try:
        result = _pull(fake, tmp_path, "org/tiny-gguf", "--file", "tiny.gguf", "--name", "g")
    finally:
        fake.stop()
    assert result.returncode == 0, result.stderr
    record = json.loads((tmp_path / "models" / "g" / "mlxgw.json").read_text())
    assert record["architecture"] == "qwen3" and record["source_spec"] == f"hf:org/tiny-gguf@{SHA1}/tiny.gguf"
