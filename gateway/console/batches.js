// mlxgw console: every key's batch jobs (GET /v1/batches?all=true, admin). Loaded after console.js.
"use strict";

async function refreshBatches() {
  const batches = await api("/v1/batches?all=true&limit=100");
  fillRows($("batches-table"), $("batches-empty"), batches.data, (b) => [
    el("td", { class: "strong", text: shortId(b.id), title: b.id }),
    el("td", { text: b.owner || "–" }),
    el("td", { class: "muted", text: b.endpoint }),
    el("td", { text: b.status }),
    el("td", { class: "num", text: fmtNum(b.request_counts.completed) }),
    el("td", { class: "num", text: fmtNum(b.request_counts.failed) }),
    el("td", { class: "num", text: fmtNum(b.request_counts.total) }),
    el("td", { class: "muted small", text: new Date(b.created_at * 1000).toLocaleString() }),
  ]);
}
