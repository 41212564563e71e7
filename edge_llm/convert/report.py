"""The converter's report: per-graph fp16 range on real activations, simulator accuracy on the
same activations, and the compiler's cost estimate.

The estimate is the sum of the per-op `Cycles(DDR/NPU/Total)` column of rknn-toolkit2's layer
table for one static shape, converted to time at the RK3588 NPU's 1 GHz clock. It is the
compiler's model of one core, not a measurement; `edge-llm bench npu` prints it next to the
measured time on a board.
"""

from __future__ import annotations

from edge_llm.backends.graph.schema import HEAD, HEAD_N
from edge_llm.backends.graph.manifest import GraphEntry, Manifest

NPU_HZ = 1.0e9  # RK3588 NPU clock (max), cycles -> seconds
FP16_REL_LIMIT = 3e-3  # what fp16 graphs are expected to stay within (max relative error)
FP16_MAX = 65504.0  # fp16's largest finite value


def worst(g: GraphEntry) -> dict[str, float] | None:
    """Worst max/mean relative error and lowest cosine over every shape and output."""
    if not g.accuracy:
        return None
    vals = [v for per in g.accuracy.values() for v in per.values()]
    return {"max_rel": max(v["max_rel"] for v in vals), "mean_rel": max(v["mean_rel"] for v in vals),
            "cosine": min(v["cosine"] for v in vals)} | (
        {"row_cosine_mean": min(v["row_cosine_mean"] for v in vals), "row_cosine_min": min(v["row_cosine_min"] for v in vals)}
        if all("row_cosine_mean" in v for v in vals) else {})


def cycles(g: GraphEntry, rows: int) -> int | None:
    for table in g.cost or []:
        if table.get("rows") == rows:
            return int(table["cycles"])
    return None


def predicted_ms(m: Manifest, rows: int) -> float | None:
    """Compiler-predicted time of one step at `rows` rows: every layer graph at `rows`; a decode
    step (1 row) also runs the head, a prefill chunk does not (the head runs once per request)."""
    total = 0
    for g in m.graphs:
        if g.kind in (HEAD, HEAD_N) and rows != 1:
            continue
        c = cycles(g, 1 if g.kind in (HEAD, HEAD_N) else rows)
        if c is None:
            return None
        total += c
    return total / NPU_HZ * 1e3


def worst_tensor(r: dict) -> tuple[str, float]:
    """The largest |value| of a graph's range record and where: 'input x', 'Mul_5 (ReduceSum)'."""
    cands = [(f"input {n}", v) for n, v in r["inputs"].items()]
    cands += [(f"output {n}", v) for n, v in r["outputs"].items()]
    cands += [(f"{n} ({op})", v) for n, op, v in r["intermediates"]]
    return max(cands, key=lambda c: c[1])


def range_summary(g: GraphEntry) -> dict | None:
    """max |input|, max |output|, the largest intermediate (tensor, op, value) and the headroom
    to fp16's largest value of the graph's largest tensor."""
    if not g.ranges:
        return None
    inter = g.ranges["intermediates"][0] if g.ranges["intermediates"] else ["-", "-", 0.0]
    where, top = worst_tensor(g.ranges)
    return {"input": max(g.ranges["inputs"].values()), "output": max(g.ranges["outputs"].values()),
            "intermediate": inter, "worst": where, "headroom": FP16_MAX / top if top > 0 else float("inf")}


def range_lines(m: Manifest) -> list[str]:
    c = m.calibration
    if not c:
        return ["Tensor ranges: not checked (converted by an edge-llm without the fp16 range check).", ""]
    lines = [f"Tensor ranges on real activations ({c['source']}), F32 in onnxruntime; an fp16 graph must keep "
             f"every tensor below {c['fp16_max']:.0f} / {c['headroom']:g}. Headroom = {c['fp16_max']:.0f} / "
             "largest |value| of the graph.", "",
             "| graph | max \\|input\\| | max \\|output\\| | largest intermediate (op) | headroom |",
             "|---|---|---|---|---|"]
    for g in m.graphs:
        r = range_summary(g)
        if r is None:
            continue
        name, op, v = r["intermediate"]
        flag = " **over**" if r["headroom"] < c["headroom"] else ""
        lines.append(f"| {g.name} | {r['input']:.4g} | {r['output']:.4g} | {v:.4g} `{name}` ({op}) | "
                     f"{r['headroom']:.2f}x{flag} |")
    return lines + [""]


def cpu_ops(g: GraphEntry) -> list[str]:
    return sorted({op for t in (g.cost or []) for op in t.get("cpu_ops", [])})


def markdown_report(m: Manifest) -> str:
    lines = [f"# rknn conversion report: {m.model.get('name')} ({m.model.get('model_type')})", "",
             f"- target {m.target}, {m.dtype}, rknn-toolkit2 {m.toolkit}; chunks {m.chunks}; "
             f"{m.layers} layer(s) converted; head split {m.head_split}; identity `{m.identity()}`",
             f"- build: {m.build}", ""]
    if m.quant:
        fp16 = m.quant.get("fp16_graphs", {})
        lines[-1:-1] = [f"- w8a8: toolkit {m.quant.get('algorithm')}/{m.quant.get('method')}, smoothing alpha "
                        f"{m.quant.get('alpha')}, "
                        f"residual rotation {m.quant.get('rotation', 'none')}; "
                        + (f"kinds built fp16 outright: {', '.join(m.quant['fp16_kinds'])}; "
                           if m.quant.get("fp16_kinds") else "")
                        + f"{len(fp16)} graph(s) built fp16 (mean row cosine of the int8 "
                        f"build below {m.quant.get('min_cosine')}): "
                        + (", ".join(f"{k} {v:.4f}" for k, v in fp16.items()) or "none")]
    for rows in m.chunks:
        ms = predicted_ms(m, rows)
        if ms is not None:
            per_tok = ms / rows
            what = "decode step (layers + head)" if rows == 1 else f"prefill chunk of {rows} rows (layers)"
            lines.append(f"- compiler estimate, {what}: {ms:.3f} ms per step, "
                         f"{per_tok:.3f} ms per token ({1e3 / per_tok:.1f} tok/s), NPU at {NPU_HZ / 1e9:.1f} GHz")
    source = m.calibration.get("source", "N(0,1) samples") if m.calibration else "N(0,1) samples"
    lines += [""] + range_lines(m)
    lines += [f"Simulator ({m.dtype}; per graph in the table) vs CPU backend (F32, numpy) on the first rows of the same activations "
              f"({source}; row 0 is the first token); expected max relative error <= {FP16_REL_LIMIT:g}.", "",
              "| graph | dtype | shapes | max rel | mean rel | cosine | row cosine mean / min | cycles per shape | CPU-placed ops | .rknn MB |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for g in m.graphs:
        w = worst(g)
        acc = (f"{w['max_rel']:.2e} | {w['mean_rel']:.2e} | {w['cosine']:.6f} | "
               + (f"{w['row_cosine_mean']:.5f} / {w['row_cosine_min']:.5f}" if "row_cosine_mean" in w else "-")
               if w else "- | - | - | -")
        cyc = ", ".join(f"{t.get('rows')}:{t['cycles']}" for t in (g.cost or []))
        mb = f"{g.rknn_bytes / 1e6:.2f}" if g.rknn_bytes else "-"
        lines.append(f"| {g.name} | {m.graph_dtype(g)} | {g.rows} | {acc} | {cyc} | {', '.join(cpu_ops(g)) or '-'} | {mb} |")
    return "\n".join(lines) + "\n"
