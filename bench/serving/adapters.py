"""Mixed LoRA-adapter traffic against the base model alone, through the server.

    python -m mlxgw.bench.serving.adapters ~/.mlxgw/models/smollm2-135m --adapters 4 \\
        --concurrency 8,16 --rounds 3 [--adapter-dir DIR ...] [--no-peer] [--out bench/out/adapters]

One `mlxgw up` serves the model folder with N LoRA adapters: the --adapter-dir folders
(mlx_lm.lora outputs), else N written here with mlx-lm's own tuner (every linear layer of
every block, as mlx_lm.lora trains by default, rank --rank, random non-zero weights). The
same greedy, streaming chat prompts run as two variants, alternated at every level with the
order rotated each round (bench/method.py): `base` sends every request to the base model;
`mixed` sends them round-robin to the base and each adapter, so every batch mixes them.
Reported per c: tokens/s and TTFT p50 of each variant (median, every round), mixed / base
paired within rounds (the cost of adapters; the goal: >= 0.8x), and the worker's RSS
after the run beside the adapters' own bytes.

The peer (unless --no-peer): `mlx_lm.server` on the same folder and BLAS (bench/servers.py)
gets the same mixed traffic, each request naming its adapter's folder in mlx_lm.server's
per-request `adapters` field (none for the base). It batches only requests of one (model,
adapter) and reloads the model whenever the adapter changes; reported: mlxgw-mixed against
mlx_lm.server-mixed tok/s (paired; the goal: >= 5x) and TTFT. Memory: mlxgw's worker
RSS (base + N adapters resident) against N fused copies (N x the base's weight bytes: a fused
model has the base's shapes), and mlx_lm.server's RSS (one model, reloaded per adapter)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from .. import method as bench_method
from ..loadgen import one_request, varied_prompts
from ..method import Method
from ..report import markdown_table
from ..servers import ServerProcess, show_log_tails, spawn_mlx_lm, spawn_mlxgw, stop_all, warm_up
from ..stats import paired_ratios, percentile, summarize

VARIANTS = ("base", "mixed")
PEER = "mlx_lm.server-mixed"
BASE = "bench-base"
Target = tuple[str, dict]  # the model a request names, and more body fields (the peer's `adapters`)


def write_random_adapter(base: Path, dest: Path, seed: int, rank: int) -> Path:
    """An mlx_lm.lora output folder with random non-zero LoRA weights (default keys)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.lora import LoRALinear, LoRASwitchLinear
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(str(base))
    model.freeze()
    params = {"rank": rank, "scale": 4.0, "dropout": 0.0}
    mx.random.seed(seed)
    linear_to_lora_layers(model, len(model.layers), params)
    for _, module in model.named_modules():
        if isinstance(module, (LoRALinear, LoRASwitchLinear)):
            module.lora_b = 0.05 * mx.random.normal(module.lora_b.shape)
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    config = {"fine_tune_type": "lora", "num_layers": len(model.layers), "lora_parameters": params}
    (dest / "adapter_config.json").write_text(json.dumps(config))
    return dest


def start_gateway(model_dir: Path, home: Path, adapters: list[Path], rows: int) -> ServerProcess:
    listed = [{"name": f"bench-lora-{i}", "path": str(p)} for i, p in enumerate(adapters)]
    entry = {"name": BASE, "source": str(model_dir), "preload": True, "max_num_seqs": rows, "adapters": listed}
    config = {"manager": {"auto_discover": False}, "models": [entry]}
    return spawn_mlxgw(home, config)


async def mixed_level(url: str, targets: list[Target], prompts: list[list[dict]], c: int, max_tokens: int):
    """Every prompt once with c clients, prompt i to targets[i % len(targets)]."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, prompt in enumerate(prompts):
        queue.put_nowait((i, prompt))
    results = []
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2 * c), timeout=timeout) as session:

        async def client() -> None:
            while not queue.empty():
                i, prompt = queue.get_nowait()
                model, extra = targets[i % len(targets)]
                kwargs = {"max_tokens": max_tokens, "temperature": 0.0, "stream": True, "extra": extra}
                results.append(await one_request(session, url, model, prompt, **kwargs))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(c)))
    return results, time.perf_counter() - started


def level(url: str, targets: list[Target], prompts: list[list[dict]], c: int, max_tokens: int, mlxgw: bool) -> dict:
    if mlxgw:  # mlxgw's prefix cache starts empty at every level (mlx_lm.server's has no such call)
        urllib.request.urlopen(urllib.request.Request(f"{url}/cache", method="DELETE"), timeout=60).read()
    results, wall = asyncio.run(mixed_level(url, targets, prompts, c, max_tokens))
    ok = [r for r in results if r.ok]
    return {
        "failed": len(results) - len(ok),
        "tok_s": round(sum(r.tokens for r in ok) / wall, 3) if wall else None,
        "ttft_p50_s": percentile([r.ttft for r in ok], 50),
    }


def worker_rss(url: str) -> int | None:
    with urllib.request.urlopen(f"{url}/status", timeout=30) as r:
        models = json.loads(r.read())["models"]
    workers = next(m for m in models if m["name"] == BASE)["workers"]
    return next((int(w["stats"]["rss_bytes"]) for w in workers if w.get("stats", {}).get("rss_bytes")), None)


def table(runs: list[dict], method: Method) -> str:
    header = "c | base tok/s (rounds) | mixed tok/s (rounds) | mixed / base, paired | TTFT p50 base / mixed s | failed"
    lines = []
    for c in sorted({r["concurrency"] for r in runs}):
        of = {v: [r for r in runs if r["concurrency"] == c and r["variant"] == v] for v in VARIANTS}
        tok = {v: summarize([r["tok_s"] for r in of[v]]) for v in VARIANTS}
        ratio = summarize(paired_ratios([r["tok_s"] for r in of["mixed"]], [r["tok_s"] for r in of["base"]]))
        method.check(f"c={c} mixed/base", ratio)
        ttft = " / ".join(f"{percentile([r['ttft_p50_s'] for r in of[v]], 50) or 0:.2f}" for v in VARIANTS)
        failed = sum(r["failed"] for r in runs if r["concurrency"] == c and r["variant"] in VARIANTS)
        lines.append([c, tok["base"].cell(), tok["mixed"].cell(), ratio.cell(), ttft, failed])
    return markdown_table(header, lines)


def peer_table(runs: list[dict], method: Method) -> str:
    """mlxgw-mixed against mlx_lm.server-mixed, the same prompts and adapters."""
    header = (
        "c | mlxgw-mixed tok/s (rounds) | mlx_lm.server-mixed tok/s (rounds) | mlxgw / mlx_lm.server, paired | "
        "TTFT p50 mlxgw-mixed / mlx_lm.server-mixed s | failed (mlx_lm.server)"
    )
    lines = []
    for c in sorted({r["concurrency"] for r in runs if r["variant"] == PEER}):
        of = {v: [r for r in runs if r["concurrency"] == c and r["variant"] == v] for v in ("mixed", PEER)}
        tok = {v: summarize([r["tok_s"] for r in rows]) for v, rows in of.items()}
        ratio = summarize(paired_ratios([r["tok_s"] for r in of["mixed"]], [r["tok_s"] for r in of[PEER]]))
        method.check(f"c={c} mlxgw-mixed/mlx_lm.server-mixed", ratio)
        ttft = " / ".join(f"{percentile([r['ttft_p50_s'] for r in rows], 50) or 0:.2f}" for rows in of.values())
        failed = sum(r["failed"] for r in of[PEER])
        lines.append([c, tok["mixed"].cell(), tok[PEER].cell(), ratio.cell(), ttft, failed])
    return markdown_table(header, lines)


def weight_bytes(model_dir: Path) -> int:
    """The model's weights on disk (what each fused copy holds again)."""
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def process_rss(server: ServerProcess | None) -> int | None:
    """RSS of a server's process and its children (mlx_lm.server: one process)."""
    import psutil

    total = 0
    for pid in server.pids() if server is not None else []:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_info().rss
    return total or None


def memory_line(rss: int | None, peer_rss: int | None, weights: int, adapter_bytes: int, n: int) -> str:
    mb = 2**20
    line = (
        f"memory: mlxgw's worker, base + {n} adapters resident: RSS {(rss or 0) / mb:.0f} MB (base weights "
        f"{weights / mb:.0f} MB + the adapters' own {adapter_bytes / mb:.1f} MB); {n} fused copies: "
        f"{n} x {weights / mb:.0f} MB = {n * weights / mb:.0f} MB of weights"
    )
    if rss:  # each fused copy served alone: about a worker without the adapters
        line += f" (as {n} servers: ~{n * (rss - adapter_bytes) / mb:.0f} MB RSS)"
    if peer_rss:
        line += f"; mlx_lm.server (one model, reloaded per adapter): RSS {peer_rss / mb:.0f} MB"
    return line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--adapters", type=int, default=4, help="adapters written here (without --adapter-dir)")
    ap.add_argument("--adapter-dir", type=Path, action="append", default=[], help="an mlx_lm.lora folder (repeat)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--concurrency", default="8,16")
    ap.add_argument("--requests", type=int, default=0, help="per level (default 2 x c, >= 4)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=40)
    ap.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True, help="mlx_lm.server's mixed too")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    bench_method.add_arguments(ap)
    args = ap.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    return args


def run_rounds(args, method: Method, model_dir: Path, folders: list[Path], tmp: Path) -> tuple[list[dict], dict]:
    """Every round: base and mixed on mlxgw (and the peer's mixed), in the round's order; the
    servers' RSS after the last."""
    names = [f"bench-lora-{i}" for i in range(len(folders))]
    server = start_gateway(model_dir, tmp, folders, max(args.concurrency))
    peer = spawn_mlx_lm(model_dir, tmp / "peer-logs") if args.peer else None
    targets: dict[str, tuple[str, list[Target]]] = {
        "base": (server.api, [(BASE, {})]),
        "mixed": (server.api, [(name, {}) for name in [BASE, *names]]),
    }
    if peer is not None:  # mlx_lm.server: the model by its folder (as started), the adapter by its folder
        targets[PEER] = (peer.api, [(peer.model, {})] + [(peer.model, {"adapters": str(p)}) for p in folders])
    runs: list[dict] = []
    try:
        server.wait_ready()
        for name in [BASE, *names]:
            warm_up(server.api, name)
        if peer is not None:
            peer.wait_ready()
            warm_up(peer.api, peer.model)
        with method.busy_loops():
            for rnd, order in method.each_round(list(targets)):
                for c in args.concurrency:
                    prompts = varied_prompts(args.requests or max(4, 2 * c), args.prompt_words, seed=c)
                    for variant in order:
                        url, to = targets[variant]
                        row = level(url, to, prompts, c, args.max_tokens, mlxgw=variant != PEER)
                        runs.append({"round": rnd + 1, "concurrency": c, "variant": variant, **row})
                        print(f"round {rnd + 1} c={c} {variant}: tok/s {row['tok_s']} failed {row['failed']}")
        return runs, {"mlxgw_worker": worker_rss(server.api), "mlx_lm.server": process_rss(peer)}
    except Exception:
        show_log_tails([server, peer])
        raise
    finally:
        stop_all([server, peer])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    method = bench_method.from_args(args)
    model_dir = args.model_dir.expanduser().resolve()
    with tempfile.TemporaryDirectory(prefix="mlxgw-adapters-") as tmp:
        folders = [p.expanduser().resolve() for p in args.adapter_dir] or [
            write_random_adapter(model_dir, Path(tmp) / f"adapter-{i}", i + 1, args.rank) for i in range(args.adapters)
        ]
        runs, rss = run_rounds(args, method, model_dir, folders, Path(tmp))
        adapter_bytes = sum((p / "adapters.safetensors").stat().st_size for p in folders)
    n, weights = len(folders), weight_bytes(model_dir)
    md = f"({method.header()}; greedy, {args.max_tokens} tokens, {n} adapters)\n\n{table(runs, method)}"
    if args.peer:
        md += f"\n\n{peer_table(runs, method)}"
    md += f"\n\n{memory_line(rss['mlxgw_worker'], rss['mlx_lm.server'], weights, adapter_bytes, n)}\n\n"
    md += "\n".join(entry.line() for entry in method.logs)
    print(md)
    status = method.finish()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"method": method.as_dict(), "runs": runs, "rss_bytes": rss, "adapter_bytes": adapter_bytes}
        report["base_weight_bytes"] = weights
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
        args.out.with_suffix(".md").write_text(md + "\n")
    sys.exit(1 if any(r["failed"] for r in runs) else status)


if __name__ == "__main__":
    main()
