"""Embeddings throughput: one by one, concurrent single-input requests (batched in the
worker), and many inputs per request; optionally the worker's encoder and batching policy
in-process (no HTTP), and peers on the same texts in the same run: sentence-transformers
(PyTorch) and mlx-embeddings, each from a Python environment that has it.

    python -m mlxgw.bench.serving.embeddings --url http://127.0.0.1:8000 --model minilm-l6 --inprocess MODEL_DIR \\
        [--st-python VENV/bin/python] [--mlx-embeddings-python VENV/bin/python] [--peer-model DIR]

Prints one JSON line per measurement and a Markdown table."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

import aiohttp

WORDS = (
    "the model serves embeddings for retrieval search ranking documents queries vectors team server "
    "memory batch worker gateway request answer question paris france capital river mountain city data"
).split()


def texts(n: int, seed: int, lo: int = 8, hi: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) + f" ({i})" for i in range(n)]


async def _worker_stats(session: aiohttp.ClientSession, url: str, model: str) -> dict:
    await asyncio.sleep(1.5)  # heartbeats carry the worker's counters
    async with session.get(f"{url}/v1/status") as r:
        status = await r.json()
    for m in status["models"]:
        if m["name"] == model and m["workers"]:
            return m["workers"][0]["stats"]
    return {}


async def http_runs(url: str, model: str, items: list[str], concurrency: int) -> list[dict]:
    results = []
    async with aiohttp.ClientSession() as session:

        async def embed(inputs: list[str]) -> None:
            body = {"model": model, "input": inputs, "encoding_format": "base64"}
            async with session.post(f"{url}/v1/embeddings", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
                await r.read()

        await embed(items[:4])  # warm-up
        runs = [
            ("one by one (1 input/request, sequential)", items[: max(16, len(items) // 4)], 1, 1),
            (f"concurrent (1 input/request, {concurrency} clients)", items, 1, concurrency),
            ("64 inputs per request (sequential)", items, 64, 1),
        ]
        for label, subset, per_request, clients in runs:
            batches = [subset[i : i + per_request] for i in range(0, len(subset), per_request)]
            before = await _worker_stats(session, url, model)
            queue = list(batches)
            started = time.perf_counter()

            async def client(queue: list[list[str]]) -> None:
                while queue:
                    await embed(queue.pop())

            await asyncio.gather(*(client(queue) for _ in range(clients)))
            wall = time.perf_counter() - started
            after = await _worker_stats(session, url, model)
            passes = after.get("forward_passes", 0) - before.get("forward_passes", 0)
            results.append(
                {
                    "run": f"mlxgw: {label}",
                    "inputs": len(subset),
                    "wall_s": round(wall, 3),
                    "embeddings_per_s": round(len(subset) / wall, 1),
                    "forward_passes": passes,
                }
            )
    return results


def inprocess_runs(model_dir: str, items: list[str]) -> list[dict]:
    """The worker's encoder and scheduler without the gateway: requests of 1 and of 64 inputs."""
    from pathlib import Path

    from ...shared.protocol import EmbedRequest
    from ...worker.model.encoder.encoder import TextEncoder
    from ...worker.schedule.embeddings import EmbedScheduler

    enc = TextEncoder(Path(model_dir))
    enc.embed([enc.tokenize(t, i) for i, t in enumerate(items[:4])])  # warm-up
    out = []
    for batch in (1, 64):
        n = len(items) if batch > 1 else max(16, len(items) // 4)
        sched = EmbedScheduler(enc, max_batch_size=64, max_batch_tokens=8192, max_queue=1 << 20)
        passes = enc.forward_passes
        started = time.perf_counter()
        for i in range(0, n, batch):
            sched.submit(EmbedRequest(rid=str(i), inputs=items[i : i + batch]))
            if batch == 1:  # one by one: each request finishes before the next arrives
                while sched.has_work():
                    sched.step()
        while sched.has_work():
            sched.step()
        wall = time.perf_counter() - started
        out.append(
            {
                "run": f"in-process worker encoder, {batch} input(s)/request",
                "inputs": n,
                "wall_s": round(wall, 3),
                "embeddings_per_s": round(n / wall, 1),
                "forward_passes": enc.forward_passes - passes,
            }
        )
    return out


# Each peer script reads the texts on stdin, takes the model folder as argv[1], and prints
# one JSON line per batch size (1 and 64), timing the same texts as the mlxgw runs.
PEER_TIMING = """
import json, sys, time
items = json.loads(sys.stdin.read())
encode(items[:4])
for batch in (1, 64):
    n = len(items) if batch > 1 else max(16, len(items) // 4)
    started = time.perf_counter()
    for i in range(0, n, batch):
        encode(items[i:i + batch])
    wall = time.perf_counter() - started
    print(json.dumps({"run": f"{LABEL}, batch {batch}", "inputs": n, "wall_s": round(wall, 3),
                      "embeddings_per_s": round(n / wall, 1)}))
"""
SENTENCE_TRANSFORMERS = """
import sys, torch
from sentence_transformers import SentenceTransformer
model = SentenceTransformer(sys.argv[1], device="cpu")
LABEL = f"sentence-transformers (PyTorch {torch.__version__})"
def encode(batch):
    model.encode(batch, batch_size=len(batch))
"""
MLX_EMBEDDINGS = """
import sys, mlx.core as mx
import mlx_embeddings
from mlx_embeddings import load
model, tok = load(sys.argv[1])
LABEL = f"mlx-embeddings {mlx_embeddings.__version__}"
def encode(batch):
    enc = tok._tokenizer(batch, padding=True, truncation=True, max_length=256, return_tensors="mlx")
    mx.eval(model(enc["input_ids"], attention_mask=enc["attention_mask"]).text_embeds)
"""


def peer_runs(python: str, script: str, model_dir: str, items: list[str]) -> list[dict]:
    from ...shared.platform import worker_environment

    proc = subprocess.run(
        [python, "-c", script + PEER_TIMING, model_dir],
        input=json.dumps(items),
        capture_output=True,
        text=True,
        check=True,
        env=worker_environment(dict(os.environ)),  # the same BLAS as the worker
    )
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> None:
    from ...shared.platform import reexec_as_worker
    from ..report import markdown_table

    reexec_as_worker("mlxgw.bench.serving.embeddings")  # the in-process encoder runs as a worker would
    ap = argparse.ArgumentParser(prog="python -m mlxgw.bench.serving.embeddings")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="minilm-l6")
    ap.add_argument("--inputs", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--inprocess", metavar="MODEL_DIR", help="also time the encoder in-process")
    ap.add_argument("--st-python", help="a Python with sentence-transformers, to time the same texts")
    ap.add_argument("--mlx-embeddings-python", help="a Python with mlx-embeddings, to time the same texts")
    ap.add_argument("--peer-model", help="model folder for the peers (default: --inprocess)")
    args = ap.parse_args(argv)
    items = texts(args.inputs, args.seed if args.seed is not None else random.randrange(1 << 30))
    results = asyncio.run(http_runs(args.url.rstrip("/"), args.model, items, args.concurrency))
    if args.inprocess:
        results += inprocess_runs(args.inprocess, items)
    peer_model = args.peer_model or args.inprocess
    if args.st_python:
        results += peer_runs(args.st_python, SENTENCE_TRANSFORMERS, peer_model, items)
    if args.mlx_embeddings_python:
        results += peer_runs(args.mlx_embeddings_python, MLX_EMBEDDINGS, peer_model, items)
    for r in results:
        print(json.dumps(r))
    rows = ([r["run"], r["inputs"], r["embeddings_per_s"], r.get("forward_passes", "")] for r in results)
    print("\n" + markdown_table("run | inputs | embeddings/s | forward passes", rows))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
