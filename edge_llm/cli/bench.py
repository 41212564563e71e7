"""`edge-llm bench restore|recovery|split|vision|compute|quant|quant-memory|npu|all`: measured
against this machine's own limits or a peer measured in the same run.

Results go to a new dated folder `<out>/<UTC>-<kind>/` (JSON + Markdown, + PNG for recovery).
`compute` runs tools/bench_compute.py from a source checkout as a separate process (the package
never imports tools/).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import click
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from edge_llm.bench.models import bench_model, synth_model
from edge_llm.settings import DEFAULTS

console = Console()
OUT_HELP = "Parent folder of the dated results folder."
_QUANT_LENGTHS = (512, 2048, 4000)


def _ints(value: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not out or min(out) < 1:
        raise click.BadParameter("need at least one positive integer")
    return out


def _progress() -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                    transient=False)


def _show(res_dir: Path, md: str) -> None:
    click.echo(md)  # the Markdown source: its tables stay readable in any terminal width
    click.echo(f"results: {res_dir}")


def _save(res_dir: Path, stem: str, res: dict, md: str) -> None:
    """`<stem>.json` + `<stem>.md` in the results folder, then the Markdown on stdout."""
    (res_dir / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    (res_dir / f"{stem}.md").write_text(md)
    _show(res_dir, md)


@click.group("bench")
def bench() -> None:
    """Benchmarks: snapshot save/restore vs raw disk, restart recovery, prefill/decode compute."""


@bench.command("restore")
@click.option("--dir", "data_dir", default=None, metavar="DIR",
              help="Where snapshots are written (the kv filesystem).  [default: $EDGE_LLM_HOME/bench]")
@click.option("--contexts", default="2048,8192", show_default=True, help="Snapshot sizes in tokens.")
@click.option("--preset", type=click.Choice(["qwen3-vl-2b"]), default="qwen3-vl-2b", show_default=True)
@click.option("--layers", type=click.IntRange(1), default=None, help="Fewer layers than the preset's.")
@click.option("--kv-bs", type=click.IntRange(1), default=DEFAULTS.kv_bs, show_default=True)
@click.option("--repeats", type=click.IntRange(0), default=3, show_default=True,
              help="Save/restore repeats per context (0: only the write budget).")
@click.option("--scan-files", type=click.IntRange(1), default=DEFAULTS.disk_kv_max_files, show_default=True)
@click.option("--scan-tokens", type=click.IntRange(1), default=None, help="[default: smallest context]")
@click.option("--turns", type=click.IntRange(0), default=6, show_default=True,
              help="Write budget: a conversation growing from the smallest to the largest context over this "
                   "many turns, saved as deltas and as full rewrites (0 skips it).")
@click.option("--ttft-models", default="synth", show_default=True,
              help="Restored TTFT (sequential vs pipelined vs bound) and the cost gate vs the alternatives "
                   "measured, on real models: 'synth' (Qwen3-VL-2B geometry, --ttft-layers layers), 'tiny', "
                   "'default' or a model dir, comma-separated ('' skips).")
@click.option("--ttft-layers", type=click.IntRange(1), default=4, show_default=True,
              help="Decoder layers of the 'synth' model (28: the whole Qwen3-VL-2B).")
@click.option("--ttft-contexts", default="2048,8192", show_default=True, help="Restored prefix sizes in tokens.")
@click.option("--tail", type=click.IntRange(1), default=64, show_default=True,
              help="New tokens after the restored prefix (computed behind the restore).")
@click.option("--ttft-repeats", type=click.IntRange(1), default=2, show_default=True)
@click.option("--throttle-mbps", default="", metavar="MBPS[,MBPS]",
              help="Also run on a loop-mounted directory throttled to this many MB/s (reads and writes, a "
                   "cgroup v1 blkio limit), e.g. 200 for an eMMC. Needs root.")
@click.option("--out", default="benchmarks/results", show_default=True, help=OUT_HELP)
def restore_cmd(data_dir, contexts, preset, layers, kv_bs, repeats, scan_files, scan_tokens, turns, ttft_models,
                ttft_layers, ttft_contexts, tail, ttft_repeats, throttle_mbps, out) -> None:
    """Save / cold restore / index scan of synthetic KV vs raw write+fsync and cold read; the write
    budget of a multi-turn conversation (delta vs full rewrite); restored TTFT sequential vs
    pipelined vs max(read, tail) and the cost gate's choices vs the alternatives measured, on
    --dir and on throttled directories."""
    ttft = TTFT([m for m in ttft_models.split(",") if m.strip()], ttft_layers, _ints(ttft_contexts), tail,
                ttft_repeats)
    rates = [float(x) for x in throttle_mbps.split(",") if x.strip()] if throttle_mbps else []
    run_restore(data_dir, _ints(contexts), preset, layers, kv_bs, repeats, scan_files, scan_tokens, out, turns,
                ttft, rates)


class TTFT(NamedTuple):
    models: list[str]
    layers: int = 4
    contexts: list[int] = [2048, 8192]
    tail: int = 64
    repeats: int = 2


def run_restore(data_dir, contexts, preset="qwen3-vl-2b", layers=None, kv_bs=DEFAULTS.kv_bs, repeats=3, scan_files=DEFAULTS.disk_kv_max_files,
                scan_tokens=None, out="benchmarks/results", turns=6, ttft: TTFT | None = None,
                throttle: list[float] = ()) -> Path:
    from edge_llm.bench import restore as B
    from edge_llm.bench import throttle as TH
    from edge_llm.bench.disk import new_results_dir
    from edge_llm.config import Geometry
    from edge_llm.settings import home_dir

    g = B.PRESETS[preset]
    if layers:
        g = Geometry(layers, g.n_kv_heads, g.head_dim)
    if throttle:
        try:
            TH.check_supported()
        except TH.ThrottleError as e:
            raise click.ClickException(str(e)) from None
    models = [bench_model(m, ttft.layers) for m in ttft.models] if ttft and ttft.models else []
    res_dir = new_results_dir(out, "restore")
    work = Path(data_dir) if data_dir else home_dir() / "bench"
    res: dict = {}
    with _progress() as prog, ExitStack() as stack:
        task = prog.add_task("restore bench", total=None)
        step = lambda msg: prog.update(task, description=msg)  # noqa: E731
        try:
            disks = [("disk", work / res_dir.name, None)]
            stack.callback(shutil.rmtree, work / res_dir.name, True)
            for rate in throttle:
                step(f"throttled directory at {rate:g} MB/s")
                size = TH.fs_size(g, max(contexts) if repeats else 0, models, ttft.contexts if ttft else [], kv_bs)
                probe = int(min(max(3 * rate * 1e6, 8 << 20), 256 << 20))  # ~3 s of raw I/O at the limit
                td = stack.enter_context(TH.throttled_dir(work, size, rate, probe))
                disks.append((f"throttled {rate:g} MB/s", td.path, td))
                res.setdefault("throttles", []).append(td.to_dict())  # raw I/O before and after the limit
            for label, path, td in disks:
                if repeats:
                    r = B.run(path / "restore", g, contexts, kv_bs=kv_bs, scan_files=scan_files,
                              scan_tokens=scan_tokens, repeats=repeats, progress=step)
                    if td is None:
                        res.update(r)
                    else:
                        res.setdefault("throttled", []).append({"label": label, "throttle": td.to_dict(), **r})
            if turns >= 2:
                from edge_llm.bench import conversation as C

                res["write_budget"] = C.write_budget(work / res_dir.name, g, kv_bs, min(contexts), max(contexts),
                                                     turns, step=step)
            if models:
                from edge_llm.bench import ttft as T

                tdisks = [T.Disk(label, path / "ttft", None if td is None else td.to_dict()["raw_after"])
                          for label, path, td in disks]
                res["ttft"] = T.run(models, tdisks, ttft.contexts, ttft.tail, ttft.repeats, kv_bs, step)
        except (OSError, MemoryError, TH.ThrottleError) as e:
            raise click.ClickException(str(e)) from None
    res["preset"], res["layers_reduced"] = preset, bool(layers)
    res["command"] = " ".join(sys.argv)
    md = B.markdown(res) if res.get("contexts") else ""
    if res.get("throttles"):
        md += "\n## Throttled directories (loop device, cgroup v1 blkio limit)\n\n" + TH.markdown(res["throttles"])
    for t in res.get("throttled", []):
        md += f"\n## {t['label']} (loop device, cgroup blkio limit)\n\n" + B.markdown(t)
    if "write_budget" in res:
        from edge_llm.bench import conversation as C

        md += "\n## Write budget of a conversation\n\n" + C.markdown(res["write_budget"])
    if "ttft" in res:
        from edge_llm.bench import ttft as T

        md += "\n## Restored TTFT and the cost gate\n\n" + T.markdown(res["ttft"])
    _save(res_dir, "restore", res, md)
    return res_dir


@bench.command("recovery")
@click.option("--model", default=DEFAULTS.model, show_default=True, help="HF model dir or 'default'.")
@click.option("--synth-layers", type=click.IntRange(1), default=None,
              help="Use a synthetic qwen3-vl-2b-geometry model with this many layers (made on first use).")
@click.option("--contexts", default="512,2048", show_default=True, help="Context sizes in tokens.")
@click.option("--max-tokens", type=click.IntRange(1), default=8, show_default=True)
@click.option("--ready-timeout", type=float, default=600.0, show_default=True)
@click.option("--restore-modes", default="sequential,pipelined", show_default=True,
              help="One S2 per mode on the same files (the last one fills the main table).")
@click.option("--out", default="benchmarks/results", show_default=True, help=OUT_HELP)
def recovery_cmd(model, synth_layers, contexts, max_tokens, ready_timeout, restore_modes, out) -> None:
    """S1 cold prefill + snapshot, kill, S2 restore + tail (sequential and pipelined): TTFT vs the
    disk's lower bound and vs max(read, tail)."""
    from edge_llm.settings import RESTORE_MODES

    modes = tuple(dict.fromkeys(m.strip() for m in restore_modes.split(",") if m.strip()))  # each once
    if not modes or any(m not in RESTORE_MODES for m in modes):
        raise click.BadParameter(f"choose from {', '.join(RESTORE_MODES)}", param_hint="--restore-modes")
    run_recovery(model, synth_layers, _ints(contexts), max_tokens, ready_timeout, out, modes)


def run_recovery(model, synth_layers, contexts, max_tokens=8, ready_timeout=600.0,
                 out="benchmarks/results", modes=("sequential", "pipelined")) -> Path:
    from edge_llm.bench import recovery as B
    from edge_llm.bench.disk import new_results_dir
    from edge_llm.config import ModelArgs
    from edge_llm.models.default import resolve_model_dir

    if synth_layers:
        model = str(synth_model(synth_layers))
    model_dir = Path(resolve_model_dir(model))
    from edge_llm.tokenizer import Tokenizer

    g = ModelArgs.from_dir(model_dir).geometry
    encode = Tokenizer.from_dir(model_dir).encode
    res_dir = new_results_dir(out, "bench-recovery")
    label = (f"synthetic qwen3-vl-2b geometry, {synth_layers} of 28 layers" if synth_layers
             else model_dir.name)
    res = {"model": model, "model_label": label, "max_tokens": max_tokens, "command": " ".join(sys.argv),
           "geometry": {"n_layers": g.n_layers, "n_kv_heads": g.n_kv_heads, "head_dim": g.head_dim,
                        "bytes_per_token": g.kv_bytes_per_token}, "rows": []}
    with _progress() as prog:
        task = prog.add_task("recovery bench", total=len(contexts))
        for ctx in contexts:
            try:
                row = B.run_context(model, g, ctx, res_dir, max_tokens, ready_timeout,
                                    step=lambda msg: prog.update(task, description=msg), encode=encode, modes=modes)
            except Exception as e:  # a failed context is reported, the others still run
                console.print(f"[red]context {ctx} failed: {e}[/red]")
                row = {"context": ctx, "error": str(e)}
            res["rows"].append(row)
            prog.advance(task)
    ok = [r for r in res["rows"] if "error" not in r]
    (res_dir / "recovery.json").write_text(json.dumps(res, indent=2) + "\n")
    md = B.markdown({**res, "rows": ok}) + "".join(
        f"\ncontext {r['context']} FAILED: {r['error']}\n" for r in res["rows"] if "error" in r)
    (res_dir / "recovery.md").write_text(md)
    if ok:
        B.plot({**res, "rows": ok}, res_dir / "recovery.png")
    _show(res_dir, md)
    if len(ok) != len(res["rows"]):
        raise click.ClickException("some contexts failed (see above)")
    return res_dir


@bench.command("split")
@click.option("--models", default="tiny,default", show_default=True,
              help="'tiny', 'default', 'synth' (--synth-layers) or model dirs, comma-separated.")
@click.option("--synth-layers", type=click.IntRange(1), default=4, show_default=True)
@click.option("--contexts", default="512,2048", show_default=True, help="History sizes in tokens.")
@click.option("--max-tokens", type=click.IntRange(1), default=32, show_default=True,
              help="Greedy tokens compared with the bitwise path.")
@click.option("--kv-bs", type=click.IntRange(1), default=DEFAULTS.kv_bs, show_default=True)
@click.option("--out", default="benchmarks/results", show_default=True, help=OUT_HELP)
def split_cmd(models, synth_layers, contexts, max_tokens, kv_bs, out) -> None:
    """Split mode's distance from the bitwise path: logit differences and greedy agreement when only
    the front of a snapshot is loaded and the rest recomputed."""
    from edge_llm.bench import split as SP
    from edge_llm.bench.disk import new_results_dir

    specs = [bench_model(m.strip(), synth_layers) for m in models.split(",") if m.strip()]
    res_dir = new_results_dir(out, "bench-split")
    with _progress() as prog:
        task = prog.add_task("split bench")
        res = SP.run(specs, _ints(contexts), max_tokens, kv_bs, lambda msg: prog.update(task, description=msg))
    res["command"] = " ".join(sys.argv)
    (res_dir / "split.json").write_text(json.dumps(res, indent=2) + "\n")
    md = SP.markdown(res)
    (res_dir / "split.md").write_text(md)
    _show(res_dir, md)


@bench.command("vision")
@click.option("--synth-layers", type=click.IntRange(1), default=4, show_default=True,
              help="Decoder layers of the synthetic Qwen3-VL-2B (its vision tower is always complete).")
@click.option("--sizes", default="224,448,896", show_default=True, help="Square image sides for the encoder table.")
@click.option("--e2e-size", type=click.IntRange(32), default=448, show_default=True,
              help="Image side of the end-to-end conversation (0 skips it).")
@click.option("--max-tokens", type=click.IntRange(1), default=8, show_default=True)
@click.option("--repeats", type=click.IntRange(1), default=2, show_default=True)
@click.option("--out", default="benchmarks/results", show_default=True, help=OUT_HELP)
def vision_cmd(synth_layers, sizes, e2e_size, max_tokens, repeats, out) -> None:
    """Vision encoder time per image size vs the sgemm roofline; image + question cold vs restored."""
    import os
    import platform
    import tempfile

    from threadpoolctl import threadpool_info

    from edge_llm.bench import vision as V
    from edge_llm.bench.disk import new_results_dir
    from edge_llm.config import ModelArgs
    from edge_llm.vision.model import VisionModel

    model_dir = synth_model(synth_layers, vision=True)
    res_dir = new_results_dir(out, "bench-vision")
    blas = ", ".join(f"{i.get('internal_api')} {i.get('architecture')} ({i.get('num_threads')} threads)"
                     for i in threadpool_info() if i.get("user_api") == "blas") or "unknown"
    res = {"label": "synthetic Qwen3-VL-2B vision tower (24 blocks, width 1024, DeepStack 5/11/17)",
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}",
           "blas": blas, "command": " ".join(sys.argv),
           "e2e_label": f"Qwen3-VL-2B geometry, {synth_layers} of 28 decoder layers"}
    with _progress() as prog:
        task = prog.add_task("vision bench")
        step = lambda msg: prog.update(task, description=msg)  # noqa: E731
        args = ModelArgs.from_dir(model_dir)
        vision = VisionModel.load(model_dir, args)
        res["encoder"], res["peak_gflops"] = V.encoder_rows(vision, _ints(sizes), repeats, step)
        del vision
        if e2e_size:
            with tempfile.TemporaryDirectory(dir=res_dir) as kv:
                res["e2e"] = V.end_to_end(model_dir, Path(kv), e2e_size, max_tokens, step)
    (res_dir / "vision.json").write_text(json.dumps(res, indent=2) + "\n")
    md = V.markdown(res)
    (res_dir / "vision.md").write_text(md)
    _show(res_dir, md)


def compute_script() -> Path | None:
    """tools/bench_compute.py of the source checkout this package runs from, if any."""
    path = Path(__file__).resolve().parents[2] / "tools" / "bench_compute.py"
    return path if path.is_file() else None


@bench.command("compute", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def compute_cmd(args) -> None:
    """Prefill/decode speed vs roofline: runs tools/bench_compute.py ARGS (source checkout only)."""
    run_compute(list(args))


def run_compute(args: list[str]) -> None:
    script = compute_script()
    if script is None:
        raise click.ClickException("bench compute needs a source checkout (tools/bench_compute.py not found)")
    r = subprocess.run([sys.executable, str(script), *args])
    if r.returncode != 0:
        raise click.ClickException(f"{script.name} exited with code {r.returncode}")


@bench.command("all")
@click.option("--synth-layers", type=click.IntRange(1), default=None,
              help="Recovery on the synthetic qwen3-vl-2b geometry with N layers (contexts 2048,8192).")
@click.option("--contexts", default=None, help="Recovery contexts.  [default: 512,2048; 2048,8192 with "
              "--synth-layers]")
@click.option("--out", default="benchmarks/results", show_default=True, help=OUT_HELP)
def all_cmd(synth_layers, contexts, out) -> None:
    """What `make bench` runs: restore (2K, 8K), recovery (default model, small contexts), compute."""
    ctx = _ints(contexts) if contexts else ([2048, 8192] if synth_layers else [512, 2048])
    run_restore(None, [2048, 8192], out=out, ttft=TTFT(["synth"]))
    run_recovery("default", synth_layers, ctx, out=out)
    if compute_script() is not None:
        run_compute(["--layers", str(synth_layers or 4)])
    else:
        console.print("bench compute skipped: tools/bench_compute.py needs a source checkout")
    from edge_llm.bench.quant import peer_python

    if peer_python() is not None:
        run_quant(list(_QUANT_LENGTHS), out=out)
        run_quant_memory(out=out)
    else:
        console.print("bench quant skipped: no llama.cpp venv (tools/setup-bench-llamacpp.sh; `make bench` runs it)")


@bench.command("quant")
@click.option("--lengths", default="512,2048,4000", show_default=True, help="Context lengths in tokens.")
@click.option("--threads", type=click.IntRange(1), default=2, show_default=True,
              help="Threads of cpu-q and of llama.cpp (the F32 backend uses the BLAS default).")
@click.option("--repeats", type=click.IntRange(1), default=2, show_default=True)
@click.option("--decode", type=click.IntRange(1), default=32, show_default=True, help="Decode steps per context.")
@click.option("--tail", type=click.IntRange(1), default=32, show_default=True, help="Tokens after a restore.")
@click.option("--no-f32", is_flag=True, help="Leave the F32 backend out of the speed table (faster).")
@click.option("--llamacpp-python", default=None, metavar="PATH",
              help="Python of the llama.cpp venv.  [default: $EDGE_LLM_LLAMACPP_PYTHON, else .venv-llamacpp]")
@click.option("--out", default="benchmarks/results", show_default=True, help=OUT_HELP)
def quant_cmd(lengths, threads, repeats, decode, tail, no_f32, llamacpp_python, out) -> None:
    """cpu-q vs the F32 backend and llama.cpp on the default model's GGUF, in one run: prefill,
    decode, restore+tail, decode vs the bandwidth roofline, perplexity / KL / greedy agreement."""
    run_quant(_ints(lengths), threads, repeats, decode, tail, not no_f32, llamacpp_python, out)


def run_quant(lengths, threads=2, repeats=2, decode=32, tail=32, f32=True, llamacpp_python=None,
              out="benchmarks/results") -> Path:
    import os

    from edge_llm.bench import quant as B
    from edge_llm.bench.disk import new_results_dir

    res_dir = new_results_dir(out, "bench-quant")
    with _progress() as prog:
        task = prog.add_task("quant bench", total=None)
        try:
            res = B.run(lengths, threads, repeats, decode, tail, f32, llamacpp_python,
                        step=lambda msg: prog.update(task, description=msg))
        except RuntimeError as e:
            raise click.ClickException(str(e)) from None
    res["command"] = " ".join(sys.argv)
    res["env"] = {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    md = B.markdown(res)
    _save(res_dir, "quant", res, md)
    return res_dir


@bench.command("quant-memory")
@click.option("--model", "model_dir", default=None, metavar="DIR",
              help="Model directory.  [default: a synthetic qwen3-vl-2b checkpoint with --layers layers]")
@click.option("--layers", type=click.IntRange(1), default=28, show_default=True)
@click.option("--max-seq", type=click.IntRange(1), default=8192, show_default=True)
@click.option("--out", default="benchmarks/results", show_default=True, help=OUT_HELP)
def quant_memory_cmd(model_dir, layers, max_seq, out) -> None:
    """Peak RSS of backend cpu-q serving the Qwen3-VL-2B geometry with an 8K cache vs an 8 GB board."""
    run_quant_memory(model_dir, layers, max_seq, out)


def run_quant_memory(model_dir=None, layers=28, max_seq=8192, out="benchmarks/results") -> Path:
    from edge_llm.bench import quant_memory as B
    from edge_llm.bench.disk import new_results_dir

    res_dir = new_results_dir(out, "bench-quant-memory")
    with _progress() as prog:
        task = prog.add_task("quant memory", total=None)
        res = B.run(Path(model_dir) if model_dir else None, layers, max_seq,
                    step=lambda msg: prog.update(task, description=msg))
    res["command"] = " ".join(sys.argv)
    md = B.markdown(res)
    _save(res_dir, "quant-memory", res, md)
    return res_dir


@bench.command("npu")
@click.option("--model", "model", required=True, help="HF model directory the graphs were converted from.")
@click.option("--rknn-dir", required=True, metavar="DIR", help="`edge-llm convert rknn` output directory.")
@click.option("--runner", type=click.Choice(["rknnlite", "sim", "onnxruntime"]), default="rknnlite",
              show_default=True, help="sim / onnxruntime: run the same measurements on a host (not NPU numbers).")
@click.option("--repeats", type=click.IntRange(1), default=10, show_default=True)
@click.option("--prefill-tokens", type=click.IntRange(1), default=256, show_default=True)
@click.option("--decode-steps", type=click.IntRange(1), default=32, show_default=True)
@click.option("--out", default="benchmarks/results", show_default=True, help=OUT_HELP)
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
    with _progress() as prog:
        task = prog.add_task("npu bench", total=None)
        try:
            res = B.run(model, rknn_dir, runner, repeats, prefill_tokens, decode_steps,
                        step=lambda msg: prog.update(task, description=msg))
        except EdgeLLMError as e:
            raise click.ClickException(str(e)) from None
    res["command"] = " ".join(sys.argv)
    md = B.markdown(res)
    _save(res_dir, "npu", res, md)
