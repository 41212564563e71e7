"""`edge-llm bench vision`: the vision encoder and image conversations."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from edge_llm.bench.models import synth_model
from edge_llm.cli.bench.common import bench, int_list, out_option, show_results, spinner


@bench.command("vision")
@click.option("--synth-layers", type=click.IntRange(1), default=4, show_default=True,
              help="Decoder layers of the synthetic Qwen3-VL-2B (its vision tower is always complete).")
@click.option("--sizes", default="224,448,896", show_default=True, help="Square image sides for the encoder table.")
@click.option("--e2e-size", type=click.IntRange(0), default=448, show_default=True,
              help="Image side of the end-to-end conversation, at least 32 (0 skips it).")
@click.option("--max-tokens", type=click.IntRange(1), default=8, show_default=True,
              help="Greedy tokens per answer of the end-to-end conversation.")
@click.option("--repeats", type=click.IntRange(1), default=2, show_default=True,
              help="Encodes per image size for the encoder table (the largest size once).")
@click.option("--graph-modes", default="f32", show_default=True, metavar="f32,q8,q4|none",
              help="The onnxruntime tower (cpu-q's path) in these weight formats: f32 (what cpu-q runs), "
                   "q8 / q4 (weight-only MatMulNBits, measured and not kept: docs/vision.md); none skips it.")
@click.option("--rknn-dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="A `convert rknn` directory of the same synthetic model: its tower's compiler estimates.")
@out_option
def vision_cmd(synth_layers, sizes, e2e_size, max_tokens, repeats, graph_modes, rknn_dir, out) -> None:
    """Vision encoder time per image size vs the sgemm roofline, numpy and the onnxruntime tower
    (and the NPU's compiler estimate from --rknn-dir); image + question cold vs restored."""
    import os
    import platform
    import tempfile

    from threadpoolctl import threadpool_info

    from edge_llm.bench import vision as V
    from edge_llm.bench.disk import new_results_dir
    from edge_llm.config import ModelArgs
    from edge_llm.vision.model import VisionModel

    from edge_llm.backends.tower.graph import TOWER_MODES

    modes = [] if graph_modes.strip() == "none" else [m.strip() for m in graph_modes.split(",") if m.strip()]
    if any(m not in TOWER_MODES for m in modes):
        raise click.BadParameter(f"weight formats are {', '.join(TOWER_MODES)} or none", param_hint="--graph-modes")
    if 0 < e2e_size < 32:
        raise click.BadParameter("an image side is at least 32 pixels (0 skips it)", param_hint="--e2e-size")
    model_dir = synth_model(synth_layers, vision=True)
    res_dir = new_results_dir(out, "bench-vision")
    blas = ", ".join(f"{i.get('internal_api')} {i.get('architecture')} ({i.get('num_threads')} threads)"
                     for i in threadpool_info() if i.get("user_api") == "blas") or "unknown"
    res = {"label": "synthetic Qwen3-VL-2B vision tower (24 blocks, width 1024, DeepStack 5/11/17)",
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}",
           "blas": blas, "command": " ".join(sys.argv),
           "e2e_label": f"Qwen3-VL-2B geometry, {synth_layers} of 28 decoder layers"}
    with spinner() as prog:
        task = prog.add_task("vision bench")
        step = lambda msg: prog.update(task, description=msg)  # noqa: E731
        args = ModelArgs.from_dir(model_dir)
        vision = VisionModel.load(model_dir, args)
        res["encoder"], res["peak_gflops"] = V.encoder_rows(vision, int_list(sizes), repeats, step)
        if rknn_dir:
            res["npu"], res["npu_dir"] = V.npu_rows(rknn_dir, vision, int_list(sizes)), str(rknn_dir)
            from edge_llm.backends.npu.backend import npu_present

            if npu_present():  # a board: the tower measured on the NPU as well
                from edge_llm.backends.tower.graph import open_rknn_tower

                npu_vision = VisionModel.load(model_dir, args, graph=open_rknn_tower(rknn_dir, "rknnlite"))
                rows, _ = V.encoder_rows(npu_vision, int_list(sizes), repeats, lambda m: step(f"NPU tower: {m}"))
                for n, r in zip(res["npu"], rows):
                    n["measured_ms"] = r["ms"]
                npu_vision.encoder.graph.close()
        del vision
        res["encoder_graph"] = {}
        for mode in modes:
            from edge_llm.backends.tower.graph import open_ort_tower

            step(f"onnxruntime tower ({mode}): export (first use)")
            graph_vision = VisionModel.load(model_dir, args, graph=open_ort_tower(model_dir, mode))
            res["encoder_graph"][mode] = V.graph_rows(res["encoder"], graph_vision, int_list(sizes), repeats, step)
            graph_vision.encoder.graph.close()
            del graph_vision
        step("tower memory (fresh process)")
        res["memory"] = V.tower_memory(model_dir)
        if e2e_size:
            with tempfile.TemporaryDirectory(dir=res_dir) as kv:
                res["e2e"] = V.end_to_end(model_dir, Path(kv), e2e_size, max_tokens, step)
    (res_dir / "vision.json").write_text(json.dumps(res, indent=2) + "\n")
    md = V.markdown(res)
    (res_dir / "vision.md").write_text(md)
    show_results(res_dir, md)


