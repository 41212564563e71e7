"""`edge-llm bench quant`: backend cpu-q against the F32 backend and llama.cpp, in one run.

Same machine, same run, same thread count, same GGUF (the embedded default model), same token
ids: for each context length, prefill tok/s, decode tok/s (one-token steps at that context) and
restore+tail (a snapshot / llama.cpp state file of all but the last `tail` tokens read back with
a cold page cache, then the tail computed) of cpu-q, cpu-q without its one-row decode graph
("cpu-q per-layer"), cpu (F32) and llama.cpp, alternating per
repeat so a load change on a shared machine hits all of them; the best repeat counts. llama.cpp
runs in its own venv (tools/setup-bench-llamacpp.sh) through `llamacpp_peer.py`.

Also: decode against the bandwidth roofline (quantized weight bytes + F32 KV bytes read per
token / this machine's read GB/s, measured in the same run), and quality on a fixed text:
perplexity of each, mean KL(F32 || x) of the next-token distribution, top-1 agreement with F32,
and greedy agreement over 100 tokens of a chat answer. The load average is recorded next to
every row (the machine is shared).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from edge_llm.qrecord import greedy, log_softmax, quality, teacher_logits  # noqa: F401 (bench's users)
from edge_llm.quality_text import QUALITY_TEXT
from edge_llm.snapshot.layout import SNAPSHOT_GLOB

log = logging.getLogger(__name__)

PEER = Path(__file__).with_name("llamacpp_peer.py")
PEER_ENV = "EDGE_LLM_LLAMACPP_PYTHON"
LENGTHS = (512, 2048, 4000)
CHAT = "Explain in a few sentences why the sky is blue."
PER_LAYER = "cpu-q per-layer"


def peer_python(explicit: str | None = None) -> Path | None:
    """The llama.cpp bench venv's python: explicit, $EDGE_LLM_LLAMACPP_PYTHON, or the checkout's
    `.venv-llamacpp` (tools/setup-bench-llamacpp.sh)."""
    cand = explicit or os.environ.get(PEER_ENV)
    path = Path(cand) if cand else Path(__file__).resolve().parents[2] / ".venv-llamacpp" / "bin" / "python"
    return path if path.is_file() else None


class Peer:
    """llamacpp_peer.py in the llama.cpp venv, one JSON line per request."""

    def __init__(self, python: Path, gguf: Path, threads: int, n_ctx: int):
        self.proc = subprocess.Popen([str(python), str(PEER), str(gguf), str(threads), str(n_ctx)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def call(self, **req) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp peer exited ({self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.call(op="quit")
        except (RuntimeError, BrokenPipeError, OSError):
            pass
        self.proc.wait(timeout=60)


def load() -> float:
    return os.getloadavg()[0]


def best_of(fn, reps: int = 5) -> float:
    """Fastest wall time of `reps` runs after one warm-up (the machine is shared: take the best)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Best streaming-read GB/s (numpy sum on one thread, and on two halves in parallel)."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    halves = np.array_split(a, 2)
    with ThreadPoolExecutor(2) as ex:
        secs = min(best_of(lambda: a.sum()), best_of(lambda: list(ex.map(np.sum, halves))))
    return nbytes / secs / 1e9


# ---- edge-llm side ---------------------------------------------------------------------------
def ours_speed(model, store, ids: list[int], decode: int, tail: int) -> dict:
    """prefill, decode and restore+tail of one model over `ids` (the store: a scratch namespace)."""
    from edge_llm.bench.disk import drop_file_cache

    cache = model.new_cache(len(ids) + decode + 8, check_memory=False)
    t0 = time.perf_counter()
    model.prefill(ids, cache)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(decode):
        model.forward([ids[i]], cache)
    dec = time.perf_counter() - t0
    cache.reset()
    model.prefill(ids[:-tail], cache)
    store.save_async(cache)
    store.flush()
    for f in store.ns.glob(SNAPSHOT_GLOB):
        drop_file_cache(f)
    cache.reset()
    t0 = time.perf_counter()
    hit = store.lookup(ids)
    res = store.restore(hit, cache)
    model.prefill(ids[hit.m:], cache)
    restore = time.perf_counter() - t0
    return {"prefill_s": prefill, "decode_s": dec, "restore_s": restore, "state_bytes": res.nbytes}


# ---- the run ---------------------------------------------------------------------------------
def run(lengths=LENGTHS, threads: int = 2, repeats: int = 2, decode: int = 32, tail: int = 32,
        f32: bool = True, peer_py: str | None = None, step: Callable[[str], None] = lambda _m: None,
        per_layer: bool = True) -> dict:
    from threadpoolctl import threadpool_info

    from edge_llm.backends.cpuq.backend import ensure_quantized, mode, open_cpu_q
    from edge_llm.bench.prompts import history
    from edge_llm.checkpoints.default import default_model_dir
    from edge_llm.checkpoints.gguf_blocks import gguf_blocks
    from edge_llm.checkpoints.packaged import default_gguf_path
    from edge_llm.convert.gptq import CpuqInputs
    from edge_llm.config import ModelArgs
    from edge_llm.models.qwen3 import Model
    from edge_llm.snapshot.identity import Identity
    from edge_llm.snapshot.store import SnapshotStore
    from edge_llm.tokenizer import Tokenizer

    py = peer_python(peer_py)
    if py is None:
        raise RuntimeError("the llama.cpp peer venv is missing: run tools/setup-bench-llamacpp.sh "
                           f"(or set {PEER_ENV})")
    step("loading models")
    model_dir = default_model_dir()
    gguf = default_gguf_path()
    args = ModelArgs.from_dir(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    blocks = gguf_blocks(model_dir)
    cal = CpuqInputs(model_dir)
    root, manifest = ensure_quantized(model_dir, mode("q4"), blocks=blocks, calibration=cal)
    models = {"cpu-q": Model.load(model_dir, backend=open_cpu_q(model_dir, "q4", threads, blocks=blocks, calibration=cal))}
    if per_layer:  # cpu-q without its decode graph: one-row steps on the per-layer graphs
        models[PER_LAYER] = Model.load(model_dir, backend=open_cpu_q(model_dir, "q4", threads, decode_graph=False,
                                                                     blocks=blocks, calibration=cal))
    if f32:
        models["cpu"] = Model.load(model_dir)
    text = tok.encode(history(max(lengths) + 64, seed=11))
    peer = Peer(py, gguf, threads, max(lengths) + decode + 64)
    res: dict = {"model": model_dir.name, "gguf": gguf.name, "threads": threads, "repeats": repeats,
                 "decode_steps": decode, "tail": tail, "peer": peer.call(op="info"),
                 "numerics": models["cpu-q"].numerics, "cpu": os.cpu_count(),
                 "blas": [f"{i.get('internal_api')} {i.get('version')} {i.get('architecture', '')} "
                          f"threads={i.get('num_threads')}" for i in threadpool_info() if i.get("user_api") == "blas"],
                 "rows": []}
    try:
        with tempfile.TemporaryDirectory(prefix="edge-llm-bench-quant-") as tmp:
            stores = {name: SnapshotStore(Path(tmp) / "kv", Identity.for_model(model_dir, args, m.numerics),
                                          args.geometry, max_files=2, kv_bs=64) for name, m in models.items()}
            for n in lengths:
                ids = text[:n]
                best: dict[str, dict] = {}
                loads = []
                for r in range(repeats):
                    for name in ["llama.cpp", *models]:
                        step(f"{n} tokens: {name} (repeat {r + 1}/{repeats})")
                        loads.append(load())
                        if name == "llama.cpp":
                            got = peer.call(op="speed", ids=ids, decode=decode, tail=tail,
                                            state=str(Path(tmp) / "llama.state"))
                        else:
                            got = ours_speed(models[name], stores[name], ids, decode, tail)
                        cur = best.setdefault(name, got)
                        for k in ("prefill_s", "decode_s", "restore_s"):
                            cur[k] = min(cur[k], got[k])
                res["rows"].append({"context": n, "load": [min(loads), max(loads)],
                                    **{name: {"prefill_tps": n / b["prefill_s"], "decode_tps": decode / b["decode_s"],
                                              "restore_s": b["restore_s"], "state_bytes": b["state_bytes"]}
                                       for name, b in best.items()}})
            for s in stores.values():
                s.close()
            step("quality: teacher-forced logits on the fixed text")
            qids = tok.encode(QUALITY_TEXT)[:512]
            f32_model = models["cpu"] if f32 else Model.load(model_dir)  # once, for both quality runs
            ref = teacher_logits(f32_model, qids)
            out = Path(tmp) / "llama_logits.npy"
            peer.call(op="logits", ids=qids, out=str(out))
            res["quality"] = {"tokens": len(qids), "cpu": quality(ref, ref, qids),
                              "cpu-q": quality(ref, teacher_logits(models["cpu-q"], qids), qids),
                              "llama.cpp": quality(ref, np.load(out), qids)}
            step("quality: greedy agreement over 100 tokens")
            chat = tok.apply_chat_template_ids([{"role": "user", "content": CHAT}])
            want = greedy(f32_model, chat, 100)
            forced = chat + want
            ref_l = teacher_logits(f32_model, forced)[len(chat) - 1:-1]
            q_l = teacher_logits(models["cpu-q"], forced)[len(chat) - 1:-1]
            peer.call(op="logits", ids=forced, out=str(out))
            l_l = np.load(out)[len(chat) - 1:-1]
            free = greedy(models["cpu-q"], chat, 100)
            res["greedy"] = {"steps": 100, "cpu-q": float((q_l.argmax(1) == ref_l.argmax(1)).mean()),
                             "llama.cpp": float((l_l.argmax(1) == ref_l.argmax(1)).mean()),
                             "cpu-q first divergence (free-running)": next(
                                 (i for i, (a, b) in enumerate(zip(want, free)) if a != b), 100)}
    finally:
        peer.close()
    step("memory bandwidth")
    res["read_gbs"] = read_bandwidth()
    qbytes = sum(w["bytes"] for w in manifest.build["weights"])
    res["roofline"] = []
    g = args.geometry
    for row in res["rows"]:
        ctx = row["context"] + decode / 2  # mean context of the decode steps
        kv = 2 * g.n_layers * ctx * g.kv_dim * 4
        roof = res["read_gbs"] * 1e9 / (qbytes + kv)
        res["roofline"].append({"context": row["context"], "weight_bytes": qbytes, "kv_bytes": kv,
                                "roofline_tps": roof, "achieved": row["cpu-q"]["decode_tps"] / roof})
    res["quant_dir"] = str(root)
    return res


def markdown(res: dict) -> str:
    names = [n for n in ("cpu-q", PER_LAYER, "cpu", "llama.cpp") if n in res["rows"][0]]
    lines = [f"# cpu-q vs llama.cpp: {res['model']} ({res['gguf']}), {res['threads']} threads, same run",
             "", f"llama-cpp-python {res['peer']['version']}; cpu-q numerics `{res['numerics']}`; "
             f"BLAS {', '.join(res['blas']) or 'none'}; best of {res['repeats']} alternating repeats; "
             f"decode = {res['decode_steps']} one-token steps at the context; restore+tail = snapshot of all "
             f"but {res['tail']} tokens read cold + tail prefill.", "",
             "| context | " + " | ".join(f"prefill tok/s {n}" for n in names) + " | prefill cpu-q/llama | "
             + " | ".join(f"decode tok/s {n}" for n in names) + " | decode cpu-q/llama | "
             + " | ".join(f"restore+tail s {n}" for n in names) + " | load (1 min) |",
             "|" + "---|" * (3 * len(names) + 4)]
    for r in res["rows"]:
        q, ll = r["cpu-q"], r["llama.cpp"]
        lines.append(f"| {r['context']} | " + " | ".join(f"{r[n]['prefill_tps']:.1f}" for n in names)
                     + f" | **{q['prefill_tps'] / ll['prefill_tps']:.2f}x** | "
                     + " | ".join(f"{r[n]['decode_tps']:.1f}" for n in names)
                     + f" | **{q['decode_tps'] / ll['decode_tps']:.2f}x** | "
                     + " | ".join(f"{r[n]['restore_s']:.3f}" for n in names)
                     + f" | {r['load'][0]:.1f}-{r['load'][1]:.1f} |")
    lines += ["", f"Decode vs the bandwidth roofline (read {res['read_gbs']:.1f} GB/s measured in this run; "
              "bytes per token = quantized weights + F32 KV rows read):", "",
              "| context | weight MB | KV MB | roofline tok/s | cpu-q tok/s | achieved |", "|---|---|---|---|---|---|"]
    for r, row in zip(res["roofline"], res["rows"]):
        lines.append(f"| {r['context']} | {r['weight_bytes'] / 1e6:.1f} | {r['kv_bytes'] / 1e6:.1f} | "
                     f"{r['roofline_tps']:.1f} | {row['cpu-q']['decode_tps']:.1f} | **{r['achieved']:.0%}** |")
    qd = res["quality"]
    lines += ["", f"Quality on a fixed text ({qd['tokens']} tokens, teacher-forced), against the F32 backend:", "",
              "| | perplexity | mean KL(F32 ‖ x) | top-1 = F32 |", "|---|---|---|---|"]
    for n in ("cpu", "cpu-q", "llama.cpp"):
        lines.append(f"| {n} | {qd[n]['ppl']:.3f} | {qd[n]['kl']:.5f} | {qd[n]['top1']:.1%} |")
    gr = res["greedy"]
    lines += ["", f"Greedy agreement with F32 over {gr['steps']} tokens of a chat answer (teacher-forced on "
              f"F32's tokens): cpu-q {gr['cpu-q']:.0%}, llama.cpp {gr['llama.cpp']:.0%}; free-running cpu-q "
              f"first differs at token {gr['cpu-q first divergence (free-running)']}.", ""]
    return "\n".join(lines)
