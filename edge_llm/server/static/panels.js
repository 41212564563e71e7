// The read-only panels: server state (/v1/edge/state), the KV store (/v1/edge/store) and the live
// log events (/v1/edge/events, server-sent events read through fetch so the key can be sent).
// What each field means: docs/ui.md and docs/api.md.

import { apiFetch, errorText, getJSON, readSSE } from "./api.js";
import { DECISIONS, LIMITS, SETTINGS, bytes, duration, fallback, perSecond, tokens, yesNo } from "./labels.js";

const $ = (id) => document.getElementById(id);
const MAX_EVENTS = 200;

// Groups of rows, each a heading and a <dl>: rows are [key, label, text]; the key (the API's field
// name) is kept in data-key for scripts and tests, the label is what is read.
function fill(container, groups) {
  container.replaceChildren(...groups.filter((g) => g.rows.length).map(({ title, rows }) => {
    const section = document.createElement("section");
    section.className = "group";
    const h = document.createElement("h3");
    h.textContent = title;
    const dl = document.createElement("dl");
    dl.className = "kv";
    dl.append(...rows.flatMap(([key, label, text]) => {
      const dt = document.createElement("dt");
      dt.textContent = label;
      const dd = document.createElement("dd");
      dd.textContent = text === null || text === undefined ? "" : String(text);
      dd.dataset.key = key;
      return [dt, dd];
    }));
    section.append(h, dl);
    return section;
  }));
}

// Rows of an object whose fields have labels (`known`: key -> [label, format]); others in words.
function labelled(prefix, obj, known) {
  return Object.entries(obj || {}).map(([k, v]) => {
    const [label, text] = known[k] ? [known[k][0], known[k][1](v)] : fallback(k, v);
    return [prefix + k, label, text];
  });
}

function memoryRows(mem) {
  if (!mem) return [["memory", "Estimate", "known once the model is loaded"]];
  return [
    ["memory.estimate_bytes", "Estimated at start", bytes(mem.estimate_bytes)],
    ...Object.entries(mem.parts || {}).map(([part, n]) => ["memory.parts." + part, "· " + part.replace(/_/g, " "), bytes(n)]),
    ["memory.rss_bytes", "In use by the server now", bytes(mem.rss_bytes)],
    ["memory.available_bytes", /^cgroup/.test(mem.available_source || "") ? "Available (cgroup limit)"
      : "Available", bytes(mem.available_bytes)],
  ];
}

export async function refreshState() {
  const s = await getJSON("/v1/edge/state");
  $("hdr-model").textContent = `${s.model || ""} · ${s.backend || ""}`;
  const badge = $("hdr-status");
  badge.textContent = s.busy ? "busy" : s.status;
  badge.className = "badge status-" + s.status + (s.degraded && s.degraded.length ? " degraded" : "");
  const ev = s.events || {};
  fill($("state"), [
    { title: "Server", rows: [
      ["status", "Status", s.status], ["version", "Version", s.version], ["model", "Model", s.model],
      ["backend", "Backend", s.backend], ["backend_reason", "Why this backend", s.backend_reason || ""],
      ["npu_selftest", "NPU self-test", s.npu_selftest || "not run"],
      ["namespace", "Snapshot namespace", s.namespace || "none"], ["max_seq", "Context length", tokens(s.max_seq)],
      ["uptime", "Running for", duration(s.uptime_s)],
      ["degraded", "Problems", (s.degraded || []).length ? s.degraded.join("; ") : "none"],
      ["busy", "Answering now", yesNo(s.busy)],
      ["queue_depth", "Requests waiting", `${s.queue_depth ?? 0} of ${s.queue_size ?? "?"}`],
    ] },
    { title: "Memory", rows: memoryRows(s.memory) },
    { title: "Settings", rows: labelled("settings.", s.settings, SETTINGS) },
    { title: "Live events", rows: [
      ["events.clients", "Pages following them", ev.clients ?? ""],
      ["events.dropped", "Dropped for pages that read too slowly", ev.dropped ?? ""],
    ] },
  ]);
  return s;
}

function cell(text, col, label) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (col) td.dataset.col = col;
  if (label) td.dataset.label = label;  // the card layout's label (style.css)
  return td;
}

function storeGroups(st) {
  const gate = st.cost_gate;
  const gateRows = gate === null || gate === undefined ? [["cost_gate", "Cost gate", "off"]] : [
    ["cost_gate.mode", "Restore mode", gate.mode],
    ["cost_gate.read_bytes_per_s", "Disk read rate", gate.read_bytes_per_s == null ? "not measured yet"
      : bytes(gate.read_bytes_per_s) + "/s"],
    ["cost_gate.compute_tokens_per_s", "Prefill rate", perSecond(gate.compute_tokens_per_s, "tokens")],
    ...Object.entries(gate.decisions || {}).map(([k, n]) =>
      ["cost_gate.decisions." + k, DECISIONS[k] ? cap(DECISIONS[k]) : fallback(k, n)[0], `${n} time${n === 1 ? "" : "s"}`]),
  ];
  return [
    { title: "Store", rows: [
      ["namespace", "Namespace", st.namespace || "none"], ["enabled", "Snapshots on disk", yesNo(st.enabled)],
      ["free_bytes", "Free space on its disk", st.free_bytes == null ? "unknown" : bytes(st.free_bytes)],
      ...labelled("limits.", st.limits, LIMITS),
    ] },
    { title: "Cost gate (restore or recompute)", rows: gateRows },
  ];
}

const cap = (t) => t.charAt(0).toUpperCase() + t.slice(1);
const HEADS = ["file", "tokens", "size on disk", "expected size", "chain", "last used", "first words"];

export async function refreshStore() {
  const st = await getJSON("/v1/edge/store");
  fill($("store-summary"), storeGroups(st));
  const snaps = [...(st.snapshots || [])].sort((a, b) => (b.last_used || 0) - (a.last_used || 0));
  $("snapshots").tBodies[0].replaceChildren(...snaps.map((s) => {
    const tr = document.createElement("tr");
    const chain = s.chain_base ? `delta on ${s.chain_base}, ${s.chain_files} files` : "full file";
    const used = s.last_used ? new Date(s.last_used * 1000).toLocaleString() : "";
    const words = cell(s.first_words, "words", HEADS[6]);
    words.title = s.first_words || "";
    tr.append(cell(s.file, "file", HEADS[0]), cell(s.tokens, "tokens", HEADS[1]),
              cell(bytes(s.bytes), "bytes", HEADS[2]), cell(bytes(s.formula_bytes), "formula", HEADS[3]),
              cell(chain, "chain", HEADS[4]), cell(used, "used", HEADS[5]), words);
    return tr;
  }));
  return st;
}

function addEvent(ev) {
  const li = document.createElement("li");
  li.className = "ev tag-" + ev.tag;
  const t = document.createElement("time");
  t.textContent = new Date(ev.ts * 1000).toLocaleTimeString();
  const line = document.createElement("span");
  line.textContent = " " + ev.line;
  li.append(t, line);
  const list = $("events");
  list.prepend(li);
  while (list.children.length > MAX_EVENTS) list.lastChild.remove();
}

// Read the event stream for as long as the page is open; reconnect when it ends (a restart). The
// server sends its recent lines first; Last-Event-ID tells it which of them this page already has
// (the same process sends only newer ones, a restarted one all of its own).
export async function followEvents(onKvDisk) {
  let lastId = "";
  for (;;) {
    try {
      const headers = { Accept: "text/event-stream" };
      if (lastId) headers["Last-Event-ID"] = lastId;
      const r = await apiFetch("/v1/edge/events", { headers });
      if (!r.ok) throw new Error(await errorText(r));
      $("events-status").textContent = "connected";
      await readSSE(r, (name, data, id) => {
        if (id) lastId = id;
        if (name === "dropped") {
          const n = JSON.parse(data).dropped;
          addEvent({ ts: Date.now() / 1000, tag: "dropped", line: `(${n} event(s) dropped: this page read too slowly)` });
          return;
        }
        if (name !== "log") return;
        const ev = JSON.parse(data);
        addEvent(ev);
        if (ev.tag === "KV-DISK") onKvDisk(ev);
      });
      $("events-status").textContent = "stream ended, reconnecting";
    } catch (e) {
      $("events-status").textContent = "disconnected (" + e.message + "), retrying";
    }
    await new Promise((res) => setTimeout(res, 2000));
  }
}
