"""`edge-llm bench restore`: snapshot save/restore vs raw disk, write budget, restored TTFT and the cost gate."""

from __future__ import annotations

import shutil
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import click

from edge_llm.bench.models import bench_model
from edge_llm.cli.bench.common import bench, int_list, out_option, save_results, spinner
from edge_llm.settings import DEFAULTS


@bench.command("restore")
@click.option("--dir", "data_dir", default=None, metavar="DIR",
              help="Where snapshots are written (the kv filesystem).  [default: $EDGE_LLM_HOME/bench]")
@click.option("--contexts", default="2048,8192", show_default=True, help="Snapshot sizes in tokens.")
@click.option("--preset", type=click.Choice(["qwen3-vl-2b"]), default="qwen3-vl-2b", show_default=True,
              help="The KV geometry of the snapshots written.")
@click.option("--layers", type=click.IntRange(1), default=None, help="Fewer layers than the preset's.")
@click.option("--kv-bs", type=click.IntRange(1), default=DEFAULTS.kv_bs, show_default=True,
              help="KV rows per snapshot block (the unit of CRC checks and partial restore).")
@click.option("--repeats", type=click.IntRange(0), default=3, show_default=True,
              help="Save/restore repeats per context (0: only the write budget).")
@click.option("--scan-files", type=click.IntRange(1), default=DEFAULTS.disk_kv_max_files, show_default=True,
              help="Snapshots written for the start-up scan's timing (the store's file cap by default).")
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
@click.option("--ttft-repeats", type=click.IntRange(1), default=2, show_default=True,
              help="Restores per mode and context for the TTFT table, in rotation.")
@click.option("--throttle-mbps", default="", metavar="MBPS[,MBPS]",
              help="Also run on a loop-mounted directory throttled to this many MB/s (reads and writes, a "
                   "cgroup v1 blkio limit), e.g. 200 for an eMMC. Needs root.")
@out_option
def restore_cmd(data_dir, contexts, preset, layers, kv_bs, repeats, scan_files, scan_tokens, turns, ttft_models,
                ttft_layers, ttft_contexts, tail, ttft_repeats, throttle_mbps, out) -> None:
    """Save / cold restore / index scan of synthetic KV vs raw write+fsync and cold read; the write
    budget of a multi-turn conversation (delta vs full rewrite); restored TTFT sequential vs
    pipelined vs max(read, tail) and the cost gate's choices vs the alternatives measured, on
    --dir and on throttled directories."""
    ttft = TTFT([m for m in ttft_models.split(",") if m.strip()], ttft_layers, int_list(ttft_contexts), tail,
                ttft_repeats)
    rates = [float(x) for x in throttle_mbps.split(",") if x.strip()] if throttle_mbps else []
    run_restore(data_dir, int_list(contexts), preset, layers, kv_bs, repeats, scan_files, scan_tokens, out, turns,
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
    with spinner() as prog, ExitStack() as stack:
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
    save_results(res_dir, "restore", res, md)
    return res_dir


