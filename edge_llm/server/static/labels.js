// The page's figures in human words (docs/ui.md, "Words and units"): a label for every field the
// panels show, sizes in B / KiB / MiB / GiB (powers of 1024), times and rates with their units.
// The panels keep each field's API name in a data-key attribute, never in the text.

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

export function bytes(n) {
  if (n === null || n === undefined || n === "") return "";
  let v = Number(n), i = 0;
  while (Math.abs(v) >= 1024 && i < UNITS.length - 1) { v /= 1024; i++; }
  return (i ? v.toFixed(1) : String(Math.round(v))) + " " + UNITS[i];
}

export const ms = (x) => (x === null || x === undefined ? "" : `${Math.round(Number(x))} ms`);
export const yesNo = (b) => (b ? "yes" : "no");
export const tokens = (n) => (n === null || n === undefined ? "" : `${n} token${n === 1 ? "" : "s"}`);
export const perSecond = (x, unit) => (x === null || x === undefined ? "not measured yet" : `${fixed(x)} ${unit}/s`);
export const orNoLimit = (f) => (v) => (v === null || v === undefined ? "no limit" : f(v));
const fixed = (x) => (Number.isInteger(x) || Math.abs(x) >= 100 ? String(Math.round(x)) : Number(x).toFixed(1));
const plain = (v) => (v === null || v === undefined ? "none" : String(v));

export function duration(s) {
  if (s === null || s === undefined) return "";
  const t = Math.round(Number(s));
  if (t < 60) return `${t} s`;
  if (t < 3600) return `${Math.floor(t / 60)} min ${t % 60} s`;
  if (t < 86400) return `${Math.floor(t / 3600)} h ${Math.floor((t % 3600) / 60)} min`;
  return `${Math.floor(t / 86400)} d ${Math.floor((t % 86400) / 3600)} h`;
}

// timings.cache_source: where the reused prefix came from
export const SOURCE = { none: "cold", ram: "RAM", disk: "disk", "disk-prefetch": "disk (read at start)" };

// /v1/edge/state `settings`: [label, format]
export const SETTINGS = {
  disk_kv: ["Snapshots on disk", yesNo],
  disk_kv_restore: ["Restore mode", plain],
  disk_kv_prefetch: ["Read a snapshot at start", plain],
  disk_kv_min_lcp: ["Shortest prefix restored", tokens],
  prefill_chunk: ["Prefill chunk", tokens],
  kv_bs: ["KV cache block", tokens],
  draft: ["Drafting", plain],
  draft_max: ["Tokens drafted per step, at most", tokens],
  default_max_tokens: ["Answer length when not asked, at most", tokens],
  api_key: ["API key required", yesNo],
  node_name: ["Node name", plain],
};

// /v1/edge/store `limits`: [label, format]
export const LIMITS = {
  max_files: ["Conversations kept, at most", orNoLimit(String)],
  max_bytes: ["Space on disk, at most", orNoLimit(bytes)],
  max_tokens: ["Tokens per snapshot, at most", orNoLimit(tokens)],
  max_chain: ["Files in a delta chain, at most", orNoLimit(String)],
};

// /v1/edge/store `cost_gate.decisions`: what the gate chose for each restore it was asked about
export const DECISIONS = {
  restore: "restored from disk",
  split: "part restored, part recomputed",
  recompute: "recomputed",
  unmeasured: "restored before any rate was measured",
};

// A field the page does not know yet (a newer server): its name in words, its value as it comes.
export function fallback(key, v) {
  const label = key.replace(/_/g, " ").replace(/^./, (c) => c.toUpperCase());
  if (typeof v === "boolean") return [label, yesNo(v)];
  if (typeof v === "number" && /bytes/.test(key)) return [label.replace(/ ?bytes/i, ""), bytes(v)];
  return [label, Array.isArray(v) ? v.join("; ") : plain(v)];
}
