"""`edge-llm bench recovery` (S1/S2 restart recovery) and `bench split` (split mode's distance)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from edge_llm.bench.models import bench_model, synth_model
from edge_llm.cli.bench.common import (
    bench,
    console,
    int_list,
    out_option,
    show_results,
    spinner,
)
from edge_llm.settings import DEFAULTS


@bench.command("recovery")
@click.option("--model", default=DEFAULTS.model, show_default=True, help="HF model dir or 'default'.")
@click.option("--synth-layers", type=click.IntRange(1), default=None,
              help="Use a synthetic qwen3-vl-2b-geometry model with this many layers (made on first use).")
@click.option("--contexts", default="512,2048", show_default=True, help="Context sizes in tokens.")
@click.option("--max-tokens", type=click.IntRange(1), default=8, show_default=True,
              help="Greedy tokens per answer.")
@click.option("--ready-timeout", type=float, default=600.0, show_default=True,
              help="Seconds a server may take to become ready before the run fails.")
@click.option("--restore-modes", default="sequential,pipelined", show_default=True,
              help="One S2 per mode on the same files (the last one fills the main table).")
@click.option("--prefetch", is_flag=True,
              help="Also two S2 with disk_kv_prefetch = latest: the follow-up once the prefetch finished, "
                   "and sent at once (it joins the read).")
@click.option("--throttle-mbps", type=click.FloatRange(min=0, min_open=True), default=None, metavar="MBPS",
              help="Keep the kv directories on a loop device throttled to this many MB/s, reads and writes "
                   "(needs root and the cgroup v1 blkio controller; see `bench restore --throttle-mbps`).")
@click.option("--repeats", type=click.IntRange(1), default=1, show_default=True,
              help="S2 processes per mode on the same files, round robin; the median is reported.")
@out_option
def recovery_cmd(model, synth_layers, contexts, max_tokens, ready_timeout, restore_modes, prefetch, throttle_mbps,
                 repeats, out) -> None:
    """S1 cold prefill + snapshot, kill, S2 restore + tail (sequential and pipelined): TTFT vs the
    disk's lower bound and vs max(read, tail); with --prefetch, against the start-up prefetch."""
    from edge_llm.settings import RESTORE_MODES

    modes = tuple(dict.fromkeys(m.strip() for m in restore_modes.split(",") if m.strip()))  # each once
    if not modes or any(m not in RESTORE_MODES for m in modes):
        raise click.BadParameter(f"choose from {', '.join(RESTORE_MODES)}", param_hint="--restore-modes")
    run_recovery(model, synth_layers, int_list(contexts), max_tokens, ready_timeout, out, modes, prefetch,
                 throttle_mbps, repeats)


def run_recovery(model, synth_layers, contexts, max_tokens=8, ready_timeout=600.0,
                 out="benchmarks/results", modes=("sequential", "pipelined"), prefetch=False,
                 throttle_mbps: float | None = None, repeats: int = 1) -> Path:
    from contextlib import ExitStack

    from edge_llm.bench import recovery as B
    from edge_llm.bench import throttle as TH
    from edge_llm.bench.disk import new_results_dir
    from edge_llm.checkpoints.default import resolve_model_dir
    from edge_llm.config import ModelArgs

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
    with spinner() as prog, ExitStack() as stack:
        task = prog.add_task("recovery bench", total=len(contexts))
        kv_parent = None
        if throttle_mbps:
            from edge_llm.snapshot.format import snapshot_size

            prog.update(task, description=f"throttled directory at {throttle_mbps:g} MB/s")
            size = 3 * sum(snapshot_size(g.n_layers, n, g.kv_dim, DEFAULTS.kv_bs) for n in contexts) + (512 << 20)
            try:
                td = stack.enter_context(TH.throttled_dir(res_dir, size, throttle_mbps))
            except (OSError, TH.ThrottleError) as e:
                raise click.ClickException(str(e)) from None
            kv_parent, res["throttle"] = td.path, td.to_dict()
        for ctx in contexts:
            try:
                row = B.run_context(model, g, ctx, res_dir, max_tokens, ready_timeout,
                                    step=lambda msg: prog.update(task, description=msg), encode=encode, modes=modes,
                                    prefetch=prefetch, kv_parent=kv_parent, repeats=repeats)
            except Exception as e:  # a failed context is reported, the others still run
                console.print(f"[red]context {ctx} failed: {e}[/red]")
                row = {"context": ctx, "error": str(e)}
            res["rows"].append(row)
            prog.advance(task)
    ok = [r for r in res["rows"] if "error" not in r]
    (res_dir / "recovery.json").write_text(json.dumps(res, indent=2) + "\n")
    md = B.markdown({**res, "rows": ok}) + (
        f"\nkv directories on a loop device throttled to {throttle_mbps:g} MB/s:\n\n" + TH.markdown([res["throttle"]])
        if "throttle" in res else "") + "".join(
        f"\ncontext {r['context']} FAILED: {r['error']}\n" for r in res["rows"] if "error" in r)
    (res_dir / "recovery.md").write_text(md)
    if ok:
        B.plot({**res, "rows": ok}, res_dir / "recovery.png")
    show_results(res_dir, md)
    if len(ok) != len(res["rows"]):
        raise click.ClickException("some contexts failed (see above)")
    return res_dir


@bench.command("split")
@click.option("--models", default="tiny,default", show_default=True,
              help="'tiny', 'default', 'synth' (--synth-layers) or model dirs, comma-separated.")
@click.option("--synth-layers", type=click.IntRange(1), default=4, show_default=True,
              help="Decoder layers of the 'synth' model (Qwen3-VL-2B geometry).")
@click.option("--contexts", default="512,2048", show_default=True, help="History sizes in tokens.")
@click.option("--max-tokens", type=click.IntRange(1), default=32, show_default=True,
              help="Greedy tokens compared with the bitwise path.")
@click.option("--kv-bs", type=click.IntRange(1), default=DEFAULTS.kv_bs, show_default=True,
              help="KV rows per snapshot block (the unit split mode loads or recomputes).")
@out_option
def split_cmd(models, synth_layers, contexts, max_tokens, kv_bs, out) -> None:
    """Split mode's distance from the bitwise path: logit differences and greedy agreement when only
    the front of a snapshot is loaded and the rest recomputed."""
    from edge_llm.bench import split as SP
    from edge_llm.bench.disk import new_results_dir

    specs = [bench_model(m.strip(), synth_layers) for m in models.split(",") if m.strip()]
    res_dir = new_results_dir(out, "bench-split")
    with spinner() as prog:
        task = prog.add_task("split bench")
        res = SP.run(specs, int_list(contexts), max_tokens, kv_bs, lambda msg: prog.update(task, description=msg))
    res["command"] = " ".join(sys.argv)
    (res_dir / "split.json").write_text(json.dumps(res, indent=2) + "\n")
    md = SP.markdown(res)
    (res_dir / "split.md").write_text(md)
    show_results(res_dir, md)


