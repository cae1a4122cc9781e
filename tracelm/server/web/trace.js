// tracelm's trace viewer: a trace's verification (done by the server with tracelm.audit.verify), its tokens with
// their probabilities, per token a layer x stage heat map of the recorded statistics with each cell's digest, and
// a replay report (tracelm replay --json) on the same grid with the first divergent cell marked.
"use strict";

const $ = (id) => document.getElementById(id);
const RAMP = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];  // viridis
const view = { events: [], tokens: new Map(), passes: new Map(), stages: [], layers: [], replay: null, tok: null };

function showError(text) {
  $("error").textContent = text || "";
}

async function fetchJSON(url, options = {}) {
  const res = await fetch(url, { ...options, headers: keyHeaders(options.headers) });
  if (res.status === 401) throw new Error(NEEDS_KEY);
  const body = await res.json();
  if (!res.ok) throw new Error((body.error && body.error.message) || `${res.status} ${res.statusText}`);
  return body;
}

function visible(text) {
  return JSON.stringify(String(text)).slice(1, -1).replace(/\\"/g, '"');
}

function fmt(v) {
  if (typeof v === "string") return v;
  if (v === null || v === undefined) return "";
  const a = Math.abs(v);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(2) : Number(v.toPrecision(3)).toString();
}

function colour(t) {
  const x = Math.min(Math.max(t, 0), 1) * (RAMP.length - 1);
  const i = Math.min(Math.floor(x), RAMP.length - 2);
  const f = x - i;
  const c = RAMP[i].map((a, k) => Math.round(a + f * (RAMP[i + 1][k] - a)));
  return { css: `rgb(${c[0]},${c[1]},${c[2]})`, dark: 0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2] < 140 };
}

function index(events) {
  view.events = events;
  view.tokens = new Map();
  view.passes = new Map();
  const stages = [];
  const layers = new Set();
  events.forEach((e, i) => {
    if (!e) return;
    if (e.event === "token" && !view.tokens.has(e.tok)) view.tokens.set(e.tok, { ...e, line: i + 1 });
    if (e.event !== "stage") return;
    if (!stages.includes(e.stage)) stages.push(e.stage);
    layers.add(e.layer);
    if (!view.passes.has(e.tok)) view.passes.set(e.tok, new Map());
    const key = `${e.layer}|${e.stage}`;
    if (!view.passes.get(e.tok).has(key)) view.passes.get(e.tok).set(key, { ...e, line: i + 1 });
  });
  view.stages = stages;
  view.layers = [...layers].sort((a, b) => (a === null ? -1 : b === null ? 1 : a - b));
}

// the trust verdict (tracelm.audit.trust): broken (red), below the policy's required level (amber), meeting it
// (green); its headline, and every step checked
function showVerdict(verdict) {
  const box = $("verdict");
  box.className = verdict.level === "broken" ? "broken" : verdict.ok ? "trusted" : "untrusted";
  $("verdict-state").textContent = verdict.state;
  $("verdict-why").textContent = verdict.ok || verdict.level === "broken" ? verdict.headline
    : `${verdict.headline} (below the required level: ${verdict.require})`;
  const list = $("verdict-steps");
  list.replaceChildren();
  for (const step of verdict.steps || []) {
    const li = document.createElement("li");
    li.className = step.ok === false ? "fail" : "";
    li.textContent = `${step.ok === false ? "FAIL" : step.ok ? "ok" : "--"} ${step.name}${step.detail ? `: ${step.detail}` : ""}`;
    list.appendChild(li);
  }
}

function signing(head) {
  const parts = [];
  if (head.signature_algorithm) {
    parts.push(`signed (${head.signature_algorithm}, key ${String(head.public_key_sha256).slice(0, 16)})`);
  }
  if (head.mac_algorithm) parts.push(`HMAC-signed (${head.mac_algorithm})`);
  if (head.attestation) parts.push("with attestation evidence");
  return parts.length ? parts.join(", ") : "unsigned";
}

function showSummary(name) {
  const head = view.events[0] || {};
  const footer = view.events.find((e) => e && e.event === "footer") || {};
  const cfg = head.config || {};
  const rows = [
    ["trace", `${name} (${head.format} v${head.trace_version}, level ${head.level}, ` +
      `${signing(head)}, ${view.events.length} lines)`],
    ["model", `${head.model_file} (sha256 ${String(head.model_sha256).slice(0, 16)}...)`],
    ["sampling", JSON.stringify(cfg.sampling || {})],
    ["prompt", `${(head.prompt_ids || []).length} tokens: ${visible(head.prompt_text || "")}`],
    ["output", typeof footer.output_text === "string" ? visible(footer.output_text)
      : visible([...view.tokens.values()].map((t) => (t.text !== undefined ? t.text : t.piece)).join(""))],
  ];
  const dl = $("summary");
  dl.replaceChildren();
  for (const [k, v] of rows) {
    const dt = document.createElement("dt");
    dt.textContent = k;
    const dd = document.createElement("dd");
    dd.textContent = v;
    dl.append(dt, dd);
  }
}

function showTokens() {
  const box = $("tokens");
  box.replaceChildren();
  const toks = [...new Set([...view.passes.keys(), ...view.tokens.keys()])].sort((a, b) => a - b);
  for (const t of toks) {
    const e = view.tokens.get(t);
    const chip = document.createElement("span");
    chip.className = "tok";
    chip.dataset.tok = t;
    chip.textContent = e ? visible(e.text !== undefined ? e.text : e.piece) || "\u2205" : `pass ${t}`;
    const p = document.createElement("span");
    p.className = "p";
    p.textContent = e && typeof e.prob === "number" ? `${(100 * e.prob).toFixed(1)}%` : "";
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = e && typeof e.prob === "number" ? `${100 * e.prob}%` : "0";
    chip.title = e ? `token ${t}: id ${e.id}, line ${e.line}` : `pass ${t}`;
    chip.append(p, bar);
    chip.addEventListener("click", () => selectToken(t));
    box.appendChild(chip);
  }
}

function selectToken(t) {
  view.tok = t;
  document.querySelectorAll(".tok").forEach((c) => c.classList.toggle("selected", Number(c.dataset.tok) === t));
  const e = view.tokens.get(t);
  $("pass-title").textContent = `Pass ${t}${t === 0 ? " (prefill)" : ""}` +
    (e ? `: token ${visible(e.text !== undefined ? e.text : e.piece)}` : "");
  renderGrid();
}

function scale(cells, stat) {
  const logs = cells.map((c) => c[stat]).filter((v) => typeof v === "number" && v > 0).map(Math.log10);
  const lo = logs.length ? Math.min(...logs) : 0;
  const hi = logs.length ? Math.max(...logs) : 1;
  return { lo, hi, at: (v) => (typeof v === "number" && v > 0 ? (Math.log10(v) - lo) / (hi - lo || 1) : null) };
}

function cellFor(layer, stage, event, s, stat) {
  const td = document.createElement("td");
  td.dataset.layer = layer === null ? "" : layer;
  td.dataset.stage = stage;
  if (!event) {
    td.className = "empty";
    return td;
  }
  const t = s.at(event[stat]);
  if (t !== null) {
    const c = colour(t);
    td.style.background = c.css;
    td.style.color = c.dark ? "#fff" : "#111";
  } else {
    td.style.background = "#f0c";
  }
  td.dataset.line = event.line;
  td.append(fmt(event[stat]));
  const d = document.createElement("span");
  d.className = "d";
  d.textContent = event.digest ? event.digest.slice(0, 8) : "\u2014";
  td.appendChild(d);
  td.title = `line ${event.line}: ${stage}${layer === null ? "" : ` layer ${layer}`}\nrms ${event.rms} ` +
    `max|x| ${event.maxabs} mean ${event.mean}\n${event.dur_us} us\ndigest ${event.digest || "(level summary)"}`;
  td.addEventListener("click", () => showDetail(td, event));
  return td;
}

function renderGrid() {
  const table = $("grid");
  table.replaceChildren();
  const pass = view.passes.get(view.tok) || new Map();
  const stat = $("stat").value;
  const s = scale([...pass.values()], stat);
  $("legend-lo").textContent = fmt(10 ** s.lo);
  $("legend-hi").textContent = fmt(10 ** s.hi);
  const head = table.insertRow();
  head.appendChild(document.createElement("th"));
  for (const stage of view.stages) {
    const th = document.createElement("th");
    th.textContent = stage;
    head.appendChild(th);
  }
  for (const layer of view.layers) {
    const row = table.insertRow();
    const th = document.createElement("th");
    th.textContent = layer === null ? "model" : `layer ${layer}`;
    row.appendChild(th);
    for (const stage of view.stages) row.appendChild(cellFor(layer, stage, pass.get(`${layer}|${stage}`), s, stat));
  }
  markReplay();
}

function showDetail(td, event) {
  document.querySelectorAll("#grid td.selected").forEach((c) => c.classList.remove("selected"));
  td.classList.add("selected");
  const { line, ...fields } = event;
  $("detail").textContent = `line ${line}\n${JSON.stringify(fields, null, 1)}`;
}

function where(d) {
  return [`line ${d.line}`, d.kind, d.token !== null ? `token ${d.token}` : null,
          d.layer !== null ? `layer ${d.layer}` : null, d.stage ? `stage ${d.stage}` : null].filter(Boolean).join(", ");
}

function showReplay() {
  const r = view.replay;
  const box = $("replay");
  if (!r) return;
  box.className = `panel shown ${r.divergence ? "diverged" : ""}`;
  const d = r.divergence;
  $("replay-headline").textContent = d
    ? `replay: diverged after ${r.compared} matching events: ${d.reason}`
    : `replay: reproduced, ${r.compared} events compared (${r.bit_exact} stage outputs bit-identical, ` +
      `${r.within_tolerance} within tolerance)`;
  const lines = [];
  if (d) lines.push(`first divergence: ${where(d)}`, `  recorded ${JSON.stringify(d.recorded)}`,
                    `  replayed ${JSON.stringify(d.replayed)}`);
  const b = r.first_bit_difference;
  if (b && (!d || b.line !== d.line)) lines.push(`first bit-level difference (within tolerance): ${where(b)}`);
  const rec = d && view.events[d.line - 1];
  if (d && view.events.length && (!rec || rec.event !== d.kind || (d.token !== null && rec.tok !== d.token))) {
    lines.push(`warning: line ${d.line} of the open trace is not the event this report names: another trace?`);
  }
  $("replay-where").textContent = lines.join("\n");
  $("replay-where").style.whiteSpace = "pre-wrap";
}

function markReplay() {
  const r = view.replay;
  if (!r) return;
  const mark = (d, cls) => {
    if (!d || d.token !== view.tok) return;
    if (d.kind === "stage") {
      const layer = d.layer === null ? "" : String(d.layer);
      document.querySelectorAll("#grid td").forEach((td) => {
        if (td.dataset.layer === layer && td.dataset.stage === d.stage) td.classList.add(cls);
      });
    }
  };
  mark(r.first_bit_difference, "bitdiff");
  mark(r.divergence, "diverged");
  document.querySelectorAll(".tok").forEach((c) => c.classList.toggle("diverged",
    !!(r.divergence && r.divergence.kind === "token" && Number(c.dataset.tok) === r.divergence.token)));
}

function setReplay(report) {
  if (!report || typeof report !== "object" || !("status" in report) || !("divergence" in report)) {
    throw new Error("not a `tracelm replay --json` report (no status and divergence)");
  }
  view.replay = report;
  showReplay();
  const d = report.divergence;
  if (d && d.token !== null && view.passes.size) selectToken(d.token);
  else if (view.passes.size) renderGrid();
}

function showTrace(described) {
  showError("");
  $("trace-name").textContent = described.name;
  showVerdict(described.verdict);
  index(described.events);
  showSummary(described.name);
  showTokens();
  $("view").hidden = false;
  showReplay();
  const d = view.replay && view.replay.divergence;
  const first = d && d.token !== null && view.passes.has(d.token) ? d.token : Math.min(...view.passes.keys());
  selectToken(Number.isFinite(first) ? first : 0);
}

async function openTraceFile(file) {
  try {
    const described = await fetchJSON(`/api/trace/verify?name=${encodeURIComponent(file.name)}`,
                                      { method: "POST", body: file });
    if (described.not_a_trace) throw new Error(described.not_a_trace);
    showTrace(described);
  } catch (e) {
    showError(`${file.name}: ${e.message}`);
  }
}

async function openReplayFile(file) {
  try {
    setReplay(JSON.parse(await file.text()));
  } catch (e) {
    showError(`${file.name}: ${e.message}`);
  }
}

async function start() {
  showError("");
  const info = await fetchJSON("/api/info");
  if (!info.chat) $("chat-link").hidden = true;
  if (info.preloaded.replay) setReplay(await fetchJSON("/api/replay/preloaded"));
  const request = new URLSearchParams(location.search).get("request");
  if (request) showTrace(await fetchJSON(`/api/trace/request/${encodeURIComponent(request)}`));
  else if (info.preloaded.trace) showTrace(await fetchJSON("/api/trace/preloaded"));
}

$("trace-file").addEventListener("change", (e) => { if (e.target.files[0]) openTraceFile(e.target.files[0]); });
$("replay-file").addEventListener("change", (e) => { if (e.target.files[0]) openReplayFile(e.target.files[0]); });
$("stat").addEventListener("change", () => { if (view.passes.size) renderGrid(); });
bindKeyField($("api-key"), () => start().catch((e) => showError(e.message)));
start().catch((e) => showError(e.message));
