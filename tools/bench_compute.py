"""Prefill / decode speed of the numpy decoder next to this machine's own limits.

    python tools/bench_compute.py --layers 4 [--prompt 512] [--decode 32] [--model DIR]

Writes a synthetic Qwen3-VL-2B-geometry checkpoint (BF16, random weights, N layers) in a child
process (so its memory does not count in our peak RSS), loads it, and measures:
  * prefill tok/s vs a roofline = the same matmul shapes timed back to back (pure sgemm time)
  * decode tok/s vs memory read bandwidth (bytes streamed per token / best read GB/s)
  * peak RSS vs F32 weights + KV cache, and which BLAS library/kernel ran (threadpoolctl).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from threadpoolctl import threadpool_info

from edge_llm.bench.quant import best_of
from edge_llm.models.qwen3 import Model


def read_bandwidth(nbytes: int = 1 << 30) -> dict[str, float]:
    """GB/s of streaming reads (sum on 1 and 2 threads, BLAS sdot, BLAS sgemv over a 1 GiB
    matrix: the way decode streams weights) and of a copy (read + write)."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    halves = np.array_split(a, 2)
    mat = a.reshape(-1, 4096)
    vec = np.ones((1, mat.shape[0]), dtype=np.float32)
    with ThreadPoolExecutor(2) as ex:
        res = {
            "sum, 1 thread": nbytes / best_of(lambda: a.sum()) / 1e9,
            "sum, 2 threads": nbytes / best_of(lambda: list(ex.map(np.sum, halves))) / 1e9,
            "BLAS sdot": nbytes / best_of(lambda: np.dot(a, a)) / 1e9,
            "BLAS sgemv (1 GiB matrix)": nbytes / best_of(lambda: vec @ mat) / 1e9,
        }
        out = np.empty_like(a)
        res["copy (read+write)"] = 2 * nbytes / best_of(lambda: np.copyto(out, a)) / 1e9
    return res


def matmul_roofline(model: Model, chunk: int, n_tokens: int) -> tuple[float, float, list]:
    """Seconds the dense prefill matmuls take alone at the chunk shape, and their FLOPs."""
    be = model.backend
    L0 = be.layers[0]
    rng = np.random.default_rng(0)
    rows = []
    total_t = total_f = 0.0
    n_layers, n_chunks = len(be.layers), -(-n_tokens // chunk)
    for name, w in (("qkv", L0.w_qkv), ("o_proj", L0.w_o), ("gate+up", L0.w_gu), ("down", L0.w_down)):
        x = rng.standard_normal((chunk, w.shape[0]), dtype=np.float32)
        t = best_of(lambda: x @ w)
        flops = 2.0 * chunk * w.shape[0] * w.shape[1]
        rows.append((f"{name} ({chunk}x{w.shape[0]} @ {w.shape[0]}x{w.shape[1]})", flops / t / 1e9))
        total_t += t * n_layers * n_chunks
        total_f += flops * n_layers * n_chunks
    x1 = rng.standard_normal((1, be.lm_head.shape[1]), dtype=np.float32)
    t = best_of(lambda: x1 @ be.lm_head.T, reps=3)  # logits of the last prompt token only
    rows.append((f"lm_head (1x{be.lm_head.shape[1]} @ {be.lm_head.shape[1]}x{be.lm_head.shape[0]})",
                 2.0 * be.lm_head.size / t / 1e9))
    return total_t + t, total_f + 2.0 * be.lm_head.size, rows


def synth(out: Path, layers: int) -> None:
    from edge_llm.checkpoints.synth import synth_checkpoint

    synth_checkpoint(out, preset="qwen3-vl-2b", layers=layers)


def peak_rss_bytes() -> int:
    """Peak RSS of this process image. VmHWM belongs to the address space; ru_maxrss survives
    exec on Linux, so a child of a big parent would report the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512, help="prefill tokens")
    ap.add_argument("--decode", type=int, default=32, help="decode steps")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2, help="timed runs per phase (best counts)")
    ap.add_argument("--model", type=Path, help="use this checkpoint instead of a synthetic one")
    args = ap.parse_args(argv)
    console = Console()

    with tempfile.TemporaryDirectory(prefix="edge-llm-bench-") as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = Path(tmp) / "synth"
            console.print(f"writing synthetic qwen3-vl-2b checkpoint with {args.layers} layers ...")
            proc = mp.get_context("spawn").Process(target=synth, args=(model_dir, args.layers))
            proc.start()
            proc.join()
            if proc.exitcode != 0:
                console.print("[red]synthetic checkpoint failed[/red]")
                return 1
        t0 = time.perf_counter()
        model = Model.load(model_dir)
        load_s = time.perf_counter() - t0
    a = model.args
    max_seq = args.prompt + args.decode
    cache = model.new_cache(max_seq)
    prompt = np.random.default_rng(1).integers(0, a.vocab_size, args.prompt)

    # warm-up on a throwaway cache pages in every weight once; then the timed runs. The machine
    # may be shared: each phase runs --repeat times and the best run counts (as for the limits)
    model.prefill(prompt[: args.chunk], model.new_cache(args.chunk, check_memory=False), chunk=args.chunk)
    prefill_s = decode_s = float("inf")
    for _ in range(args.repeat):
        cache.reset()
        t0 = time.perf_counter()
        logits = model.prefill(prompt, cache, chunk=args.chunk)
        prefill_s = min(prefill_s, time.perf_counter() - t0)
        tok = int(np.argmax(logits))
        t0 = time.perf_counter()
        for _ in range(args.decode):
            tok = int(np.argmax(model.forward([tok], cache)))
        decode_s = min(decode_s, time.perf_counter() - t0)
    rss = peak_rss_bytes()
    load_before = os.getloadavg()[0]

    roof_s, dense_flops, mm_rows = matmul_roofline(model, args.chunk, args.prompt)
    bw = read_bandwidth()
    read_gbs = max(v for k, v in bw.items() if not k.startswith("copy"))
    be = model.backend
    wbytes = be.nbytes
    # decode streams every weight once per token (tied lm_head counted once) plus the KV rows read
    mid = args.prompt + args.decode // 2
    kv_read = 2 * a.num_hidden_layers * mid * a.kv_dim * 4
    decode_bytes = wbytes - be.embed_tokens.nbytes + be.lm_head.nbytes + kv_read
    if not a.tie_word_embeddings:
        decode_bytes -= be.lm_head.nbytes  # already in wbytes
    prefill_tps, decode_tps = args.prompt / prefill_s, args.decode / decode_s
    roof_tps = args.prompt / roof_s
    decode_gbs = decode_bytes * decode_tps / 1e9
    kv_bytes = cache.nbytes

    t = Table(title=f"edge-llm compute benchmark: qwen3-vl-2b geometry, {a.num_hidden_layers} layers, "
                    f"backend {be.numerics}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("weights (F32 in RAM)", f"{wbytes / 2**20:.0f} MiB (loaded in {load_s:.1f} s)")
    t.add_row("KV cache allocated", f"{kv_bytes / 2**20:.0f} MiB ({max_seq} rows)")
    t.add_row(f"prefill {args.prompt} tok (chunk {args.chunk})", f"{prefill_tps:.1f} tok/s ({prefill_s:.2f} s)")
    t.add_row("prefill roofline (same matmuls alone)", f"{roof_tps:.1f} tok/s")
    t.add_row("prefill achieved dense GFLOP/s", f"{dense_flops / prefill_s / 1e9:.1f}")
    t.add_row("[bold]prefill / roofline[/bold]", f"[bold]{prefill_tps / roof_tps:.0%}[/bold]")
    for name, gf in mm_rows:
        t.add_row(f"  sgemm {name}", f"{gf:.1f} GFLOP/s")
    t.add_row(f"decode {args.decode} tok at ctx ~{mid}", f"{decode_tps:.2f} tok/s")
    t.add_row("decode bytes/token (weights + KV read)", f"{decode_bytes / 1e6:.0f} MB")
    t.add_row("decode achieved read GB/s", f"{decode_gbs:.2f}")
    for name, v in bw.items():
        t.add_row(f"  memory: {name}", f"{v:.2f} GB/s")
    t.add_row("decode roofline (bytes / best read GB/s)", f"{read_gbs * 1e9 / decode_bytes:.2f} tok/s")
    t.add_row("[bold]decode / bandwidth[/bold]", f"[bold]{decode_gbs / read_gbs:.0%}[/bold]")
    t.add_row("peak RSS", f"{rss / 2**20:.0f} MiB")
    t.add_row("[bold]peak RSS / (weights + KV)[/bold]", f"[bold]{rss / (wbytes + kv_bytes):.2f}[/bold]")
    for info in threadpool_info():
        if info.get("user_api") == "blas":
            t.add_row("BLAS", f"{info.get('internal_api')} {info.get('version')} "
                              f"{info.get('architecture', '')} threads={info.get('num_threads')}")
    t.add_row("load average (1 min) before / after limits",
              f"{load_before:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    console.print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
