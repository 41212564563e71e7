"""`edge-llm bench quant-memory`: peak RSS of the Qwen3-VL-2B geometry (synthetic weights, all 28
layers) served by backend cpu-q (or `--backend cpu`, F32) with an 8K KV cache, against an 8 GB
board, next to the start-up admission's estimate (edge_llm/footprint.py) of the same setup.

Each phase runs in a fresh child process so its peak (VmHWM) is its own: quantizing the BF16
checkpoint into MatMulNBits graphs (done once per model, on a host or on the board), then the
runtime as the server builds it (`load_runtime`: model, tokenizer, KV cache of `max_seq` rows),
a prompt prefilled and a few tokens decoded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from edge_llm.bench.models import synth_model
from edge_llm.bench.procstat import in_child, proc_status

BOARD_BYTES = 8 * 1024**3


def _quantize(model_dir: str) -> dict:
    from edge_llm.backends.cpuq.backend import ensure_quantized, mode
    from edge_llm.checkpoints.gguf_blocks import gguf_blocks

    t0 = time.perf_counter()
    root, m = ensure_quantized(model_dir, mode("q4"), blocks=gguf_blocks(model_dir))
    return {"seconds": time.perf_counter() - t0, "dir": str(root),
            "weight_bytes": sum(w["bytes"] for w in m.build["weights"]), **proc_status()}


def _serve(model_dir: str, max_seq: int, prompt: int, decode: int, backend: str = "cpu-q") -> dict:
    import numpy as np

    from edge_llm.footprint import ModelSizes, estimate_memory
    from edge_llm.runtime import load_runtime
    from edge_llm.settings import Settings

    s = Settings(model=model_dir, backend=backend, max_seq=max_seq, disk_kv=None)
    est = estimate_memory(s, backend, ModelSizes.of_dir(model_dir), model_dir)
    t0 = time.perf_counter()
    eng = load_runtime(s)
    load_s = time.perf_counter() - t0
    after_load = proc_status()
    m, cache = eng.model, eng.cache
    ids = np.random.default_rng(0).integers(0, m.args.vocab_size, prompt)
    t0 = time.perf_counter()
    logits = m.prefill(ids, cache)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(decode):
        logits = m.forward([int(np.argmax(logits))], cache)
    decode_s = time.perf_counter() - t0
    return {"load_s": load_s, "after_load": after_load, "kv_bytes": cache.nbytes, "numerics": m.numerics,
            "estimate": est.total, "estimate_parts": est.describe(),
            "prefill_tps": prompt / prefill_s, "decode_tps": decode / decode_s, **proc_status()}


def run(model_dir: Path | None = None, layers: int = 28, max_seq: int = 8192, prompt: int = 256,
        decode: int = 8, step: Callable[[str], None] = lambda _m: None, backend: str = "cpu-q") -> dict:
    from edge_llm.config import ModelArgs
    if model_dir is None:  # the whole Qwen3-VL-2B: the vision tower is part of what a board holds
        step("the synthetic checkpoint (BF16, with the vision tower; written once)")
        model_dir = synth_model(layers, vision=True)
    args = ModelArgs.from_dir(model_dir)
    q = None
    if backend == "cpu-q":
        step("quantizing (child process)")
        q = in_child(_quantize, str(model_dir))
    step(f"serving with an {max_seq}-token cache (child process)")
    s = in_child(_serve, str(model_dir), max_seq, prompt, decode, backend)
    f32_weights = 4 * sum(n for n in _param_counts(args))
    return {"model": model_dir.name, "layers": args.num_hidden_layers, "max_seq": max_seq, "quantize": q,
            "backend": backend,
            "serve": s, "f32_weight_bytes": f32_weights, "board_bytes": BOARD_BYTES, "prompt": prompt,
            "decode": decode}


def _param_counts(args) -> list[int]:
    h, i, n = args.hidden_size, args.intermediate_size, args.num_hidden_layers
    per_layer = h * (args.q_dim + 2 * args.kv_dim) + args.q_dim * h + 3 * h * i
    return [n * per_layer, args.vocab_size * h * (1 if args.tie_word_embeddings else 2)]


def markdown(res: dict) -> str:
    s, q, gb = res["serve"], res["quantize"], 1024**3
    backend = res.get("backend", "cpu-q")
    rows = []
    if q is not None:
        rows.append(("quantized weights (MatMulNBits graphs)",
                     f"{q['weight_bytes'] / gb:.2f} GiB (F32: {res['f32_weight_bytes'] / gb:.2f} GiB)"))
    else:
        rows.append(("weights as F32", f"{res['f32_weight_bytes'] / gb:.2f} GiB"))
    rows += [
        (f"KV cache ({res['max_seq']} rows, F32)", f"{s['kv_bytes'] / gb:.2f} GiB"),
        ("RSS after load (anon / file-backed)", f"{s['after_load']['VmRSS'] / gb:.2f} GiB "
                                                f"({s['after_load']['RssAnon'] / gb:.2f} / {s['after_load']['RssFile'] / gb:.2f})"),
        (f"**peak RSS serving** ({res['prompt']}-token prefill + {res['decode']} decode steps)",
         f"**{s['VmHWM'] / gb:.2f} GiB = {s['VmHWM'] / res['board_bytes']:.0%} of an 8 GB board**"),
        ("start-up estimate (edge_llm/footprint.py)",
         f"{s['estimate'] / gb:.2f} GiB = {s['estimate'] / s['VmHWM']:.2f}x the peak ({s['estimate_parts']})"),
    ]
    if q is not None:
        rows.append(("peak RSS of the one-time quantization", f"{q['VmHWM'] / gb:.2f} GiB ({q['seconds']:.0f} s)"))
    rows += [
        ("prefill / decode on this machine", f"{s['prefill_tps']:.1f} / {s['decode_tps']:.2f} tok/s"),
        ("load time", f"{s['load_s']:.1f} s"),
    ]
    return "\n".join([f"# {backend} memory: {res['model']} ({res['layers']} layers), {res['max_seq']}-token KV cache", "",
                      "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), "",
                      f"numerics `{s['numerics']}`", ""])
