"""Discovery: MLX folders in a Hugging Face hub cache (symlinked blobs, as
the hub writes them) and in LM Studio's org/name layout are served in place under org/name;
a broken folder is listed with its reason instead of breaking discovery."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import http, start_gateway
from helpers.mlxgw_cli import mlxgw

SHA = "a" * 40


def _hub_cache(root: Path, tiny_dir: Path, org: str = "mlx-community", name: str = "Tiny-4bit") -> Path:
    repo = root / f"models--{org}--{name}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    snapshot = repo / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    for i, f in enumerate(p for p in sorted(tiny_dir.iterdir()) if p.is_file() and p.name != "mlxgw.json"):
        shutil.copy(f, repo / "blobs" / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("../../blobs") / f"blob{i}")
    return snapshot


def _lm_studio(root: Path, tiny_dir: Path) -> Path:
    folder = root / "lmstudio-community" / "tiny-mlx"
    shutil.copytree(tiny_dir, folder, ignore=shutil.ignore_patterns("mlxgw.json"))
    broken = root / "someone" / "broken"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{not json")
    (broken / "model.safetensors").write_bytes(b"")
    gguf_only = root / "someone" / "gguf-only"
    gguf_only.mkdir(parents=True)
    (gguf_only / "model.gguf").write_bytes(b"GGUF")
    return folder


@pytest.fixture()
def layouts(tmp_path, tiny_dir) -> tuple[Path, Path]:
    hub, lms = tmp_path / "hub", tmp_path / "lmstudio"
    _hub_cache(hub, tiny_dir)
    _lm_studio(lms, tiny_dir)
    return hub, lms


def test_hub_cache_and_lm_studio_models_are_found_by_org_and_name(layouts):
    from mlxgw.shared.discovery import discover

    found = {m.name: m for m in discover(list(layouts))}
    assert found["mlx-community/Tiny-4bit"].source == "hf-cache"
    assert found["mlx-community/Tiny-4bit"].path.name == SHA
    assert found["mlx-community/Tiny-4bit"].error is None
    assert found["lmstudio-community/tiny-mlx"].source == "lmstudio"
    assert found["lmstudio-community/tiny-mlx"].error is None


def test_broken_folders_are_listed_with_their_reason(layouts):
    from mlxgw.shared.discovery import discover

    found = {m.name: m for m in discover(list(layouts))}
    assert "config.json" in found["someone/broken"].error
    assert "GGUF only" in found["someone/gguf-only"].error


def test_models_list_shows_discovered_models_and_reasons(layouts, tmp_path):
    hub, lms = layouts
    result = mlxgw("models", "list", "--discover-path", str(hub), "--discover-path", str(lms), home=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert "hf-cache" in lines["mlx-community/Tiny-4bit"]
    assert "lmstudio" in lines["lmstudio-community/tiny-mlx"]
    assert "NOT SERVABLE" in lines["someone/broken"]


def test_registry_gets_servable_discovered_models_in_place(layouts, tmp_path):
    from mlxgw.shared.config import ManagerConfig, Registry, with_discovered_models

    manager = ManagerConfig(models_dir=str(tmp_path / "models"), discover_paths=[str(p) for p in layouts])
    registry = with_discovered_models(Registry(manager, models=[]))
    by_name = {e.name: e for e in registry.models}
    assert set(by_name) == {"mlx-community/Tiny-4bit", "lmstudio-community/tiny-mlx"}
    assert Path(by_name["mlx-community/Tiny-4bit"].source).name == SHA
    assert not (tmp_path / "models").exists()  # nothing copied


def test_discovered_models_answer_through_the_gateway(layouts, tmp_path):
    hub, lms = layouts
    config = {"manager": {"auto_discover": True, "discover_paths": [str(hub), str(lms)]}, "models": []}
    gw = start_gateway(tmp_path, config, "discovery")
    try:
        status, _, body = http(f"{gw.url}/v1/models")
        assert status == 200
        listed = {m["id"]: m for m in body["data"]}
        assert listed["mlx-community/Tiny-4bit"]["source"] == "hf-cache"
        assert listed["lmstudio-community/tiny-mlx"]["source"] == "lmstudio"
        broken = [m for m in listed.values() if m["state"] == "unavailable"]
        assert broken and all(m["last_error"] for m in broken)  # listed with the reason, not hidden
        for model in ("mlx-community/Tiny-4bit", "lmstudio-community/tiny-mlx"):
            req = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            status, _, reply = http(f"{gw.url}/v1/chat/completions", "POST", req, timeout=240)
            assert status == 200, reply
            assert reply["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        gw.stop()
