"""Recovery after a crash: kill -9 a model's worker and time until the model serves again.

    python -m mlxgw.bench.hostile.recovery --url http://127.0.0.1:8000 --model smollm2-135m

Run it on the gateway's machine (it signals the worker process)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import urllib.request


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


def _chat(url: str, model: str) -> float:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", body, {"content-type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()
    return time.perf_counter() - started


def _model(url: str, name: str) -> dict:
    return next(m for m in _get(f"{url}/v1/status")["models"] if m["name"] == name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    first = _chat(args.url, args.model)
    model = _model(args.url, args.model)
    worker = next(w for w in model["workers"] if w["local"])
    rss = worker["stats"].get("rss_bytes", 0)
    os.kill(worker["pid"], signal.SIGKILL)
    killed = time.perf_counter()
    while True:
        try:
            _chat(args.url, args.model)
            break
        except OSError:
            time.sleep(0.05)
    recovered = time.perf_counter() - killed
    model = _model(args.url, args.model)
    print(
        json.dumps(
            {
                "model": args.model,
                "first_request_s": round(first, 3),
                "load_seconds": model["load_seconds"],
                "worker_rss_mb": round(rss / 1e6),
                "recovery_after_kill_s": round(recovered, 3),
                "restarts": model["restarts"],
            }
        )
    )


if __name__ == "__main__":
    main()
