"""Latency classes: how soon a request's first token is owed, and how the classes fare.

The gateway names each generating request's class (gateway/pipeline/latency_class.py):
editor completion (fill-in-the-middle, /infill), interactive chat, agents, background
(batch jobs, service_tier "flex"), with the class's target time to first token. The worker
orders its waiting queue by deadline = arrival + target within a priority
(worker/schedule/fair_share.py), so a keystroke that arrives after queued agent turns is
admitted before them, and reports per class what waits, what runs and the first-token
times it measured against the target (/v1/status `classes`).

A request from an older gateway names no class: background priority makes it background,
anything else is chat, with the default targets below."""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from ...shared.protocol import BACKGROUND_PRIORITY

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ...shared import protocol as p
    from .sequence import Sequence

CLASSES = ("editor", "chat", "agent", "background")  # most urgent first
# Seconds to first token, by class (the gateway's defaults too: shared/gateway_config.py).
DEFAULT_TARGETS_S = {"editor": 0.5, "chat": 1.0, "agent": 3.0, "background": 60.0}
RECENT = 512  # first-token times kept per class for its percentiles
# An editor's file stays in the prefix cache this long after each of its requests (as a
# client's caching hint: its blocks leave after every block nobody holds). Every keystroke
# reads it again; beside 24 agent sessions' turns, LRU alone lets their blocks push it out,
# and a 4,000-token file read again costs a minute on a loaded 2-core host, past every pause.
EDITOR_HOLD_S = 300.0


def class_of(req: p.GenerateRequest) -> str:
    if req.latency_class in CLASSES:
        return req.latency_class
    return "background" if req.priority >= BACKGROUND_PRIORITY else "chat"


def target_of(req: p.GenerateRequest) -> float:
    """The request's target time to first token, in seconds (its class's default unless the
    gateway sent one)."""
    target = req.ttft_target_s
    if isinstance(target, (int, float)) and not isinstance(target, bool) and math.isfinite(target) and target > 0:
        return float(target)
    return DEFAULT_TARGETS_S[class_of(req)]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


class ClassStats:
    """First-token times per class (the most recent RECENT each), against each one's target."""

    def __init__(self) -> None:
        self._ttft: dict[str, deque[tuple[float, float]]] = {c: deque(maxlen=RECENT) for c in CLASSES}
        self.answered = dict.fromkeys(CLASSES, 0)  # lifetime first tokens
        self.late = dict.fromkeys(CLASSES, 0)  # of which after their target

    def first_token(self, seq: Sequence) -> None:
        if seq.first_token_at is None or seq.paused:  # a resumed row's first token was long ago
            return
        name, target = class_of(seq.req), target_of(seq.req)
        ttft = seq.first_token_at - seq.arrived
        self._ttft[name].append((ttft, target))
        self.answered[name] += 1
        self.late[name] += ttft > target

    def report(self, seqs: Iterable[Sequence]) -> dict:
        """Per class: the default target, waiting and running requests, and the recent
        first-token times (p50 / p90 / p99) with the share of them within their target."""
        waiting, running = dict.fromkeys(CLASSES, 0), dict.fromkeys(CLASSES, 0)
        for seq in seqs:
            (running if seq.uid is not None else waiting)[class_of(seq.req)] += 1
        out = {}
        for name in CLASSES:
            recent = list(self._ttft[name])
            times = [t for t, _ in recent]
            within = sum(1 for t, target in recent if t <= target)
            out[name] = {
                "target_s": DEFAULT_TARGETS_S[name] if not recent else recent[-1][1],
                "waiting": waiting[name],
                "running": running[name],
                "answered": self.answered[name],
                "late": self.late[name],
                "ttft_p50_s": _percentile(times, 0.5),
                "ttft_p90_s": _percentile(times, 0.9),
                "ttft_p99_s": _percentile(times, 0.99),
                "within_target": round(within / len(recent), 3) if recent else None,
            }
        return out
