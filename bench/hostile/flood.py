"""The flood figures: slowloris bodies and idle sockets against a real `mlxgw up`
(null engine, default edge settings), on loopback. Reports how many connections the server
held, how fast /health answered during the flood, whether a stream completed, and what the
log took.

    .venv/bin/python -m mlxgw.bench.hostile.flood --slow-bodies 1100 --idle 15000 [--max-files 1024]

--max-files starts the gateway under that descriptor limit (soft and hard), to show the
connection ceiling keeps it from running out."""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import tempfile
import time
import urllib.request
from pathlib import Path

from ..servers import ServerProcess, start_mlxgw
from ..stats import median

CONFIG = {"manager": {"auto_discover": False}, "models": [{"name": "null", "engine": "null", "preload": True}]}


def start(home: Path, max_files: int | None) -> ServerProcess:
    """`mlxgw up` serving the null engine, ready; max_files: its descriptor limit (soft and hard)."""
    limit = None if max_files is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (max_files,) * 2))
    try:
        return start_mlxgw(home, CONFIG, "gateway", timeout=120, preexec_fn=limit)
    except RuntimeError as e:
        raise SystemExit(str(e)) from e


async def slow_body(port: int, stop: asyncio.Event) -> None:
    """Headers promising a megabyte, then one byte every 2 s."""
    try:
        _, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n")
        while not stop.is_set():
            w.write(b" ")
            await w.drain()
            await asyncio.wait_for(stop.wait(), 2)
    except (OSError, asyncio.TimeoutError):
        pass


async def idle(port: int, stop: asyncio.Event) -> None:
    try:
        _, w = await asyncio.open_connection("127.0.0.1", port)
        await stop.wait()
        w.close()
    except OSError:
        pass


def health_probes(port: int, seconds: float) -> list[float | None]:
    """/health every 0.25 s for `seconds`, on a thread of its own with blocking sockets, so the
    attack's event loop does not delay the probe: seconds per answer, None for a failure."""
    out: list[float | None] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
                out.append(time.monotonic() - started if r.status == 200 else None)
        except OSError:
            out.append(None)
        time.sleep(0.25)
    return out


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {
        line.split(" ")[0]: float(line.split(" ")[-1])
        for line in text.splitlines()
        if line.startswith("mlxgw_http_connections")
    }


def stream_tokens(port: int) -> int:
    body = json.dumps({"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50})
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", body.encode(), {"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(req, timeout=60).read())["usage"]["completion_tokens"]


async def flood(port: int, slow_bodies: int, idle_sockets: int, seconds: float) -> dict:
    stop = asyncio.Event()
    tasks = [asyncio.create_task(slow_body(port, stop)) for _ in range(slow_bodies)]
    tasks += [asyncio.create_task(idle(port, stop)) for _ in range(idle_sockets)]
    await asyncio.sleep(0.5)  # the flood is under way
    tokens = asyncio.create_task(asyncio.to_thread(stream_tokens, port))
    latencies = await asyncio.to_thread(health_probes, port, seconds)
    held = await asyncio.to_thread(metrics, port)
    stop.set()
    await asyncio.gather(*tasks)
    ok = sorted(x for x in latencies if x is not None)
    return {
        "health_answered": f"{len(ok)} of {len(latencies)}",
        "health_median_ms": round(median(ok) * 1000, 1) if ok else None,
        "health_p95_ms": round(ok[int(0.95 * (len(ok) - 1))] * 1000, 1) if ok else None,
        "health_max_ms": round(ok[-1] * 1000, 1) if ok else None,
        "stream_tokens": await tokens,
        "connections_held_at_end": held.get("mlxgw_http_connections"),
        "connections_peak": held.get("mlxgw_http_connections_peak"),
        "connections_closed": {k.split("reason=")[-1].strip('"}'): v for k, v in held.items() if "closed" in k},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slow-bodies", type=int, default=1100)
    ap.add_argument("--idle", type=int, default=15000)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--max-files", type=int, default=None)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.slow_bodies + args.idle + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard) if hard != resource.RLIM_INFINITY else need, hard))
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        server = start(home, args.max_files)
        try:
            figures = asyncio.run(flood(server.port, args.slow_bodies, args.idle, args.seconds))
        finally:
            server.stop(timeout=60)
        log = (home / "gateway.log").read_text(errors="replace")
    figures |= {
        "attack": {"slow_bodies": args.slow_bodies, "idle_sockets": args.idle, "gateway_max_files": args.max_files},
        "log_bytes": len(log),
        "too_many_open_files_lines": log.count("Too many open files"),
    }
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
