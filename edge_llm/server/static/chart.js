// TTFT of each turn against its prompt length, cold and restored from disk as two series, drawn on
// a canvas by hand (two scatter series and two axes are less code than a charting library and
// its CSS; docs/ui.md, "Chart"). Export: the canvas as PNG, the points as CSV.

export const SERIES = {
  cold: { color: "#1f6fb4", label: "cold", sources: ["none"] },
  restored: { color: "#d9480f", label: "restored", sources: ["disk", "disk-prefetch"] },
};

let points = [];  // [{series, prompt_tokens, ttft_ms, cached_tokens, cache_source}]

function seriesOf(turn) {
  for (const [name, s] of Object.entries(SERIES)) if (s.sources.includes(turn.cache_source)) return name;
  return null;  // reused from RAM: the turns table shows it, the chart compares cold with restored
}

export function setTurns(turns) {
  points = turns.filter((t) => t.ttft_ms > 0 && t.prompt_tokens > 0 && seriesOf(t)).map((t) => ({
    series: seriesOf(t), prompt_tokens: t.prompt_tokens, ttft_ms: t.ttft_ms,
    cached_tokens: t.cached_tokens, cache_source: t.cache_source,
  }));
  draw();
}

function niceMax(v) {
  if (v <= 0) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

export function draw() {
  const canvas = document.getElementById("chart");
  const w = Math.max(200, Math.floor(canvas.clientWidth || 560));
  const h = Math.round(w * 0.55);
  if (canvas.width !== w || canvas.height !== h) {
    canvas.width = w;
    canvas.height = h;
  }
  const ctx = canvas.getContext("2d");
  const pad = { l: 52, r: 12, t: 10, b: 36 };
  const pw = w - pad.l - pad.r, ph = h - pad.t - pad.b;
  const xmax = niceMax(Math.max(0, ...points.map((p) => p.prompt_tokens)));
  const ymax = niceMax(Math.max(0, ...points.map((p) => p.ttft_ms)));
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, w, h);
  ctx.strokeStyle = "#999";
  ctx.fillStyle = "#333";
  ctx.font = "11px sans-serif";
  ctx.lineWidth = 1;
  ctx.beginPath();
  ctx.moveTo(pad.l, pad.t);
  ctx.lineTo(pad.l, pad.t + ph);
  ctx.lineTo(pad.l + pw, pad.t + ph);
  ctx.stroke();
  for (let i = 0; i <= 4; i++) {
    const x = pad.l + (pw * i) / 4, y = pad.t + ph - (ph * i) / 4;
    ctx.textAlign = "center";
    ctx.fillText(String(Math.round((xmax * i) / 4)), x, pad.t + ph + 14);
    ctx.textAlign = "right";
    ctx.fillText(String(Math.round((ymax * i) / 4)), pad.l - 4, y + 4);
  }
  ctx.textAlign = "center";
  ctx.fillText("prompt tokens", pad.l + pw / 2, h - 4);
  ctx.save();
  ctx.translate(12, pad.t + ph / 2);
  ctx.rotate(-Math.PI / 2);
  ctx.fillText("TTFT ms", 0, 0);
  ctx.restore();
  for (const p of points) {
    ctx.fillStyle = SERIES[p.series].color;
    ctx.beginPath();
    ctx.arc(pad.l + (pw * p.prompt_tokens) / xmax, pad.t + ph - (ph * p.ttft_ms) / ymax, 5, 0, 2 * Math.PI);
    ctx.fill();
  }
  for (const name of Object.keys(SERIES)) canvas.dataset[name] = String(points.filter((p) => p.series === name).length);
}

export function csv() {
  const rows = ["series,prompt_tokens,ttft_ms,cached_tokens,cache_source"];
  for (const p of points) rows.push([p.series, p.prompt_tokens, p.ttft_ms, p.cached_tokens, p.cache_source].join(","));
  return rows.join("\n") + "\n";
}

function download(blob, name) {
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 10000);
}

export function installChart() {
  document.getElementById("chart-png").addEventListener("click", () =>
    document.getElementById("chart").toBlob((b) => download(b, "edge-llm-ttft.png"), "image/png"));
  document.getElementById("chart-csv").addEventListener("click", () =>
    download(new Blob([csv()], { type: "text/csv" }), "edge-llm-ttft.csv"));
  window.addEventListener("resize", draw);
}
