// mlxgw console: usage per key and the key table. Loaded after console.js, whose helpers ($, el, api, state, toast) it uses.
"use strict";

// -- keys and usage -------------------------------------------------------------------------------
async function refreshKeys() {
  const [keys, today, week, models] = await Promise.all([
    api("/v1/keys").catch((e) => (e.status === 400 ? { data: [], open: e.message } : Promise.reject(e))),
    api("/v1/usage?since=today&by=key").catch(() => ({ data: [] })),
    api("/v1/usage?since=7d&by=key").catch(() => ({ data: [] })),
    api("/v1/usage?since=7d&by=model").catch(() => ({ data: [] })),
  ]);
  renderUsage(today.data, week.data);
  renderModelUsage(models.data);
  renderKeys(keys);
  refreshBatches().catch(() => null); // batches.js
}

function renderUsage(today, week) {
  const byKey = new Map();
  for (const r of week) byKey.set(r.key, { week: r, today: null });
  for (const r of today) (byKey.get(r.key) || byKey.set(r.key, { week: null }).get(r.key)).today = r;
  const total = week.reduce((a, r) => a + r.total_tokens, 0) || 1;
  const rows = [...byKey.entries()].sort((a, b) => (b[1].week?.total_tokens || 0) - (a[1].week?.total_tokens || 0));
  fillRows($("usage-table"), $("usage-empty"), rows, ([key, u]) => {
    const share = (100 * (u.week?.total_tokens || 0)) / total;
    return [
      el("td", { class: "strong", text: key }),
      el("td", { class: "num", text: fmtNum(u.today?.requests || 0) }),
      el("td", { class: "num", text: fmtNum(u.today?.total_tokens || 0) }),
      el("td", { class: "num", text: fmtNum(u.week?.requests || 0) }),
      el("td", { class: "num", text: fmtNum(u.week?.total_tokens || 0) }),
      el("td", { class: "num", text: fmtNum(u.week?.errors || 0) }),
      el("td", {}, el("div", { class: "share" }, el("div", { class: "share-fill", style: `width:${share}%` })),
        el("span", { class: "muted small", text: ` ${share.toFixed(0)}%` })),
    ];
  });
}

function renderModelUsage(rows) {
  fillRows($("model-usage-table"), $("model-usage-empty"), rows, (r) => [
    r.model === "-"
      ? el("td", { class: "muted", text: "(refused before routing)" })
      : el("td", { class: "strong", text: r.model }),
    el("td", { class: "num", text: fmtNum(r.requests) }),
    el("td", { class: "num", text: fmtNum(r.prompt_tokens) }),
    el("td", { class: "num", text: fmtNum(r.completion_tokens) }),
    el("td", { class: "num", text: fmtNum(r.errors) }),
    el("td", { class: "num", text: fmtSecs(r.avg_latency_s) }),
    el("td", { class: "num", text: fmtSecs(r.avg_ttft_s) }),
  ]);
}

function limitsText(k) {
  const parts = [];
  if (k.rpm != null) parts.push(`${fmtNum(k.rpm)} req/min`);
  if (k.tpm != null) parts.push(`${fmtNum(k.tpm)} tok/min`);
  if (k.tpd != null) parts.push(`${fmtNum(k.tpd)} tok/day`);
  if (k.tpmo != null) parts.push(`${fmtNum(k.tpmo)} tok/month`);
  if (k.aspm != null) parts.push(`${fmtNum(k.aspm)} audio s/min`);
  if (k.max_concurrent != null) parts.push(`${k.max_concurrent} at once`);
  if (k.expires) parts.push(`expires ${k.expires.slice(0, 10)}`);
  if (k.weight != null && k.weight !== 1) parts.push(`weight ${k.weight}`); // fair share
  if (k.min_priority) parts.push(`priority from ${k.min_priority}`);
  if (k.cache_group) parts.push(`cache group ${k.cache_group}`); // shares prefix-cache hits with its group
  return parts.join(" · ") || "none";
}

function renderKeys(keys) {
  const items = keys.data || [];
  fillRows($("keys-table"), $("keys-empty"), items, (k) => {
    const revoke = el("button", { class: "small danger", text: "Revoke", "data-action": "revoke", "data-key": k.name });
    return [
      el("td", {}, el("span", { class: "strong", text: k.name }), k.admin ? el("span", { class: "pill admin", text: "admin" }) : null),
      el("td", { text: (k.models || ["all"]).join(", ") }),
      el("td", { class: "small", text: limitsText(k) }),
      el("td", { class: "muted", text: k.created ? k.created.slice(0, 10) : "–" }),
      el("td", { class: "muted", text: fmtAgo(k.last_used) }),
      el("td", { class: "num", text: fmtNum(k.usage?.today?.tokens || 0) }),
      el("td", { class: "actions" }, revoke),
    ];
  });
  if (keys.open) $("keys-empty").textContent = keys.open;
  $("keys-empty").hidden = items.length > 0;
}

async function revokeKey(button) {
  if (button.dataset.confirm !== "1") {
    button.dataset.confirm = "1";
    button.textContent = "Confirm";
    setTimeout(() => { button.dataset.confirm = ""; button.textContent = "Revoke"; }, 4000);
    return;
  }
  try {
    await api(`/v1/keys/${encodeURIComponent(button.dataset.key)}`, { method: "DELETE" });
    toast(`revoked ${button.dataset.key}`, "ok");
  } catch (e) {
    toast(e.message, "error");
  }
  refreshKeys().catch(() => {});
}

async function createKey(ev) {
  ev.preventDefault();
  const num = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  const body = { name: $("key-name").value.trim(), rpm: num("key-rpm"), tpm: num("key-tpm"), tpd: num("key-tpd") };
  if ($("key-models").value.trim()) body.models = $("key-models").value;
  if ($("key-cache-group").value.trim()) body.cache_group = $("key-cache-group").value.trim();
  if ($("key-admin").checked) body.admin = true;
  try {
    const k = await api("/v1/keys", { method: "POST", body });
    $("new-key-name").textContent = k.name;
    $("new-key-value").textContent = k.key;
    $("new-key").hidden = false;
    $("key-form").reset();
  } catch (e) {
    toast(e.message, "error");
  }
  refreshKeys().catch(() => {});
}
