"""Summaries of a load level (percentiles, throughput), merged over rounds, and the tables
(every bench's Markdown table is drawn by markdown_table).

Every statistic comes from bench/stats.py; the spread test and the round order from
bench/method.py."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .method import Method
from .stats import paired_ratios, percentile, summarize

if TYPE_CHECKING:  # the in-process benches draw tables too: they need not import aiohttp
    from .loadgen import RequestResult

__all__ = [
    "percentile",
    "summarize_level",
    "merge_rounds",
    "paired_ratio_rows",
    "levels_markdown",
    "markdown_table",
    "or_dash",
]

# Figures of a level that are merged over rounds (median, every round kept beside it).
ROUND_KEYS = (
    "output_tok_s",
    "requests_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "itl_max_s",
)
CHECKED = "output_tok_s"  # the figure whose rounds must agree within --max-spread


def summarize_level(results: list[RequestResult], wall: float) -> dict:
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


def merge_rounds(rows: list[dict], method: Method) -> list[dict]:
    """One row per (server, concurrency): each figure's median over the rounds, its rounds
    (in the order they ran) under `<key>_rounds`, and the spread of tok/s, flagged when the
    rounds disagree by more than the method's max spread."""
    out: list[dict] = []
    for key in dict.fromkeys((r["server"], r["concurrency"]) for r in rows):
        same = sorted((x for x in rows if (x["server"], x["concurrency"]) == key), key=lambda x: x.get("round", 1))
        merged = {k: v for k, v in same[0].items() if k != "round"}
        merged["rounds"] = len(same)
        for k in ("completed", "failed", "output_tokens", "cached_tokens"):
            merged[k] = sum(x.get(k, 0) for x in same)
        merged["errors"] = sorted({e for x in same for e in x.get("errors", [])})[:5]
        for k in ROUND_KEYS:
            summary = summarize([x.get(k) for x in same])
            merged[k] = _r(summary.median)
            merged[f"{k}_rounds"] = [_r(v) for v in summary.rounds]
            if k == CHECKED:
                merged["tok_s_spread"] = _r(summary.spread)
                merged["unstable"] = method.check(f"{key[0]} c={key[1]} tok/s", summary)
                merged["verdict"] = method.flag_cell(summary)
        out.append(merged)
    return out


def paired_ratio_rows(rows: list[dict], a: str, b: str, method: Method) -> list[dict]:
    """a / b per concurrency from the rounds' pairs (a and b ran back to back in a round):
    tok/s (higher: a is faster) and TTFT p50 as b / a (higher: a answers sooner)."""
    out = []
    levels = dict.fromkeys(r["concurrency"] for r in rows if r["server"] == a)
    for c in levels:
        ra = _by_round(rows, a, c)
        rb = _by_round(rows, b, c)
        common = sorted(set(ra) & set(rb))
        if not common:
            continue
        tok = summarize(paired_ratios([ra[n]["output_tok_s"] for n in common], [rb[n]["output_tok_s"] for n in common]))
        ttft = summarize(paired_ratios([rb[n]["ttft_p50_s"] for n in common], [ra[n]["ttft_p50_s"] for n in common]))
        unstable = method.check(f"{a} / {b} c={c} tok/s ratio", tok)
        out.append(
            {
                "concurrency": c,
                "tok_s_ratio": _r(tok.median, 3),
                "tok_s_ratio_rounds": [_r(v, 3) for v in tok.rounds],
                "tok_s_ratio_spread": _r(tok.spread),
                "ttft_p50_ratio": _r(ttft.median, 3),
                "ttft_p50_ratio_rounds": [_r(v, 3) for v in ttft.rounds],
                "unstable": unstable,
                "verdict": method.flag_cell(tok),
            }
        )
    return out


def _by_round(rows: list[dict], server: str, c: int) -> dict[int, dict]:
    return {r.get("round", 1): r for r in rows if r["server"] == server and r["concurrency"] == c}


LEVEL_COLUMNS = [
    ("server", "server"),
    ("concurrency", "c"),
    ("completed", "ok"),
    ("failed", "failed"),
    ("output_tok_s", "tok/s median (rounds)"),
    ("verdict", "tok/s spread"),
    ("ttft_p50_s", "TTFT p50 s (rounds)"),
    ("ttft_p90_s", "TTFT p90 s"),
    ("itl_p50_s", "ITL p50 s"),
    ("itl_p99_s", "ITL p99 s"),
]
WITH_ROUNDS = {"output_tok_s": 2, "ttft_p50_s": 3}


def markdown_table(header: str | Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table: the header (its columns, or one string of them as the table shows
    them, "a | b"), its separator, then a line per row (each cell as str())."""
    columns = header.split(" | ") if isinstance(header, str) else header

    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(map(str, cells)) + " |"

    return "\n".join([line(columns), "|" + "---|" * len(columns), *map(line, rows)])


def or_dash(x: float | None, fmt: str = "{:.2f}") -> str:
    """A table's figure, "-" where there is none."""
    return "-" if x is None else fmt.format(x)


def levels_markdown(rows: list[dict]) -> str:
    return markdown_table([c[1] for c in LEVEL_COLUMNS], ([_cell(r, k) for k, _ in LEVEL_COLUMNS] for r in rows))


def ratios_markdown(a: str, peer: str, rows: list[dict]) -> str:
    header = (
        f"c | {a} / {peer} tok/s, median of per-round ratios (rounds) | spread | "
        f"TTFT p50 ratio (higher = {a} answers sooner) (rounds)"
    )
    cells = (
        [
            r["concurrency"],
            _with_rounds(r["tok_s_ratio"], r["tok_s_ratio_rounds"], 3),
            r["verdict"],
            _with_rounds(r["ttft_p50_ratio"], r["ttft_p50_ratio_rounds"], 3),
        ]
        for r in rows
    )
    return markdown_table(header, cells)


def _cell(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None:
        return ""
    digits = WITH_ROUNDS.get(key)
    if digits is None:
        return str(value)
    return _with_rounds(value, row.get(f"{key}_rounds") or [], digits)


def _with_rounds(value: float | None, rounds: list[float], digits: int) -> str:
    """'59.10 (58.00, 60.30, 61.20)': a summary with every round beside it."""
    if value is None:
        return ""
    if len(rounds) < 2:
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} ({', '.join(f'{v:.{digits}f}' for v in rounds)})"


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)
