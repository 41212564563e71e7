"""`edge-llm convert rknn MODEL_DIR OUT_DIR`: graphs for the RK3588 NPU, built on an x86 host."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import click

from edge_llm.cli.bench.common import int_list
from edge_llm.convert.calibration_text import CALIB_TOKENS
from edge_llm.logsetup import setup_cli_logging
from edge_llm.settings import (MM_CLIP, MM_CLIPS, MM_DOWN_ROTATION, MM_GPTQ_TOKENS, MM_ROTATION, MM_ROTATIONS,
                               MM_VO_ROTATION)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # in sys.modules as None: blocked
        return False


@click.group("convert")
def convert() -> None:
    """Convert a model for another backend (the NPU: `convert rknn` graphs, `convert npu-mm` int8 matmul weights)."""


@convert.command("rknn")
@click.argument("model_dir")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--chunks", default="1,32,128", show_default=True,
              help="Static row counts of the layer graphs (prefill chunk sizes; must include 1).")
@click.option("--layers", type=click.IntRange(1), default=None,
              help="Convert only the first N layers (to measure; such a directory cannot serve).")
@click.option("--head-split", type=click.IntRange(1), default=None,
              help="Split lm_head into N graphs over vocab ranges (less RAM while converting).  "
                   "[default: parts of at most 320 MB of F32 weights: 4 for Qwen3-VL-2B, 1 for the default model]")
@click.option("--converter-python", envvar="EDGE_LLM_CONVERTER_PYTHON", default=None, metavar="PATH",
              help="python of the converter venv (tools/setup-converter.sh).  [default: .venv-converter]")
@click.option("--no-accuracy", is_flag=True, help="Skip the simulator accuracy check (the range check stays).")
@click.option("--calibration", "--calib-text", "calib_text", type=click.Path(exists=True, dir_okay=False),
              default=None, metavar="FILE", help="UTF-8 text the F32 model runs on to capture real graph inputs "
              "(activation ranges, w8a8's scales).  [default: the built-in mixed calibration text]")
@click.option("--calib-tokens", type=click.IntRange(8), default=CALIB_TOKENS, show_default=True,
              help="Calibration tokens (the text as a chat user message, cut to N).")
@click.option("--fp16-headroom", type=click.FloatRange(1.0), default=2.0, show_default=True,
              help="Refuse a graph whose largest tensor on the calibration text passes 65504 / this.")
@click.option("--dtype", type=click.Choice(["float16", "w8a8"]), default="float16", show_default=True,
              help="float16, or w8a8 (int8 weights and activations; norms on the CPU; docs/npu.md 'w8a8').")
@click.option("--quant-algorithm", type=click.Choice(["normal", "mmse", "kl_divergence"]), default="normal",
              show_default=True, help="w8a8: rknn-toolkit2's quantized_algorithm (activation ranges).")
@click.option("--quant-method", type=click.Choice(["channel", "layer"]), default="channel", show_default=True,
              help="w8a8: weight scales per output channel or per tensor.")
@click.option("--w8a8-min-cosine", type=click.FloatRange(0.0, 1.0), default=0.99, show_default=True,
              help="w8a8: a graph whose mean per-row cosine on the calibration rows is below this is built fp16.")
@click.option("--w8a8-rotation", type=click.Choice(["hadamard", "none"]), default="hadamard", show_default=True,
              help="w8a8: hadamard keeps the residual stream in a rotated basis folded into the weights "
                   "(measured better on every count: docs/npu.md 'w8a8').")
@click.option("--w8a8-fp16", "w8a8_fp16", default="", metavar="KIND,...",
              help="w8a8: build these graph kinds fp16 outright (qkv_n, o, mlp, head_n; e.g. mlp, the hybrid "
                   "docs/npu.md 'w8a8' measures).")
@click.option("--vision-grids", default="256x256,448x448", show_default=True, metavar="WxH,...|none",
              help="A model with a vision tower: the image sizes its one tower graph holds (an image is "
                   "resized onto at most the largest one's patches and padded up to the smallest that "
                   "holds it; docs/vision.md 'Grids on the NPU'); none: no tower graph.")
@click.option("-v", "--verbose", is_flag=True,
              help="Also print the converter's log lines (INFO): the calibration capture, w8a8 graphs built "
                   "fp16 and why, the graphs built and reused.")
def rknn_cmd(model_dir, out_dir, chunks, layers, head_split, converter_python, no_accuracy, calib_text,
             calib_tokens, fp16_headroom, dtype, quant_algorithm, quant_method, w8a8_min_cosine, w8a8_rotation,
             w8a8_fp16, vision_grids, verbose) -> None:
    """Export ONNX graphs from MODEL_DIR's F32 weights (an HF model directory, or 'default' for the
    embedded default model, as `--model default` elsewhere), check every tensor's range on real
    activations, build fp16 .rknn files for rk3588 with rknn-toolkit2 (in the converter venv),
    check each in the simulator; write OUT_DIR/manifest.json and OUT_DIR/report.md, OUT_DIR published
    whole (a killed run leaves the old one or none; a refused range check: OUT_DIR.refused.md). A full
    Qwen3-VL-2B takes tens of minutes."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    # before anything that needs them: a clear line, not a traceback from deep inside (looked
    # up, not imported: only the exporters import onnx, tests/test_layering.py)
    missing = next((m for m in ("onnx", "onnxruntime") if not _importable(m)), None)
    if missing:
        raise click.ClickException(
            f"`convert rknn` needs the Python package {missing}, from the 'convert' extra: "
            "pip install 'edge-llm[convert]' (in a checkout: .venv/bin/pip install -e '.[convert]'; "
            "`make test` installs it)")

    from edge_llm.cli.progress import resolve_model_with_bar
    from edge_llm.config import ModelArgs
    from edge_llm.convert.report import FP16_REL_LIMIT, predicted_ms, range_summary, worst
    from edge_llm.convert.rknn import convert_rknn, head_parts
    from edge_llm.convert.vision import parse_grids
    from edge_llm.errors import EdgeLLMError

    setup_cli_logging(logging.INFO if verbose else logging.WARNING)
    console = Console(stderr=True)
    try:
        model_dir = str(resolve_model_with_bar(model_dir))  # 'default': imported on first use, as `generate`
        args = ModelArgs.from_dir(model_dir)
        grids = None if vision_grids.strip().lower() == "none" else parse_grids(vision_grids)
    except EdgeLLMError as e:
        raise click.ClickException(str(e)) from None
    head_split = head_split or head_parts(args)
    head_gb = args.vocab_size * args.hidden_size * 4 / head_split / 1e9
    if head_gb > 1.0:
        console.print(f"[yellow]note: each lm_head graph holds {head_gb:.1f} GB of F32 weights; exporting and "
                      f"compiling it needs several times that in RAM (use --head-split N to lower it)[/yellow]")
    n_graphs = (3 if dtype == "w8a8" else 2) * (layers or args.num_hidden_layers) + head_split
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as prog:
        phases = {"calibrate": ("run the F32 model on the calibration text", 1), "export": ("export ONNX", n_graphs),
                  "ranges": ("fp16 range check", n_graphs), "build": ("build .rknn + simulate", n_graphs)}
        tasks = {k: prog.add_task(label, total=total) for k, (label, total) in phases.items()}

        def step(phase: str, name: str, i: int, total: int) -> None:
            prog.update(tasks[phase], completed=i, description=f"{phase} {name}")
            if i == 0:  # every phase before this one is complete
                for before in list(phases)[:list(phases).index(phase)]:
                    label, total_ = phases[before]
                    prog.update(tasks[before], completed=total_, description=label)

        tower: dict = {}

        def build_tower(new_dir: Path) -> None:  # into the new directory, before it is published
            from edge_llm.convert.vision import convert_tower

            prog.update(tasks["build"], completed=n_graphs, description="vision tower: export, range check, build")
            try:
                tower["manifest"] = convert_tower(model_dir, new_dir, grids, converter_python, not no_accuracy,
                                                  fp16_headroom)
            except EdgeLLMError as e:  # the text graphs are still published; the tower's refusal is reported
                tower["error"] = e

        try:
            m = convert_rknn(model_dir, out_dir, tuple(int_list(chunks)), layers=layers, head_split=head_split,
                             converter_python=converter_python, accuracy=not no_accuracy, progress=step,
                             calib_text=Path(calib_text).read_text(encoding="utf-8") if calib_text else None,
                             calib_tokens=calib_tokens, headroom=fp16_headroom, dtype=dtype,
                             algorithm=quant_algorithm, method=quant_method, min_cosine=w8a8_min_cosine,
                             rotation=w8a8_rotation,
                             fp16_kinds=tuple(k.strip() for k in w8a8_fp16.split(",") if k.strip()),
                             tower=build_tower if grids and args.model_type == "qwen3_vl" else None)
        except EdgeLLMError as e:
            raise click.ClickException(str(e)) from None
        prog.update(tasks["build"], completed=n_graphs, description="build .rknn + simulate")
    bad = []
    for g in (g for g in m.graphs if m.graph_dtype(g) == "float16"):  # int8 graphs: the w8a8 line below
        w = worst(g)
        if w is not None and w["max_rel"] > FP16_REL_LIMIT:
            bad.append(f"{g.name} max rel {w['max_rel']:.2e}")
    est = predicted_ms(m, 1)
    click.echo(f"{len(m.graphs)} graphs -> {out_dir} (identity {m.identity()}, rknn-toolkit2 {m.toolkit}); "
               f"{m.build['total_seconds']:.1f} s, peak RSS {m.build['peak_rss_mb_export']:.0f} MB (export), "
               f"{m.build['peak_rss_mb_toolkit']:.0f} MB (toolkit)")
    if est is not None:
        click.echo(f"compiler estimate: {est:.2f} ms per decode token for the converted graphs")
    ranges = [(r["headroom"], g.name, r["worst"]) for g in m.graphs if (r := range_summary(g))]
    if ranges:
        head, name, where = min(ranges)
        click.echo(f"fp16 range on real activations: smallest headroom {head:.2f}x ({name}, {where})")
    if m.quant:
        fp16 = m.quant.get("fp16_graphs", {})
        n16 = sum(m.graph_dtype(g) == "float16" for g in m.graphs)
        kinds = m.quant.get("fp16_kinds")
        click.echo(f"w8a8: {len(m.graphs) - n16} graphs int8, {n16} fp16 ("
                   + (f"kinds {', '.join(kinds)} by --w8a8-fp16; " if kinds else "")
                   + f"mean row cosine below {m.quant['min_cosine']}: {', '.join(fp16) or 'none'})")
    click.echo(f"report: {out_dir}/report.md")
    if "error" in tower:
        raise click.ClickException(f"vision tower: {tower['error']}")
    if tower:
        _report_tower(tower["manifest"], out_dir, console)
    if bad:
        console.print(f"[yellow]above the fp16 expectation ({FP16_REL_LIMIT:g}): {'; '.join(bad)}[/yellow]")


@convert.command("npu-mm")
@click.argument("model_dir")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--rotation", type=click.Choice(MM_ROTATIONS), default=MM_ROTATION, show_default=True,
              help="The residual stream in a randomized Hadamard basis folded into the weights.")
@click.option("--down-rotation", type=click.Choice(MM_ROTATIONS), default=MM_DOWN_ROTATION,
              show_default=True, help="An online Hadamard of down_proj's input (on the CPU), its transpose in W_down.")
@click.option("--vo-rotation", type=click.Choice(MM_ROTATIONS), default=MM_VO_ROTATION, show_default=True,
              help="Attention values per head times a Hadamard matrix folded into W_v, its transpose into W_o "
                   "(o_proj's input spread; no run-time cost).")
@click.option("--clip", type=click.Choice(MM_CLIPS), default=MM_CLIP, show_default=True,
              help="Per-channel weight scale: the absmax (none) or the MSE-optimal clip of it (mse).")
@click.option("--gptq-tokens", type=click.IntRange(0), default=MM_GPTQ_TOKENS, show_default=True,
              help="GPTQ error compensation on this many tokens of the built-in calibration text (0: round "
                   "to nearest; the F32 model runs on them first).")
@click.option("-v", "--verbose", is_flag=True,
              help="Also print the converter's log lines (INFO): GPTQ's calibration capture, the whole "
                   "conversion's time.")
def npu_mm_cmd(model_dir, out_dir, rotation, down_rotation, vo_rotation, clip, gptq_tokens, verbose) -> None:
    """Quantize MODEL_DIR (an HF model directory, or 'default') for the NPU's int8 matmul API:
    per-channel int8 weights, their scales and rotations in OUT_DIR/weights.npz and
    OUT_DIR/manifest.json, with numpy alone (no rknn-toolkit2; runs on the board too). Serve with
    --backend rknn --rknn-dir OUT_DIR (docs/npu.md, "The matmul path")."""
    from edge_llm.cli.progress import phase_progress, resolve_model_with_bar
    from edge_llm.convert.npu_mm import CAPTURE, QUANTIZE, RECORD_PHASE, WRITE, convert_mm8
    from edge_llm.errors import EdgeLLMError

    setup_cli_logging(logging.INFO if verbose else logging.WARNING)
    phases = {CAPTURE: f"GPTQ calibration: the F32 model on {gptq_tokens} tokens, layers",
              QUANTIZE: "quantize: layers + head" + (" (GPTQ)" if gptq_tokens else " (round to nearest)"),
              WRITE: "write weights.npz and its digest",
              RECORD_PHASE: "accuracy record: the int8 model against F32 (host emulation)"}
    try:
        model_dir = str(resolve_model_with_bar(model_dir))
        with phase_progress(phases) as progress:
            m = convert_mm8(model_dir, out_dir, rotation, down_rotation, clip, gptq_tokens, vo_rotation,
                            progress=progress)
    except EdgeLLMError as e:
        raise click.ClickException(str(e)) from None
    b = m.build
    click.echo(f"{m.layers} layers -> {out_dir} (identity {m.identity()}): {b['bytes'] / 1e6:.0f} MB of int8 "
               f"weights and scales in {b['seconds']:.1f} s, peak RSS {b['peak_rss_mb']:.0f} MB")
    from edge_llm.backends.choice import rknn_record

    passed, why = rknn_record(out_dir)
    click.echo(f"{'passes' if passed else 'FAILS'}: {why}" if passed is not None else why)


NPU_WINDOW = 4 << 30  # the RK3588 NPU's IOMMU window: every graph of a process maps into it


def _report_tower(vm, out_dir, console) -> None:
    """What the vision tower's conversion into OUT_DIR/vision/ (convert/vision.py) made, and its report."""
    from edge_llm.convert.report import FP16_REL_LIMIT, worst
    from edge_llm.convert.vision import tower_rows

    if vm is None:
        click.echo("vision tower: none in this model (its config declares one, its weights do not)")
        return
    (g,) = vm.graphs
    for row in tower_rows(vm):
        acc = row["accuracy"]
        click.echo(f"vision tower at {row['patches']} patches: "
                   + (f"compiler estimate {row['predicted_ms']:.1f} ms per image" if row["predicted_ms"] else "no estimate")
                   + (f", cosine {acc['cosine']:.6f} vs numpy (max rel {acc['max_rel']:.2e})" if acc else ""))
    b = vm.build
    click.echo(f"vision tower: {(g.rknn_bytes or 0) / 1e6:.0f} MB .rknn in {b['total_seconds']:.0f} s, peak RSS "
               f"{b['peak_rss_mb_export']:.0f} MB (export), {b['peak_rss_mb_toolkit']:.0f} MB (toolkit); "
               f"report: {out_dir}/vision/report.md")
    from edge_llm.backends.graph.manifest import Manifest

    npu_bytes = sum(d.rknn_bytes or 0 for d in Manifest.read(out_dir).graphs) + (g.rknn_bytes or 0)
    if npu_bytes > NPU_WINDOW:
        console.print(f"[yellow]decoder + vision tower: {npu_bytes / 2**30:.2f} GiB of graphs, more than the NPU's "
                      f"4 GiB window: on a board the tower will not load and images take the numpy tower "
                      f"(convert with --dtype w8a8, or --vision-grids none; docs/vision.md 'NPU memory')[/yellow]")
    w = worst(g)
    if w is not None and w["max_rel"] > FP16_REL_LIMIT:
        console.print(f"[yellow]vision tower above the fp16 expectation ({FP16_REL_LIMIT:g}): "
                      f"max rel {w['max_rel']:.2e}[/yellow]")
