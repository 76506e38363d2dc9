"""The PDF flood: six 137 KB bomb PDFs (1,000 pages sharing one content stream of
300k text operators) at once, then how long the admin routes, a 300 KB chat body and the
gateway's SIGTERM take meanwhile.

    PYTHONPATH=<checkout> python -m mlxgw.bench.hostile.pdf_flood [--bombs 6] [--probe-timeout 60]

Runs `mlxgw up` (bench/servers.py) from the checkout on PYTHONPATH with an echo model and keys on; every wait is
bounded (probes by --probe-timeout, SIGTERM by --stop-timeout, then kill -9)."""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from ..servers import ServerProcess, start_mlxgw
from .pdf_bytes import pdf_bomb

ADMIN_KEY = "mlxgw-flood-admin-key-0123456789"
USER_KEY = "mlxgw-flood-user-key-0123456789"


def call(url: str, key: str, body: dict | None = None, timeout: float = 60) -> tuple[int, float]:
    """(status, seconds); status 0 when it timed out."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return resp.status, time.monotonic() - start
    except urllib.error.HTTPError as e:
        return e.code, time.monotonic() - start
    except (TimeoutError, urllib.error.URLError, ConnectionError):
        return 0, time.monotonic() - start


def start(home: Path) -> ServerProcess:
    """`mlxgw up` with an echo model and two keys (an admin's, a user's), ready."""
    from ...gateway.access.keys import hash_key

    keys = [
        {"name": "admin", "sha256": hash_key(ADMIN_KEY), "admin": True},
        {"name": "user", "sha256": hash_key(USER_KEY)},
    ]
    (home / "keys.yaml").write_text(yaml.safe_dump({"keys": keys}))
    config = {
        "manager": {"auto_discover": False},
        "models": [{"name": "echo", "engine": "echo", "preload": True, "context_length": 1_000_000}],
    }
    try:
        return start_mlxgw(home, config, "gateway", timeout=120, extra_args=["--keys", str(home / "keys.yaml")])
    except RuntimeError as e:
        raise SystemExit(f"gateway did not start: {e}") from e


def flood(bombs: int, probe_timeout: float, stop_timeout: float) -> dict:
    pdf = base64.b64encode(pdf_bomb()).decode()
    doc = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": pdf}}
    bomb_body = {
        "model": "echo",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [doc, {"type": "text", "text": "sum"}]}],
    }
    big_chat = {"model": "echo", "max_tokens": 4, "messages": [{"role": "user", "content": "word " * 60_000}]}
    with tempfile.TemporaryDirectory() as tmp:
        server = start(Path(tmp))
        proc, url = server.proc, server.url
        results: dict = {"bombs": []}
        threads = [
            threading.Thread(
                target=lambda: results["bombs"].append(call(f"{url}/v1/messages", USER_KEY, bomb_body, 300))
            )
            for _ in range(bombs)
        ]
        for t in threads:
            t.start()
        time.sleep(0.3)  # the bombs are being read
        results["GET /v1/keys"] = call(f"{url}/v1/keys", ADMIN_KEY, timeout=probe_timeout)
        results["GET /v1/usage"] = call(f"{url}/v1/usage", ADMIN_KEY, timeout=probe_timeout)
        results["300 KB chat"] = call(f"{url}/v1/chat/completions", USER_KEY, big_chat, probe_timeout)
        start_stop = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(stop_timeout)
            results["SIGTERM exit s"] = round(time.monotonic() - start_stop, 1)
        except subprocess.TimeoutExpired:
            results["SIGTERM exit s"] = f"still running after {stop_timeout:g} s (kill -9)"
            proc.kill()
            proc.wait()
        for t in threads:
            t.join(5)
        results["bombs"] = sorted((s, round(d, 1)) for s, d in results["bombs"])
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bombs", type=int, default=6)
    parser.add_argument("--probe-timeout", type=float, default=60)
    parser.add_argument("--stop-timeout", type=float, default=30)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    results = flood(args.bombs, args.probe_timeout, args.stop_timeout)
    for name, value in results.items():
        print(f"{name}: {value}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
