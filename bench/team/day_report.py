"""The whole-day study's rows: one per server, round and latency class (summarized as every
load level is, bench/report.summarize_level), merged over rounds (report.merge_rounds: the
median, every round beside it) and shown as one markdown table."""

from __future__ import annotations

from ..loadgen import RequestResult
from ..method import Method
from ..report import merge_rounds, summarize_level
from ..stats import percentile, summarize

CLASSES = ("editor", "chat", "agent", "background")
UNANSWERED = "no first token within the pause"
NOT_OPEN = "the file open did not finish by the end of the round"
# Figures of a server's round that are not summarize_level's, merged over rounds here.
EXTRA_KEYS = ("within_pause", "file_open_p50_s", "peak_rss_mb")
COLUMNS = [  # (key, header, digits: None for a plain value, else the median with its rounds)
    ("server", "server", None),
    ("class", "class", None),
    ("completed", "ok", None),
    ("failed", "failed", None),
    ("output_tok_s", "tok/s (rounds)", 1),
    ("ttft_p50_s", "TTFT p50 s (rounds)", 2),
    ("ttft_p90_s", "TTFT p90 s (rounds)", 2),
    ("ttft_p99_s", "TTFT p99 s (rounds)", 2),
    ("within_pause", "last keys within pause", 2),
    ("file_open_p50_s", "file open p50 s", 2),
    ("peak_rss_mb", "peak RSS MB", 0),
]


def editor_results(typing, typists: int = 0) -> list[RequestResult]:
    """Each burst's last keystroke (the one nothing supersedes) as a request: refused by the
    server, unanswered within the pause (the typist goes on: it is never answered), or
    answered with its TTFT and the tokens the editor received; and a failure for each of the
    `typists` whose file open never finished (it typed nothing)."""
    out = [RequestResult(False, 200, NOT_OPEN) for _ in range(typists - len(typing.open_s))]
    for k in typing.keystrokes:
        if not k.last_of_burst:
            continue
        if k.error:
            out.append(RequestResult(False, 0, k.error))
        elif k.first_token is None:
            out.append(RequestResult(False, 200, UNANSWERED))
        else:
            out.append(RequestResult(True, 200, ttft=k.first_token - k.sent, tokens=k.delivered))
    return out


def class_rows(server: str, rnd: int, loads, pause_s: float, peak_rss: int | None) -> list[dict]:
    """One server's round (day.Loads) as a row per class, in CLASSES order."""
    by_class = {"editor": editor_results(loads.typing, loads.typists), **loads.results}
    rows = []
    for name in CLASSES:
        # merge_rounds groups a server's rows by `concurrency`: here, the class
        row = {"server": server, "round": rnd, "class": name, "concurrency": name}
        row |= summarize_level(by_class.get(name, []), loads.wall)
        row["peak_rss_mb"] = round(peak_rss / 2**20) if peak_rss else None
        if name == "editor":
            answered = [r.ttft for r in by_class["editor"] if r.ttft is not None]
            last = sum(1 for k in loads.typing.keystrokes if k.last_of_burst)  # not the unopened files
            row["within_pause"] = round(sum(t <= pause_s for t in answered) / last, 3) if last else None
            open_p50 = percentile(loads.typing.open_s, 50)
            row["file_open_p50_s"] = None if open_p50 is None else round(open_p50, 3)
        rows.append(row)
    return rows


def merge(rows: list[dict]) -> list[dict]:
    """One row per server and class: merge_rounds' medians, and the same for EXTRA_KEYS."""
    merged = merge_rounds(rows, Method(rounds=max((r["round"] for r in rows), default=1), max_spread=None))
    for row in merged:
        same = sorted((r for r in rows if (r["server"], r["class"]) == (row["server"], row["class"])),
                      key=lambda r: r["round"])  # fmt: skip
        for key in EXTRA_KEYS:
            summary = summarize([r.get(key) for r in same])
            row[key] = summary.median
            row[f"{key}_rounds"] = list(summary.rounds)
    return merged


def _cell(row: dict, key: str, digits: int | None) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    if digits is None:
        return str(value)
    return summarize(row.get(f"{key}_rounds") or [value]).cell(digits)  # the median (every round)


def markdown(merged: list[dict], header: str = "") -> str:
    """The merged rows as one table (`header`: the method's line above it)."""
    lines = [header, ""] if header else []
    lines.append("| " + " | ".join(h for _, h, _ in COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    lines += ["| " + " | ".join(_cell(r, k, d) for k, _, d in COLUMNS) + " |" for r in merged]
    return "\n".join(lines)
