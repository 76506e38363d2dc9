"""A real Open WebUI server (its own virtualenv, `make test-openwebui` installs it) pointed at a
gateway's Ollama API, for tests/e2e/test_openwebui.py."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from mlxgw.bench.servers import stop_process

from .gateway import REPO
from .http import free_port, http

# Open WebUI pins ~90 packages (torch, transformers, chromadb...): it lives in a virtualenv of
# its own, never in mlxgw's. MLXGW_OPENWEBUI_PYTHON names its interpreter; else the Makefile's.
DEFAULT_PYTHON = REPO / ".cache" / "openwebui-venv" / "bin" / "python"
OPENWEBUI_PYTHON = Path(os.environ.get("MLXGW_OPENWEBUI_PYTHON") or DEFAULT_PYTHON)

# Open WebUI starts offline and lean: no embedding or reranking model loaded (it would fetch
# one from the hub), no update check, no telemetry, no OpenAI connection, one Ollama connection.
OFFLINE_ENV = {
    "OFFLINE_MODE": "true",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "RAG_EMBEDDING_ENGINE": "ollama",
    "RAG_EMBEDDING_MODEL": "",
    "RAG_RERANKING_MODEL": "",
    "BYPASS_EMBEDDING_AND_RETRIEVAL": "true",
    "ENABLE_RAG_HYBRID_SEARCH": "false",
    "ENABLE_VERSION_UPDATE_CHECK": "false",
    "ENABLE_OPENAI_API": "false",
    "ENABLE_OLLAMA_API": "true",
    "ENABLE_WEB_SEARCH": "false",
    "ENABLE_IMAGE_GENERATION": "false",
    "ENABLE_CODE_INTERPRETER": "false",
    "ENABLE_EVALUATION_ARENA_MODELS": "false",
    "ENABLE_COMMUNITY_SHARING": "false",
    "ENABLE_TITLE_GENERATION": "false",
    "ENABLE_TAGS_GENERATION": "false",
    "ENABLE_FOLLOW_UP_GENERATION": "false",
    "ENABLE_AUTOCOMPLETE_GENERATION": "false",
    "ANONYMIZED_TELEMETRY": "false",
    "DO_NOT_TRACK": "true",
    "SCARF_NO_ANALYTICS": "true",
    "ENABLE_OTEL": "false",
    "ENV": "prod",
}


def openwebui_missing() -> str | None:
    if not OPENWEBUI_PYTHON.exists():
        return (
            f"Open WebUI is not installed at {OPENWEBUI_PYTHON}: `make test-openwebui` installs it"
            " (or set MLXGW_OPENWEBUI_PYTHON)"
        )
    return None


@dataclass
class OpenWebUI:
    proc: subprocess.Popen
    port: int
    log_path: Path
    token: str = ""  # the admin's session token, once signed up

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def call(self, method: str, path: str, body=None, timeout: float = 120) -> tuple[int, object]:
        """A request to Open WebUI's own backend with the admin's session."""
        session = {"Authorization": f"Bearer {self.token}"}
        status, _, out = http(f"{self.url}{path}", method, body, session, timeout=timeout)
        return status, out

    def stop(self) -> int:
        return stop_process(self.proc, timeout=30)


def start_openwebui(root: Path, ollama_url: str, ollama_key: str, timeout: float = 300) -> OpenWebUI:
    """`uvicorn open_webui.main:app` on 127.0.0.1 with its Ollama connection at ollama_url and
    ollama_key as the connection's bearer key; ready when /health answers."""
    data = root / "openwebui-data"
    data.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = root / "openwebui.log"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD", "VIRTUAL_ENV")}
    env.update(OFFLINE_ENV)
    env.update(
        DATA_DIR=str(data),
        HOME=str(root),  # caches it writes (tiktoken, nltk...) stay in the test's folder
        WEBUI_SECRET_KEY=secrets.token_hex(32),
        OLLAMA_BASE_URL=ollama_url,
        OLLAMA_API_CONFIGS=json.dumps({"0": {"enable": True, "key": ollama_key}}),
        PYTHONUNBUFFERED="1",
        # As `open-webui serve` runs it: the frontend from the installed package, not a source tree.
        FROM_INIT_PY="true",
    )
    command = [str(OPENWEBUI_PYTHON), "-m", "uvicorn", "open_webui.main:app", "--host", "127.0.0.1"]
    command += ["--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=data, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = OpenWebUI(proc, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"Open WebUI exited with {proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if http(f"{server.url}/health", timeout=5)[0] == 200:
                return server
        except OSError:
            pass
        time.sleep(0.5)
    server.stop()
    raise AssertionError(f"Open WebUI not ready after {timeout} s:\n{server.log()[-4000:]}")


def sign_up_admin(server: OpenWebUI) -> str:
    """The first account Open WebUI creates is its admin; its token is the session."""
    body = {"name": "Admin", "email": "admin@example.com", "password": secrets.token_urlsafe(16)}
    status, _, out = http(f"{server.url}/api/v1/auths/signup", "POST", body)
    assert status == 200 and out.get("role") == "admin", (status, out)
    server.token = out["token"]
    return server.token
