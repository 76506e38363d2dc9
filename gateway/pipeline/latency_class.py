"""A generating request's latency class, and the classes in /v1/status.

Four classes, most urgent first: editor (fill-in-the-middle: /infill, `suffix`, Ollama's
`suffix`), chat, agent (a request that carries tools) and background (batch jobs,
service_tier "flex"). A request's class is the one its route gives, or the one it asks
(`latency_class`), but never more urgent than its key grants (keys.yaml `latency_class`,
like `min_priority`); background priority makes it background, and a background class
runs at background priority (it yields its rows to interactive requests). Each class has a
target time to first token (models.yaml gateway `ttft_target_<class>_s`); the worker admits
the earliest arrival + target first within a priority (worker/schedule/latency.py)."""

from __future__ import annotations

from aiohttp import web

from ...shared.protocol import BACKGROUND_PRIORITY

CLASSES = ("editor", "chat", "agent", "background")  # most urgent first


def route_class(fim: dict | None, tools: list | None) -> str:
    if fim is not None:
        return "editor"
    return "agent" if tools else "chat"


def target_s(settings, name: str) -> float:
    return float(getattr(settings, f"ttft_target_{name}_s"))


def classify(request: web.Request, asked: str | None, route: str, priority: int) -> tuple[str, int]:
    """(class, priority) a request runs at: `asked` (or its route's class when it asks none),
    made no more urgent than its key's grant; background class and priority go together."""
    if priority >= BACKGROUND_PRIORITY:
        return "background", priority
    name = asked if asked in CLASSES else route
    key = request.get("key")
    grant = getattr(key, "latency_class", None) if key is not None else None
    if grant in CLASSES and CLASSES.index(grant) > CLASSES.index(name):
        name = grant
    return name, BACKGROUND_PRIORITY if name == "background" else priority


def classes_status(settings, models: list[dict]) -> dict:
    """/v1/status `classes`: per class its target and, summed over the workers, what waits,
    what runs, first tokens counted and how many came after their target; the workers'
    own entries (their stats' `classes`) carry the first-token percentiles."""
    out = {
        name: {"target_s": target_s(settings, name), "waiting": 0, "running": 0, "answered": 0, "late": 0}
        for name in CLASSES
    }
    for model in models:
        for worker in model.get("workers") or []:
            reported = (worker.get("stats") or {}).get("classes")
            if not isinstance(reported, dict):
                continue
            for name, entry in out.items():
                mine = reported.get(name)
                if not isinstance(mine, dict):
                    continue
                for field in ("waiting", "running", "answered", "late"):
                    value = mine.get(field)
                    if isinstance(value, int) and not isinstance(value, bool):
                        entry[field] += value
    return out
