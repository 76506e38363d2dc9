"""Reports from the usage ledger: totals since a time, grouped by key, model, API or day.

One implementation for `mlxgw usage` (reads the SQLite file directly, gateway running or
not) and `GET /v1/usage` (admin keys)."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math
import re
import sqlite3
import time

from .budgets import UTC, day_start, month_start

GROUPS = {"key": "key", "model": "model", "api": "api", "day": "date(ts, 'unixepoch')", "none": "'all'"}
_SINCE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class UsageQueryError(ValueError):
    pass


def parse_since(text: str | None, now: float | None = None) -> float:
    """'7d', '24h', '30m', 'today', 'month', 'all' or an ISO date/time (UTC) -> Unix time."""
    now = now or time.time()
    text = (text or "7d").strip().lower()
    if text == "all":
        return 0.0
    if text == "today":
        return day_start(now)
    if text == "month":
        return month_start(now)
    m = _SINCE_RE.match(text)
    if m:
        since = now - float(m.group(1)) * _UNITS[m.group(2)]
        if not math.isfinite(since) or since < 0:  # 5,000 nines of days: -Infinity is not JSON
            raise UsageQueryError(f"since: {text[:40]!r} reaches back before 1970; use 'all' for everything")
        return since
    try:
        parsed = dt.datetime.fromisoformat(text.upper().replace("Z", "+00:00"))
    except ValueError:
        raise UsageQueryError(
            f"since: cannot parse {text!r}; use 7d, 24h, 30m, today, month, all or an ISO date"
        ) from None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()


def totals(conn: sqlite3.Connection, since: float, by: str = "key") -> list[dict]:
    """Request and token totals per group, largest token users first (days in order)."""
    if by not in GROUPS:
        raise UsageQueryError(f"by: must be one of {', '.join(GROUPS)}")
    group = GROUPS[by]
    order = "grp" if by == "day" else "total_tokens DESC, grp"
    rows = conn.execute(
        f"""SELECT {group} AS grp, COUNT(*), SUM(status >= 400 OR outcome LIKE 'error:%'),
                   SUM(prompt_tokens), SUM(cached_tokens), SUM(completion_tokens),
                   SUM(prompt_tokens + completion_tokens) AS total_tokens,
                   SUM(embedding_inputs), SUM(audio_seconds), SUM(images), AVG(latency_s), AVG(ttft_s),
                   MAX(ts)
            FROM requests WHERE ts >= ? GROUP BY grp ORDER BY {order}""",
        (since,),
    ).fetchall()
    out = []
    for grp, n, errors, prompt, cached, completion, total, inputs, audio, images, latency, ttft, last in rows:
        out.append(
            {
                by if by != "none" else "group": grp,
                "requests": n,
                "errors": errors or 0,
                "prompt_tokens": prompt or 0,
                "cached_tokens": cached or 0,
                "completion_tokens": completion or 0,
                "total_tokens": total or 0,
                "embedding_inputs": inputs or 0,
                "audio_seconds": round(audio or 0.0, 3),
                "images": images or 0,
                "avg_latency_s": round(latency, 4) if latency is not None else None,
                "avg_ttft_s": round(ttft, 4) if ttft is not None else None,
                "last_at": _iso(last),
            }
        )
    return out


def _iso(ts: float | None) -> str | None:
    return dt.datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if ts else None


def _sums_by_key(conn: sqlite3.Connection, since: float) -> dict[str, int]:
    rows = conn.execute(
        "SELECT tenant, SUM(prompt_tokens + completion_tokens) FROM requests WHERE ts >= ? AND tenant IS NOT NULL"
        " GROUP BY tenant",
        (since,),
    )
    return {k: int(n or 0) for k, n in rows}


def budget_seed(conn: sqlite3.Connection, now: float | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """Tokens per key identity (ApiKey.tenant) so far today and this month (UTC): what the
    budgets start from."""
    now = now or time.time()
    return _sums_by_key(conn, day_start(now)), _sums_by_key(conn, month_start(now))


def key_activity(conn: sqlite3.Connection, now: float | None = None) -> dict[str, dict]:
    """Per key name: last use, and requests and tokens today and over the last 7 days."""
    now = now or time.time()
    out: dict[str, dict] = {}
    for key, last in conn.execute("SELECT key, MAX(ts) FROM requests GROUP BY key"):
        out[key] = {"last_used": _iso(last)}
    for label, since in (("today", day_start(now)), ("7d", now - 7 * 86400)):
        for key, n, tokens in conn.execute(
            "SELECT key, COUNT(*), SUM(prompt_tokens + completion_tokens) FROM requests WHERE ts >= ? GROUP BY key",
            (since,),
        ):
            out.setdefault(key, {"last_used": None})[label] = {"requests": n, "tokens": int(tokens or 0)}
    return out


def render(rows: list[dict], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(rows, indent=2)
    if not rows:
        return "no usage recorded in this period" if fmt == "table" else ""
    columns = list(rows[0])
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return buf.getvalue().rstrip("\n")
    shown = [c for c in columns if c not in ("cached_tokens", "audio_seconds", "images", "last_at")]
    table = [[c.upper() for c in shown]] + [["-" if r[c] is None else str(r[c]) for c in shown] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(shown))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)
