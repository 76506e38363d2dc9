"""The usage ledger's cost per request, end to end: two gateways in one run, the same null-engine
model, one with the ledger on and one with `usage_ledger: false`, driven alternately.

    python -m mlxgw.bench.overhead.ledger_ab --rounds 6 --seconds 5 --concurrency 16 [--pin]

Each round drives both gateways (the order alternates between rounds) with a closed loop of
`--concurrency` clients sending non-streaming chat completions of `--tokens` tokens, and
reports per gateway: requests/s and the CPU time its processes (gateway and worker) spent per
request. CPU per request is the robust figure on a shared machine (neighbours slow a server
down without changing what it spends per request). At the end the ledger's rows are counted
against the requests the clients saw answered. The micro-benchmark of the hook alone is
`python -m mlxgw.bench.overhead.ledger_overhead`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from ..method import rotated
from ..servers import ServerProcess, spawn_mlxgw
from ..stats import median
from .capacity import ready_and_pinned
from .drive import MODEL, cpu_seconds, drive


def start(home: Path, ledger: bool) -> ServerProcess:
    home.mkdir(parents=True, exist_ok=True)
    config = {
        "manager": {"auto_discover": False, "usage_ledger": ledger},
        "models": [{"name": MODEL, "engine": "null", "preload": True, "max_num_seqs": 64, "max_queue": 1024}],
    }
    return spawn_mlxgw(home, config, label="ledger-on" if ledger else "ledger-off")


async def measure(args: argparse.Namespace, servers: list[ServerProcess]) -> list[dict]:
    await ready_and_pinned(servers, args.pin)
    for server in servers:  # warm-up: connections, first-request paths
        await drive(server.url, args.concurrency, 1.0, args.tokens, False)
    rows = []
    for rnd in range(args.rounds):
        for server in rotated(servers, rnd):
            pids = server.pids()
            before = cpu_seconds(pids)
            tally, wall = await drive(server.url, args.concurrency, args.seconds, args.tokens, False)
            cpu = cpu_seconds(pids) - before
            row = {
                "round": rnd,
                "server": server.label,
                "requests": tally.requests,
                "failed": tally.failed,
                "req_s": round(tally.requests / wall, 1),
                "cpu_us_per_req": round(cpu * 1e6 / max(tally.requests, 1), 1),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def summarize(rows: list[dict]) -> dict:
    out: dict = {}
    for metric in ("req_s", "cpu_us_per_req"):
        per = {s: [r[metric] for r in rows if r["server"] == s] for s in ("ledger-on", "ledger-off")}
        med = {s: median(v) for s, v in per.items()}
        out[metric] = {
            **med,
            "on_minus_off": round(med["ledger-on"] - med["ledger-off"], 1),
            "per_round_on_minus_off": [round(a - b, 1) for a, b in zip(per["ledger-on"], per["ledger-off"])],
        }
    return out


def ledger_rows(home: Path) -> int:
    with sqlite3.connect(home / "usage.db") as conn:
        return conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=5.0, help="per gateway and round")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=4, help="max_tokens of each request")
    ap.add_argument("--pin", action="store_true", help="both gateways on CPU 0, the client on CPU 1")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxgw-ledger-ab-") as tmp:
        on, off = start(Path(tmp) / "on", True), start(Path(tmp) / "off", False)
        try:
            rows = asyncio.run(measure(args, [on, off]))
        finally:
            for server in (on, off):
                server.stop()  # a graceful stop commits the ledger's last batch
        answered = sum(r["requests"] for r in rows if r["server"] == "ledger-on")
        summary = summarize(rows)
        summary["ledger_rows"] = ledger_rows(Path(tmp) / "on")
        summary["ledger_on_requests_measured"] = answered  # rows also count warm-up and readiness probes
        summary["load_average"] = os.getloadavg()
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
