"""`edge-llm bench recovery`: the lab's S1/S2 experiment with real server processes.

Per context: S1 (fresh kv dir) prefills history + question from scratch and publishes a snapshot;
S1 is killed (SIGKILL). Then, once per restore mode (`--restore-modes`, default sequential and
pipelined), the kv dir is put back to exactly the files S1 left, their pages are dropped from the
page cache, and a new S2 process started with `--disk-kv-restore MODE` gets history + a follow-up:
the prefix comes back from disk and only the tail is prefilled. The sequential S2 gives the read
time and the tail's prefill time apart; their sum is what sequential pays and max(read, tail) is
the bound the pipelined S2 approaches. The lower bound at the raw disk is restore_bytes / (raw
cold-read bandwidth of the same directory) + the tail's prefill time. The cost gate's decision is
reported as S2 made it (a fresh process has no estimates yet: `unmeasured`, it restores).

`--prefetch` adds two S2 processes with `disk_kv_prefetch = "latest"` on the same files: `after`
sends the follow-up once the prefetch has put the rows in RAM (the `is in RAM` line), `join`
sends it as soon as the server is ready, so it joins the read in flight. TTFT is then measured
from the request's arrival at the client (`wall_ms - decode_ms`: a joined request's wait for
the read is queue time, which the server's own `ttft_ms` does not count), for every S2 alike.
`--throttle-mbps` puts the kv directories on a throttled loop device (`throttle.py`).
"""

from __future__ import annotations

import logging
import re
import shutil
import signal
import time
from pathlib import Path

from edge_llm.bench import client as S
from edge_llm.bench.disk import MB, drop_file_cache, measure_raw
from edge_llm.bench.prompts import FOLLOW_UP, QUESTION, history, sized_history
from edge_llm.costgate import PIPELINED, SEQUENTIAL
from edge_llm.settings import DEFAULTS

log = logging.getLogger(__name__)

HEADROOM = 64  # tokens left free below the context size for the question/follow-up + answer
AFTER, JOIN = "prefetch-after", "prefetch-join"  # the S2 runs of --prefetch (module docstring)
IN_RAM_RE = re.compile(r"\[KV-DISK\] prefetch: (\d+)-token KV prefix of \S+ is in RAM \((\d+) ms\)")


def _snapshot_formula(geometry, n: int, kv_bs: int) -> int:
    """docs/snapshot-format.md: 64 + 4n + 2*L*n*kv_dim*4 + 8*L*ceil(n/kv_bs)."""
    return 64 + 4 * n + n * geometry.kv_bytes_per_token + 8 * geometry.n_layers * -(-n // kv_bs)


def _s2(model: str, kv_dir: Path, saved: Path, work: Path, ctx: int, mode: str, extra: list[str], prompt: str,
        max_tokens: int, ready_timeout: float, step) -> dict:
    """Put back S1's files, drop their pages, start S2 with `mode` (a restore mode, or AFTER / JOIN:
    prefetch on), send history + follow-up."""
    shutil.rmtree(kv_dir, ignore_errors=True)
    shutil.copytree(saved, kv_dir)  # the same files for every mode (S2's own save is thrown away)
    for snap in kv_dir.rglob("*.kv"):  # as after a power cut: from the device, not the page cache
        drop_file_cache(snap)
    log_file = work / f"server-{ctx}-{mode}.log"
    flags = ["--disk-kv-prefetch", "latest"] if mode in (AFTER, JOIN) else ["--disk-kv-restore", mode]
    srv = S.LocalServer(model, kv_dir, log_file, extra_args=[*extra, *flags],
                        stderr_file=work / f"server-{ctx}.stderr")
    prefetch: dict = {}
    try:
        step(f"{ctx}: S2 ({mode}) start")
        srv.start()
        ready = S.wait_ready(srv.base_url, ready_timeout, srv.proc, stderr_file=srv.stderr_file)
        if mode == AFTER:
            step(f"{ctx}: S2 ({mode}) waiting for the prefetch")
            t0 = time.perf_counter()
            line = S.wait_for_line(log_file, 0, IN_RAM_RE, ready_timeout)
            if line is None:
                raise RuntimeError(f"S2 ({mode}): no prefetch 'is in RAM' line in {log_file}")
            prefetch = {"prefetch_ms": float(line[2]), "ready_to_prefetched_ms": (time.perf_counter() - t0) * 1e3}
        step(f"{ctx}: S2 ({mode}) restore + tail")
        warm = S.complete(srv.base_url, prompt + FOLLOW_UP, max_tokens)
        text = S.read_since(log_file, 0)
    finally:
        srv.stop(signal.SIGTERM)
    if mode == JOIN and (m := IN_RAM_RE.search(text)):
        prefetch = {"prefetch_ms": float(m[2]), "joined": "joins the read" in text}
    t = warm.timings
    return {"ready_s": ready, "completion": warm, "loaded": bool(S.LOADED_RE.search(text)),
            "prefill_n": [int(m[1]) for m in S.PREFILL_RE.finditer(text)], "ttft_ms": t.get("ttft_ms"),
            "restore_ms": t.get("restore_ms", 0.0), "tail_ms": t.get("prefill_ms", 0.0), "gate": t.get("gate", ""),
            "gate_predicted_ms": t.get("gate_predicted_ms", 0.0), "restore_mode": t.get("restore_mode", ""),
            "cache_source": t.get("cache_source"), "arrival_ttft_ms": warm.wall_ms - t.get("decode_ms", 0.0),
            **prefetch}


def run_context(model: str, geometry, ctx: int, work: Path, max_tokens: int, ready_timeout: float,
                kv_bs: int = DEFAULTS.kv_bs, step=lambda _m: None, encode=None,
                modes: tuple[str, ...] = (SEQUENTIAL, PIPELINED), prefetch: bool = False,
                kv_parent: Path | None = None, repeats: int = 1) -> dict:
    """One context size: S1 cold + snapshot, kill, one S2 per restore mode on the same files (and
    the two prefetch S2s with `prefetch`), `repeats` times each (the median run is reported); the kv
    directories live under `kv_parent` (default `work`).

    `encode` (the model's tokenizer) sizes the history to ctx - HEADROOM tokens exactly enough.
    The row's main figures are those of the last restore mode (the server's default, pipelined, last).
    """
    kv_parent = kv_parent or work
    kv_dir, log_file = kv_parent / f"kv-{ctx}", work / f"server-{ctx}.log"
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
        step(f"{ctx}: kill S1")
    finally:
        srv.stop(signal.SIGKILL)
    s1_files = kv_parent / f"kv-{ctx}-s1"
    shutil.copytree(kv_dir, s1_files)
    runs: dict[str, list[dict]] = {}
    try:
        for _ in range(repeats):  # round robin: a slow spell of a shared machine hits every mode alike
            for m in (*modes, *((AFTER, JOIN) if prefetch else ())):
                runs.setdefault(m, []).append(_s2(model, kv_dir, s1_files, work, ctx, m, extra, prompt, max_tokens,
                                                  ready_timeout, step))
        # each mode's median run by arrival TTFT (the first of the two middle ones), all runs kept
        s2 = {m: sorted(rs, key=lambda r: r["arrival_ttft_ms"])[(len(rs) - 1) // 2] | {
              "arrival_ttft_all_ms": [round(r["arrival_ttft_ms"]) for r in rs]} for m, rs in runs.items()}
    finally:
        shutil.rmtree(s1_files, ignore_errors=True)
    snap_bytes, snap_tokens = int(saved[3]), int(saved[1])
    step(f"{ctx}: raw disk bandwidth ({snap_bytes / MB:.0f} MB)")
    raw = measure_raw(kv_dir, snap_bytes)
    shutil.rmtree(kv_dir, ignore_errors=True)
    prefetched = {m: s2.pop(m) for m in (AFTER, JOIN) if m in s2}
    main = s2[modes[-1]]
    warm = main["completion"]
    t = warm.timings
    restore_s = t.get("restore_ms", 0) / 1e3
    bound_ms = t.get("restore_bytes", 0) / MB / raw.read.mb_s * 1e3 + t.get("prefill_ms", 0)
    row.update({
        "s2_ready_s": main["ready_s"], "restore_mode": main["restore_mode"],
        "prompt_tokens_s1": cold.prompt_tokens, "prompt_tokens_s2": warm.prompt_tokens,
        "cold_ttft_ms": cold.timings.get("ttft_ms"), "restored_ttft_ms": t.get("ttft_ms"),
        "speedup": cold.timings["ttft_ms"] / t["ttft_ms"] if t.get("ttft_ms") else None,
        "snapshot_tokens": snap_tokens, "snapshot_bytes": snap_bytes,
        "formula_bytes": _snapshot_formula(geometry, snap_tokens, kv_bs),
        "save_ms": float(saved[4]), "save_mb_s": float(saved[5]),
        "cache_source": t.get("cache_source"), "cached_tokens": warm.cached_tokens,
        "disk_read_line": main["loaded"], "restore_ms": t.get("restore_ms"), "restore_bytes": t.get("restore_bytes"),
        "restore_mb_s": t.get("restore_bytes", 0) / MB / restore_s if restore_s else None,
        "tail_tokens": t.get("prefill_tokens"), "align_rows": t.get("align_rows", 0),
        "tail_prefill_ms": t.get("prefill_ms"),
        "prefill_timing_n": main["prefill_n"][-1] if main["prefill_n"] else None,
        "raw_write_mb_s": raw.write.mb_s, "raw_cold_read_mb_s": raw.read.mb_s,
        "lower_bound_ms": bound_ms, "restored_vs_bound": t["ttft_ms"] / bound_ms if bound_ms else None,
        "gate": main["gate"], "gate_predicted_ms": main["gate_predicted_ms"],
        "modes": {m: {k: v for k, v in r.items() if k != "completion"} | {"text": r["completion"].text}
                  for m, r in s2.items()},
    })
    if SEQUENTIAL in s2 and PIPELINED in s2:  # read and tail apart (sequential) vs overlapped
        seq = s2[SEQUENTIAL]
        row.update({"read_ms": seq["restore_ms"], "tail_ms": seq["tail_ms"],
                    "sum_ms": seq["restore_ms"] + seq["tail_ms"], "pipe_bound_ms": max(seq["restore_ms"], seq["tail_ms"]),
                    "sequential_ttft_ms": seq["ttft_ms"], "pipelined_ttft_ms": s2[PIPELINED]["ttft_ms"],
                    "same_text": seq["completion"].text == s2[PIPELINED]["completion"].text})
    if prefetched:
        row["prefetch"] = {m: {k: v for k, v in r.items() if k != "completion"} | {"text": r["completion"].text}
                           for m, r in prefetched.items()}
        row["prefetch"]["on_demand"] = {"arrival_ttft_ms": main["arrival_ttft_ms"], "ttft_ms": main["ttft_ms"],
                                        "restore_mode": main["restore_mode"], "restore_ms": main["restore_ms"],
                                        "arrival_ttft_all_ms": main["arrival_ttft_all_ms"]}
        row["prefetch_same_text"] = all(r["completion"].text == warm.text for r in prefetched.values())
    log.info("bench recovery %d: cold %.0f ms, restored %.0f ms (bound %.0f ms)", ctx,
             row["cold_ttft_ms"], row["restored_ttft_ms"], bound_ms)
    return row


def markdown(res: dict) -> str:
    g = res["geometry"]
    lines = [f"Model: `{res['model']}` ({g['n_layers']} layers x {g['n_kv_heads']} KV heads x {g['head_dim']} "
             f"dims = {g['bytes_per_token']:,} B/token of F32 KV), {res['max_tokens']} generated tokens.", "",
             "| context | S1 prompt | cold TTFT ms | S2 prompt | restored TTFT ms | speed-up | snapshot bytes "
             "(formula) | save ms (MB/s) | restore ms (MB/s) | raw cold read MB/s | tail tokens (recomputed for "
             "alignment) | tail prefill ms "
             "| lower bound ms | restored / bound |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        ok = "=" if r["snapshot_bytes"] == r["formula_bytes"] else "!="
        lines.append(
            f"| {r['context']} | {r['prompt_tokens_s1']} | {r['cold_ttft_ms']:.0f} | {r['prompt_tokens_s2']} "
            f"| {r['restored_ttft_ms']:.0f} | {r['speedup']:.1f}x | {r['snapshot_bytes']:,} ({ok}) "
            f"| {r['save_ms']:.0f} ({r['save_mb_s']:.0f}) | {r['restore_ms']:.0f} ({r['restore_mb_s'] or 0:.0f}) "
            f"| {r['raw_cold_read_mb_s']:.0f} | {r['tail_tokens']} ({r.get('align_rows', 0)}) "
            f"| {r['tail_prefill_ms']:.0f} "
            f"| {r['lower_bound_ms']:.0f} | {r['restored_vs_bound']:.2f} |")
    lines += ["", "Lower bound = restore_bytes / raw cold-read bandwidth of the kv directory (measured in the "
              "same run, page cache dropped) + the tail's prefill time. S1 is killed with SIGKILL after its "
              "`[KV-DISK] saved` line and the snapshot's pages are dropped from the page cache (as after a "
              "power cut); S2 is a new process that reads it from the device."]
    piped = [r for r in res["rows"] if "pipe_bound_ms" in r]
    if piped:
        lines += ["", "### Restored TTFT: sequential vs pipelined (one S2 process each, the same files)", "",
                  "| context | read ms | tail ms | sum ms | max(read, tail) ms | sequential TTFT ms "
                  "| pipelined TTFT ms | pipelined / sequential | pipelined / bound | same text | gate (S2) |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---|"]
        for r in piped:
            lines.append(f"| {r['context']} | {r['read_ms']:.0f} | {r['tail_ms']:.0f} | {r['sum_ms']:.0f} "
                         f"| {r['pipe_bound_ms']:.0f} | {r['sequential_ttft_ms']:.0f} | {r['pipelined_ttft_ms']:.0f} "
                         f"| {r['pipelined_ttft_ms'] / r['sequential_ttft_ms']:.2f} "
                         f"| {r['pipelined_ttft_ms'] / r['pipe_bound_ms']:.2f} | {'yes' if r['same_text'] else 'NO'} "
                         f"| {r['gate'] or '-'} |")
        lines += ["", "Read and tail come from the sequential S2 (its restore, then its tail prefill); TTFT "
                  "includes the first decode step. A freshly started server has no cost-gate estimates yet, "
                  "so its first request restores (`unmeasured`); `edge-llm bench restore` shows the gate with "
                  "estimates against the alternatives measured."]
    pre = [r for r in res["rows"] if "prefetch" in r]
    if pre:
        lines += ["", "### Restored TTFT of the follow-up: on demand vs disk_kv_prefetch = \"latest\"", "",
                  "| context | on demand (restore mode, its read ms) ms | prefetch, after it finished ms "
                  "| prefetch read ms | prefetch, sent at ready (joins) ms | cache_source (after / join) | same text |",
                  "|---:|---:|---:|---:|---:|---|:---:|"]
        for r in pre:
            p, a, j = r["prefetch"]["on_demand"], r["prefetch"][AFTER], r["prefetch"][JOIN]
            runs = (lambda x: "" if len(x.get("arrival_ttft_all_ms", ())) < 2 else
                    " [" + ", ".join(map(str, x["arrival_ttft_all_ms"])) + "]")
            lines.append(f"| {r['context']} | {p['arrival_ttft_ms']:.0f}{runs(p)} ({p['restore_mode']}, "
                         f"{p['restore_ms']:.0f}) | {a['arrival_ttft_ms']:.0f}{runs(a)} | {a['prefetch_ms']:.0f} "
                         f"| {j['arrival_ttft_ms']:.0f}{runs(j)}{'' if j.get('joined') else ' (did not join)'} "
                         f"| {a['cache_source']} / {j['cache_source']} | {'yes' if r['prefetch_same_text'] else 'NO'} |")
        lines += ["", "Medians of the runs in brackets (one S2 process each, round robin). "
                  "TTFT here is measured from the request's arrival at the client to its first token "
                  "(`wall_ms - decode_ms`), so a joined request's wait for the rest of the read counts. "
                  "\"After it finished\": the follow-up is sent once the log says the prefix is in RAM; the "
                  "read itself happened while the server was idle after start-up."]
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
    if all("sequential_ttft_ms" in r for r in rows):
        ax.plot(x, [r["sequential_ttft_ms"] / 1e3 for r in rows], "v:", label="restored, sequential")
        ax.plot(x, [r["pipe_bound_ms"] / 1e3 for r in rows], "x:", label="max(read, tail)")
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
