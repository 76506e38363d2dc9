"""Shared by the capacity-isolation tests (tests/e2e/test_capacity_isolation.py): a keyed
`mlxgw up` with the models and MCP servers they attack, and the requests and checks they make."""

from __future__ import annotations

import base64
import sys
import time
from pathlib import Path

import psutil
import yaml

from mlxgw.gateway.access.keys import hash_key

from .gateway import start_gateway
from .http import http

KEYS = {
    "admin": "mlxgw-hostile-admin-0123456789",
    "user": "mlxgw-hostile-user-0123456789",
    "limited": "mlxgw-hostile-limited-0123456789",
    "resident": "mlxgw-hostile-resident-0123456789",
}


KEY_ENTRIES = [
    {"name": "admin", "sha256": hash_key(KEYS["admin"]), "admin": True},
    {"name": "user", "sha256": hash_key(KEYS["user"])},
    {"name": "limited", "sha256": hash_key(KEYS["limited"]), "models": ["null"]},
    {"name": "resident", "sha256": hash_key(KEYS["resident"]), "residency": True},
]


MODELS = [
    {"name": "echo", "engine": "echo", "preload": True, "context_length": 1_000_000},
    {"name": "null", "engine": "null", "preload": True, "idle_unload_s": 600},  # so a pin would show
    {"name": "null-unload", "engine": "null"},
    {"name": "tiny", "preload": True, "max_num_seqs": 8, "chat": {"allow_request_chat_template": True}},
    {"name": "tiny-fifo", "source": "tiny"},  # loaded by the FIFO test, onto a planted FIFO
    # Audio is measured before any worker is asked: a model that would never load will do.
    {"name": "ears", "kind": "audio", "source": "no-such-whisper"},
]


def auth(name: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[name]}"}


HOSTILE_MCP = str(Path(__file__).parent.parent / "fixtures" / "mcp_hostile_server.py")


MCP_SERVERS = [
    # The operator chose what it exposes: ordinary keys may use it.
    {
        "label": "tools",
        "command": sys.executable,
        "args": [HOSTILE_MCP],
        "allowed_tools": ["slow_add", "crash", "noisy"],
    },
    # Every tool the server lists: admin keys (or keys whose `mcp:` names it) only.
    {"label": "everything", "command": sys.executable, "args": [HOSTILE_MCP]},
]


def keyed_gateway(home, name: str, models: list[dict], mcp: list[dict] | None = None):
    keys_path = home / f"{name}-keys.yaml"
    keys_path.write_text(yaml.safe_dump({"keys": KEY_ENTRIES}))
    config = {"manager": {"auto_discover": False}, "models": models}
    if mcp:
        config["mcp"] = {"servers": mcp}
    return start_gateway(home, config, name, extra_args=("--keys", str(keys_path)))


def bomb_message(pdf: bytes) -> dict:
    source = {"type": "base64", "media_type": "application/pdf", "data": base64.b64encode(pdf).decode()}
    content = [{"type": "document", "source": source}, {"type": "text", "text": "summarize"}]
    return {"model": "echo", "max_tokens": 64, "messages": [{"role": "user", "content": content}]}


def timed(fn) -> tuple[object, float]:
    started = time.monotonic()
    result = fn()
    return result, time.monotonic() - started


def pdf_jobs(gw) -> list[int]:
    return [
        c.pid
        for c in psutil.Process(gw.proc.pid).children(recursive=True)
        if "mlxgw.gateway.pipeline.pdf_job" in " ".join(c.cmdline())
    ]


def model_status(gw, name: str) -> dict:
    status = http(gw.url + "/v1/status", headers=auth("admin"))[2]
    return next(m for m in status["models"] if m["name"] == name)


def worker_pids(model: dict) -> list[int]:
    return sorted(w["pid"] for w in model["workers"])


def post_audio(gw, data: bytes, fields: dict) -> tuple[int, dict, float]:
    import requests

    started = time.monotonic()
    r = requests.post(
        gw.url + "/v1/audio/transcriptions",
        files={"file": ("clip.bin", data)},
        data=fields,
        headers=auth("user"),
        timeout=60,
    )
    return r.status_code, r.json(), time.monotonic() - started


def mcp_servers(gw, key: str) -> dict[str, dict]:
    return {s["label"]: s for s in http(gw.url + "/v1/mcp/servers", headers=auth(key))[2]["data"]}


def wait_mcp_ready(gw) -> None:
    deadline = time.monotonic() + 60
    while {s["state"] for s in mcp_servers(gw, "admin").values()} != {"ready"}:
        assert time.monotonic() < deadline, mcp_servers(gw, "admin")
        time.sleep(0.3)
