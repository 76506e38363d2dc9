"""Every server a bench (or a test) starts, started one way: mlxgw (`mlxgw up` with a given
registry), and its peers (`mlx_lm.server`, `vllm-mlx serve`, the bare aiohttp server of
bench/overhead/bare_server.py), each on a free loopback port, with its own log file, a
readiness wait that fails as soon as the process exits, and a stop that escalates from
SIGTERM to SIGKILL.

    with tempfile.TemporaryDirectory() as tmp:
        server = start_mlxgw(Path(tmp), registry(model_dir, name="bench-model"))
        try:
            ...  # server.api is the OpenAI base URL, server.model the name to send
        finally:
            stop_all([server])

Peers get the environment mlxgw gives its workers (shared/platform.worker_environment:
OpenBLAS preloaded on Linux), so a comparison is on one BLAS.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

READY_LINE = "mlxgw ready on"  # gateway/server.py prints it once the preloaded models are ready
MLXGW_COMMAND = (sys.executable, "-c", "from mlxgw.cli import main; main()")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    """Signal a server, wait up to `timeout`, then kill -9; its exit status (the tests' gateways
    stop the same way)."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@dataclass
class ServerProcess:
    """One server process on a loopback port; `proc` None: a server this run did not start."""

    label: str
    proc: subprocess.Popen | None
    port: int
    log_path: Path | None = None
    model: str = ""  # the model name its clients send
    ready_line: str | None = None  # a log line that says ready; None: GET /v1/models answers
    extra: dict = field(default_factory=dict)
    base_url: str | None = None  # set for a server this run did not start

    @classmethod
    def running(cls, label: str, url: str, model: str = "") -> ServerProcess:
        """A server already running at `url` (its root, without /v1), not started here."""
        return cls(label, None, 0, model=model, base_url=url)

    @property
    def url(self) -> str:
        return self.base_url or f"http://127.0.0.1:{self.port}"

    @property
    def api(self) -> str:
        """The OpenAI-compatible base URL."""
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def pids(self) -> list[int]:
        """The process and all its descendants (a gateway's workers)."""
        import psutil

        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root.pid, *(c.pid for c in root.children(recursive=True))]
        except psutil.NoSuchProcess:
            return []

    def is_ready(self) -> bool:
        if self.ready_line is not None:
            return self.ready_line in self.log()
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{self.api}/models", timeout=2) as r:
                return r.status == 200
        return False

    def wait_ready(self, timeout: float = 300, interval: float = 0.2) -> ServerProcess:
        """Return once ready; raise RuntimeError (with the log's end) if the process exits first
        or the timeout passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.is_ready():
                return self
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            time.sleep(interval)
        raise RuntimeError(f"{self.label} not ready after {timeout:.0f} s:\n{self.log()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        """Signal the process, wait up to `timeout`, then kill -9; its exit status."""
        return None if self.proc is None else stop_process(self.proc, sig, timeout)


def stop_all(servers: Iterable[ServerProcess | None], timeout: float = 30) -> None:
    """SIGTERM to every server at once, then wait for each (kill -9 after `timeout`)."""
    started = [s for s in servers if s is not None and s.proc is not None]
    for server in started:
        if server.proc.poll() is None:
            server.proc.terminate()
    for server in started:
        server.stop(timeout=timeout)


def show_log_tails(servers: Iterable[ServerProcess | None], chars: int = 4000) -> None:
    """A bench that failed prints the end of its servers' logs on stderr."""
    for server in servers:
        if server is not None and server.log_path is not None:
            sys.stderr.write(f"--- {server.label} ({server.log_path.name})\n{server.log()[-chars:]}\n")


def registry(model_dir: Path | str, name: str = "bench-model", **entry) -> dict:
    """A one-model registry: the folder, preloaded, no auto-discovery; `entry` adds fields."""
    return {
        "manager": {"auto_discover": False},
        "models": [{"name": name, "source": str(model_dir), "preload": True, **entry}],
    }


def spawn_mlxgw(
    home: Path,
    config: dict,
    name: str = "models",
    *,
    label: str = "mlxgw",
    env: dict | None = None,
    extra_args: Iterable[str] = (),
    cwd: Path | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> ServerProcess:
    """`mlxgw up` with `config` written to HOME/NAME.yaml, MLXGW_HOME=HOME, on a free port,
    its output in HOME/NAME.log; not waited for (see ServerProcess.wait_ready). `env` adds to
    this process's environment (PYTHONPATH: another checkout's mlxgw); cwd defaults to HOME,
    so a ./mlxgw folder in the caller's directory shadows nothing."""
    home.mkdir(parents=True, exist_ok=True)
    config_path = home / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = home / f"{name}.log"
    full_env = dict(os.environ, MLXGW_HOME=str(home), PYTHONUNBUFFERED="1", **(env or {}))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*MLXGW_COMMAND, "up", "--config", str(config_path), "--port", str(port), *extra_args],
            cwd=cwd or home,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
        )
    model = config["models"][0]["name"] if config.get("models") else ""
    return ServerProcess(label, proc, port, log_path, model, READY_LINE, {"config_path": config_path})


def start_mlxgw(home: Path, config: dict, name: str = "models", *, timeout: float = 300, **kwargs) -> ServerProcess:
    """spawn_mlxgw, then wait until it says ready (stopped again if it never does)."""
    server = spawn_mlxgw(home, config, name, **kwargs)
    try:
        return server.wait_ready(timeout)
    except BaseException:
        server.stop()
        raise


def _spawn_peer(
    label: str, cmd: list[str], port: int, logs: Path, model: str, env: dict | None = None
) -> ServerProcess:
    from ..shared.platform import worker_environment

    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{label}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env or worker_environment(), stdout=log, stderr=subprocess.STDOUT)
    return ServerProcess(label, proc, port, log_path, model)


def spawn_mlx_lm(model_dir: Path, logs: Path, extra_args: Iterable[str] = (), label: str = "mlx_lm.server"):
    """`python -m mlx_lm.server` on the folder (this Python's mlx-lm), workers' environment."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--host", "127.0.0.1"]
    return _spawn_peer(label, [*cmd, "--port", str(port), *extra_args], port, logs, str(model_dir))


def spawn_vllm_mlx(python: str, model_dir: Path, logs: Path, extra_args: Iterable[str] = ()) -> ServerProcess:
    """`vllm-mlx serve --continuous-batching` from the venv of `python` (its own install)."""
    port = free_port()
    exe = str(Path(python).parent / "vllm-mlx")
    cmd = [exe, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    return _spawn_peer(
        "vllm-mlx", [*cmd, "--continuous-batching", "--offline", *extra_args], port, logs, str(model_dir)
    )


def spawn_bare(logs: Path) -> ServerProcess:
    """The bare aiohttp server of bench/overhead/bare_server.py (the gateway's floor): answers
    POST /v1/chat/completions in mlxgw's shapes with no work behind them."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlxgw.bench.overhead.bare_server", str(port)]
    return _spawn_peer("bare", cmd, port, logs, "null", env=dict(os.environ))


def warm_up(api: str, model: str, timeout: float = 300, key: str | None = None) -> None:
    """One short chat request to the OpenAI base URL `api` (with `key` where keys are in force),
    so that no server's first level pays its lazy setup."""
    import json

    body = json.dumps({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(f"{api}/chat/completions", body.encode(), headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()
