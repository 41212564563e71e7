"""`edge-llm bench npu`: the rknn backend on a board, against Rockchip's RKLLM numbers and the
compiler's own estimate.

Measures per-graph call latency per static shape, prefill tok/s per chunk size, decode tok/s,
decode under other core-mask layouts, RSS and NPU memory; prints the compiler-predicted time
(`convert/report.py`) next to each measured one, and the ratio to the RKLLM anchor (Qwen3-VL-2B,
w8a8, RK3588: TTFT 383.6 ms for 128 tokens, 14.98 tok/s decode, 1869 MB; rknn-llm benchmark.md).
On a host, `--runner sim|onnxruntime` runs the same measurements (numbers of that runner, not
of an NPU) so the benchmark itself is tested.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edge_llm.backends.graph.manifest import Manifest
from edge_llm.backends.graph.schema import sample_inputs
from edge_llm.backends.npu.backend import npu_present, open_rknn
from edge_llm.bench.rkllm import RKLLM
from edge_llm.bench.procstat import proc_status
from edge_llm.convert.report import predicted_ms

NPU_MM = "/sys/kernel/debug/rknpu/mm"


def _rss_mb() -> tuple[float, float]:
    st = proc_status()
    return st["VmRSS"] / 2**20, st["VmHWM"] / 2**20


def _npu_memory() -> str | None:
    try:
        return " ".join(Path(NPU_MM).read_text().split())[:300]
    except OSError:
        return None


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first call allocates
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _decode_tok_s(model, cache, steps: int) -> float:
    cache.truncate(16)
    t = time.perf_counter()
    tok = 1
    for _ in range(steps):
        tok = int(np.argmax(model.forward([tok], cache)))
    return steps / (time.perf_counter() - t)


def run(model_dir: str | Path, rknn_dir: str | Path, runner: str = "rknnlite", repeats: int = 10,
        prefill_tokens: int = 256, decode_steps: int = 32, core_layouts: bool = True,
        step: Callable[[str], None] = lambda msg: None) -> dict:
    from edge_llm.models.qwen3 import Model

    m = Manifest.read(rknn_dir)
    res: dict = {"runner": runner, "model": str(model_dir), "rknn_dir": str(rknn_dir), "identity": m.identity(),
                 "toolkit": m.toolkit, "chunks": m.chunks, "anchor": RKLLM, "graphs": [], "prefill": [],
                 "rss_mb_before": _rss_mb()[0]}
    step("loading graphs")
    be = open_rknn(rknn_dir, runner, model_dir=model_dir)
    try:
        model = Model.load(model_dir, backend=be)
        res["numerics"] = be.numerics
        res["rss_mb_loaded"], _ = _rss_mb()
        res["npu_memory"] = _npu_memory()
        by_name = {g.name: g for g in m.graphs}
        for spec in be.specs:
            for rows in spec.rows:
                step(f"latency {spec.name} x{rows}")
                xs = sample_inputs(spec, rows)
                ms = _median_ms(lambda: be.runner.run(spec, xs), repeats)
                cyc = next((t["cycles"] for t in by_name[spec.name].cost or [] if t.get("rows") == rows), None)
                res["graphs"].append({"graph": spec.name, "rows": rows, "ms": ms,
                                      "predicted_ms": cyc / 1e6 if cyc else None})
        cache = model.new_cache(max(prefill_tokens, 128) + decode_steps + 32, check_memory=False)
        ids = np.arange(prefill_tokens) % min(model.args.vocab_size, 1000)
        for chunk in m.chunks:
            step(f"prefill {prefill_tokens} tokens in chunks of {chunk}")
            cache.reset()
            t = time.perf_counter()
            model.prefill(ids, cache, chunk=chunk)
            s = time.perf_counter() - t
            pred = predicted_ms(m, chunk)
            res["prefill"].append({"chunk": chunk, "tok_s": prefill_tokens / s,
                                   "predicted_tok_s": chunk / pred * 1e3 if pred else None})
        step("decode")
        res["decode_tok_s"] = _decode_tok_s(model, cache, decode_steps)
        before = sum(be.calls.values())
        model.forward([1], cache)
        res["calls_per_token"] = sum(be.calls.values()) - before
        # what a call costs beyond the compiler's cycles (inputs converted on the CPU, the driver):
        # the median over one-row graphs of measured - predicted; meaningful on a board only
        ones = [g["ms"] - g["predicted_ms"] for g in res["graphs"] if g["rows"] == 1 and g["predicted_ms"]]
        res["per_call_overhead_ms"] = statistics.median(ones) if ones else None
        pred = predicted_ms(m, 1)
        res["decode_predicted_ms"] = pred
        res["decode_ms"] = 1e3 / res["decode_tok_s"]
        cache.reset()
        ids128 = np.arange(128) % min(model.args.vocab_size, 1000)
        t = time.perf_counter()  # as the engine does: the tail in chunks, the last token alone
        model.prefill(ids128[:127], cache, chunk=max(m.chunks))
        model.forward(ids128[127:], cache)
        res["ttft_128_ms"] = (time.perf_counter() - t) * 1e3
        res["rss_mb_peak"] = _rss_mb()[1]
    finally:
        be.close()
    if core_layouts and runner == "rknnlite":
        res["core_layouts"] = _core_layouts(model_dir, rknn_dir, m, decode_steps, step)
    res["ratio_to_rkllm"] = {"ttft_128": RKLLM["ttft_128_ms"] / res["ttft_128_ms"],
                             "decode": res["decode_tok_s"] / RKLLM["decode_tok_s"],
                             "memory": RKLLM["memory_mb"] / max(res["rss_mb_peak"], 1.0)}
    return res


def _core_layouts(model_dir, rknn_dir, m: Manifest, steps: int, step) -> list[dict]:
    """Decode tok/s with layers round-robin on cores 0/1/2 vs all on core 0 vs all on 0+1+2."""
    from edge_llm.backends.npu.graphs.rknnlite import NPU_CORE_0, NPU_CORE_0_1_2
    from edge_llm.models.qwen3 import Model

    out = []
    for label, masks in (("round-robin 0/1/2", (1, 2, 4)), ("core 0", (NPU_CORE_0,)),
                         ("cores 0+1+2", (NPU_CORE_0_1_2,))):
        step(f"decode, layers on {label}")
        be = open_rknn(rknn_dir, "rknnlite", model_dir=model_dir, layer_masks=masks)
        try:
            model = Model.load(model_dir, backend=be)
            cache = model.new_cache(64 + steps, check_memory=False)
            model.prefill(np.arange(16), cache)
            out.append({"layers": label, "decode_tok_s": _decode_tok_s(model, cache, steps)})
        finally:
            be.close()
    return out


def markdown(res: dict) -> str:
    a = res["anchor"]
    lines = [f"# NPU benchmark ({res['runner']})", "", f"- numerics `{res.get('numerics')}`; rknn-toolkit2 "
             f"{res['toolkit']}; chunks {res['chunks']}", f"- RSS loaded {res['rss_mb_loaded']:.0f} MB, peak "
             f"{res['rss_mb_peak']:.0f} MB; NPU memory: {res.get('npu_memory') or 'not readable (debugfs)'}",
             f"- TTFT 128 tokens {res['ttft_128_ms']:.1f} ms (RKLLM {a['ttft_128_ms']} ms: ratio "
             f"{res['ratio_to_rkllm']['ttft_128']:.2f}x)",
             f"- decode {res['decode_tok_s']:.2f} tok/s = {res['decode_ms']:.1f} ms/token; compiler predicted "
             + (f"{res['decode_predicted_ms']:.1f} ms/token" if res["decode_predicted_ms"] else "n/a")
             + f" (RKLLM {a['decode_tok_s']} tok/s: ratio {res['ratio_to_rkllm']['decode']:.2f}x)",
             f"- {res['calls_per_token']} graph calls per decode token; per-call overhead (median of measured - "
             "predicted over one-row graphs): " + (f"{res['per_call_overhead_ms']:.3f} ms, "
                                                   f"{res['per_call_overhead_ms'] * res['calls_per_token']:.1f} ms "
                                                   "per token" if res["per_call_overhead_ms"] is not None
                                                   else "n/a (no compiler estimate)"), "",
             "| chunk | prefill tok/s | predicted tok/s |", "|---|---|---|"]
    for p in res["prefill"]:
        pred = f"{p['predicted_tok_s']:.0f}" if p["predicted_tok_s"] else "-"
        lines.append(f"| {p['chunk']} | {p['tok_s']:.1f} | {pred} |")
    lines += ["", "| graph | rows | measured ms | predicted ms |", "|---|---|---|---|"]
    for g in res["graphs"]:
        pred = f"{g['predicted_ms']:.3f}" if g["predicted_ms"] else "-"
        lines.append(f"| {g['graph']} | {g['rows']} | {g['ms']:.3f} | {pred} |")
    for c in res.get("core_layouts", []):
        lines.append(f"\n- layers on {c['layers']}: decode {c['decode_tok_s']:.2f} tok/s")
    return "\n".join(lines) + "\n"


# ---- the matmul path (an `edge-llm convert npu-mm` directory) --------------------------------------
def run_mm(model_dir: str | Path, mm_dir: str | Path, lib: str | None = None, repeats: int = 3,
           contexts: tuple[int, ...] = (512, 8192), step: Callable[[str], None] = lambda msg: None) -> dict:
    """The matmul path through librknnrt (`lib`: None -> $EDGE_LLM_LIBRKNNRT, else librknnrt.so):
    the engine's per-call overhead and GB/s on one core and three (bench/npu/matmul.py), then the
    model's decode at each context, prefill of a 32- and a 128-row prompt and RSS with the KV rows
    of each context written; each next to the prediction (the published rates, and the rates just
    measured) with the CPU work measured in the same forwards, and to RKLLM's figures."""
    from edge_llm.backends.npu.matmul.engine import open_npu_matmul
    from edge_llm.bench.npu.a76 import predict_cpu_q
    from edge_llm.bench.npu.cpu import measure
    from edge_llm.bench.npu.matmul import STREAM_SHAPES, bench_matmul
    from edge_llm.bench.npu.predict import Plan, Rates, predict
    from edge_llm.config import ModelArgs

    step("matmul micro-benchmark")
    micro = bench_matmul(lib)
    engine = open_npu_matmul(lib)
    res: dict = {"path": "matmul", "model": str(model_dir), "rknn_dir": str(mm_dir), "micro": micro.as_dict(),
                 "numerics": engine.numerics, "npu": npu_present(), "anchor": RKLLM}
    got = measure(model_dir, mm_dir, engine, contexts=contexts, verify_rows=(), repeats=repeats, step=step)
    stream = micro.gbps[next(iter(STREAM_SHAPES))]  # the first stream shape: the 2B's gate/up
    measured_rates = Rates(bw_core_gbs=stream["1 core"], bw_all_gbs=stream["3 cores"], call_us=micro.lib_run_us,
                           engine_us=micro.engine_us)
    plan = Plan.of(ModelArgs.from_dir(model_dir))
    res["predicted"] = predict(plan, Rates(engine_us=micro.engine_us), got.cpu, contexts)
    res["predicted_measured_rates"] = predict(plan, measured_rates, got.cpu, contexts)
    res["decode"] = [{"context": c, "ms": got.decode_ms[(1, c)], "tok_s": 1e3 / got.decode_ms[(1, c)]}
                     for c in contexts]
    res["rss_mb"], res["rss_context"] = got.rss_mb, got.context
    res["prefill"] = [{"rows": r, "ms": ms, "tok_s": r / ms * 1e3} for r, ms in got.prompt_ms.items()]
    res["cpu_isa"] = got.cpu.isa
    res["cpu_q"] = predict_cpu_q(ModelArgs.from_dir(model_dir))  # docs/npu.md, "NPU or CPU decode"
    return res


def markdown_mm(res: dict) -> str:
    """Measured next to predicted (published rates / measured rates) and RKLLM's figures."""
    from edge_llm.bench.npu import a76
    from edge_llm.bench.rkllm import RKLLM_PREFILL_ROWS

    where = (f"NPU at {res['npu']}" if res["npu"] else
             "NO NPU on this machine: the library is a stand-in (the tests' fake: C on this CPU), so every "
             "measured figure below is that C code's speed, not an NPU's")
    m = res["micro"]
    lines = [f"# NPU benchmark: the matmul path ({where})", "",
             f"- engine `{res['numerics']}` on {m['machine']}; CPU work measured in the same forwards on "
             f"{res['cpu_isa']}",
             f"- per call: run {m['run_us']:.1f} us on one core (rknn_matmul_run {m['lib_run_us']:.1f} us), "
             f"a round over {m['round_cores']} cores {m['round_us']:.1f} us, the engine's own "
             f"{m['engine_us']:.1f} us of it (prediction: 33 us per call + the engine's; on Python's thread "
             f"pool {m['pool_round_us']:.1f} us)"]
    for shape, by in m["gbps"].items():
        lines.append(f"- stream {shape}: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in by.items())
                     + " (prediction: 11 GB/s on one core, 26.6 over three)")
    pub, mes = res["predicted"], res["predicted_measured_rates"]
    rk_pre = RKLLM_PREFILL_ROWS / (RKLLM["ttft_128_ms"] / 1e3)
    lines += ["", f"Model {Path(res['model']).name}; RKLLM's figures are Qwen3-VL-2B's (w8a8, RK3588).", "",
              "| | measured tok/s | predicted (published rates) | predicted (measured rates) | RKLLM | "
              "measured / RKLLM |", "|---|---|---|---|---|---|"]
    for d, p, q in zip(res["decode"], pub["decode"], mes["decode"]):
        lines.append(f"| decode at {d['context']} | {d['tok_s']:.2f} | {p['tok_s']:.2f} | {q['tok_s']:.2f} | "
                     f"{RKLLM['decode_tok_s']} | {d['tok_s'] / RKLLM['decode_tok_s']:.2f}x |")
    for d, p, q in zip(res["prefill"], pub["prefill"], mes["prefill"]):
        lines.append(f"| prefill, {d['rows']}-row prompt | {d['tok_s']:.1f} | {p['tok_s']:.1f} | {q['tok_s']:.1f} | "
                     f"{rk_pre:.0f} | {d['tok_s'] / rk_pre:.2f}x |")
    lines.append(f"\n- RSS with a {res['rss_context']}-token KV cache written: {res['rss_mb']:.0f} MB (RKLLM: "
                 f"{RKLLM['memory_mb']:.0f} MB for Qwen3-VL-2B)")
    lines += ["", a76.markdown(res["cpu_q"], pub["decode"][0]["tok_s"])]
    return "\n".join(lines) + "\n"
