// mlxgw console: the audit trail (GET /v1/audit, admin): who changed what, newest first, and
// whether the hash chain is unbroken. Loaded after console.js, whose helpers ($, el, api, fillRows) it uses.
"use strict";

function auditActor(a) {
  if (!a) return "–";
  if (a.kind === "key") return a.name;
  if (a.kind === "cli") return `cli:${a.user}${a.via ? "/" + a.via : ""}`;
  return `${a.kind}:${a.address || a.signal || "–"}`;
}

async function refreshAudit() {
  const q = new URLSearchParams({ limit: "200", verify: "true" });
  const filter = $("audit-filter").value.trim();
  if (filter) q.set(filter.includes(".") ? "action" : "actor", filter);
  const trail = await api(`/v1/audit?${q}`);
  const v = trail.verify || {};
  const chain = $("audit-chain");
  chain.textContent = v.ok ? `chain unbroken (${v.entries} entries)` : `BROKEN at entry ${v.first_bad?.seq}: ${v.first_bad?.problem}`;
  chain.className = v.ok ? "badge ok" : "badge bad";
  fillRows($("audit-table"), $("audit-empty"), [...trail.data].reverse(), (e) => [
    el("td", { class: "muted small", text: new Date(e.time).toLocaleString() }),
    el("td", { class: "strong", text: auditActor(e.actor), title: e.actor?.id || "" }),
    el("td", { text: e.action }),
    el("td", { text: e.target || "–" }),
    el("td", { class: e.outcome === "ok" ? "ok" : "bad", text: e.outcome + (e.status ? ` ${e.status}` : ""), title: e.reason || "" }),
    el("td", { class: "muted small", text: JSON.stringify(e.change || {}) }),
  ]);
}

$("audit-filter").addEventListener("change", () => refreshAudit().catch((e) => toast(e.message, "error")));
