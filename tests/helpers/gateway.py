"""Real `mlxgw up` processes for tests, and the clients and waits that drive them."""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from mlxgw.bench.servers import spawn_mlxgw, stop_process

from .http import http

REPO = Path(__file__).resolve().parent.parent.parent


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
        return stop_process(self.proc, sig, timeout)


def start_gateway(
    home: Path,
    config: dict,
    name: str,
    *,
    timeout: float = 240,
    extra_args: tuple[str, ...] = (),
    max_files: int | None = None,
    address_space: int | None = None,
) -> GatewayProcess:
    """`mlxgw up` on a free port, ready; max_files sets its descriptor limit (soft and hard),
    address_space its RLIMIT_AS in bytes (its workers inherit both)."""
    server = spawn_mlxgw(  # bench/servers.py: the benches start their gateways the same way
        home,
        config,
        name,
        extra_args=extra_args,
        cwd=REPO,
        preexec_fn=None if max_files is None and address_space is None else lambda: _limit(max_files, address_space),
    )
    proc = server.proc
    gw = GatewayProcess(proc, server.port, server.log_path, server.extra["config_path"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "mlxgw ready on" in gw.log():
            return gw
        if proc.poll() is not None:
            raise AssertionError(f"gateway exited with {proc.returncode}:\n{gw.log()}")
        time.sleep(0.05)  # a log read: ~100 gateways a suite each wait half a poll less
    gw.stop()
    raise AssertionError(f"gateway not ready after {timeout} s:\n{gw.log()}")


def _limit(files: int | None, address_space: int | None) -> None:
    import resource

    if files is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
    if address_space is not None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))


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
        {"name": "tiny-smallcache", "source": "tiny", "cache": {"prefix_memory_mb": 1}},
        {"name": "tiny-short", "source": "tiny", "context_length": 64, "max_tokens_policy": "reject"},
        # Loaded only by the test of refusals from a cold model (a lazy load first).
        {"name": "tiny-cold", "source": "tiny", "context_length": 64},
        {"name": "tiny-tools", "source": "tiny", "chat": {"tool_parser": "hermes"}},
        # Speculative decoding with a draft model: the model itself, named by its folder.
        {"name": "tiny-drafted", "source": "tiny", "speculative": {"mode": "draft", "draft_model": "tiny"}},
        {"name": "tiny-think", "chat": {"reasoning_parser": "think"}},
        {"name": "echo", "engine": "echo", "chat": {"tool_parser": "hermes", "reasoning_parser": "think"}},
        {"name": "null", "engine": "null", "preload": True, "max_num_seqs": 64, "max_queue": 256},
        {"name": "null-default", "engine": "null", "defaults": {"max_tokens": 7}},
    ],
}


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


def wait_for(predicate, timeout: float = 30, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def running(gw: GatewayProcess, model: str) -> int:
    """Sequences running in the model's workers."""
    return sum(w["stats"].get("running", 0) for w in gw.model_status(model)["workers"])
