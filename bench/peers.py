"""mlxgw against its peers on equal terms: one model folder, one BLAS, one client, one run.

Starts mlxgw (`mlxgw up`), `mlx_lm.server` and, when a Python with vllm-mlx is given,
`vllm-mlx serve --continuous-batching`, all on the same model folder and with the same
OpenBLAS preloaded (shared/platform.worker_environment, as mlxgw's own workers get it), then
runs `mlxgw bench`'s sweep against all of them, servers alternated within every level and
their order rotated each round. Only loopback ports; every server is stopped at the end.

    python -m mlxgw.bench.peers ~/.cache/mlxgw/models/smollm2-135m \\
        --vllm-python /work/peers/vllm/bin/python --concurrency 1,4,8,16,32 --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from mlxgw.shared.platform import worker_environment

from .run import BenchConfig, Target, run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/models", timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not ready after {timeout:.0f} s")


def warm_up(url: str, model: str) -> None:
    """One short request, so that no server's first level pays its lazy setup."""
    body = json.dumps({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    req = urllib.request.Request(f"{url}/chat/completions", body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def start_mlxgw(model_dir: Path, home: Path, max_num_seqs: int | None, log) -> tuple[str, subprocess.Popen, str]:
    port = free_port()
    entry = {"name": "bench-model", "source": str(model_dir), "preload": True}
    if max_num_seqs:
        entry["max_num_seqs"] = max_num_seqs
    config = home / "models.yaml"
    config.write_text(json.dumps({"manager": {"auto_discover": False}, "models": [entry]}))
    env = {**os.environ, "MLXGW_HOME": str(home)}
    cmd = [sys.executable, "-c", "from mlxgw.cli import main; main()", "up", "--config", str(config)]
    proc = subprocess.Popen([*cmd, "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    return f"http://127.0.0.1:{port}/v1", proc, "bench-model"


def start_mlx_lm(model_dir: Path, log) -> tuple[str, subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--host", "127.0.0.1"]
    proc = subprocess.Popen([*cmd, "--port", str(port)], env=worker_environment(), stdout=log, stderr=subprocess.STDOUT)
    return f"http://127.0.0.1:{port}/v1", proc, str(model_dir)


def start_vllm_mlx(python: str, model_dir: Path, log) -> tuple[str, subprocess.Popen, str]:
    port = free_port()
    exe = str(Path(python).parent / "vllm-mlx")
    cmd = [
        exe,
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--continuous-batching",
        "--offline",
    ]
    proc = subprocess.Popen(cmd, env=worker_environment(), stdout=log, stderr=subprocess.STDOUT)
    return f"http://127.0.0.1:{port}/v1", proc, str(model_dir)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-mlx installed")
    ap.add_argument("--no-mlx-lm", action="store_true", help="skip mlx_lm.server")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="mlxgw's batch (default: its own default)")
    ap.add_argument("--concurrency", default="1,4,8,16,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=0, help="per level (default 2 x c, >= 4)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    model_dir = args.model_dir.expanduser().resolve()
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="mlxgw-peers-") as tmp, open(Path(tmp) / "servers.log", "wb") as log:
        try:
            servers = [("mlxgw", *start_mlxgw(model_dir, Path(tmp), args.max_num_seqs, log))]
            if not args.no_mlx_lm:
                servers.append(("mlx_lm.server", *start_mlx_lm(model_dir, log)))
            if args.vllm_python:
                servers.append(("vllm-mlx", *start_vllm_mlx(args.vllm_python, model_dir, log)))
            procs = [proc for _, _, proc, _ in servers]
            for label, url, proc, model in servers:
                wait_ready(url, proc)
                warm_up(url, model)
                print(f"{label} ready at {url}", flush=True)
            targets = [Target(label, url, model) for label, url, _, model in servers]
            cfg = BenchConfig(
                concurrency=[int(c) for c in args.concurrency.split(",")],
                requests=args.requests,
                max_tokens=args.max_tokens,
                prompt_words=40,
                prompt_words_max=None,
                temperature=args.temperature,
                stream=True,
                fixed_prompt=False,
                prefix_words=0,
                prefix_repeats=0,
                seed=args.seed if args.seed is not None else int(time.time()) % (1 << 30),
                rounds=args.rounds,
            )
            report = run(targets, cfg, args.out)
            print(report["markdown"])
        except Exception:
            log.flush()
            sys.stderr.write((Path(tmp) / "servers.log").read_text(errors="replace")[-4000:])
            raise
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
