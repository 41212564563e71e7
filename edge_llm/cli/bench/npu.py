"""`edge-llm bench npu`: the NPU backend on a board."""

from __future__ import annotations

import sys

import click

from edge_llm.cli.bench.common import bench, out_option, save_results, spinner


@bench.command("npu")
@click.option("--model", "model", required=True, help="HF model directory the graphs were converted from.")
@click.option("--rknn-dir", required=True, metavar="DIR",
              help="`edge-llm convert rknn` output directory (the graph path), or an `edge-llm convert npu-mm` "
                   "one (the matmul path).")
@click.option("--runner", type=click.Choice(["rknnlite", "sim", "onnxruntime"]), default="rknnlite",
              show_default=True, help="Graph path: sim / onnxruntime run the same measurements on a host "
                                      "(not NPU numbers).")
@click.option("--lib", default=None, metavar="PATH",
              help="Matmul path: the librknnrt.so to load (with --predict-only: to measure the engine's own time "
                   "per round over it).  [default: $EDGE_LLM_LIBRKNNRT, else librknnrt.so]")
@click.option("--predict-only", is_flag=True,
              help="Matmul path: no NPU needed; print the prediction for --model's geometry (docs/npu.md, "
                   "\"Prediction\"), the CPU work measured here on --rknn-dir (its npu-mm conversion).")
@click.option("--npu-layers", type=click.IntRange(1), default=None,
              help="--predict-only: predict for this many decoder layers (the CPU work of the converted layers "
                   "scaled).  [default: the model's]")
@click.option("--drafting-tokens", type=click.IntRange(0), default=128, show_default=True,
              help="--predict-only: greedy tokens of bench decode's recall and code answers (default model, cpu "
                   "backend) replayed with drafting; 0: no drafting rows.")
@click.option("--contexts", default=None, metavar="N,N,...",
              help="Matmul path: decode measured (or predicted) at these context lengths.  [default: 512,8192 "
                   "measured; 128,512,2048,8192 with --predict-only]")
@click.option("--repeats", type=click.IntRange(1), default=10, show_default=True,
              help="Timed runs per measurement, the median reported (the matmul path: at most 3).")
@click.option("--prefill-tokens", type=click.IntRange(1), default=256, show_default=True,
              help="Graph path: prompt tokens of the prefill measured at each chunk size.")
@click.option("--decode-steps", type=click.IntRange(1), default=32, show_default=True,
              help="Graph path: decode steps timed after the prefill.")
@out_option
def npu_cmd(model, rknn_dir, runner, lib, predict_only, npu_layers, drafting_tokens, contexts, repeats,
            prefill_tokens, decode_steps, out) -> None:
    """The rknn backend on the board, vs RKLLM and a prediction. Graph path: graph latency per shape,
    prefill per chunk size, decode, core-mask layouts, RSS/NPU memory, vs the compiler's estimate.
    Matmul path: per-call overhead, GB/s on one core and three, decode, prefill at 32 and 128 rows,
    RSS at 8K, vs the prediction (docs/npu.md, "Prediction")."""
    import os

    from edge_llm.backends.npu.matmul.decoder import is_mm_dir
    from edge_llm.backends.npu.backend import npu_present
    from edge_llm.bench.npu import run as B
    from edge_llm.bench.disk import new_results_dir
    from edge_llm.errors import EdgeLLMError
    from edge_llm.settings import LIBRKNNRT_ENV

    try:
        ctx = tuple(int(c) for c in contexts.split(",")) if contexts else None
    except ValueError:
        raise click.BadParameter(f"--contexts: comma-separated token counts, got {contexts!r}") from None
    if ctx is not None and min(ctx) < 1:
        raise click.BadParameter("--contexts: each at least 1")
    try:
        matmul = is_mm_dir(rknn_dir)
    except EdgeLLMError as e:
        raise click.ClickException(str(e)) from None
    if predict_only and not matmul:
        raise click.ClickException(f"--predict-only needs an `edge-llm convert npu-mm` directory of --model; "
                                   f"{rknn_dir} is not one")
    if matmul and not predict_only and npu_present() is None and not (lib or os.environ.get(LIBRKNNRT_ENV)):
        raise click.ClickException("no RKNPU device on this machine: run this on an RK3588 board, pass "
                                   "--predict-only for the prediction, or --lib a stand-in librknnrt.so")
    if not matmul and runner == "rknnlite" and npu_present() is None:
        raise click.ClickException("no RKNPU device on this machine (no /dev/rknpu, no DRM render node with "
                                   "driver RKNPU): run this on an RK3588 board, or pass --runner sim|onnxruntime "
                                   "to exercise the benchmark on a host")
    res_dir = new_results_dir(out, "bench-npu")
    with spinner() as prog:
        task = prog.add_task("npu bench", total=None)
        say = lambda msg: prog.update(task, description=msg)  # noqa: E731
        try:
            if predict_only:
                from edge_llm.bench.npu.cpu import run_prediction

                from edge_llm.backends.npu.matmul.binding import library_path

                has_lib = lib or os.environ.get(LIBRKNNRT_ENV) or npu_present()
                res = run_prediction(model, rknn_dir, npu_layers, drafting_tokens=drafting_tokens,
                                     repeats=min(repeats, 3), lib=library_path(lib) if has_lib else None, step=say,
                                     **({"contexts": ctx} if ctx else {}))
            elif matmul:
                res = B.run_mm(model, rknn_dir, lib, repeats=min(repeats, 3), step=say,
                               **({"contexts": ctx} if ctx else {}))
            else:
                res = B.run(model, rknn_dir, runner, repeats, prefill_tokens, decode_steps, step=say)
        except EdgeLLMError as e:
            raise click.ClickException(str(e)) from None
    res["command"] = " ".join(sys.argv)
    if predict_only:
        from edge_llm.bench.npu import a76
        from edge_llm.bench.npu.predict import markdown

        md = (markdown(res, res["cpu"]["isa"], res["cpu"]["parts_ms"]) + "\n"
              + a76.markdown(res["cpu_q"], res["decode"][0]["tok_s"]))
    else:
        md = B.markdown_mm(res) if matmul else B.markdown(res)
    save_results(res_dir, "npu", res, md)
