// mlxgw console: the playground (a streaming chat). Loaded after console.js, whose helpers ($, el, api, state, toast) it uses.
"use strict";

// -- playground -----------------------------------------------------------------------------------
function fillModelPicker(models) {
  const pick = $("play-model");
  const names = models.filter((m) => m.kind === "chat" || m.kind === "vision").map((m) => m.name);
  const current = [...pick.options].map((o) => o.value);
  if (names.join("\n") === current.join("\n")) return;
  const chosen = pick.value;
  pick.replaceChildren(...names.map((n) => el("option", { value: n, text: n })));
  if (names.includes(chosen)) pick.value = chosen;
}

function chatBubble(role, text) {
  $("play-empty").hidden = true;
  const body = el("div", { class: "bubble-text", text });
  const node = el("div", { class: `bubble ${role}` }, el("div", { class: "bubble-role", text: role }), body);
  $("play-log").append(node);
  $("play-log").scrollTop = $("play-log").scrollHeight;
  return body;
}

async function sendChat(ev) {
  ev.preventDefault();
  const text = $("play-input").value.trim();
  const model = $("play-model").value;
  if (!text || !model || state.abort) return;
  $("play-input").value = "";
  state.chat.push({ role: "user", content: text });
  chatBubble("user", text);
  const out = chatBubble("assistant", "");
  out.classList.add("streaming");
  state.abort = new AbortController();
  $("play-send").hidden = true;
  $("play-stop").hidden = false;
  const started = performance.now();
  let first = null, chunks = 0, reply = "", usage = null;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST",
      signal: state.abort.signal,
      headers: state.key
        ? { Authorization: `Bearer ${state.key}`, "Content-Type": "application/json" }
        : { "X-Mlxgw-Console": "1", "Content-Type": "application/json" }, // a signed-in session's cookie
      body: JSON.stringify({
        model, messages: state.chat, stream: true, max_tokens: Number($("play-max").value) || 256,
        stream_options: { include_usage: true },
      }),
    });
    if (!resp.ok) {
      const data = await resp.json().catch(() => ({}));
      throw new Error((data.error && data.error.message) || `HTTP ${resp.status}`);
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "the stream ended with an error");
        if (chunk.usage) usage = chunk.usage;
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          if (first === null) first = performance.now();
          chunks++;
          reply += delta.content;
          out.textContent = reply;
          $("play-log").scrollTop = $("play-log").scrollHeight;
        }
      }
    }
    state.chat.push({ role: "assistant", content: reply });
    const secs = (performance.now() - started) / 1000;
    const tokens = usage ? usage.completion_tokens : chunks;
    $("play-stats").textContent =
      `${tokens} tokens in ${secs.toFixed(2)} s · first token after ${first ? ((first - started) / 1000).toFixed(2) : "–"} s`;
  } catch (e) {
    if (e.name === "AbortError") {
      out.append(el("span", { class: "muted", text: " [stopped]" }));
      if (reply) state.chat.push({ role: "assistant", content: reply });
    } else {
      out.parentNode.classList.add("error");
      out.textContent = reply ? `${reply}\n\n[${e.message}]` : e.message;
      state.chat.pop();
    }
  } finally {
    out.classList.remove("streaming");
    out.parentNode.setAttribute("data-done", "1");
    state.abort = null;
    $("play-send").hidden = false;
    $("play-stop").hidden = true;
  }
}
