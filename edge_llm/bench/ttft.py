"""Restored TTFT on a real model and real files: sequential vs pipelined vs the bound, and the
cost gate's choice against the alternatives measured (docs/store.md, "Restore, the cost gate").

Per model (a backend: its prefill rate against its KV bytes per row) and context n:

1. The prompt (n history ids + `tail` new ids) is prefilled from scratch, recompute forced: the
   measured recompute alternative (it reads no disk, so it is measured once for every disk).
   Its history rows are saved through a real SnapshotStore on every disk: the same files.
2. Per disk (`--dir`, then each throttled directory): a fresh cost gate that knows the backend's
   prefill rate from step 1 (as a running server would) sees one warm-up restore on that disk,
   which gives it the read bandwidth; it then decides for every context, in its default mode and
   in split mode. Then, with the snapshot's pages dropped before each run, the request is
   restored sequentially and pipelined, `repeats` times in rotation (with the split the
   split-mode gate picked, if it picked one, and the recompute when it is a close call).

TTFT here runs from the request's start to the prompt's logits (restore + tail prefill; sampling
the first token adds microseconds). The sequential run gives read (its restore time, nothing
else running) and tail (its tail prefill, the rows in RAM): sum = read + tail is what
sequential pays, max(read, tail) is the bound a perfect pipeline approaches.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_llm.bench.disk import MB, drop_file_cache, measure_raw
from edge_llm.costgate import PIPELINED, SEQUENTIAL, SPLIT, CostGate, Decision
from edge_llm.engine import Engine
from edge_llm.kvcache import KVCache
from edge_llm.settings import DEFAULTS
from edge_llm.snapshot.identity import Identity
from edge_llm.snapshot.layout import SNAPSHOT_GLOB
from edge_llm.snapshot.store import SnapshotStore

log = logging.getLogger(__name__)


@dataclass
class Disk:
    label: str
    path: Path  # the kv directory (created)
    raw: dict | None = None  # raw write+fsync / cold read of this directory, measured in the run


RECOMPUTE = "recompute"
CLOSE = 20  # recompute measured `repeats` times when predicted within this factor of the restore


class ForcedGate(CostGate):
    """A gate that loads exactly `load` rows (None: every matched row; 0: none) so that each
    alternative can be measured; what the engine observes goes to the live gate."""

    def __init__(self, live: CostGate, load: int | None):
        super().__init__(live.bytes_per_token, live.mode, live.chunk)
        self.live, self.load = live, load

    def observe_read(self, nbytes: int, seconds: float) -> None:
        self.live.observe_read(nbytes, seconds)

    def observe_prefill(self, rows: int, seconds: float) -> None:
        self.live.observe_prefill(rows, seconds)

    def decide(self, n: int, m_ram: int, m_disk: int, block: int, min_rows: int) -> Decision:
        k = m_disk if self.load is None else min(self.load, m_disk)
        action = "recompute" if k <= m_ram else ("restore" if k == m_disk else "split")
        return Decision(action, k if k > m_ram else 0, n - max(k, m_ram), 0.0, 0.0, 0.0)


def prompt_ids(vocab: int, n: int, tail: int, seed: int) -> list[int]:
    """n history ids then `tail` new ones; the seed (per context) makes histories share no prefix."""
    rng = np.random.default_rng([seed, n])
    return rng.integers(100, vocab - 100, size=n + tail).tolist()


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


class Runner:
    """One model's engine on one disk's store, and the runs of one request."""

    def __init__(self, model, tokenizer, cache: KVCache, store: SnapshotStore | None):
        self.engine = Engine(model, tokenizer, cache, store=store)
        self.store = store

    def run(self, prompt: list[int], gate: CostGate, mode: str) -> tuple[dict, np.ndarray]:
        eng = self.engine
        if self.store is not None:
            for p in self.store.ns.glob(SNAPSHOT_GLOB):  # cold: from the device, as after a restart
                drop_file_cache(p)
        eng.cache.reset()
        eng.gate, eng.restore_mode = gate, mode
        t0 = time.perf_counter()
        logits, t = eng.prefill_prompt(prompt)
        ms = (time.perf_counter() - t0) * 1e3
        return {"ttft_ms": ms, "restore_ms": t.restore_ms, "tail_ms": t.prefill_ms, "loaded": t.disk_cached_tokens,
                "computed": t.prefill_tokens, "aligned": t.align_rows, "source": t.cache_source}, logits.copy()


def run_model(model_dir: Path, label: str, disks: list[Disk], contexts: list[int], tail: int, repeats: int,
              kv_bs: int = DEFAULTS.kv_bs, seed: int = 0, step: Callable[[str], None] = lambda _m: None) -> list[dict]:
    """Every (disk, context) row for one model; see the module docstring."""
    from edge_llm.models.qwen3 import Model
    from edge_llm.tokenizer import Tokenizer

    step(f"{label}: loading the model")
    model = Model.load(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    g = model.args.geometry
    identity = Identity.for_model(model_dir, model.args, model.backend.numerics)
    cache = KVCache(g, max_seq=max(contexts) + tail + kv_bs, kv_bs=kv_bs)
    stores = [SnapshotStore(d.path, identity, g, max_files=len(contexts) + 1, max_tokens=max(contexts), kv_bs=kv_bs,
                            compact_idle=None) for d in disks]
    for s in stores:
        s.scan()
    prompts = {n: prompt_ids(model.args.vocab_size, n, tail, seed) for n in contexts}
    compute = Runner(model, tokenizer, cache, None)
    backend = CostGate(g.kv_bytes_per_token, PIPELINED, compute.engine.align)
    recompute = {}
    step(f"{label}: warm-up prefill")
    compute.run(prompt_ids(model.args.vocab_size, 64, 0, seed + 1), ForcedGate(CostGate(g.kv_bytes_per_token), 0),
                PIPELINED)  # weights touched, BLAS threads up: not counted anywhere
    try:
        for n in contexts:  # 1. recompute, measured; its history rows become every disk's file
            step(f"{label}: {n} + {tail} tokens: full prefill (the recompute alternative)")
            recompute[n], _ = compute.run(prompts[n], ForcedGate(backend, 0), PIPELINED)
            cache.truncate(n)
            for s in stores:
                s.save_async(cache)
                s.flush()
        rows = []
        for disk, store in zip(disks, stores):
            rows += _disk_rows(Runner(model, tokenizer, cache, store), disk, label, g.kv_bytes_per_token,
                               backend.prefill_tps, prompts, recompute, tail, repeats, kv_bs, step)
    finally:
        for s in stores:
            s.close()
    return rows


def _disk_rows(runner: Runner, disk: Disk, label: str, bytes_per_token: int, prefill_tps: float | None,
               prompts: dict[int, list[int]], recompute: dict[int, dict], tail: int, repeats: int, kv_bs: int,
               step: Callable[[str], None]) -> list[dict]:
    live = CostGate(bytes_per_token, PIPELINED, runner.engine.align, prefill_tps=prefill_tps)
    first = min(prompts)
    step(f"{label}, {disk.label}: warm-up restore (the gate's read bandwidth)")
    runner.run(prompts[first], ForcedGate(live, None), PIPELINED)
    rows = []
    for n, prompt in prompts.items():
        min_lcp = runner.store.min_lcp
        est = {"est_read_mb_s": (live.read_bps or 0) / MB, "est_prefill_rows_s": live.prefill_tps or 0.0}
        gate = live.decide(len(prompt), 0, n, kv_bs, min_lcp)
        split_gate = CostGate(bytes_per_token, SPLIT, live.chunk, read_bps=live.read_bps,
                              prefill_tps=live.prefill_tps).decide(len(prompt), 0, n, kv_bs, min_lcp)
        runs: dict[str, list[dict]] = {SEQUENTIAL: [], PIPELINED: [], SPLIT: [], RECOMPUTE: []}
        logits: dict[str, list[np.ndarray]] = {SEQUENTIAL: [], PIPELINED: []}
        # a close call is measured as carefully as the restores, in the same rotation; a recompute
        # far slower than the predicted restore keeps its one measurement (step 1)
        close = recompute[n]["ttft_ms"] < CLOSE * gate.restore_ms
        kinds = [SEQUENTIAL, PIPELINED] + ([SPLIT] if split_gate.action == "split" else []) + ([RECOMPUTE] if close else [])
        loads = {SEQUENTIAL: None, PIPELINED: None, SPLIT: split_gate.load_rows, RECOMPUTE: 0}
        for i in range(repeats):
            for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:  # rotate: no kind always first
                step(f"{label}, {disk.label}: {n} + {tail} tokens, {kind} ({loads[kind]} rows) {i + 1}/{repeats}")
                r, lg = runner.run(prompt, ForcedGate(live, loads[kind]), SEQUENTIAL if kind == SEQUENTIAL else PIPELINED)
                runs[kind].append(r)
                if kind in logits:
                    logits[kind].append(lg)
        if not close:
            runs[RECOMPUTE] = [recompute[n]]
        ref = logits[SEQUENTIAL][0].view(np.uint32)
        seq, pipe = runs[SEQUENTIAL], runs[PIPELINED]
        read, tail_ms = _median([r["restore_ms"] for r in seq]), _median([r["tail_ms"] for r in seq])
        best_read, best_tail = min(r["restore_ms"] for r in seq), min(r["tail_ms"] for r in seq)
        row = {"disk": disk.label, "model": label, "context": n, "tail": tail, "prompt": len(prompt),
               "restored_rows": seq[0]["loaded"], "align_rows": seq[0]["aligned"], "read_ms": read, "tail_ms": tail_ms, "sum_ms": read + tail_ms,
               "bound_ms": max(read, tail_ms), "sequential_ms": _median([r["ttft_ms"] for r in seq]),
               "pipelined_ms": _median([r["ttft_ms"] for r in pipe]),
               # the fastest run of each: closest to the undisturbed cost on a shared machine
               "best": {"read_ms": best_read, "tail_ms": best_tail, "sum_ms": best_read + best_tail,
                        "bound_ms": max(best_read, best_tail), "sequential_ms": min(r["ttft_ms"] for r in seq),
                        "pipelined_ms": min(r["ttft_ms"] for r in pipe)},
               "read_tail_runs": [(round(r["restore_ms"], 1), round(r["tail_ms"], 1)) for r in seq],
               "pipelined_reader_ms": _median([r["restore_ms"] for r in pipe]),
               "read_mb_s": seq[0]["loaded"] * bytes_per_token / MB / (read / 1e3) if read else None,
               "bitwise_equal": all(np.array_equal(x.view(np.uint32), ref) for v in logits.values() for x in v),
               "all_sources_disk": all(r["source"] == "disk" for r in seq + pipe),
               "recompute_ms": _median([r["ttft_ms"] for r in runs[RECOMPUTE]]), "recompute_runs": len(runs[RECOMPUTE]),
               "split_rows": split_gate.load_rows if runs[SPLIT] else None,
               "split_ms": _median([r["ttft_ms"] for r in runs[SPLIT]]) if runs[SPLIT] else None,
               "gate": gate.to_dict(), "split_gate": split_gate.to_dict(), **est,
               "runs": {k: [round(r["ttft_ms"], 1) for r in v] for k, v in runs.items() if v}}
        row["verdict"] = verdict(row)
        rows.append(row)
        log.info("ttft %s %s %d: read %.0f tail %.0f seq %.0f pipe %.0f recompute %.0f gate %s", disk.label, label,
                 n, read, tail_ms, row["sequential_ms"], row["pipelined_ms"], row["recompute_ms"], gate.action)
    return rows


def verdict(row: dict) -> dict:
    """The gate's choices against the alternatives as measured: was the faster one picked?"""
    measured = {"restore": row["pipelined_ms"], "recompute": row["recompute_ms"]}
    out = {}
    for key, options in (("gate", measured), ("split_gate", {**measured, **(
            {"split": row["split_ms"]} if row["split_ms"] is not None else {})})):
        choice = row[key]["action"]
        choice = "restore" if choice == "unmeasured" else choice
        best = min(options, key=options.get)
        out[key] = {"choice": choice, "best": best, "right": choice == best,
                    "regret": options[choice] / options[best]}
    return out


def run(models: list[tuple[str, Path]], disks: list[Disk], contexts: list[int], tail: int = 64, repeats: int = 2,
        kv_bs: int = DEFAULTS.kv_bs, step: Callable[[str], None] = lambda _m: None) -> dict:
    """The whole section: raw bandwidth of each disk, then every model on every disk."""
    from threadpoolctl import threadpool_info

    for d in disks:
        d.path.mkdir(parents=True, exist_ok=True)
        if d.raw is None:
            step(f"{d.label}: raw disk bandwidth")
            d.raw = measure_raw(d.path, 256 << 20).to_dict()
    blas = ", ".join(f"{i.get('internal_api')} {i.get('architecture')} ({i.get('num_threads')} threads)"
                     for i in threadpool_info() if i.get("user_api") == "blas") or "unknown"
    out = {"contexts": contexts, "tail": tail, "repeats": repeats, "blas": blas, "load_before": os.getloadavg(),
           "disks": [{"label": d.label, "raw": d.raw} for d in disks], "rows": []}
    for label, model_dir in models:
        out["rows"] += run_model(model_dir, label, disks, contexts, tail, repeats, kv_bs, step=step)
    out["load_after"] = os.getloadavg()
    return out


def markdown(res: dict) -> str:
    load = "/".join(f"{x:.1f}" for x in (res["load_before"][0], res["load_after"][0]))
    lines = [f"Tail {res['tail']} new tokens after the restored context; medians of {res['repeats']} cold runs per "
             f"mode, in rotation; BLAS {res['blas']}; load average {load} (start/end, 2 cores).", "",
             "| disk | raw write MB/s | raw cold read MB/s |", "|---|---:|---:|"]
    lines += [f"| {d['label']} | {d['raw']['write']['mb_s']:.0f} | {d['raw']['read']['mb_s']:.0f} |" for d in res["disks"]]
    lines += ["", "### Restored TTFT: sequential vs pipelined vs the bound", "",
              "Each cell: median / best of the runs (the best run is the least disturbed on a shared machine).", "",
              "| disk | model | context | read ms (MB/s) | tail ms | sum ms | max(read, tail) ms | sequential ms "
              "| pipelined ms | pipelined / sequential | pipelined / bound | logits bitwise equal |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in res["rows"]:
        b = r["best"]

        def two(key: str) -> str:
            return f"{r[key]:.0f} / {b[key]:.0f}"

        lines.append(f"| {r['disk']} | {r['model']} | {r['context']} | {two('read_ms')} ({r['read_mb_s'] or 0:.0f}) "
                     f"| {two('tail_ms')} | {two('sum_ms')} | {two('bound_ms')} | {two('sequential_ms')} "
                     f"| {two('pipelined_ms')} | {r['pipelined_ms'] / r['sequential_ms']:.2f} / "
                     f"{b['pipelined_ms'] / b['sequential_ms']:.2f} | {r['pipelined_ms'] / r['bound_ms']:.2f} / "
                     f"{b['pipelined_ms'] / b['bound_ms']:.2f} | {'yes' if r['bitwise_equal'] else 'NO'} |")
    lines += ["", "### The cost gate against the alternatives measured", "",
              "| disk | model | context | gate's estimates: read MB/s, prefill rows/s | restore ms (pipelined) "
              "| recompute ms | split ms (rows loaded) | gate: choice (predicted ms) | right? | split mode: choice "
              "| right? |", "|---|---|---:|---:|---:|---:|---:|---|:---:|---|:---:|"]
    for r in res["rows"]:
        v, g, s = r["verdict"], r["gate"], r["split_gate"]
        split = f"{r['split_ms']:.0f} ({r['split_rows']})" if r["split_ms"] is not None else "-"
        sc = f"split {s['load_rows']}" if s["action"] == "split" else s["action"]
        lines.append(
            f"| {r['disk']} | {r['model']} | {r['context']} | {r['est_read_mb_s']:.0f}, {r['est_prefill_rows_s']:.0f} "
            f"| {r['pipelined_ms']:.0f} | {r['recompute_ms']:.0f} | {split} | {g['action']} ({g['predicted_ms']:.0f}) "
            f"| {_right(v['gate'])} | {sc} | {_right(v['split_gate'])} |")
    lines += ["", f"Restore, recompute and split are medians of {res['repeats']} cold runs in one rotation on each disk; "
              f"a recompute measured first more than {CLOSE}x slower than the gate's predicted restore is not repeated "
              "(one full prefill per model and context; it reads no disk). 'right?' compares the gate's choice with "
              "the faster alternative as measured; when it is not, the ratio is the measured cost of the choice over "
              "the best one."]
    return "\n".join(lines) + "\n"


def _right(v: dict) -> str:
    return "yes" if v["right"] else f"no ({v['best']} faster; x{v['regret']:.2f})"
