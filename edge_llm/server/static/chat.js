// The chat panel: conversations in localStorage, a streamed /v1/chat/completions per turn, stop,
// resend, images for a vision model, and the per-turn figures from the stream's last chunks
// (docs/ui.md, "Chat" and "Turns"; the fields: docs/api.md, "Response fields").

import { apiFetch, errorText, readSSE } from "./api.js";
import { SOURCE, bytes, ms } from "./labels.js";

const STORE_ITEM = "edge-llm.conversations";
const $ = (id) => document.getElementById(id);

let db = load();
let running = null;          // the AbortController of the request in flight
let pendingImage = null;     // a promise of the data: URL picked for the next message
let onTurnDone = () => {};

function load() {
  try {
    const d = JSON.parse(localStorage.getItem(STORE_ITEM) || "null");
    if (d && Array.isArray(d.list) && d.list.length) return d;
  } catch (_) { /* a damaged entry: start again */ }
  const c = newConversation();
  return { current: c.id, list: [c] };
}

function save() {
  try {
    localStorage.setItem(STORE_ITEM, JSON.stringify(db));
  } catch (e) {
    showError("could not keep the conversation in this browser: " + e.message);
  }
}

function newConversation() {
  return { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "new conversation",
           system: "", messages: [], turns: [] };
}

export function conversation() {
  return db.list.find((c) => c.id === db.current) || db.list[0];
}

export function allTurns() {
  return db.list.flatMap((c) => c.turns);
}

function showError(msg) {
  const p = $("chat-error");
  p.textContent = msg || "";
  p.hidden = !msg;
}

function textOf(content) {
  if (typeof content === "string") return content;
  return content.filter((p) => p.type === "text").map((p) => p.text).join("\n");
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  for (const m of conversation().messages) box.append(messageNode(m.role, m.content));
  box.scrollTop = box.scrollHeight;
}

function messageNode(role, content) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const who = document.createElement("span");
  who.className = "role";
  who.textContent = role;
  const body = document.createElement("span");
  body.className = "body";
  body.textContent = textOf(content);
  div.append(who, body);
  if (Array.isArray(content) && content.some((p) => p.type === "image_url")) {
    const tag = document.createElement("span");
    tag.className = "muted";
    tag.textContent = " [image]";
    div.append(tag);
  }
  return div;
}

function renderConversations() {
  const sel = $("conv-select");
  sel.replaceChildren(...db.list.map((c) => {
    const o = document.createElement("option");
    o.value = c.id;
    o.textContent = c.title;
    o.selected = c.id === db.current;
    return o;
  }));
  const c = conversation();
  $("opt-system").value = c.system;
  $("opt-temp").value = c.temperature ?? "";
  $("opt-max").value = c.max_tokens ?? "64";
}

const COLS = ["n", "prompt", "cached", "source", "aligned", "restored", "prefill", "ttft", "tps", "draft", "image"];

// One turn's cells in words and units (docs/ui.md, "Turns"). "recomputed to align" is shown only
// for a turn that reused a prefix: on a cold turn the rows the engine gave up were never reused.
function turnCells(t, i) {
  const reused = (t.cached_tokens || 0) > 0;
  return [i + 1, t.prompt_tokens ?? "", t.cached_tokens, SOURCE[t.cache_source] || t.cache_source,
          reused ? t.align_rows : "", t.restore_bytes ? bytes(t.restore_bytes) : "",
          ms(t.prefill_ms), ms(t.ttft_ms), t.decode_tps == null ? "" : `${t.decode_tps.toFixed(1)} tok/s`,
          `${t.drafted_tokens} / ${t.accepted_tokens}`, t.image_tokens || 0];
}

export function renderTurns() {
  const body = $("turns").tBodies[0];
  body.replaceChildren(...conversation().turns.map((t, i) => {
    const tr = document.createElement("tr");
    tr.className = "turn source-" + t.cache_source;
    tr.replaceChildren(...turnCells(t, i).map((v, k) => {
      const td = document.createElement("td");
      td.textContent = String(v);
      td.dataset.col = COLS[k];
      return td;
    }));
    return tr;
  }));
}

function turnFrom(usage, timings, finish) {
  const t = timings || {};
  const u = usage || {};
  return {
    at: Date.now() / 1000,
    prompt_tokens: u.prompt_tokens,
    completion_tokens: u.completion_tokens,
    cached_tokens: (u.prompt_tokens_details || {}).cached_tokens || 0,
    cache_source: t.cache_source || "none",
    align_rows: t.align_rows || 0,
    restore_bytes: t.restore_bytes || 0,
    prefill_ms: t.prefill_ms,
    ttft_ms: t.ttft_ms,
    decode_tps: t.decode_ms > 0 ? (t.decode_tokens * 1000) / t.decode_ms : null,
    drafted_tokens: t.drafted_tokens || 0,
    accepted_tokens: t.accepted_tokens || 0,
    image_tokens: t.image_tokens || 0,
    finish_reason: finish,
  };
}

// One streamed request for the conversation's messages; the answer is appended as it arrives.
async function run(conv) {
  showError("");
  const body = { messages: [], stream: true, stream_options: { include_usage: true } };
  if (conv.system.trim()) body.messages.push({ role: "system", content: conv.system });
  body.messages.push(...conv.messages);
  const max = parseInt($("opt-max").value, 10);
  if (max > 0) body.max_tokens = max;
  const temp = $("opt-temp").value;
  if (temp !== "") body.temperature = Number(temp);

  const answer = { role: "assistant", content: "" };
  const node = messageNode("assistant", "");
  node.classList.add("streaming");
  $("messages").append(node);
  const textNode = node.querySelector(".body");
  running = new AbortController();
  setRunning(true);
  let usage = null, timings = null, finish = null;
  try {
    const r = await apiFetch("/v1/chat/completions", {
      method: "POST", signal: running.signal,
      headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    if (!r.ok) throw new Error(await errorText(r));
    await readSSE(r, (_name, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      for (const ch of chunk.choices || []) {
        if (ch.delta && ch.delta.content) {
          answer.content += ch.delta.content;
          textNode.textContent = answer.content;
          $("messages").scrollTop = $("messages").scrollHeight;
        }
        if (ch.finish_reason) finish = ch.finish_reason;
      }
      if (chunk.timings) timings = chunk.timings;
      if (chunk.usage) usage = chunk.usage;
    });
  } catch (e) {
    if (e.name !== "AbortError") showError(e.message);
  } finally {
    running = null;
    setRunning(false);
    node.classList.remove("streaming");
  }
  if (answer.content) conv.messages.push(answer);
  if (usage && timings) {
    conv.turns.push(turnFrom(usage, timings, finish));
    renderTurns();
    onTurnDone();
  }
  save();
}

function takeOptions(conv) {
  conv.system = $("opt-system").value;
  conv.temperature = $("opt-temp").value;
  conv.max_tokens = $("opt-max").value;
}

function setRunning(on) {
  $("send").disabled = on;
  $("resend").disabled = on;
  $("stop").disabled = !on;
}

async function send(ev) {
  ev.preventDefault();
  const text = $("chat-input").value;
  if (!text.trim() || running) return;
  const conv = conversation();
  takeOptions(conv);
  let image = null;
  try {
    image = pendingImage && await pendingImage;
  } catch (e) {
    showError("could not read the image: " + e.message);
    return;
  }
  const content = image ? [{ type: "text", text }, { type: "image_url", image_url: { url: image } }] : text;
  conv.messages.push({ role: "user", content });
  if (conv.title === "new conversation") conv.title = text.slice(0, 40);
  $("chat-input").value = "";
  $("image-input").value = "";
  pendingImage = null;
  save();
  renderConversations();
  renderMessages();
  await run(conv);
}

// The lab's S2 step: the whole conversation again, without its last answer, which the new one replaces.
async function resend() {
  if (running) return;
  const conv = conversation();
  takeOptions(conv);
  if (conv.messages.length && conv.messages[conv.messages.length - 1].role === "assistant") conv.messages.pop();
  if (!conv.messages.length) return;
  renderMessages();
  await run(conv);
}

export function setVision(on) {
  $("image-label").hidden = !on;
}

export function installChat(turnDone) {
  onTurnDone = turnDone;
  $("chat-form").addEventListener("submit", send);
  $("resend").addEventListener("click", resend);
  $("stop").addEventListener("click", () => running && running.abort());
  $("chat-input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("image-input").addEventListener("change", () => {
    const f = $("image-input").files[0];
    pendingImage = null;
    if (!f) return;
    pendingImage = new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(f);
    });
  });
  $("conv-select").addEventListener("change", () => {
    db.current = $("conv-select").value;
    save();
    renderAll();
    onTurnDone();
  });
  $("conv-new").addEventListener("click", () => {
    const c = newConversation();
    db.list.push(c);
    db.current = c.id;
    save();
    renderAll();
  });
  $("conv-delete").addEventListener("click", () => {
    db.list = db.list.filter((c) => c.id !== db.current);
    if (!db.list.length) db.list.push(newConversation());
    db.current = db.list[0].id;
    save();
    renderAll();
    onTurnDone();
  });
  // the options belong to the conversation: a resend after a reload asks for the same answer
  for (const [id, field] of [["opt-system", "system"], ["opt-temp", "temperature"], ["opt-max", "max_tokens"]]) {
    $(id).addEventListener("change", () => {
      conversation()[field] = $(id).value;
      save();
    });
  }
  renderAll();
}

function renderAll() {
  renderConversations();
  renderMessages();
  renderTurns();
}
