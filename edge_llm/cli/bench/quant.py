"""`edge-llm bench quant` / `quant-memory`: cpu-q vs llama.cpp and the 2B memory budget."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from edge_llm.cli.bench.common import bench, int_list, out_option, save_results, spinner

QUANT_LENGTHS = (512, 2048, 4000)


@bench.command("quant")
@click.option("--lengths", default="512,2048,4000", show_default=True, help="Context lengths in tokens.")
@click.option("--threads", type=click.IntRange(1), default=2, show_default=True,
              help="Threads of cpu-q and of llama.cpp (the F32 backend uses the BLAS default).")
@click.option("--repeats", type=click.IntRange(1), default=2, show_default=True,
              help="Runs per context and engine, alternating; the best is reported.")
@click.option("--decode", type=click.IntRange(1), default=32, show_default=True, help="Decode steps per context.")
@click.option("--tail", type=click.IntRange(1), default=32, show_default=True, help="Tokens after a restore.")
@click.option("--no-f32", is_flag=True, help="Leave the F32 backend out of the speed table (faster).")
@click.option("--llamacpp-python", default=None, metavar="PATH",
              help="Python of the llama.cpp venv.  [default: $EDGE_LLM_LLAMACPP_PYTHON, else .venv-llamacpp]")
@out_option
def quant_cmd(lengths, threads, repeats, decode, tail, no_f32, llamacpp_python, out) -> None:
    """cpu-q vs the F32 backend and llama.cpp on the default model's GGUF, in one run: prefill,
    decode, restore+tail, decode vs the bandwidth roofline, perplexity / KL / greedy agreement."""
    run_quant(int_list(lengths), threads, repeats, decode, tail, not no_f32, llamacpp_python, out)


def run_quant(lengths, threads=2, repeats=2, decode=32, tail=32, f32=True, llamacpp_python=None,
              out="benchmarks/results") -> Path:
    import os

    from edge_llm.bench import quant as B
    from edge_llm.bench.disk import new_results_dir

    res_dir = new_results_dir(out, "bench-quant")
    with spinner() as prog:
        task = prog.add_task("quant bench", total=None)
        try:
            res = B.run(lengths, threads, repeats, decode, tail, f32, llamacpp_python,
                        step=lambda msg: prog.update(task, description=msg))
        except RuntimeError as e:
            raise click.ClickException(str(e)) from None
    res["command"] = " ".join(sys.argv)
    res["env"] = {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    md = B.markdown(res)
    save_results(res_dir, "quant", res, md)
    return res_dir


@bench.command("quant-memory")
@click.option("--model", "model_dir", default=None, metavar="DIR",
              help="Model directory.  [default: a synthetic qwen3-vl-2b checkpoint with --layers layers]")
@click.option("--layers", type=click.IntRange(1), default=28, show_default=True,
              help="Decoder layers of the synthetic checkpoint (28: the whole Qwen3-VL-2B).")
@click.option("--max-seq", type=click.IntRange(1), default=8192, show_default=True,
              help="Context window: the KV cache allocated and written, in tokens.")
@click.option("--backend", type=click.Choice(["cpu-q", "cpu"]), default="cpu-q", show_default=True,
              help="cpu: the F32 path (its weights are 4x the checkpoint's BF16).")
@out_option
def quant_memory_cmd(model_dir, layers, max_seq, backend, out) -> None:
    """Peak RSS of backend cpu-q (or cpu) serving the Qwen3-VL-2B geometry with an 8K cache vs an
    8 GB board, and the start-up estimate of the same configuration."""
    run_quant_memory(model_dir, layers, max_seq, out, backend)


def run_quant_memory(model_dir=None, layers=28, max_seq=8192, out="benchmarks/results", backend="cpu-q") -> Path:
    from edge_llm.bench import quant_memory as B
    from edge_llm.bench.disk import new_results_dir

    res_dir = new_results_dir(out, "bench-quant-memory")
    with spinner() as prog:
        task = prog.add_task("quant memory", total=None)
        res = B.run(Path(model_dir) if model_dir else None, layers, max_seq,
                    step=lambda msg: prog.update(task, description=msg), backend=backend)
    res["command"] = " ".join(sys.argv)
    md = B.markdown(res)
    save_results(res_dir, "quant-memory", res, md)
    return res_dir


