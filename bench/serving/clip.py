"""A conversation of four turns about one 30-second clip: the time to the first token of turns
2-4 against turn 1 (goal: 10x sooner, the frames never encoded again), on mlxgw and, with
`--vllm-python`, on vllm-mlx serving the same model folder.

Each turn resends the clip (as chat clients do) with the earlier turns and one more question;
the assistant turns are fixed texts, so every server reads the same prompts. Every turn is
streamed with `video_fps` and `video_max_frames` (both servers take these names), a fixed
`max_tokens` and temperature 0; the first token is the first chunk carrying text. Each round
makes its own clip (another colour), so no round's first turn finds an earlier round's cache.
The servers run one after another, never beside each other (one model's memory at a time).

The model: `--model DIR`, or a random-weight Qwen2-VL built into `--build DIR` at the size of
Qwen2-VL-2B (`--size 2b`: vision tower of 32 layers x 1280, language model of 28 x 1536;
bench/serving/random_vlm.py) or tiny (`--size tiny`, to try the bench in seconds). No
trained weights are needed: timing does not depend on them.

    python -m mlxgw.bench.serving.clip --build ~/.cache/mlxgw/bench/qwen2-vl-2b-random \\
        --size 2b --vllm-python /work/peers-venv/bin/python --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from ..report import markdown_table
from ..servers import ServerProcess, registry, show_log_tails, spawn_mlxgw, spawn_vllm_mlx, stop_all, warm_up

QUESTIONS = [
    "Describe what happens in this recording, step by step, and what a new viewer should notice first.",
    "What changes between the start and the end of the clip?",
    "Which colour dominates the last seconds?",
    "Summarise the clip in one sentence.",
]
ANSWERS = ["A square moves across a dark background.", "It moves from left to right.", "The same colour."]


def make_clip(seconds: float, fps: int, size: int, seed: int) -> bytes:
    """An MP4 (MPEG-4 Part 2, PyAV) of a square crossing a gradient; `seed` sets its colour."""
    import os

    import av
    import numpy as np

    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    colour = np.array([(seed * 67) % 256, (seed * 131 + 90) % 256, (seed * 29 + 170) % 256], np.uint8)
    background = np.tile(np.linspace(0, 80, size, dtype=np.uint8)[None, :, None], (size, 1, 3))
    frames = int(seconds * fps)
    side = max(4, size // 6)
    try:
        with av.open(path, "w", format="mp4") as out:
            stream = out.add_stream("mpeg4", rate=fps)
            stream.width = stream.height = size
            stream.pix_fmt = "yuv420p"
            for i in range(frames):
                img = background.copy()
                x = (size - side) * i // max(1, frames - 1)
                img[size // 2 - side // 2 : size // 2 + side // 2, x : x + side] = colour
                for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        return Path(path).read_bytes()
    finally:
        os.unlink(path)


def turn_messages(clip: bytes, turn: int) -> list[dict]:
    """Turn `turn` (0-based): the clip and the first question, then the fixed answers and the
    next questions up to this turn's."""
    import base64

    url = f"data:video/mp4;base64,{base64.b64encode(clip).decode()}"
    first = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": QUESTIONS[0]}]
    messages = [{"role": "user", "content": first}]
    for k in range(1, turn + 1):
        messages += [{"role": "assistant", "content": ANSWERS[k - 1]}, {"role": "user", "content": QUESTIONS[k]}]
    return messages


def ask(api: str, model: str, messages: list[dict], args) -> dict:
    """One streamed turn: seconds to the first text, total seconds, usage."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "video_fps": args.video_fps,
        "video_max_frames": args.video_max_frames,
    }
    req = urllib.request.Request(
        f"{api}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    first, usage = None, {}
    with urllib.request.urlopen(req, timeout=args.timeout) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
            if first is None and (delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")):
                first = time.perf_counter() - started
    total = time.perf_counter() - started
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return {
        "ttft_s": first if first is not None else total,
        "total_s": total,
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": cached,
    }


def encodes_skipped(server: ServerProcess) -> int | None:
    """mlxgw's count of vision-tower runs its prefix cache made unnecessary (from /v1/status)."""
    try:
        with urllib.request.urlopen(f"{server.url}/v1/status", timeout=10) as r:
            status = json.loads(r.read())
        model = next(m for m in status["models"] if m["name"] == server.model)
        return sum(
            ((w.get("stats") or {}).get("cache") or {}).get("media_encodes_skipped", 0) for w in model["workers"]
        )
    except (OSError, StopIteration, KeyError, ValueError):
        return None


def conversation(server: ServerProcess, clip: bytes, args) -> dict:
    """The four turns, and on mlxgw how many vision-tower runs its prefix cache skipped."""
    before = encodes_skipped(server) if server.label == "mlxgw" else None
    turns = []
    for turn in range(len(QUESTIONS)):
        turns.append(ask(server.api, server.model, turn_messages(clip, turn), args))
        print(f"  {server.label} turn {turn + 1}: {json.dumps(turns[-1])}", flush=True)
    skipped = None
    if before is not None:
        time.sleep(2.5)  # the worker's counters arrive with its heartbeats
        after = encodes_skipped(server)
        skipped = None if after is None else after - before
    return {"turns": turns, "encodes_skipped": skipped}


def start(label: str, model_dir: Path, work: Path, args) -> ServerProcess:
    if label == "mlxgw":
        config = registry(model_dir, name="clip-model", kind="vision")
        server = spawn_mlxgw(work / "mlxgw-home", config, "clip")
    else:
        server = spawn_vllm_mlx(args.vllm_python, model_dir, work / "logs", ["--mllm"])
    server.wait_ready(args.timeout)
    warm_up(server.api, server.model, timeout=args.timeout)
    return server


def run_server(label: str, model_dir: Path, work: Path, args) -> list[dict] | str:
    """Every round's turns on one server, or why it could not run."""
    server = None
    try:
        started = time.perf_counter()
        server = start(label, model_dir, work, args)
        print(f"{label} ready in {time.perf_counter() - started:.0f} s", flush=True)
        rounds = []
        for r in range(args.rounds):
            clip = make_clip(args.seconds, args.clip_fps, args.clip_size, seed=r + 1)
            rounds.append(conversation(server, clip, args))
        return rounds
    except Exception as e:  # a peer that cannot serve this model is reported, not fatal
        show_log_tails([server])
        return f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        stop_all([server])


def summary(results: dict[str, list[dict] | str]) -> str:
    header = (
        "server | round | turn 1 TTFT s | turns 2-4 TTFT s | turn 1 / mean(2-4) | prompt tokens (cached) | "
        "encodes skipped"
    )
    rows = []
    for label, rounds in results.items():
        if isinstance(rounds, str):
            rows.append([label, "-", f"did not run: {rounds}", "", "", "", ""])
            continue
        for i, conv in enumerate(rounds):
            turns = conv["turns"]
            later = [t["ttft_s"] for t in turns[1:]]
            ratio = turns[0]["ttft_s"] / statistics.mean(later)
            tokens = ", ".join(f"{t['prompt_tokens']} ({t['cached_tokens']})" for t in turns)
            later_text = ", ".join(f"{t:.3f}" for t in later)
            skipped = "-" if conv["encodes_skipped"] is None else f"{conv['encodes_skipped']} of {len(later)}"
            rows.append([label, i + 1, f"{turns[0]['ttft_s']:.3f}", later_text, f"{ratio:.1f}x", tokens, skipped])
    lines = [markdown_table(header, rows)]
    if len(results) == 2 and all(not isinstance(v, str) for v in results.values()):
        mine, peer = results.values()
        for i, (a, b) in enumerate(zip(mine, peer)):
            ratios = ", ".join(f"{y['ttft_s'] / x['ttft_s']:.1f}x" for x, y in zip(a["turns"], b["turns"]))
            lines.append(f"\nround {i + 1}, vllm-mlx TTFT / mlxgw TTFT, turns 1-4: {ratios}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", type=Path, help="a vision model folder")
    where.add_argument("--build", type=Path, help="build (or reuse) a random-weight Qwen2-VL here")
    ap.add_argument("--size", choices=["2b", "tiny"], default="2b", help="with --build")
    ap.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default="float32",
        help="with --build: float32 on a CPU (MLX's half-precision matmul there is ~16x slower), bfloat16 on a Mac",
    )
    ap.add_argument("--tokenizer", type=Path, default=None, help="with --build: a folder with tokenizer.json")
    ap.add_argument("--seconds", type=float, default=30.0, help="the clip's length")
    ap.add_argument("--clip-fps", type=int, default=4, help="frames a second in the file")
    ap.add_argument("--clip-size", type=int, default=168, help="the clip's width and height in pixels")
    ap.add_argument("--video-fps", type=float, default=0.5, help="frames sampled a second (the request field)")
    ap.add_argument("--video-max-frames", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--vllm-python", default=None, help="the python of a venv with vllm-mlx: run it too")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=None, help="write the turns as JSON")
    args = ap.parse_args()
    model_dir = args.model
    if args.build is not None:
        from .random_vlm import DEFAULT_TOKENIZER, build

        started = time.perf_counter()
        model_dir = build(args.build.expanduser(), args.size, args.dtype, args.tokenizer or DEFAULT_TOKENIZER)
        print(f"model: {model_dir} ({args.size}, {args.dtype}) in {time.perf_counter() - started:.0f} s", flush=True)
    results: dict[str, list[dict] | str] = {}
    with tempfile.TemporaryDirectory(prefix="mlxgw-clip-") as tmp:
        for label in ["mlxgw", *(["vllm-mlx"] if args.vllm_python else [])]:
            results[label] = run_server(label, model_dir, Path(tmp), args)
    table = summary(results)
    print(table)
    if args.out:
        args.out.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1)
        )
    if isinstance(results["mlxgw"], str):
        sys.exit(1)


if __name__ == "__main__":
    main()
