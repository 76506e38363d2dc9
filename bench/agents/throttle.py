"""A host made slow on purpose: a worker runs `duty` of the time (SIGSTOP/SIGCONT in a cycle,
its link thread heartbeating while it runs), while one long prompt is read.

    python bench/agents/throttle.py --url http://127.0.0.1:8000 --model smollm2-135m --duty 0.25 \\
        --prompt-tokens 2000 [--timeout 1200]

Prints the request's outcome, wall time and the model's restart counters before and after.
Bounded: the cycle ends with the request (or at --timeout) and always leaves the worker
running (SIGCONT)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import httpx


def worker_pid(client: httpx.Client, url: str, model: str) -> tuple[int, dict]:
    for m in client.get(f"{url}/v1/status").json()["models"]:
        if m["name"] == model:
            ready = [w for w in m["workers"] if w["state"] == "ready"]
            counters = {k: m.get(k) for k in ("restarts", "crashes", "watchdog_kills")}
            return (ready[0]["pid"] if ready else 0), counters
    raise SystemExit(f"no model {model}")


def throttle(pid: int, duty: float, period_s: float, done: threading.Event) -> None:
    run_s, stop_s = period_s * duty, period_s * (1 - duty)
    try:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(run_s)
    except ProcessLookupError:
        pass
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--duty", type=float, default=0.25)
    ap.add_argument("--period", type=float, default=0.4)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--timeout", type=float, default=1200)
    args = ap.parse_args()
    with httpx.Client() as client:
        pid, before = worker_pid(client, args.url, args.model)
        words = " ".join(f"note {i}: the build passed." for i in range(args.prompt_tokens // 8))
        body = {
            "model": args.model,
            "messages": [{"role": "user", "content": words + "\nSummarise the notes."}],
            "max_tokens": 8,
            "temperature": 0,
        }
        done = threading.Event()
        thread = threading.Thread(target=throttle, args=(pid, args.duty, args.period, done), daemon=True)
        started = time.monotonic()
        thread.start()
        try:
            r = client.post(f"{args.url}/v1/chat/completions", json=body, timeout=args.timeout)
            outcome = {"status": r.status_code, **({"usage": r.json().get("usage")} if r.status_code == 200 else {})}
            if r.status_code != 200:
                outcome["error"] = r.text[:300]
        except httpx.HTTPError as e:
            outcome = {"error": repr(e)}
        finally:
            done.set()
            thread.join(5)
        wall = time.monotonic() - started
        after_pid, after = worker_pid(client, args.url, args.model)
        print(
            json.dumps(
                {
                    "duty": args.duty,
                    "wall_s": round(wall, 1),
                    **outcome,
                    "before": before,
                    "after": after,
                    "same_worker": after_pid == pid,
                }
            )
        )


if __name__ == "__main__":
    main()
