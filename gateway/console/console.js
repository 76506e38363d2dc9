// mlxgw console: plain JavaScript, no build step, no third-party code, same origin only.
// Every value from the server is written with textContent, never as HTML.
"use strict";

const KEY_STORAGE = "mlxgw.console.key";
const POLL_MS = { status: 2000, requests: 2000, throughput: 10000, keys: 10000, audit: 10000 };
const $ = (id) => document.getElementById(id);
const state = {
  key: sessionStorage.getItem(KEY_STORAGE),
  open: false, // a gateway without API keys, on loopback: no sign-in at all
  tab: "overview",
  status: null,
  throughput: { models: {}, window_s: 3600 },
  modelRows: new Map(),
  busy: new Set(), // polls in flight: never stack them up on a slow server
  timers: [],
  chat: [],
  abort: null,
};

// -- small helpers ------------------------------------------------------------------------------
function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) if (c != null) node.append(c);
  return node;
}
const fmtBytes = (n) => {
  if (!n) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(n >= 100 || i === 0 ? 0 : 1)} ${units[i]}`;
};
const fmtNum = (n) => (n == null ? "–" : Number(n).toLocaleString("en-US"));
const fmtRate = (n) => (n >= 100 ? n.toFixed(0) : n.toFixed(1));
const fmtSecs = (s) => (s == null ? "–" : s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`);
const fmtTime = (ts) => new Date(ts * 1000).toLocaleTimeString([], { hour12: false });
const fmtAgo = (iso) => {
  if (!iso) return "never";
  const s = (Date.now() - Date.parse(iso)) / 1000;
  if (s < 60) return "just now";
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  return `${Math.floor(s / 86400)} d ago`;
};

function toast(message, kind = "info") {
  const t = el("div", { class: `toast ${kind}`, text: message });
  $("toasts").append(t);
  setTimeout(() => t.remove(), kind === "error" ? 7000 : 3500);
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, { method = "GET", body, signal, timeoutMs = 15000 } = {}) {
  const ctrl = new AbortController();
  const timer = setTimeout(() => ctrl.abort(), timeoutMs);
  if (signal) signal.addEventListener("abort", () => ctrl.abort());
  // The header marks the console's own requests: a signed-in session's cookie opens no change without it.
  const headers = state.key ? { Authorization: `Bearer ${state.key}` } : { "X-Mlxgw-Console": "1" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  try {
    const resp = await fetch(path, {
      method, headers, signal: ctrl.signal, body: body === undefined ? undefined : JSON.stringify(body),
    });
    const data = await resp.json().catch(() => ({}));
    if (!resp.ok) {
      const msg = (data.error && (data.error.message || data.error)) || `HTTP ${resp.status}`;
      if (resp.status === 401 && (state.key || state.person)) signOut("That key or sign-in is not valid (any more).");
      throw new ApiError(resp.status, String(msg));
    }
    return data;
  } finally {
    clearTimeout(timer);
  }
}

function setConn(ok, text) {
  $("conn-state").classList.toggle("bad", !ok);
  $("conn-text").textContent = text;
}

// poll(name, fn): runs fn now and every POLL_MS[name], skipping a beat while the last one is
// still out and while the tab is hidden.
function poll(name, fn) {
  const run = async () => {
    if (state.busy.has(name) || document.hidden || !(state.key || state.open)) return;
    state.busy.add(name);
    try { await fn(); } catch (e) { if (name === "status") setConn(false, "unreachable"); }
    finally { state.busy.delete(name); }
  };
  run();
  state.timers.push(setInterval(run, POLL_MS[name]));
}

// -- sign in --------------------------------------------------------------------------------------
async function signIn(key) {
  state.key = key;
  try {
    await api("/v1/keys", { timeoutMs: 10000 });
  } catch (e) {
    state.key = null;
    if (e.status === 403) throw new Error("This key is not an admin key.");
    if (e.status === 400) { state.key = key; return; } // a gateway without keys: open on loopback
    throw new Error(e.status === 401 ? "Unknown or expired key." : e.message);
  }
}

function signOut(message) {
  if (state.person) endSession(); // signin.js: the server forgets the session too
  sessionStorage.removeItem(KEY_STORAGE);
  state.key = null;
  state.timers.forEach(clearInterval);
  state.timers = [];
  $("app").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
}

function startApp() {
  $("login").hidden = true;
  $("app").hidden = false;
  poll("status", refreshStatus);
  poll("requests", refreshRequests);
  poll("throughput", refreshThroughput);
  poll("keys", () => (state.tab === "keys" ? refreshKeys() : null));
  poll("audit", () => (state.tab === "audit" ? refreshAudit() : null));
}

// -- overview -------------------------------------------------------------------------------------
async function refreshStatus() {
  const s = await api("/v1/status", { timeoutMs: 8000 });
  state.status = s;
  setConn(true, `up ${fmtUptime(s.uptime_s)}`);
  renderSummary(s);
  renderModels(s.models);
  fillModelPicker(s.models);
}

function fmtUptime(s) {
  if (s < 120) return `${Math.round(s)} s`;
  if (s < 7200) return `${Math.round(s / 60)} min`;
  if (s < 172800) return `${(s / 3600).toFixed(1)} h`;
  return `${Math.round(s / 86400)} d`;
}

function workerStats(m) {
  const stats = (m.workers || []).map((w) => w.stats || {});
  const sum = (k) => stats.reduce((a, x) => a + (Number(x[k]) || 0), 0);
  return { running: sum("running"), waiting: sum("waiting"), tps: sum("tokens_per_s") };
}

function renderSummary(s) {
  const mem = s.memory || {};
  const pct = mem.budget_bytes ? Math.min(100, (100 * mem.used_bytes) / mem.budget_bytes) : 0;
  $("mem-value").textContent = fmtBytes(mem.used_bytes || 0);
  $("mem-foot").textContent = `of ${fmtBytes(mem.budget_bytes)} budget · ${pct.toFixed(0)}%`;
  $("mem-bar").style.width = `${pct}%`;
  $("mem-bar").classList.toggle("warn", pct > 85);
  const loaded = s.models.filter((m) => m.state === "ready").length;
  $("models-value").textContent = `${loaded}`;
  const failed = s.models.filter((m) => m.state === "failed").length;
  $("models-foot").textContent = `of ${s.models.length} configured${failed ? ` · ${failed} failed` : ""}`;
  let running = 0, waiting = 0, tps = 0;
  for (const m of s.models) {
    const w = workerStats(m);
    running += w.running; waiting += w.waiting; tps += w.tps;
  }
  $("reqs-value").textContent = `${running}`;
  $("reqs-foot").textContent = `running · ${waiting} waiting`;
  $("tps-value").textContent = fmtRate(tps);
  $("classes-foot").textContent = classesText(s.classes);
}

// Latency classes: what waits, and how many first tokens came after the class's target.
function classesText(classes) {
  return Object.entries(classes || {})
    .map(([name, c]) => `${name} ${c.waiting} waiting, ${c.late}/${c.answered} over ${c.target_s} s`)
    .join(" · ");
}

const STATE_CLASS = { ready: "ok", loading: "busy", restarting: "busy", draining: "busy", failed: "bad" };

// A loading model shows how far its load has got: "loading 312/540 MB".
function stateText(m) {
  if (m.state !== "loading" || !m.load) return m.state;
  const mb = (n) => Math.round(n / 1e6);
  return `loading ${mb(m.load.loaded_bytes)}/${mb(m.load.expected_bytes)} MB`;
}

function modelRow(name) {
  let row = state.modelRows.get(name);
  if (row) return row;
  const cells = {
    name: el("div", { class: "model-name" }),
    sub: el("div", { class: "model-sub" }),
    replicas: el("div", { class: "model-replicas", hidden: true }),
    state: el("span", { class: "pill" }),
    err: el("div", { class: "model-err" }),
    mem: el("td", { class: "num" }),
    load: el("td", { class: "num" }),
    spark: el("div", { class: "spark" }),
    rate: el("span", { class: "rate" }),
    loadBtn: el("button", { class: "small", text: "Load", "data-action": "load", "data-model": name }),
    unloadBtn: el("button", { class: "small", text: "Unload", "data-action": "unload", "data-model": name }),
    pinBtn: el("button", { class: "small ghost", text: "Pin", "data-action": "pin", "data-model": name }),
  };
  const tr = el(
    "tr",
    { "data-model": name },
    el("td", {}, cells.name, cells.sub, cells.replicas),
    el("td", {}, cells.state, cells.err),
    cells.mem,
    cells.load,
    el("td", {}, el("div", { class: "spark-cell" }, cells.spark, cells.rate)),
    el("td", { class: "actions" }, cells.loadBtn, cells.unloadBtn, cells.pinBtn),
  );
  row = { tr, cells, model: null };
  state.modelRows.set(name, row);
  return row;
}

function renderModels(models) {
  const body = $("models-table").tBodies[0];
  const filter = $("model-filter").value.trim().toLowerCase();
  const which = $("model-state-filter").value;
  const seen = new Set();
  let shown = 0;
  for (const m of models) {
    seen.add(m.name);
    const row = modelRow(m.name);
    row.model = m;
    const c = row.cells;
    const w = workerStats(m);
    c.name.textContent = m.name;
    c.sub.textContent = [m.kind, ...(m.aliases || []).slice(0, 3)].join(" · ");
    c.state.textContent = stateText(m) + (m.pinned ? " · pinned" : "");
    c.state.className = `pill ${STATE_CLASS[m.state] || "idle"}`;
    c.err.textContent = m.last_error || "";
    renderReplicas(c.replicas, m.replicas);  // replicas.js
    c.mem.textContent = m.memory_bytes ? fmtBytes(m.memory_bytes) : "–";
    c.mem.title = m.expected_bytes ? `expected ${fmtBytes(m.expected_bytes)}` : "";
    c.load.textContent = m.workers.length ? `${w.running} · ${w.waiting}` : "–";
    c.rate.textContent = m.workers.length ? fmtRate(w.tps) : "";
    const active = ["ready", "loading", "restarting", "draining"].includes(m.state);
    c.loadBtn.hidden = active;
    c.unloadBtn.hidden = !active || m.state === "draining";
    c.pinBtn.textContent = m.pinned ? "Unpin" : "Pin";
    drawSpark(c.spark, state.throughput.models[m.name]);
    const matches =
      (!filter || m.name.toLowerCase().includes(filter) || (m.aliases || []).some((a) => a.toLowerCase().includes(filter))) &&
      (which === "all" || (which === "active" ? active : which === "unloaded" ? m.state === "unloaded" : m.state === "failed"));
    row.tr.hidden = !matches;
    if (matches) shown++;
    if (row.tr.parentNode !== body) body.append(row.tr);
  }
  for (const [name, row] of state.modelRows) {
    if (!seen.has(name)) { row.tr.remove(); state.modelRows.delete(name); }
  }
  $("models-empty").hidden = shown > 0;
}

const SVG = "http://www.w3.org/2000/svg";
function drawSpark(holder, points) {
  const W = 140, H = 30;
  let svg = holder.firstChild;
  if (!svg) {
    svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    svg.setAttribute("width", W);
    svg.setAttribute("height", H);
    svg.append(document.createElementNS(SVG, "path"), document.createElementNS(SVG, "path"));
    svg.firstChild.setAttribute("class", "spark-area");
    svg.lastChild.setAttribute("class", "spark-line");
    holder.append(svg);
  }
  const [area, line] = svg.childNodes;
  line.setAttribute("class", points && points.length >= 2 ? "spark-line" : "spark-line empty");
  if (!points || points.length < 2) {
    line.setAttribute("d", `M0 ${H - 1} H${W}`);
    area.setAttribute("d", "");
    holder.title = "no samples yet";
    return;
  }
  // The x axis spans the history there is, up to the hour the gateway keeps: a gateway that
  // started a minute ago gets a readable line, not a sliver at the right edge.
  const now = Date.now() / 1000;
  const span = Math.min(state.throughput.window_s || 3600, Math.max(60, now - points[0][0]));
  const max = Math.max(1, ...points.map((p) => p[1]));
  const xy = points.map(([t, v]) => [
    Math.max(0, W - ((now - t) / span) * W).toFixed(1),
    (H - 2 - (v / max) * (H - 4)).toFixed(1),
  ]);
  const d = "M" + xy.map(([x, y]) => `${x} ${y}`).join(" L");
  line.setAttribute("d", d);
  area.setAttribute("d", `${d} L${xy[xy.length - 1][0]} ${H} L${xy[0][0]} ${H} Z`);
  holder.title = `peak ${fmtRate(max)} tokens/s over the last ${Math.round(span / 60)} min`;
}

async function refreshThroughput() {
  state.throughput = await api("/v1/status/throughput", { timeoutMs: 8000 });
  if (state.status) renderModels(state.status.models);
}

async function refreshRequests() {
  if (state.tab !== "overview") return;
  const r = await api("/v1/status/requests?limit=40", { timeoutMs: 8000 });
  $("running-count").textContent = String(r.running_total);
  fillRows($("running-table"), $("running-empty"), r.running, (q) => [
    el("td", { class: "mono", text: shortId(q.request_id) }),
    el("td", { text: q.key }),
    el("td", { text: q.model }),
    el("td", {}, el("span", { class: `pill ${q.state === "generating" ? "ok" : "busy"}`, text: q.state })),
    el("td", { class: "num", text: `${q.age_s.toFixed(1)} s` }),
  ]);
  fillRows($("recent-table"), $("recent-empty"), r.recent, (q) => [
    el("td", { class: "mono", text: fmtTime(q.ts) }),
    el("td", { text: q.key }),
    el("td", { text: q.model }),
    el("td", { text: q.api }),
    el("td", {}, el("span", { class: `pill ${statusClass(q)}`, text: statusText(q) })),
    el("td", { class: "num", text: fmtNum(q.prompt_tokens + q.completion_tokens) }),
    el("td", { class: "num", text: fmtSecs(q.latency_s) }),
  ]);
}

const shortId = (rid) => (rid && rid.length > 14 ? `${rid.slice(0, 12)}…` : rid || "–");
const isError = (q) => q.status >= 400 || (q.outcome || "").startsWith("error");
const statusClass = (q) => (isError(q) ? (q.status === 429 ? "busy" : "bad") : "ok");
const statusText = (q) => (isError(q) && q.status < 400 ? q.outcome : String(q.status));

function fillRows(table, empty, items, cellsOf) {
  const body = table.tBodies[0];
  body.replaceChildren(...items.map((it) => el("tr", {}, ...cellsOf(it))));
  empty.hidden = items.length > 0;
}

async function modelAction(button) {
  const { action, model } = button.dataset;
  const row = state.modelRows.get(model);
  const path = `/v1/models/${encodeURIComponent(model)}/${action}`;
  const body = action === "pin" ? { pinned: !(row && row.model && row.model.pinned) } : undefined;
  button.disabled = true;
  try {
    const r = await api(path, { method: "POST", body, timeoutMs: 330000 });
    toast(`${model}: ${r.state}${r.pinned ? " (pinned)" : ""}`, "ok");
  } catch (e) {
    toast(`${model}: ${e.message}`, "error");
  } finally {
    button.disabled = false;
    refreshStatus().catch(() => {});
  }
}

// -- wiring ---------------------------------------------------------------------------------------
function showTab(name) {
  state.tab = name;
  for (const b of document.querySelectorAll(".tab-button")) b.classList.toggle("active", b.dataset.tab === name);
  for (const p of document.querySelectorAll(".tab-panel")) p.hidden = p.id !== `tab-${name}`;
  if (name === "keys") refreshKeys().catch((e) => toast(e.message, "error"));
  if (name === "audit") refreshAudit().catch((e) => toast(e.message, "error")); // audit.js
  if (name === "overview") refreshRequests().catch(() => {});
}

function wire() {
  $("login-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const key = $("login-key").value.trim();
    if (!key) return;
    $("login-submit").disabled = true;
    try {
      await signIn(key);
      sessionStorage.setItem(KEY_STORAGE, key);
      $("login-key").value = "";
      startApp();
    } catch (e) {
      $("login-error").textContent = e.message;
    } finally {
      $("login-submit").disabled = false;
    }
  });
  $("sign-out").addEventListener("click", () => signOut());
  for (const b of document.querySelectorAll(".tab-button")) b.addEventListener("click", () => showTab(b.dataset.tab));
  $("models-table").addEventListener("click", (ev) => {
    const b = ev.target.closest("button[data-action]");
    if (b) modelAction(b);
  });
  $("keys-table").addEventListener("click", (ev) => {
    const b = ev.target.closest("button[data-action='revoke']");
    if (b) revokeKey(b);
  });
  for (const id of ["model-filter", "model-state-filter"]) {
    $(id).addEventListener("input", () => state.status && renderModels(state.status.models));
  }
  $("key-form").addEventListener("submit", createKey);
  $("new-key-dismiss").addEventListener("click", () => { $("new-key").hidden = true; $("new-key-value").textContent = ""; });
  $("play-form").addEventListener("submit", sendChat);
  $("play-input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("play-form").requestSubmit(); }
  });
  $("play-stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("play-clear").addEventListener("click", () => {
    state.chat = [];
    $("play-log").replaceChildren($("play-empty"));
    $("play-empty").hidden = false;
    $("play-stats").textContent = "";
  });
}

// keys.js and playground.js load after this file: start once every script has run.
document.addEventListener("DOMContentLoaded", () => {
  wire();
  if (state.key) {
    signIn(state.key).then(startApp, (e) => signOut(e.message));
  } else {
    // Keys off (the quick start): the console opens at once; a signed-in session (its cookie):
    // the console for its roles; else the sign-in, which says how to get an admin key (signin.js).
    startWithoutKey();
  }
});
