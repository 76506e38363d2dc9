"""deploy/grafana-dashboard.json against a real gateway's /metrics: every query of every
panel (and of the dashboard's variables) names only series that `mlxgw up` exports, with
labels those series carry. Grafana itself is not run: the PromQL is read for its series."""

from __future__ import annotations

import json
import re

from helpers import NO_EOS, REPO, http
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = REPO / "deploy" / "grafana-dashboard.json"
SERIES = re.compile(r"\b(mlxgw_[A-Za-z0-9_]+)\s*(\{[^}]*\})?")
MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LABEL_VALUES = re.compile(r"label_values\((mlxgw_[A-Za-z0-9_]+),\s*([A-Za-z_]+)\)")


def _panels(items: list[dict]):
    for item in items:
        yield item
        yield from _panels(item.get("panels", []))


def _exported(gw) -> dict[str, set[str]]:
    """Each series name /metrics exports, with the labels its samples carry."""
    status, _, text = http(f"{gw.url}/metrics")
    assert status == 200
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def test_every_panel_queries_series_the_gateway_exports(tiny_gateway):
    # one streamed answer of a few tokens: the latency and token series have samples
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    body["logit_bias"] = NO_EOS
    assert http(f"{tiny_gateway.url}/v1/chat/completions", "POST", body)[0] == 200
    exported = _exported(tiny_gateway)
    dashboard = json.loads(DASHBOARD.read_text())

    queries = []
    for panel in _panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        assert panel.get("targets"), f"panel {panel['title']!r} queries nothing"
        queries += [(panel["title"], t["expr"]) for t in panel["targets"]]
    assert len(queries) >= 20
    for title, expr in queries:
        named = SERIES.findall(expr)
        assert named, f"{title!r}: {expr} names no mlxgw series"
        labels: set[str] = {"le"}
        for name, selector in named:
            assert name in exported, f"{title!r}: {name} is not in /metrics"
            used = set(MATCHER.findall(selector))
            assert used <= exported[name], f"{title!r}: {name} has no label {used - exported[name]}"
            labels |= exported[name]
        for group in GROUPING.findall(expr):
            grouped = {g.strip() for g in group.split(",") if g.strip()}
            assert grouped <= labels, f"{title!r}: grouped by {grouped - labels}, which its series lack"

    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "model", "key"} <= set(variables)
    for name in ("model", "key"):
        series, label = LABEL_VALUES.fullmatch(variables[name]["definition"]).groups()
        assert series in exported and label in exported[series]
