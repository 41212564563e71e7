"""`edge-llm bench npu`: the NPU backend on a board."""

from __future__ import annotations

import sys

import click

from edge_llm.cli.bench.common import bench, out_option, save_results, spinner


@bench.command("npu")
@click.option("--model", "model", required=True, help="HF model directory the graphs were converted from.")
@click.option("--rknn-dir", required=True, metavar="DIR", help="`edge-llm convert rknn` output directory.")
@click.option("--runner", type=click.Choice(["rknnlite", "sim", "onnxruntime"]), default="rknnlite",
              show_default=True, help="sim / onnxruntime: run the same measurements on a host (not NPU numbers).")
@click.option("--repeats", type=click.IntRange(1), default=10, show_default=True)
@click.option("--prefill-tokens", type=click.IntRange(1), default=256, show_default=True)
@click.option("--decode-steps", type=click.IntRange(1), default=32, show_default=True)
@out_option
def npu_cmd(model, rknn_dir, runner, repeats, prefill_tokens, decode_steps, out) -> None:
    """The rknn backend on the board: graph latency per shape, prefill per chunk size, decode,
    core-mask layouts, RSS/NPU memory, vs RKLLM and the compiler's estimate."""
    from edge_llm.backends.rknn import npu_present
    from edge_llm.bench import npu as B
    from edge_llm.bench.disk import new_results_dir
    from edge_llm.errors import EdgeLLMError

    if runner == "rknnlite" and npu_present() is None:
        raise click.ClickException("no RKNPU device on this machine (no /dev/rknpu, no DRM render node with "
                                   "driver RKNPU): run this on an RK3588 board, or pass --runner sim|onnxruntime "
                                   "to exercise the benchmark on a host")
    res_dir = new_results_dir(out, "bench-npu")
    with spinner() as prog:
        task = prog.add_task("npu bench", total=None)
        try:
            res = B.run(model, rknn_dir, runner, repeats, prefill_tokens, decode_steps,
                        step=lambda msg: prog.update(task, description=msg))
        except EdgeLLMError as e:
            raise click.ClickException(str(e)) from None
    res["command"] = " ".join(sys.argv)
    md = B.markdown(res)
    save_results(res_dir, "npu", res, md)
