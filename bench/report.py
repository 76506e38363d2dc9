"""Summaries of a load level: percentiles, throughput, and a Markdown table."""

from __future__ import annotations

from .loadgen import RequestResult


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    tokens = sum(r.tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 2) if wall else 0.0,
        "requests_s": round(len(ok) / wall, 2) if wall else 0.0,
        "ttft_p50_s": _r(percentile(ttfts, 50)),
        "ttft_p90_s": _r(percentile(ttfts, 90)),
        "ttft_p99_s": _r(percentile(ttfts, 99)),
        "itl_p50_s": _r(percentile(gaps, 50)),
        "itl_p99_s": _r(percentile(gaps, 99)),
        "itl_max_s": _r(max(gaps) if gaps else None),
        "cached_tokens": sum(r.cached_tokens for r in ok),
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


COLUMNS = [
    ("server", "server"),
    ("concurrency", "c"),
    ("completed", "ok"),
    ("failed", "failed"),
    ("output_tok_s", "tok/s"),
    ("requests_s", "req/s"),
    ("ttft_p50_s", "TTFT p50 s"),
    ("ttft_p90_s", "TTFT p90 s"),
    ("ttft_p99_s", "TTFT p99 s"),
    ("itl_p50_s", "ITL p50 s"),
    ("itl_p99_s", "ITL p99 s"),
]


def markdown(rows: list[dict]) -> str:
    head = "| " + " | ".join(c[1] for c in COLUMNS) + " |"
    sep = "|" + "---|" * len(COLUMNS)
    body = ["| " + " | ".join("" if r.get(k) is None else str(r.get(k)) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join([head, sep, *body])
