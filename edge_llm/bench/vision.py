"""`edge-llm bench vision`: the vision encoder against this machine's matmul roofline, and an
image + question end to end, cold vs restored from disk after a restart.

Roofline: the encoder's FLOPs (every projection, attention's two products, the mergers) divided
by the sgemm rate this machine reaches on the encoder's own largest matmul shape, measured in the
same run. End to end: a fresh runtime (model load, KV cache, snapshot scan) answers the image
question cold and saves its snapshot; the runtime is dropped, the snapshot's page cache evicted,
and a second fresh runtime answers a follow-up on the same image (restored from disk: no image
encoding, tail-only prefill) and, for comparison, on another image (cold).
"""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edge_llm.bench.procstat import in_child, proc_status
from edge_llm.config import VisionArgs
from edge_llm.snapshot.layout import SNAPSHOT_GLOB

SIZES = (224, 448, 896)
# Rockchip's own runtime (rknn-llm benchmark.md, multimodal table): Qwen3-VL-2B's tower on a
# 448x448 image, fp16 on RK3588's three NPU cores
RKLLM_ENCODE_MS_448 = 2080.0


def encoder_flops(v: VisionArgs, n_patches: int) -> float:
    """Multiply-adds x 2 of one image's encoder pass (n_patches at the patch grid)."""
    h, n = v.hidden_size, n_patches
    per_block = 2 * n * h * (3 * h + h + 2 * v.intermediate_size) + 2 * 2 * n * n * h  # dense + attention
    mergers = (1 + len(v.deepstack_visual_indexes)) * 2 * (n // v.spatial_merge_size ** 2) * v.merged_dim * (
        v.merged_dim + v.out_hidden_size)
    return 2 * n * v.patch_dim * h + v.depth * per_block + mergers


def sgemm_rate(m: int, k: int, n: int, repeats: int = 3) -> float:
    """GFLOP/s of float32 (m, k) @ (k, n) on this machine (best of `repeats`)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    a @ b  # warm-up
    best = min(_time(lambda: a @ b) for _ in range(repeats))
    return 2 * m * k * n / best / 1e9


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def square_png(side: int, seed: int = 0) -> bytes:
    from edge_llm.convert.vision import sample_image

    return sample_image(side, side, seed)


def encoder_rows(vision, sizes=SIZES, repeats: int = 2, step: Callable[[str], None] = lambda s: None
                 ) -> tuple[list[dict], float]:
    """Encoder time per square size; returns (rows, best sgemm GFLOP/s seen).

    Each size's roofline is the sgemm rate of that image's own MLP matmul (patches x hidden x
    intermediate), measured right before it: on a shared machine a peer measured at the same
    moment is the fair yardstick."""
    v = vision.args
    rows, best = [], 0.0
    for side in sizes:
        img = vision.prepare(square_png(side))
        n = img.pixel_values.shape[0]
        step(f"sgemm roofline at {n} patches")
        peak = sgemm_rate(n, v.hidden_size, v.intermediate_size)
        best = max(best, peak)
        times = []
        for r in range(repeats if side < max(sizes) else 1):
            step(f"encoder {side}x{side} ({r + 1})")
            times.append(_time(lambda: vision.encode(img)))
        secs = min(times)
        flops = encoder_flops(v, n)
        rows.append({"size": side, "grid": list(img.grid_thw), "patches": n, "tokens": img.n_tokens,
                     "ms": secs * 1e3, "gflop": flops / 1e9, "gflops": flops / secs / 1e9,
                     "sgemm_gflops": peak, "roofline_ms": flops / (peak * 1e9) * 1e3,
                     "of_roofline": flops / secs / 1e9 / peak, "repeats": len(times)})
    return rows, best


def graph_rows(numpy_rows: list[dict], graph_vision, sizes=SIZES, repeats: int = 2,
               step: Callable[[str], None] = lambda s: None) -> list[dict]:
    """The same sizes through the tower graph (onnxruntime): time and roofline as `encoder_rows`,
    plus the speed-up over the numpy rows and the features' error against the numpy tower."""
    rows, _ = encoder_rows(graph_vision, sizes, repeats, lambda m: step(f"onnxruntime tower: {m}"))
    for r, ref in zip(rows, numpy_rows):
        r["speedup"] = ref["ms"] / r["ms"]
    for r, side in zip(rows, sizes):
        img = graph_vision.prepare(square_png(side))
        got = graph_vision.encode(img)
        want = graph_vision.encoder.backend_encode(img.pixel_values, img.grid_thw)
        a = np.concatenate([got.embeds, *got.deepstack], 1).astype(np.float64)
        b = np.concatenate([want.embeds, *want.deepstack], 1).astype(np.float64)
        r["max_rel"] = float(np.abs(a - b).max() / np.abs(b).max())
        r["cosine"] = float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))
    return rows


def npu_rows(rknn_dir: str | Path, vision, sizes=SIZES) -> list[dict]:
    """The compiler-predicted NPU encode per size from a converted tower (`<rknn_dir>/vision/`):
    the shape the grid rule pads the image to, its estimate, the simulator's accuracy there."""
    from edge_llm.backends.graph.manifest import Manifest
    from edge_llm.backends.tower.graph import VISION_DIR, held_shape
    from edge_llm.convert.vision import tower_rows
    from edge_llm.vision.model import fit_to_graph
    from edge_llm.vision.preprocess import prepare_image

    m = Manifest.read(Path(rknn_dir) / VISION_DIR)
    (spec,) = m.specs()
    pre = fit_to_graph(vision.pre, spec.rows)
    by_shape = {r["patches"]: r for r in tower_rows(m)}
    out = []
    for side in sizes:
        img = prepare_image(square_png(side), pre, vision.limits)
        n = img.pixel_values.shape[0]
        shape = held_shape(spec.rows, n)
        row = by_shape.get(shape, {})
        out.append({"size": side, "grid": list(img.grid_thw), "patches": n, "shape": shape,
                    "predicted_ms": row.get("predicted_ms"), "accuracy": row.get("accuracy")})
    return out


def end_to_end(model_dir: Path, kv_dir: Path, side: int, max_tokens: int,
               step: Callable[[str], None] = lambda s: None) -> dict:
    """Image + question cold; restart; follow-up on the same image (disk) and on another (cold)."""
    import gc

    from edge_llm.bench.disk import drop_file_cache
    from edge_llm.engine import GenerationRequest
    from edge_llm.runtime import load_runtime
    from edge_llm.settings import Settings

    opts = Settings(model=str(model_dir), max_seq=4096, disk_kv=str(kv_dir))
    question = "Describe this picture: the colours, the shapes and what stands out."

    def ask(engine, photo: bytes, follow_up: bool, answer: str = "") -> tuple[dict, str]:
        img = engine.vision.prepare(photo)
        shown = engine.vision.placeholder(engine.tokenizer.id_to_token)
        msgs = [{"role": "user", "content": shown + question}]
        if follow_up:
            msgs += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "Which colour covers most of it?"}]
        ids = engine.vision.expand(engine.tokenizer.apply_chat_template_ids(msgs), [img])
        text, last = "", None
        for ev in engine.generate(GenerationRequest(ids, max_tokens, images=[img])):
            text += ev.text
            last = ev
        t = last.timings
        return {"prompt_tokens": len(ids), "image_tokens": t.image_tokens, "ttft_ms": t.ttft_ms,
                "vision_ms": t.vision_ms, "prefill_tokens": t.prefill_tokens, "prefill_ms": t.prefill_ms,
                "cache_source": t.cache_source, "cached_tokens": t.ram_cached_tokens + t.disk_cached_tokens,
                "restore_ms": t.restore_ms, "restore_bytes": t.restore_bytes}, text

    photo, other = square_png(side, 1), square_png(side, 2)
    step("end to end: cold")
    engine = load_runtime(opts)
    cold, answer = ask(engine, photo, False)
    engine.store.flush()
    engine.store.close()
    del engine
    gc.collect()
    for f in kv_dir.rglob(SNAPSHOT_GLOB):
        drop_file_cache(f)
    step("end to end: restart, same image follow-up")
    engine = load_runtime(opts)
    restored, _ = ask(engine, photo, True, answer)
    step("end to end: another image follow-up")
    engine.cache.reset()  # no RAM reuse: what a restart sees for an image it never stored
    other_row, _ = ask(engine, other, True, answer)
    engine.store.flush()
    engine.store.close()
    return {"side": side, "cold": cold, "restored": restored, "other_image": other_row}


def _tower_memory(model_dir: str, side: int) -> dict:
    from edge_llm.config import ModelArgs
    from edge_llm.vision.model import VisionModel

    before = proc_status()
    vision = VisionModel.load(model_dir, ModelArgs.from_dir(model_dir))
    loaded = proc_status()
    feats = vision.encode(vision.prepare(square_png(side)))
    encoded = proc_status()
    out = np.concatenate([feats.embeds.ravel(), *(d.ravel() for d in feats.deepstack)])
    return {"side": side, "anon_loaded": loaded["RssAnon"] - before["RssAnon"],
            "file_loaded": loaded["RssFile"] - before["RssFile"],
            "anon_after_encode": encoded["RssAnon"] - before["RssAnon"],
            "file_after_encode": encoded["RssFile"] - before["RssFile"],
            "peak": encoded["VmHWM"], "output_sha256": hashlib.sha256(out.tobytes()).hexdigest()}


def tower_memory(model_dir: Path, side: int = 448) -> dict:
    """What the tower holds, measured in a fresh process: anonymous and file-backed RSS added by
    loading it, then after encoding one image (the matrices are file pages widened per block,
    docs/vision.md), and a digest of the encoder output (equal across versions = same bits)."""
    return in_child(_tower_memory, str(model_dir), side)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table: the first column left-aligned, the others right-aligned."""
    out = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def markdown(res: dict) -> str:
    lines = [f"# Vision encoder and image conversation ({res['label']})", "",
             f"Machine: {res['machine']}; BLAS: {res['blas']}.",
             "Roofline: the sgemm rate of each image's own MLP matmul (patches x 1024 x 4096), measured "
             "right before it; encoder ms is the best of the repeats.", "",
             "| image | patch grid | patches | decoder tokens | encoder ms | GFLOP | GFLOP/s | sgemm GFLOP/s "
             "| roofline ms | of roofline |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["encoder"]:
        g = "x".join(map(str, r["grid"]))
        lines.append(f"| {r['size']}x{r['size']} | {g} | {r['patches']} | {r['tokens']} | {r['ms']:.0f} | "
                     f"{r['gflop']:.1f} | {r['gflops']:.1f} | {r['sgemm_gflops']:.1f} | {r['roofline_ms']:.0f} | "
                     f"{r['of_roofline']:.0%} |")
    if res.get("encoder_graph"):
        lines += ["", "## Tower paths: numpy, onnxruntime (cpu-q), NPU (rknn)", "",
                  "onnxruntime: the tower graph (docs/vision.md) in each weight format, same machine, same "
                  "sizes, roofline measured the same way; error against the numpy tower's features.", ""]
        lines += _table(["image", "weights", "numpy ms", "onnxruntime ms", "speed-up", "GFLOP/s", "of roofline",
                         "max rel", "cosine"],
                        [[f"{r['size']}x{r['size']}", mode, f"{ref['ms']:.0f}", f"{r['ms']:.0f}", f"{r['speedup']:.2f}x",
                          f"{r['gflops']:.1f}", f"{r['of_roofline']:.0%}", f"{r['max_rel']:.1e}", f"{r['cosine']:.7f}"]
                         for mode, g in res["encoder_graph"].items() for r, ref in zip(g, res["encoder"])])
    if res.get("npu"):
        lines += ["", f"## NPU (compiler estimate, {res.get('npu_dir', '')})", "",
                  "Predicted from rknn-toolkit2's cycle tables at 1 GHz for the shape the grid rule pads the "
                  f"image to; RKLLM encodes a 448x448 image in {RKLLM_ENCODE_MS_448:.0f} ms (its benchmark).", ""]

        def num(v, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)

        lines += _table(["image", "resized grid", "patches", "shape", "predicted ms", "RKLLM 448 / predicted",
                         "measured ms (board)", "sim max rel"],
                        [[f"{r['size']}x{r['size']}", "x".join(map(str, r["grid"][1:])), str(r["patches"]), str(r["shape"]),
                          num(r["predicted_ms"], ".0f"),
                          "-" if r["predicted_ms"] is None else f"{RKLLM_ENCODE_MS_448 / r['predicted_ms']:.2f}x",
                          num(r.get("measured_ms"), ".0f"), num((r["accuracy"] or {}).get("max_rel"), ".1e")]
                         for r in res["npu"]])
    e = res.get("e2e")
    if e:
        lines += ["", f"## Image ({e['side']}x{e['side']}) + question, end to end ({res['e2e_label']})", "",
                  "| request | prompt tok | image tok | cache | cached tok | prefilled tok | vision ms | "
                  "restore ms | TTFT ms |", "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
        for name, key in (("cold (first turn)", "cold"), ("after restart, same image (follow-up)", "restored"),
                          ("after restart, another image (follow-up)", "other_image")):
            r = e[key]
            lines.append(f"| {name} | {r['prompt_tokens']} | {r['image_tokens']} | {r['cache_source']} | "
                         f"{r['cached_tokens']} | {r['prefill_tokens']} | {r['vision_ms']:.0f} | "
                         f"{r['restore_ms']:.0f} | {r['ttft_ms']:.0f} |")
        ratio = e["other_image"]["ttft_ms"] / max(e["restored"]["ttft_ms"], 1e-9)
        lines += ["", f"Restored vs cold follow-up TTFT: {ratio:.1f}x faster."]
    m = res.get("memory")
    if m:
        gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
        lines += ["", f"## What the tower holds (fresh process, one {m['side']}x{m['side']} image)", "",
                  "| | anonymous | file-backed |", "|---|---:|---:|",
                  f"| after loading | {gib(m['anon_loaded'])} | {gib(m['file_loaded'])} |",
                  f"| after one encode | {gib(m['anon_after_encode'])} | {gib(m['file_after_encode'])} |",
                  "", f"Peak RSS {gib(m['peak'])}; encoder output sha256 {m['output_sha256'][:16]}."]
    lines += ["", f"Command: `{res['command']}`", ""]
    return "\n".join(lines)
