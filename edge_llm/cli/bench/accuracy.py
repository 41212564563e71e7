"""`edge-llm bench accuracy`: rknn (simulator, onnxruntime or the board) or cpu-q against the
exact CPU backend on the real model, end to end; `edge-llm bench quant-variants`: where cpu-q's
distance from F32 comes from (bench/quant_variants.py)."""

from __future__ import annotations

import sys

import click

from edge_llm.cli.bench.common import bench, out_option, save_results, spinner
from edge_llm.settings import CPUQ_REQUANTS, RKNN_RUNNERS


@bench.command("accuracy")
@click.option("--model", default="default", show_default=True, help="Model directory, or `default`.")
@click.option("--backend", type=click.Choice(["rknn", "cpu-q"]), required=True,
              help="The backend compared with cpu (F32) on the same checkpoint.")
@click.option("--rknn-dir", default=None, metavar="DIR", help="`edge-llm convert rknn` or `convert npu-mm` output (backend rknn).")
@click.option("--rknn-runner", type=click.Choice([r for r in RKNN_RUNNERS if r != "auto"]), default="sim",
              show_default=True, help="sim: the toolkit's fp16 simulator (converter venv); rknnlite: the board; an "
              "npu-mm directory: host (the exact emulation) or librknnrt (the board).")
@click.option("--teacher-tokens", type=click.IntRange(16), default=320, show_default=True,
              help="Tokens of the teacher-forced text (top-1 agreement, KL).")
@click.option("--greedy-tokens", type=click.IntRange(0), default=100, show_default=True,
              help="Greedy tokens compared after a chat prompt (0: skip; slow on the simulator).")
@out_option
def accuracy_cmd(model, backend, rknn_dir, rknn_runner, teacher_tokens, greedy_tokens, out) -> None:
    """Last-token logit cosine on several chat prompts, teacher-forced top-1 agreement and KL, and
    the greedy answer to a factual question, greedy agreement over N tokens: BACKEND vs cpu (F32)
    on the same checkpoint."""
    from edge_llm.bench import accuracy as B
    from edge_llm.bench.disk import new_results_dir
    from edge_llm.errors import EdgeLLMError

    with spinner() as prog:
        task = prog.add_task("accuracy", total=None)
        try:
            res = B.run(model, backend, rknn_dir, rknn_runner, teacher_tokens,
                        step=lambda msg: prog.update(task, description=msg), greedy_tokens=greedy_tokens)
        except EdgeLLMError as e:
            raise click.ClickException(str(e)) from None
    res["command"] = " ".join(sys.argv)
    save_results(new_results_dir(out, "bench-accuracy"), "accuracy", res, B.markdown(res))


@bench.command("quant-variants")
@click.option("--model", default="default", show_default=True, help="Model directory, or `default`.")
@click.option("--teacher-tokens", type=click.IntRange(16), default=320, show_default=True,
              help="Tokens of the teacher-forced text (top-1 agreement, KL).")
@click.option("--no-cpu-q", is_flag=True, help="Only the numpy emulations (no cpu-q graphs built or run).")
@click.option("--no-emulate", is_flag=True, help="No numpy emulations (only cpu-q's real graphs).")
@click.option("--from-f32", is_flag=True,
              help="Also the emulations of every weight re-quantized from F32: round to nearest, GPTQ + MSE "
                   "clip, each plain and rotated, and 8 bits (float activations).")
@click.option("--requantized", "requantized", multiple=True, type=click.Choice(CPUQ_REQUANTS),
              help="Also cpu-q q4 with every weight re-quantized from F32 (the GGUF blocks ignored) by this "
                   "method: rtn, gptq or gptq-mse (repeatable; built in their own directories).")
@click.option("--calibration-tokens", type=click.IntRange(16), default=None,
              help="GPTQ's calibration tokens for --requantized (default: what cpu-q's build uses). The "
                   "directories are reused whatever the count: use a fresh EDGE_LLM_HOME to compare counts.")
@out_option
def quant_variants_cmd(model, teacher_tokens, no_cpu_q, no_emulate, from_f32, requantized, calibration_tokens,
                       out) -> None:
    """Where cpu-q's distance from F32 comes from: each source of error (int8 activations per kind
    of linear, 4-bit weights re-quantized from F32, rotations) emulated alone on the F32 backend,
    next to cpu-q's real graphs: teacher-forced top-1 and KL, greedy answers to the acceptance
    prompts (docs/quantization.md, "Where the error comes from")."""
    from edge_llm.bench import quant_variants as B
    from edge_llm.bench.disk import new_results_dir
    from edge_llm.errors import EdgeLLMError

    with spinner() as prog:
        task = prog.add_task("quant variants", total=None)
        try:
            res = B.run(model, teacher_tokens, cpu_q=not no_cpu_q, step=lambda msg: prog.update(task, description=msg),
                        emulate=not no_emulate, requantized=tuple(requantized), calibration_tokens=calibration_tokens,
                        from_f32=from_f32)
        except EdgeLLMError as e:
            raise click.ClickException(str(e)) from None
    res["command"] = " ".join(sys.argv)
    save_results(new_results_dir(out, "bench-quant-variants"), "quant_variants", res, B.markdown(res))
