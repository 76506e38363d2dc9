"""The gateway's own capacity against a bare aiohttp server, same client, one run.

    python -m mlxgw.bench.overhead.capacity --rounds 4 --seconds 6 [--pin]

Two servers answer POST /v1/chat/completions with the same JSON and SSE shapes:
- bare: one aiohttp process whose handler parses the JSON body and answers at once (a
  completion body, or one `chat.completion.chunk` per token, the usage chunk, [DONE]), the
  least any OpenAI-compatible Python server does;
- mlxgw: `mlxgw up` with a null-engine model (tokens without a model: worker/model/runners/null_runner.py),
  every middleware on (access log, usage ledger, metrics, limits), one gateway process and
  its worker process.

One client (aiohttp, `--concurrency` keep-alive connections, closed loop) drives each server
for `--seconds` per workload; the servers alternate within every round, and the first one
alternates between rounds. Reported: requests/s (non-streaming, `--plain-tokens` tokens) and
streamed tokens/s (`--stream-tokens` per request) per round, their medians, and the ratio
mlxgw / bare; and the CPU time the server's processes spent per request and per token
(robust on a busy machine, where throughput swings with the neighbours' load: bare / mlxgw of
it is the capacity ratio a run on quiet cores would show). With `--pin`, every server process
(the bare server; the gateway and its worker) runs on CPU 0 and the client on CPU 1, so both
servers get the same one core; without it the OS places everything (the gateway and its
worker may then use both cores)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import aiohttp

from ..method import rotated
from ..servers import ServerProcess, spawn_bare, spawn_mlxgw
from ..stats import median
from .drive import MODEL, cpu_seconds, drive, pin

# -- the servers ---------------------------------------------------------------------------------


def start_gateway(home: Path, max_num_seqs: int, label: str = "mlxgw", pythonpath: str | None = None) -> ServerProcess:
    """`mlxgw up` serving the null engine; `pythonpath`: another mlxgw (an earlier commit's
    tree laid out as the mlxgw package)."""
    config = {
        "manager": {"auto_discover": False},
        "models": [{"name": MODEL, "engine": "null", "preload": True, "max_num_seqs": max_num_seqs, "max_queue": 1024}],
    }
    return spawn_mlxgw(home, config, label=label, env={"PYTHONPATH": pythonpath} if pythonpath else None)


async def wait_ready(server: ServerProcess, timeout: float = 120) -> None:
    """A chat request answered 200 (the bare server has no /v1/models, and mlxgw's null
    model must answer too)."""
    deadline = time.monotonic() + timeout
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if server.proc is not None and server.proc.poll() is not None:
                raise RuntimeError(f"{server.label} exited with {server.proc.returncode}:\n{server.log()[-3000:]}")
            try:
                async with session.post(f"{server.url}/v1/chat/completions", json=body) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.3)
    raise RuntimeError(f"{server.label} not ready after {timeout} s")


# -- the run ----------------------------------------------------------------------------------------


def ratio(ours: list[float], theirs: list[float]) -> float:
    return round(median(ours) / median(theirs), 3) if theirs and ours else 0.0


async def ready_and_pinned(servers: list[ServerProcess], pin_cpus: bool) -> None:
    """Every server answering; with pin_cpus, the servers on CPU 0 and this client on CPU 1
    (so the client's own load does not count against the servers)."""
    for server in servers:
        await wait_ready(server)
    if pin_cpus:
        for server in servers:
            pin(server.pids(), 0)
        os.sched_setaffinity(0, {1})


async def measure(args: argparse.Namespace, servers: list[ServerProcess]) -> dict:
    rows: list[dict] = []
    await ready_and_pinned(servers, args.pin)
    for server in servers:  # warm-up: connections, first-request paths
        await drive(server.url, args.concurrency, 1.0, args.plain_tokens, False)
        await drive(server.url, args.concurrency, 1.0, args.stream_tokens, True)
    for rnd in range(args.rounds):
        order = rotated(servers, rnd)
        for stream, tokens in ((False, args.plain_tokens), (True, args.stream_tokens)):
            for server in order:
                pids = server.pids()
                cpu_before = cpu_seconds(pids)
                tally, wall = await drive(server.url, args.concurrency, args.seconds, tokens, stream)
                cpu = cpu_seconds(pids) - cpu_before
                row = {
                    "round": rnd,
                    "server": server.label,
                    "stream": stream,
                    "requests": tally.requests,
                    "failed": tally.failed,
                    "req_s": round(tally.requests / wall, 1),
                    "tok_s": round(tally.tokens / wall, 1),
                    # server CPU (all its processes) per request and per streamed token
                    "cpu_us_per_req": round(cpu * 1e6 / max(tally.requests, 1), 1),
                    "cpu_us_per_tok": round(cpu * 1e6 / max(tally.tokens, 1), 2),
                    "load_1m": round(os.getloadavg()[0], 2),  # the machine's, at the end of the run
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    return {"rows": rows, "summary": summarize(rows, [s.label for s in servers])}


def summarize(rows: list[dict], labels: list[str]) -> dict:
    """Medians per server, and each mlxgw's ratio to the bare server (per round too)."""
    summary: dict = {}
    gateways = [label for label in labels if label != "bare"]
    for stream, metric, name in (
        (False, "req_s", "plain_req_s"),
        (True, "tok_s", "stream_tok_s"),
        (False, "cpu_us_per_req", "plain_cpu_us_per_req"),
        (True, "cpu_us_per_tok", "stream_cpu_us_per_tok"),
    ):
        per = {label: [r[metric] for r in rows if r["server"] == label and r["stream"] == stream] for label in labels}
        summary[name] = {label: median(v) for label, v in per.items() if v}
        for label in gateways:
            suffix = "" if label == "mlxgw" else f"_{label}"
            if metric.startswith("cpu"):  # bare / mlxgw: the capacity ratio a server-bound run would show
                summary[name][f"ratio{suffix}"] = ratio(per["bare"], per[label])
            else:
                summary[name][f"ratio{suffix}"] = ratio(per[label], per["bare"])
                summary[name][f"ratios_per_round{suffix}"] = [
                    round(a / b, 3) for a, b in zip(per[label], per["bare"]) if b
                ]
        if "before" in per:  # this tree against the earlier one, round by round (> 1: this one is better)
            now, then = per["mlxgw"], per["before"]
            better = (then, now) if metric.startswith("cpu") else (now, then)
            summary[name]["now_vs_before"] = ratio(*better)
            summary[name]["now_vs_before_per_round"] = [round(a / b, 3) for a, b in zip(*better) if b]
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=6.0, help="per server, workload and round")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--plain-tokens", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--pin", action="store_true", help="servers on CPU 0, the client on CPU 1")
    ap.add_argument("--url", default=None, help="an mlxgw already running (null model `null`) instead of starting one")
    ap.add_argument(
        "--before",
        default=None,
        help="also run an earlier mlxgw, labelled `before`: a PYTHONPATH where `mlxgw` is that version "
        "(bench/overhead/README.md)",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the rows and summary as JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxgw-capacity-") as tmp:
        home = Path(tmp)
        bare = spawn_bare(home)
        seqs = max(64, args.concurrency)
        started = [bare]
        try:
            if args.url:
                servers = [ServerProcess.running("mlxgw", args.url.rstrip("/")), bare]
            else:
                (home / "mlxgw").mkdir()
                servers = [start_gateway(home / "mlxgw", seqs), bare]
                started.append(servers[0])
            if args.before:
                (home / "before").mkdir()
                servers.append(start_gateway(home / "before", seqs, "before", args.before))
                started.append(servers[-1])
            result = asyncio.run(measure(args, servers))
        finally:
            for server in started:
                server.stop()
    result["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    result["settings"]["out"] = str(args.out) if args.out else None
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
