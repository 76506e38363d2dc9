"""Where a transcription's time goes inside a Whisper worker: the worker's own scheduler and
model in-process (no gateway), the committed clips one after another, then 8 at once, with
the seconds spent in encoder passes, decoder prefills and decoder steps, and the texts (to
check that a speed-up leaves them unchanged: --save writes them, --compare diffs them).

    LD_PRELOAD=$(python -c "from mlxgw.shared.platform import openblas_path; print(openblas_path())") \\
        python -m mlxgw.bench.serving.audio_profile ~/.mlxgw/models/whisper-tiny-en [--save a.json] [--compare b.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

CLIPS_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "audio"
PHASES = ("encode", "prefill", "step")


def timed_runner(folder: Path):
    from ...worker.model.whisper.runner import WhisperRunner

    runner = WhisperRunner(folder)
    spent = dict.fromkeys(PHASES, 0.0)
    for name in PHASES:
        inner = getattr(runner, name)

        def wrapper(*args, _inner=inner, _name=name):
            started = time.perf_counter()
            try:
                return _inner(*args)
            finally:
                spent[_name] += time.perf_counter() - started

        setattr(runner, name, wrapper)
    return runner, spent


def transcribe(runner, pcm: dict[str, bytes], names: list[str]) -> dict[str, dict]:
    from ...shared import protocol as p
    from ...worker.schedule.transcription import AudioScheduler

    scheduler = AudioScheduler(runner, max_rows=16, max_queue=64)
    for i, name in enumerate(names):
        scheduler.submit(p.TranscribeRequest(rid=f"{i}:{name}", audio=pcm[name], language="en"))
    done: dict[str, dict] = {}
    while len(done) < len(names):
        for rid, event in scheduler.step():
            if event.KIND in ("finish", "error"):
                done[rid] = {"segments": [{k: s[k] for k in ("start", "end", "text")} for s in event.segments or []]}
    return done


def main() -> None:
    from ...gateway.pipeline.audio_decode import decode_audio

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--save", type=Path)
    ap.add_argument("--compare", type=Path)
    args = ap.parse_args()
    meta = json.loads((CLIPS_DIR / "clips.json").read_text())
    started = time.perf_counter()
    pcm = {n: decode_audio((CLIPS_DIR / n).read_bytes(), 600).pcm for n in meta}
    print(f"audio decode (PyAV): {(time.perf_counter() - started) / len(meta):.3f} s per clip")
    runner, spent = timed_runner(args.model)
    transcribe(runner, pcm, [next(iter(meta))])  # warm-up
    results = {}
    english = [n for n in meta if meta[n]["language"] == "en"]
    for label, names in (("one at a time", list(meta)), ("8 at once", (english * 2)[:8])):
        before, stats0 = dict(spent), runner.stats()
        started = time.perf_counter()
        if label == "one at a time":
            out = {k: v for n in names for k, v in transcribe(runner, pcm, [n]).items()}
        else:
            out = transcribe(runner, pcm, names)
        wall = time.perf_counter() - started
        stats = {k: v - stats0[k] for k, v in runner.stats().items()}
        phases = {k: round(spent[k] - before[k], 2) for k in PHASES}
        print(f"{label}: {wall:.2f} s; {phases}; {stats}")
        results[label] = out
    for rid, r in results["one at a time"].items():
        print(rid, repr("".join(s["text"] for s in r["segments"])))
    if args.save:
        args.save.write_text(json.dumps(results, indent=1, sort_keys=True))
    if args.compare:
        same = json.loads(args.compare.read_text()) == json.loads(json.dumps(results, sort_keys=True))
        print("texts and segments identical to", args.compare, ":", same)


if __name__ == "__main__":
    main()
