"""`edge-llm convert rknn MODEL_DIR OUT_DIR`: graphs for the RK3588 NPU, built on an x86 host."""

from __future__ import annotations

import logging
import sys

import click

from edge_llm.cli.bench.common import int_list


@click.group("convert")
def convert() -> None:
    """Convert a model for another backend (the NPU: `convert rknn`)."""


@convert.command("rknn")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--chunks", default="1,32,128", show_default=True,
              help="Static row counts of the layer graphs (prefill chunk sizes; must include 1).")
@click.option("--layers", type=click.IntRange(1), default=None,
              help="Convert only the first N layers (to measure; such a directory cannot serve).")
@click.option("--head-split", type=click.IntRange(1), default=1, show_default=True,
              help="Split lm_head into N graphs over vocab ranges (less RAM while converting).")
@click.option("--converter-python", envvar="EDGE_LLM_CONVERTER_PYTHON", default=None, metavar="PATH",
              help="python of the converter venv (tools/setup-converter.sh).  [default: .venv-converter]")
@click.option("--no-accuracy", is_flag=True, help="Skip the simulator accuracy check.")
@click.option("-v", "--verbose", is_flag=True)
def rknn_cmd(model_dir, out_dir, chunks, layers, head_split, converter_python, no_accuracy, verbose) -> None:
    """Export ONNX graphs from MODEL_DIR's F32 weights, build fp16 .rknn files for rk3588 with
    rknn-toolkit2 (in the converter venv), check each in the simulator; write OUT_DIR/manifest.json
    and OUT_DIR/report.md. A full Qwen3-VL-2B takes tens of minutes."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from edge_llm.config import ModelArgs
    from edge_llm.convert.report import FP16_REL_LIMIT, predicted_ms, worst
    from edge_llm.convert.rknn import convert_rknn
    from edge_llm.errors import EdgeLLMError

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(message)s")
    console = Console(stderr=True)
    try:
        args = ModelArgs.from_dir(model_dir)
    except EdgeLLMError as e:
        raise click.ClickException(str(e)) from None
    head_gb = args.vocab_size * args.hidden_size * 4 / head_split / 1e9
    if head_gb > 1.0:
        console.print(f"[yellow]note: each lm_head graph holds {head_gb:.1f} GB of F32 weights; exporting and "
                      f"compiling it needs several times that in RAM (use --head-split N to lower it)[/yellow]")
    n_graphs = 2 * (layers or args.num_hidden_layers) + head_split
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as prog:
        tasks = {"export": prog.add_task("export ONNX", total=n_graphs),
                 "build": prog.add_task("build .rknn + simulate", total=n_graphs)}

        def step(phase: str, name: str, i: int, total: int) -> None:
            prog.update(tasks[phase], completed=i, description=f"{phase} {name}")
            if phase == "build" and i == 0:
                prog.update(tasks["export"], completed=n_graphs, description="export ONNX")

        try:
            m = convert_rknn(model_dir, out_dir, tuple(int_list(chunks)), layers=layers, head_split=head_split,
                             converter_python=converter_python, accuracy=not no_accuracy, progress=step)
        except EdgeLLMError as e:
            raise click.ClickException(str(e)) from None
        prog.update(tasks["build"], completed=n_graphs, description="build .rknn + simulate")
    bad = []
    for g in m.graphs:
        w = worst(g)
        if w is not None and w["max_rel"] > FP16_REL_LIMIT:
            bad.append(f"{g.name} max rel {w['max_rel']:.2e}")
    est = predicted_ms(m, 1)
    click.echo(f"{len(m.graphs)} graphs -> {out_dir} (identity {m.identity()}, rknn-toolkit2 {m.toolkit}); "
               f"{m.build['total_seconds']:.1f} s, peak RSS {m.build['peak_rss_mb_export']:.0f} MB (export), "
               f"{m.build['peak_rss_mb_toolkit']:.0f} MB (toolkit)")
    if est is not None:
        click.echo(f"compiler estimate: {est:.2f} ms per decode token for the converted graphs")
    click.echo(f"report: {out_dir}/report.md")
    if bad:
        console.print(f"[yellow]above the fp16 expectation ({FP16_REL_LIMIT:g}): {'; '.join(bad)}[/yellow]")
