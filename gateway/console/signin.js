// mlxgw console: sign-in with the team's identity provider (the session is an HttpOnly cookie
// this script never sees) and a signed-in person's own keys. Loaded after console.js, whose
// helpers ($, el, api, state, toast, startApp, showTab, signOut) it uses.
"use strict";

async function startWithoutKey() {
  let me = null;
  try {
    me = await api("/v1/me", { timeoutMs: 10000 });
  } catch (e) {
    const info = await api("/auth/info").catch(() => ({ oidc: false }));
    $("login-sso").hidden = !info.oidc;
    signOut(e.status === 401 && e.message.includes("session") ? e.message : "");
    return;
  }
  state.open = true; // no key to send: the cookie (or a keyless gateway) is the sign-in
  if (me.kind !== "person") { startApp(); return; }
  state.person = me;
  $("whoami").textContent = me.person + (me.admin ? " (admin)" : "");
  $("whoami").dataset.person = me.person;
  document.querySelector(".tab-button[data-tab='mine']").hidden = false;
  if (me.admin) { startApp(); return; }
  // Not an admin: their own keys only (the other tabs show every user's traffic).
  for (const b of document.querySelectorAll(".tab-button")) b.hidden = b.dataset.tab !== "mine";
  $("login").hidden = true;
  $("app").hidden = false;
  setConn(true, "signed in");
  showTab("mine");
  refreshMine().catch((e) => toast(e.message, "error"));
}

async function endSession() {
  state.person = null;
  state.open = false;
  await api("/auth/logout", { method: "POST" }).catch(() => null);
  $("whoami").textContent = "";
  $("login-sso").hidden = false;
}

async function refreshMine() {
  const mine = await api("/v1/me/keys");
  fillRows($("mine-table"), $("mine-empty"), mine.data, (k) => [
    el("td", { class: "strong", text: k.name }),
    el("td", { text: k.cache_group || "own" }),
    el("td", { class: "muted", text: k.created ? k.created.slice(0, 10) : "–" }),
    el("td", { class: "actions" },
      el("button", { class: "small danger", text: "Revoke", "data-action": "revoke-mine", "data-key": k.name })),
  ]);
}

async function createMine(ev) {
  ev.preventDefault();
  try {
    const k = await api("/v1/me/keys", { method: "POST", body: { label: $("mine-label").value.trim() } });
    $("mine-new-name").textContent = k.name;
    $("mine-new-value").textContent = k.key;
    $("mine-new").hidden = false;
    $("mine-form").reset();
  } catch (e) {
    toast(e.message, "error");
  }
  refreshMine().catch(() => {});
}

async function revokeMine(button) {
  try {
    await api(`/v1/me/keys/${encodeURIComponent(button.dataset.key)}`, { method: "DELETE" });
    toast(`revoked ${button.dataset.key}`, "ok");
  } catch (e) {
    toast(e.message, "error");
  }
  refreshMine().catch(() => {});
}

document.addEventListener("DOMContentLoaded", () => {
  $("mine-form").addEventListener("submit", createMine);
  $("mine-table").addEventListener("click", (ev) => {
    const b = ev.target.closest("button[data-action='revoke-mine']");
    if (b) revokeMine(b);
  });
  document.querySelector(".tab-button[data-tab='mine']").addEventListener("click", () => refreshMine().catch(() => {}));
});
