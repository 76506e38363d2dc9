"""The worker's two CPU forward changes against mlx-lm's own, in one process, alternated.

    python -m mlxgw.bench.step.cpu_forward [MODEL_DIR] --rounds 3 [--prefill-tokens 2048] [--out F]

- attention: one layer's attention at the model's head shape (SmolLM2-135M: 9 query heads,
  3 KV heads, 64 wide), mlx-lm's `scaled_dot_product_attention` (MLX's CPU fallback) against
  worker/model/cpu/cpu_attention.py, at decode shapes (batch x cached positions; rows past the first
  left-padded by a fifth, as BatchKVCache does) and a prefill chunk;
- head: the output head's GEMM, `x @ W.T` (mlx-lm's layout) against `x @ Wt`
  (worker/model/cpu/output_head.py), at batch 1, 8, 16, 32;
- prefill: one prompt of --prefill-tokens through the whole model in 512-token chunks, then
  10 decode steps at that context, with mlx-lm's attention and with the worker's (the head
  as the worker stores it in both: this isolates the attention).

Each round runs every variant once, the order rotated; medians with every round beside them.
Runs with the environment workers get (OpenBLAS)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..method import rotated
from ..report import markdown_table
from ..stats import median, paired_ratios, summarize

DECODE = [(1, 80), (1, 4000), (8, 1000), (16, 100), (16, 500)]
PREFILL_CHUNK = (1, 512, 2048)  # batch, chunk rows, cached positions


def _time(fn, mx, repeats: int) -> float:
    """Seconds per call: the median of `repeats` evaluated calls."""
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        seconds.append(time.perf_counter() - t0)
    return median(seconds)


def _attention_inputs(mx, B: int, L: int, T: int, heads: tuple[int, int, int]):
    hq, hk, d = heads
    q, k, v = mx.random.normal((B, hq, L, d)), mx.random.normal((B, hk, T, d)), mx.random.normal((B, hk, T, d))
    if L > 1:
        mask = "causal"
    elif B > 1:  # left padding: rows past the first start a fifth of the way in
        starts = mx.array([0] + [T // 5] * (B - 1))
        mask = (mx.arange(T)[None, :] >= starts[:, None]).reshape(B, 1, 1, T)
    else:
        mask = None
    mx.eval(q, k, v)
    return q, k, v, mask


def _alternate(variants: dict, mx, rounds: int, repeats: int) -> dict[str, list[float]]:
    """ms per call of each variant per round (the median of `repeats`), the order rotated."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rnd in range(rounds):
        for name in rotated(list(variants), rnd):
            times[name].append(_time(variants[name], mx, repeats) * 1e3)
    return times


def attention_rounds(mx, heads, rounds: int, repeats: int) -> list[dict]:
    from functools import partial

    from ...worker.model.cpu import cpu_attention as ca

    ca.install()
    rows = []
    for B, L, T in [(b, 1, t) for b, t in DECODE] + [PREFILL_CHUNK]:
        q, k, v, mask = _attention_inputs(mx, B, L, T, heads)
        scale = heads[2] ** -0.5
        variants = {
            "mlx-lm": partial(ca._original, q, k, v, cache=None, scale=scale, mask=mask),
            "mlxgw": partial(ca.attention, q, k, v, None, scale, mask),
        }
        times = _alternate(variants, mx, rounds, repeats)
        rows.append({"what": "attention", "batch": B, "rows": L, "keys": T, **_summary(times)})
    return rows


def head_rounds(mx, model, rounds: int, repeats: int) -> list[dict]:
    from functools import partial

    from ...worker.model.cpu.output_head import TOKEN_EMBEDDINGS

    weights = [m.weight for name, m in model.named_modules() if name.split(".")[-1] in ("lm_head", *TOKEN_EMBEDDINGS)]
    w = weights[0]
    wt = mx.contiguous(w.T)
    mx.eval(wt)
    rows = []
    for m in (1, 8, 16, 32):
        x = mx.random.normal((m, w.shape[1]))
        mx.eval(x)
        variants = {"mlx-lm": partial(mx.matmul, x, w.T), "mlxgw": partial(mx.matmul, x, wt)}
        times = _alternate(variants, mx, rounds, repeats)
        rows.append({"what": "head", "batch": m, "shape": list(w.shape), **_summary(times)})
    return rows


def prefill_rounds(mx, model, tokens: int, rounds: int) -> list[dict]:
    from mlx_lm.models.cache import make_prompt_cache

    from ...worker.model.cpu import cpu_attention as ca

    prompt = mx.random.randint(0, 1000, (1, tokens), key=mx.random.key(0))
    prefill = {"mlx-lm": [], "mlxgw": []}
    decode = {"mlx-lm": [], "mlxgw": []}
    for rnd in range(rounds):
        for name in rotated(["mlx-lm", "mlxgw"], rnd):
            ca.settings.enabled = name == "mlxgw"
            cache = make_prompt_cache(model)
            t0 = time.perf_counter()
            for i in range(0, tokens, 512):
                out = model(prompt[:, i : i + 512], cache=cache)
                mx.eval(out, [c.state for c in cache])
            prefill[name].append(time.perf_counter() - t0)
            y, steps = out[:, -1:].argmax(-1), []
            for _ in range(10):
                t0 = time.perf_counter()
                out = model(y, cache=cache)
                mx.eval(out)
                steps.append(time.perf_counter() - t0)
                y = out.argmax(-1)
            decode[name].append(median(steps) * 1e3)
    ca.settings.enabled = True
    return [
        {"what": "prefill", "tokens": tokens, "unit": "s", **_summary(prefill)},
        {"what": "decode step", "tokens": tokens, "unit": "ms", **_summary(decode)},
    ]


def _summary(times: dict[str, list[float]]) -> dict:
    return {
        "mlx_lm": summarize(times["mlx-lm"]).as_dict(),
        "mlxgw": summarize(times["mlxgw"]).as_dict(),
        "mlxgw_over_mlx_lm": summarize(paired_ratios(times["mlxgw"], times["mlx-lm"])).as_dict(),
    }


def markdown(rows: list[dict]) -> str:
    header = "what | shape | mlx-lm median (rounds) | mlxgw median (rounds) | mlxgw / mlx-lm, paired"
    lines = []
    for r in rows:
        if r["what"] == "attention":
            shape = f"batch {r['batch']}, {r['rows']} row(s), {r['keys']} keys"
        elif r["what"] == "head":
            shape = f"batch {r['batch']} x {r['shape'][1]} @ {r['shape'][1]} x {r['shape'][0]}"
        else:
            shape = f"{r['tokens']} tokens ({r['unit']})"

        def cell(s: dict) -> str:
            return f"{s['median']:.2f} ({', '.join(f'{v:.2f}' for v in s['rounds'])})"

        ratio = r["mlxgw_over_mlx_lm"]["median"]
        lines.append([r["what"], shape, cell(r["mlx_lm"]), cell(r["mlxgw"]), f"{ratio:.2f}x"])
    return markdown_table(header, lines)


def main(argv: list[str] | None = None) -> None:
    from ...shared.platform import reexec_as_worker

    reexec_as_worker("mlxgw.bench.step.cpu_forward")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?", type=Path, default=Path("~/.cache/mlxgw/models/smollm2-135m").expanduser())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15, help="timed calls per variant and round (their median)")
    ap.add_argument("--prefill-tokens", type=int, default=2048, help="0: skip the whole-model prefill")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import mlx.core as mx
    from mlx_lm import load

    from ...worker.model.cpu.output_head import transpose_head

    model, _ = load(str(args.model_dir))
    attn = model.model.layers[0].self_attn if hasattr(model, "model") else None
    heads = (attn.n_heads, attn.n_kv_heads, attn.q_proj.weight.shape[0] // attn.n_heads) if attn else (9, 3, 64)
    rows = attention_rounds(mx, heads, args.rounds, args.repeats)
    rows += head_rounds(mx, model, args.rounds, args.repeats)
    if args.prefill_tokens:
        transpose_head(model, choose=lambda weight, weight_t: True)  # the layout this bench compares
        rows += prefill_rounds(mx, model, args.prefill_tokens, args.rounds)
    print(markdown(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
