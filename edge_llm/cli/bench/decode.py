"""`edge-llm bench decode`: plain vs speculative decoding, with llama.cpp and the NPU prediction."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from edge_llm.cli.bench.common import bench, out_option, save_results, spinner


@bench.command("decode")
@click.option("--backends", default="cpu,cpu-q", show_default=True, help="Backends to run (cpu, cpu-q; cpu-q:MODE for a quant mode, e.g. cpu-q:q4-int8).")
@click.option("--families", default="recall,code,chat", show_default=True,
              help="Prompt families (edge_llm/bench/decode.py): recall, code, chat.")
@click.option("--max-tokens", type=click.IntRange(2), default=128, show_default=True, help="Greedy tokens per answer.")
@click.option("--threads", type=click.IntRange(1), default=2, show_default=True, help="Threads of cpu-q and llama.cpp.")
@click.option("--repeats", type=click.IntRange(1), default=2, show_default=True,
              help="Runs of each answer, plain and speculative alternately; the best speed is reported.")
@click.option("--llamacpp-python", default=None, metavar="PATH",
              help="Python of the llama.cpp venv.  [default: $EDGE_LLM_LLAMACPP_PYTHON, else .venv-llamacpp; "
                   "without one, no llama.cpp column]")
@click.option("--rknn-dir", default=None, metavar="DIR",
              help="A converted model (`edge-llm convert rknn`): predict the NPU's effective decode from its "
                   "compiler estimates, drafting replayed on each answer with that profile.")
@click.option("--npu-layers", type=click.IntRange(1), default=None,
              help="Predict for this many decoder layers from a `--layers N` conversion (the layer graphs' "
                   "estimates scaled).  [default: the converted layers]")
@out_option
def decode_cmd(backends, families, max_tokens, threads, repeats, llamacpp_python, rknn_dir, npu_layers, out) -> None:
    """Plain vs speculative decoding on the default model: tok/s, acceptance, tokens per forward,
    same text, next to llama.cpp's plain decode in the same run (docs/speculative.md)."""
    run_decode(backends.split(","), families.split(","), max_tokens, threads, repeats, llamacpp_python, rknn_dir, out,
               npu_layers)


def run_decode(backends, families, max_tokens=128, threads=2, repeats=2, llamacpp_python=None, rknn_dir=None,
               out="benchmarks/results", npu_layers=None) -> Path:
    from edge_llm.bench import decode as B
    from edge_llm.bench.disk import new_results_dir

    from edge_llm.settings import QUANT_MODES

    ok = ("cpu", "cpu-q", *(f"cpu-q:{q}" for q in QUANT_MODES))
    bad = [f for f in families if f not in B.FAMILIES] + [b for b in backends if b not in ok]
    if bad:
        raise click.BadParameter(f"unknown: {', '.join(bad)}")
    res_dir = new_results_dir(out, "bench-decode")
    with spinner() as prog:
        task = prog.add_task("decode bench", total=None)
        res = B.run(tuple(backends), tuple(families), max_tokens, threads, repeats, llamacpp_python, rknn_dir,
                    step=lambda msg: prog.update(task, description=msg), npu_layers=npu_layers)
    res["command"] = " ".join(sys.argv)
    res["env"] = {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    save_results(res_dir, "decode", res, B.markdown(res))
    return res_dir
