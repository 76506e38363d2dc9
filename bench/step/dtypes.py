"""Single-stream decode and prompt speed of model folders, with and without OpenBLAS.

python -m mlxgw.bench.step.dtypes ~/.cache/mlxgw/models/smollm2-135m ~/.cache/mlxgw/models/smollm2-bf16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def measure(path: str, max_tokens: int = 48) -> dict:
    from mlx_lm import load, stream_generate

    model, tok = load(path)
    prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True)
    for _ in stream_generate(model, tok, prompt, max_tokens=4):  # warm-up
        pass
    started, first, last = time.perf_counter(), None, None
    for response in stream_generate(model, tok, prompt, max_tokens=max_tokens):
        first = first or time.perf_counter() - started
        last = response
    return {
        "model": os.path.basename(path.rstrip("/")),
        "ttft_s": round(first, 3),
        "decode_tok_s": round(last.generation_tps, 2),
        "prompt_tok_s": round(last.prompt_tps, 1),
    }


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(measure(sys.argv[2])), flush=True)
        return
    from ...shared.platform import openblas_path, worker_environment

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model_dirs", nargs="+", help="model folders, each measured with and without OpenBLAS")
    for path in ap.parse_args().model_dirs:
        for blas in [True, False] if openblas_path() else [False]:
            env = worker_environment(use_openblas=blas)
            if not blas:
                env.pop("LD_PRELOAD", None)
            out = subprocess.run(
                [sys.executable, "-m", "mlxgw.bench.step.dtypes", "--child", path],
                env=env,
                capture_output=True,
                text=True,
            )
            row = json.loads(out.stdout) if out.returncode == 0 else {"model": path, "error": out.stderr[-300:]}
            print(json.dumps({**row, "blas": "openblas" if blas else "bundled"}), flush=True)


if __name__ == "__main__":
    main()
