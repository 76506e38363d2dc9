// Replicas of a model (routing.replicas, remote workers of it): one line each under the
// model's name with what the pool reports (/v1/status models[].replicas): load, prefix-cache
// bytes and hit rate, how requests were routed to it (by prefix, session, load), later turns
// of a session that missed its cache, and the route entries its worker says it holds.
"use strict";

function replicaText(r) {
  const pct = r.cache_hit_rate == null ? "–" : `${Math.round(100 * r.cache_hit_rate)}%`;
  const parts = [
    `load ${r.load || 0}`,
    `cache ${fmtBytes(r.cache_bytes || 0)}`,
    `hits ${pct}`,
    `routed ${r.routed_by_prefix || 0} prefix / ${r.routed_by_session || 0} session / ${r.routed_by_load || 0} load`,
    `cold warm turns ${r.cold_warm_turns || 0}`,
    `${r.indexed_prefixes || 0} prefixes`,
  ];
  if (r.breaker_open_s > 0) parts.push(`breaker open ${r.breaker_open_s} s`);
  return parts.join(" · ");
}

function renderReplicas(holder, replicas) {
  const rows = (replicas || []).filter((r) => r && r.replica);
  holder.hidden = rows.length < 2;
  holder.replaceChildren(
    ...(rows.length < 2 ? [] : rows).map((r) =>
      el(
        "div",
        { class: "replica", "data-replica": r.replica },
        el("span", { class: "replica-name", text: `${r.replica}${r.remote ? " (remote)" : ""}` }),
        el("span", { class: "replica-stats", text: r.state ? replicaText(r) : r.slot_state || "" }),
      ),
    ),
  );
}
