// The page's only way to the server: the public API and the /v1/edge/* endpoints, with the API
// key when the server has one (docs/ui.md, "The key"). A 401 asks for the key and retries.

const KEY_ITEM = "edge-llm.key";
const keyForm = () => document.getElementById("key-form");
let keyWaiters = [];

export function currentKey() {
  return sessionStorage.getItem(KEY_ITEM) || "";
}

function headers(extra) {
  const h = { ...(extra || {}) };
  const key = currentKey();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// Show the key form and resolve once the user submitted a key. `refused` says the last key failed.
export function askForKey(refused) {
  const form = keyForm();
  const err = document.getElementById("key-error");
  err.hidden = !refused;
  err.textContent = refused ? "The server refused this key (401). Try again." : "";
  form.hidden = false;
  document.body.classList.add("needs-key");
  document.getElementById("key-input").focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

export function installKeyForm() {
  keyForm().addEventListener("submit", (ev) => {
    ev.preventDefault();
    const input = document.getElementById("key-input");
    sessionStorage.setItem(KEY_ITEM, input.value.trim());
    input.value = "";
    keyForm().hidden = true;
    const waiters = keyWaiters;
    keyWaiters = [];
    waiters.forEach((w) => w());
  });
  document.getElementById("key-change").addEventListener("click", () => askForKey(false));
}

function keyAccepted() {
  document.body.classList.remove("needs-key");
  keyForm().hidden = true;
}

// fetch() with the key; on 401 ask for the key (once per failed key) and try again.
export async function apiFetch(path, init) {
  for (;;) {
    const opts = { ...(init || {}), headers: headers(init && init.headers) };
    const r = await fetch(path, opts);
    if (r.status !== 401) {
      keyAccepted();
      return r;
    }
    await r.body?.cancel();
    await askForKey(currentKey() !== "");  // a key was sent: it was refused
  }
}

// The error message of an OpenAI error body, or the status line.
export async function errorText(r) {
  try {
    const j = await r.json();
    if (j && j.error && j.error.message) return `${r.status}: ${j.error.message}`;
  } catch (_) { /* not JSON */ }
  return `${r.status} ${r.statusText}`;
}

export async function getJSON(path) {
  const r = await apiFetch(path);
  if (!r.ok) throw new Error(await errorText(r));
  return r.json();
}

// Server-sent events from a fetch response (EventSource cannot send the Authorization header).
// Calls onEvent(name, data, id) per event (id: the event's `id:` field, "" if none); resolves when
// the stream ends. Comment lines (": keep-alive") are skipped, as the SSE format says.
export async function readSSE(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  let name = "message";
  let data = [];
  let id = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let nl;
    while ((nl = buf.search(/\r\n|\n|\r/)) >= 0) {
      const line = buf.slice(0, nl);
      buf = buf.slice(nl + (buf.startsWith("\r\n", nl) ? 2 : 1));
      if (line === "") {
        if (data.length) onEvent(name, data.join("\n"), id);
        name = "message";
        data = [];
        id = "";
      } else if (!line.startsWith(":")) {
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? "" : line.slice(colon + 1);
        if (val.startsWith(" ")) val = val.slice(1);
        if (field === "event") name = val;
        else if (field === "data") data.push(val);
        else if (field === "id") id = val;
      }
    }
  }
}
