// The page's start: wires the panels together (docs/ui.md). No data is shown before the server
// accepted the key (api.js asks for it on a 401).

import { installKeyForm } from "./api.js";
import { allTurns, installChat, setVision } from "./chat.js";
import { installChart, setTurns } from "./chart.js";
import { followEvents, refreshState, refreshStore } from "./panels.js";

const STATE_EVERY_MS = 5000;
let storeTimer = null;

function loadStore() {
  const err = document.getElementById("store-error");
  refreshStore().then(() => { err.hidden = true; }, (e) => {
    err.textContent = "store: " + e.message;
    err.hidden = false;
  });
}

function refreshStoreSoon() {
  clearTimeout(storeTimer);
  storeTimer = setTimeout(loadStore, 300);
}

async function pollState() {
  try {
    const s = await refreshState();
    setVision(Boolean(s.vision));
  } catch (e) {
    document.getElementById("hdr-status").textContent = "unreachable: " + e.message;
  }
  setTimeout(pollState, STATE_EVERY_MS);
}

function start() {
  installKeyForm();
  installChart();
  installChat(() => {
    setTurns(allTurns());
    refreshStoreSoon();
  });
  setTurns(allTurns());
  pollState();
  loadStore();
  followEvents(refreshStoreSoon);
  document.getElementById("store-refresh").addEventListener("click", loadStore);
}

start();
