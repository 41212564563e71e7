// The read-only panels: server state (/v1/edge/state), the KV store (/v1/edge/store) and the live
// log events (/v1/edge/events, server-sent events read through fetch so the key can be sent).
// What each field means: docs/ui.md and docs/api.md.

import { apiFetch, errorText, getJSON, readSSE } from "./api.js";

const $ = (id) => document.getElementById(id);
const MAX_EVENTS = 200;

export function bytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Number(n), i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i ? v.toFixed(1) : String(v)) + " " + units[i];
}

function fill(dl, rows) {
  dl.replaceChildren(...rows.flatMap(([k, v]) => {
    const dt = document.createElement("dt");
    dt.textContent = k;
    const dd = document.createElement("dd");
    dd.textContent = v === null || v === undefined ? "" : String(v);
    dd.dataset.key = k;
    return [dt, dd];
  }));
}

const isBytes = (k) => /bytes/.test(k);
function show(k, v) {
  if (v === null || v === undefined) return "none";
  if (typeof v === "number") {
    if (isBytes(k)) return bytes(v) + (k.endsWith("_per_s") ? "/s" : "");
    return Number.isInteger(v) ? String(v) : v.toFixed(1);
  }
  return Array.isArray(v) ? v.join("; ") : v;
}

// Rows for an object's fields, nested objects flattened with dotted names (memory.parts.weights).
function rows(prefix, obj) {
  return Object.entries(obj || {}).flatMap(([k, v]) =>
    v !== null && typeof v === "object" && !Array.isArray(v)
      ? rows(prefix + k + ".", v)
      : [[prefix + k, show(prefix.includes("parts") ? "bytes" : k, v)]]);
}

export async function refreshState() {
  const s = await getJSON("/v1/edge/state");
  $("hdr-model").textContent = `${s.model || ""} · ${s.backend || ""}`;
  const badge = $("hdr-status");
  badge.textContent = s.busy ? "busy" : s.status;
  badge.className = "badge status-" + s.status + (s.degraded && s.degraded.length ? " degraded" : "");
  const mem = s.memory || { estimate: "(loading)" };
  const settings = s.settings || {};
  fill($("state"), [
    ["status", s.status], ["version", s.version], ["model", s.model], ["backend", s.backend],
    ["backend_reason", s.backend_reason], ["namespace", s.namespace], ["max_seq", s.max_seq],
    ["uptime", s.uptime_s === undefined ? "" : `${Math.round(s.uptime_s)} s`],
    ["degraded", (s.degraded || []).length ? s.degraded.join("; ") : "none"],
    ["busy", s.busy], ["queue_depth", s.queue_depth],
    ...rows("memory.", mem), ...rows("settings.", settings), ...rows("events.", s.events),
  ]);
  return s;
}

function cell(text, col) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (col) td.dataset.col = col;
  return td;
}

export async function refreshStore() {
  const st = await getJSON("/v1/edge/store");
  const limits = st.limits || {};
  const gate = st.cost_gate || {};
  fill($("store-summary"), [
    ["namespace", st.namespace], ["enabled", st.enabled], ["free", bytes(st.free_bytes)],
    ...rows("limit ", limits), ...rows("cost gate ", st.cost_gate === null ? { mode: "off" } : gate),
  ]);
  const snaps = [...(st.snapshots || [])].sort((a, b) => (b.last_used || 0) - (a.last_used || 0));
  $("snapshots").tBodies[0].replaceChildren(...snaps.map((s) => {
    const tr = document.createElement("tr");
    const chain = s.chain_base ? `on ${s.chain_base} (${s.chain_files} files)` : `${s.chain_files || 1} file`;
    const used = s.last_used ? new Date(s.last_used * 1000).toLocaleTimeString() : "";
    tr.append(cell(s.file, "file"), cell(s.tokens, "tokens"), cell(bytes(s.bytes), "bytes"),
              cell(bytes(s.formula_bytes), "formula"), cell(chain, "chain"), cell(used, "used"),
              cell(s.first_words, "words"));
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

// Read the event stream for as long as the page is open; reconnect when it ends (a restart).
export async function followEvents(onKvDisk) {
  for (;;) {
    try {
      const r = await apiFetch("/v1/edge/events", { headers: { Accept: "text/event-stream" } });
      if (!r.ok) throw new Error(await errorText(r));
      $("events-status").textContent = "connected";
      await readSSE(r, (name, data) => {
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
