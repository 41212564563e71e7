"""`edge-llm bench recovery`: the lab's S1/S2 experiment with real server processes.

Per context: S1 (fresh kv dir) prefills history + question from scratch and publishes a snapshot;
S1 is killed (SIGKILL) and the snapshot's pages are dropped from the page cache; S2 starts, indexes the snapshot, and gets history + a follow-up: the prefix
comes back from disk and only the tail is prefilled. The lower bound for S2's TTFT is
restore_bytes / (raw cold-read bandwidth of the same directory) + the tail's prefill time.
"""

from __future__ import annotations

import logging
import shutil
import signal
from pathlib import Path

from edge_llm.bench import client as S
from edge_llm.bench.disk import MB, drop_file_cache, measure_raw
from edge_llm.bench.prompts import FOLLOW_UP, QUESTION, history, sized_history
from edge_llm.settings import DEFAULTS

log = logging.getLogger(__name__)

HEADROOM = 64  # tokens left free below the context size for the question/follow-up + answer


def _snapshot_formula(geometry, n: int, kv_bs: int) -> int:
    """docs/snapshot-format.md: 64 + 4n + 2*L*n*kv_dim*4 + 8*L*ceil(n/kv_bs)."""
    return 64 + 4 * n + n * geometry.kv_bytes_per_token + 8 * geometry.n_layers * -(-n // kv_bs)


def run_context(model: str, geometry, ctx: int, work: Path, max_tokens: int, ready_timeout: float,
                kv_bs: int = DEFAULTS.kv_bs, step=lambda _m: None, encode=None) -> dict:
    """One context size: S1 cold + snapshot, kill, S2 restore + tail. Returns the row.

    `encode` (the model's tokenizer) sizes the history to ctx - HEADROOM tokens exactly enough.
    """
    kv_dir, log_file = work / f"kv-{ctx}", work / f"server-{ctx}.log"
    target = max(16, ctx - HEADROOM)
    nonce = f"Bench {ctx}"
    prompt = sized_history(encode, target, nonce) if encode else history(target, nonce)
    extra = ["--kv-bs", str(kv_bs), "--max-seq", str(max(ctx, 256))]
    srv = S.LocalServer(model, kv_dir, log_file, extra_args=extra, stderr_file=work / f"server-{ctx}.stderr")
    row: dict = {"context": ctx}
    try:
        step(f"{ctx}: S1 start")
        srv.start()
        row["s1_ready_s"] = S.wait_ready(srv.base_url, ready_timeout, srv.proc, stderr_file=srv.stderr_file)
        step(f"{ctx}: S1 cold prefill")
        mark = S.log_offset(log_file)
        cold = S.complete(srv.base_url, prompt + QUESTION, max_tokens)
        saved = S.wait_for_line(log_file, mark, S.SAVED_RE, 3600)
        if saved is None:
            raise RuntimeError(f"S1 wrote no snapshot (no [KV-DISK] saved line in {log_file})")
        step(f"{ctx}: kill S1, start S2")
        srv.stop(signal.SIGKILL)
        # as after a power cut: S2 reads the snapshot from the device, not from S1's page cache
        for snap in kv_dir.rglob("*.kv"):
            drop_file_cache(snap)
        mark = S.log_offset(log_file)
        srv.start()
        row["s2_ready_s"] = S.wait_ready(srv.base_url, ready_timeout, srv.proc, stderr_file=srv.stderr_file)
        step(f"{ctx}: S2 restore + tail")
        warm = S.complete(srv.base_url, prompt + FOLLOW_UP, max_tokens)
        text = S.read_since(log_file, mark)
        loaded, pre = S.LOADED_RE.search(text), S.PREFILL_RE.findall(text)
    finally:
        srv.stop(signal.SIGTERM)
    snap_bytes, snap_tokens = int(saved[3]), int(saved[1])
    step(f"{ctx}: raw disk bandwidth ({snap_bytes / MB:.0f} MB)")
    raw = measure_raw(kv_dir, snap_bytes)
    shutil.rmtree(kv_dir, ignore_errors=True)
    t = warm.timings
    restore_s = t.get("restore_ms", 0) / 1e3
    bound_ms = t.get("restore_bytes", 0) / MB / raw.read.mb_s * 1e3 + t.get("prefill_ms", 0)
    row.update({
        "prompt_tokens_s1": cold.prompt_tokens, "prompt_tokens_s2": warm.prompt_tokens,
        "cold_ttft_ms": cold.timings.get("ttft_ms"), "restored_ttft_ms": t.get("ttft_ms"),
        "speedup": cold.timings["ttft_ms"] / t["ttft_ms"] if t.get("ttft_ms") else None,
        "snapshot_tokens": snap_tokens, "snapshot_bytes": snap_bytes,
        "formula_bytes": _snapshot_formula(geometry, snap_tokens, kv_bs),
        "save_ms": float(saved[4]), "save_mb_s": float(saved[5]),
        "cache_source": t.get("cache_source"), "cached_tokens": warm.cached_tokens,
        "disk_read_line": bool(loaded), "restore_ms": t.get("restore_ms"), "restore_bytes": t.get("restore_bytes"),
        "restore_mb_s": t.get("restore_bytes", 0) / MB / restore_s if restore_s else None,
        "tail_tokens": t.get("prefill_tokens"), "tail_prefill_ms": t.get("prefill_ms"),
        "prefill_timing_n": int(pre[-1][0]) if pre else None,
        "raw_write_mb_s": raw.write.mb_s, "raw_cold_read_mb_s": raw.read.mb_s,
        "lower_bound_ms": bound_ms, "restored_vs_bound": t["ttft_ms"] / bound_ms if bound_ms else None,
    })
    log.info("bench recovery %d: cold %.0f ms, restored %.0f ms (bound %.0f ms)", ctx,
             row["cold_ttft_ms"], row["restored_ttft_ms"], bound_ms)
    return row


def markdown(res: dict) -> str:
    g = res["geometry"]
    lines = [f"Model: `{res['model']}` ({g['n_layers']} layers x {g['n_kv_heads']} KV heads x {g['head_dim']} "
             f"dims = {g['bytes_per_token']:,} B/token of F32 KV), {res['max_tokens']} generated tokens.", "",
             "| context | S1 prompt | cold TTFT ms | S2 prompt | restored TTFT ms | speed-up | snapshot bytes "
             "(formula) | save ms (MB/s) | restore ms (MB/s) | raw cold read MB/s | tail tokens | tail prefill ms "
             "| lower bound ms | restored / bound |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        ok = "=" if r["snapshot_bytes"] == r["formula_bytes"] else "!="
        lines.append(
            f"| {r['context']} | {r['prompt_tokens_s1']} | {r['cold_ttft_ms']:.0f} | {r['prompt_tokens_s2']} "
            f"| {r['restored_ttft_ms']:.0f} | {r['speedup']:.1f}x | {r['snapshot_bytes']:,} ({ok}) "
            f"| {r['save_ms']:.0f} ({r['save_mb_s']:.0f}) | {r['restore_ms']:.0f} ({r['restore_mb_s'] or 0:.0f}) "
            f"| {r['raw_cold_read_mb_s']:.0f} | {r['tail_tokens']} | {r['tail_prefill_ms']:.0f} "
            f"| {r['lower_bound_ms']:.0f} | {r['restored_vs_bound']:.2f} |")
    lines += ["", "Lower bound = restore_bytes / raw cold-read bandwidth of the kv directory (measured in the "
              "same run, page cache dropped) + the tail's prefill time. S1 is killed with SIGKILL after its "
              "`[KV-DISK] saved` line and the snapshot's pages are dropped from the page cache (as after a "
              "power cut); S2 is a new process that reads it from the device."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = res["rows"]
    x = [r["prompt_tokens_s2"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(x, [r["cold_ttft_ms"] / 1e3 for r in rows], "o-", label="cold (full prefill)")
    ax.plot(x, [r["restored_ttft_ms"] / 1e3 for r in rows], "s-", label="restored after restart")
    ax.plot(x, [r["lower_bound_ms"] / 1e3 for r in rows], "^--", label="lower bound (disk read + tail)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(x, [str(v) for v in x])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("context tokens")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"Restart recovery: {res['model_label']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
