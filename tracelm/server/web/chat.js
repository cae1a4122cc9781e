// tracelm's chat page: streams /v1/chat/completions (Server-Sent Events) from the server that serves this page.
// Conversations are kept in this browser's localStorage by session_id; the server keeps their KV cache.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "tracelm.chat.sessions";
const SAMPLING = ["temperature", "top_p", "top_k", "min_p"];

const state = { info: null, id: null, messages: [], controller: null, busy: false };

function sessions() {
  try { return JSON.parse(localStorage.getItem(STORE) || "{}"); } catch (e) { return {}; }
}

function saveSession() {
  const all = sessions();
  all[state.id] = { messages: state.messages, system: $("system").value, updated: Date.now() };
  localStorage.setItem(STORE, JSON.stringify(all));
  listSessions();
}

function listSessions() {
  const list = $("sessions");
  list.replaceChildren();
  const all = sessions();
  Object.keys(all).sort((a, b) => all[b].updated - all[a].updated).forEach((id) => {
    const opt = document.createElement("option");
    opt.value = id;
    opt.label = `${all[id].messages.length} messages`;
    list.appendChild(opt);
  });
}

function newId() {
  const bytes = new Uint8Array(6);
  crypto.getRandomValues(bytes);
  return "chat-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function openSession(id) {
  const saved = sessions()[id];
  state.id = id;
  state.messages = saved ? saved.messages : [];
  if (saved) $("system").value = saved.system || "";
  $("session").value = id;
  localStorage.setItem(STORE + ".last", id);
  renderAll();
  setStatus(saved ? `resumed session ${id}: ${state.messages.length} messages` : `new session ${id}`);
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function renderAll() {
  $("messages").replaceChildren();
  state.messages.forEach((m) => bubble(m.role, m.content));
}

function setStatus(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

function setBusy(busy) {
  state.busy = busy;
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function requestBody() {
  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(state.messages);
  const body = { model: state.info.model, messages, stream: true, stream_options: { include_usage: true },
                 session_id: state.id };
  for (const name of [...SAMPLING, "max_tokens", "seed"]) {
    const v = $(name).value.trim();
    if (v !== "") body[name] = Number(v);
  }
  return body;
}

function headers() {
  return keyHeaders({ "Content-Type": "application/json" });
}

async function errorText(res) {
  try {
    const body = await res.json();
    return (body.error && body.error.message) || res.statusText;
  } catch (e) {
    return `${res.status} ${res.statusText}`;
  }
}

// Reads an SSE body, calling onEvent for each JSON chunk; returns when the stream ends.
async function readEvents(res, onEvent) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of frame.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data !== "[DONE]") onEvent(JSON.parse(data));
      }
    }
  }
}

function footer(div, parts) {
  const foot = document.createElement("span");
  foot.className = "foot";
  parts.forEach((p, i) => {
    if (i) foot.append(" \u00b7 ");
    foot.append(p);
  });
  div.appendChild(foot);
}

function traceLink(rid) {
  const a = document.createElement("a");
  a.href = `/trace?request=${encodeURIComponent(rid)}`;
  a.target = "_blank";
  a.className = "trace-link";
  a.textContent = "view trace";
  return a;
}

// A streamed reply's text is added to the page at most once per frame, one text node appended to: however fast
// tokens come, the page's thread stays free for input (Stop) and the work stays linear in the reply's length.
function shownOncePerFrame(div) {
  const node = div.querySelector(".text").appendChild(document.createTextNode(""));
  let pending = "";
  let frame = 0;
  const flush = () => {
    if (frame) cancelAnimationFrame(frame);
    frame = 0;
    if (!pending) return;
    node.appendData(pending);
    pending = "";
    div.scrollIntoView({ block: "end" });
  };
  return {
    add(text) {
      pending += text;
      if (!frame) frame = requestAnimationFrame(flush);
    },
    flush,
  };
}

async function send() {
  const text = $("input").value;
  if (!text.trim() || state.busy) return;
  if (!state.info) {
    setStatus(NEEDS_KEY, true);
    return;
  }
  $("input").value = "";
  state.messages.push({ role: "user", content: text });
  bubble("user", text);
  saveSession();
  const div = bubble("assistant", "");
  div.classList.add("streaming");
  const shown = shownOncePerFrame(div);
  const reply = { text: "", rid: null, finish: null, usage: null, first: null, stopped: false };
  state.controller = new AbortController();
  setBusy(true);
  setStatus("generating...");
  const started = performance.now();
  try {
    const res = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
      body: JSON.stringify(requestBody()), signal: state.controller.signal });
    if (!res.ok) throw new Error(await errorText(res));
    reply.rid = res.headers.get("x-request-id");
    await readEvents(res, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) reply.usage = chunk.usage;
      const choice = (chunk.choices || [])[0];
      if (!choice) return;
      if (choice.delta && choice.delta.content) {
        if (reply.first === null) reply.first = performance.now();
        reply.text += choice.delta.content;
        shown.add(choice.delta.content);
      }
      if (choice.finish_reason) reply.finish = choice.finish_reason;
    });
  } catch (e) {
    if (e.name === "AbortError") reply.stopped = true;
    else setStatus(`error: ${e.message}`, true);
  }
  shown.flush();
  finishReply(div, reply, started);
}

function finishReply(div, reply, started) {
  div.classList.remove("streaming");
  setBusy(false);
  state.controller = null;
  if (reply.text || reply.finish || reply.stopped) {
    state.messages.push({ role: "assistant", content: reply.text.trim() });
    saveSession();
  } else {
    state.messages.pop();  // the turn failed: take the user's message back, so the input can be sent again
    saveSession();
  }
  const parts = [];
  const seconds = (performance.now() - (reply.first || started)) / 1000;
  if (reply.usage) {
    const n = reply.usage.completion_tokens;
    parts.push(`${n} tokens`, `${(n / Math.max(seconds, 1e-3)).toFixed(1)} tok/s`,
               `${reply.usage.prompt_tokens_details.cached_tokens} of ${reply.usage.prompt_tokens} prompt tokens reused`);
  }
  if (reply.stopped) parts.push("stopped");
  else if (reply.finish) parts.push(`finish: ${reply.finish}`);
  if (reply.rid && state.info.tracing) parts.push(traceLink(reply.rid));
  if (parts.length) footer(div, parts);
  if (reply.stopped) setStatus("stopped: the server was told to stop generating");
  else if (!$("status").classList.contains("error")) setStatus("");
  refreshCounters();
}

function stop() {
  if (state.controller) state.controller.abort();
}

// The server's counters, asked again while it still has requests running (a stopped reply ends there a token later).
async function refreshCounters(tries = 20) {
  try {
    const res = await fetch("/health");
    const h = await res.json();
    const c = h.counters;
    $("server-counters").textContent = `server: ${c.served} served, ${c.cancelled} cancelled, ` +
      `${c.generated_tokens} tokens generated, ${h.running} running`;
    $("server-counters").dataset.cancelled = c.cancelled;
    if (h.running > 0 && tries > 1 && !state.busy) setTimeout(() => refreshCounters(tries - 1), 250);
  } catch (e) {
    $("server-counters").textContent = "server: no answer from /health";
  }
}

async function start() {
  const res = await fetch("/api/info", { headers: keyHeaders() });
  if (res.status === 401) {
    setStatus(NEEDS_KEY, true);
    return;
  }
  if (!res.ok) throw new Error(await errorText(res));
  const info = await res.json();
  state.info = info;
  setStatus("");
  $("model-meta").textContent = `${info.model} \u00b7 context ${info.context}` +
    (info.tracing ? " \u00b7 traced" : "");
  for (const name of SAMPLING) $(name).placeholder = String(info.sampling[name]);
  $("max_tokens").placeholder = String(info.max_tokens);
  if (info.system) $("system").placeholder = info.system;
  listSessions();
  const wanted = new URLSearchParams(location.search).get("session");
  openSession(wanted || localStorage.getItem(STORE + ".last") || newId());
  refreshCounters();
}

$("send").addEventListener("click", send);
$("stop").addEventListener("click", stop);
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    send();
  }
});
$("new-session").addEventListener("click", () => { if (!state.busy) openSession(newId()); });
$("resume-session").addEventListener("click", () => {
  const id = $("session").value.trim();
  if (!state.busy && /^[A-Za-z0-9._:-]{1,128}$/.test(id)) openSession(id);
  else if (!state.busy) setStatus("a session_id is 1 to 128 letters, digits, '.', '_', ':' or '-'", true);
});
bindKeyField($("api-key"), () => { if (!state.info) start().catch(cannotStart); });
const cannotStart = (e) => setStatus(`cannot reach the server: ${e.message}`, true);
start().catch(cannotStart);
