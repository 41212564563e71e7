"""What restore == recompute costs and where it ends (docs/store.md, "Restore and recompute").

    python tools/bench_alignment.py rows   --model DIR [--backend cpu|cpu-q]
    python tools/bench_alignment.py reuse  --model DIR [--backend cpu|cpu-q]
    python tools/bench_alignment.py chunks --model DIR [--backend cpu|cpu-q] [--rows 2048] [--chunks 32,64,128]
    python tools/bench_alignment.py align  --model DIR [--backend cpu|cpu-q] [--contexts 2048,8192]
    python tools/bench_alignment.py decode --model DIR [--backend cpu|cpu-q] [--tokens 64]

rows:   why the rule is needed, on the real weights: layer 0's qkv of the first rows of a
        200-row batch, computed in batches of 1..128 rows, bitwise equal to the rows inside the
        200-row batch or not (numpy's BLAS for cpu, MatMulNBits for cpu-q); and attention of
        rows [100, 200) computed as one chunk from row 0 or as a chunk that starts at row 100.
        Run it again under OPENBLAS_CORETYPE=Haswell, or `qemu-x86_64-static -cpu Haswell`.
reuse:  a reused prefix of m unaligned rows + the tail vs a cold prefill, with the rule and
        without it (the prefix not cut back): bitwise or the largest logit difference.
chunks: prefill rows/s of --rows random tokens per chunk size: the alignment unit is the chunk,
        so this is what a smaller unit costs every prefill.
align:  the rows a reused prefix gives up so that the tail is batched as in a cold run are
        recomputed: the time of r of them (r = the mean 64 and the worst 127 of a 128-row chunk)
        at context c, next to the time of a whole chunk there. The cache rows before c are random
        (attention costs the same), so an 8K context needs no 8K prefill.
decode: rows an answer wrote one at a time (decode steps), resent as history, reused from the
        cache vs a cold prefill of the same prompt: the largest logit difference at the prompt's
        last token and the greedy agreement over --tokens tokens.
Prints one JSON line per measurement, with the BLAS kernel family (threadpoolctl) and the CPU's
ISA. For a benchmark, run it with OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE unset.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from threadpoolctl import threadpool_info

from edge_llm.bench.restore import fill_random
from edge_llm.engine import GenerationRequest
from edge_llm.runtime import load_runtime
from edge_llm.settings import Settings


def blas() -> str:
    info = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    return f"{info[0].get('internal_api')} {info[0].get('architecture')}" if info else "none"


def isa() -> str:
    from edge_llm.backends.cpuq.backend import kernel_isa  # the CPU features that pick the kernels

    return kernel_isa()


def align(a) -> None:
    eng = load_runtime(Settings(model=a.model, backend=a.backend, disk_kv=None, max_seq=max(a.contexts) + 256))
    model, cache, chunk = eng.model, eng.cache, eng.align
    rng = np.random.default_rng(0)
    ids = rng.integers(100, min(model.args.vocab_size, 20000), size=max(a.contexts) + chunk).tolist()
    def at(c: int, r: int) -> float:
        """Best-of seconds to prefill r rows after c random cache rows."""
        times = []
        for _ in range(a.repeats):
            cache.truncate(0)
            fill_random(cache, c, rng)
            t0 = time.perf_counter()
            model.prefill(ids[c:c + r], cache, chunk=chunk, logits=False)
            times.append(time.perf_counter() - t0)
        return min(times)

    for c in a.contexts:
        full = at(c, chunk)
        for r in (64, chunk - 1):
            ms = at(c, r) * 1e3
            print(json.dumps({"what": "align", "model": eng.model_dir.name, "backend": a.backend, "context": c,
                              "chunk": chunk, "rows": r, "ms": round(ms, 1), "chunk_ms": round(full * 1e3, 1),
                              "blas": blas(), "isa": isa()}), flush=True)


def rows(a) -> None:
    from edge_llm.models.qwen3 import attention

    eng = load_runtime(Settings(model=a.model, backend=a.backend, disk_kv=None, max_seq=256))
    be, args = eng.model.backend, eng.model.args
    ids = np.random.default_rng(0).integers(100, min(args.vocab_size, 20000), size=200)
    x = np.ascontiguousarray(be.embed(ids), dtype=np.float32)
    ref = np.concatenate(be.qkv(0, x), axis=1)
    differ = []
    for m in (1, 2, 3, 4, 8, 9, 16, 32, 64, 128):
        got = np.concatenate(be.qkv(0, np.ascontiguousarray(x[:m])), axis=1)
        if not np.array_equal(got.view(np.uint32), ref[:m].view(np.uint32)):
            differ.append([m, float(np.abs(got - ref[:m]).max())])
    # attention of queries [100, 200): in one chunk from row 0, or in a chunk that starts at row 100
    H, n_kv, D = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    rng = np.random.default_rng(1)
    q = rng.standard_normal((200, H, D), dtype=np.float32)
    k, v = (rng.standard_normal((200, n_kv * D), dtype=np.float32) for _ in range(2))
    whole = attention(q, k, v, 0, n_kv)[100:]
    tail = attention(np.ascontiguousarray(q[100:]), k, v, 100, n_kv)
    print(json.dumps({"what": "rows", "model": eng.model_dir.name, "backend": a.backend,
                      "qkv_batches_differing_from_200": differ,
                      "attention_tail_chunk_bitwise": bool(np.array_equal(whole.view(np.uint32), tail.view(np.uint32))),
                      "attention_max_abs": float(np.abs(whole - tail).max()), "blas": blas(), "isa": isa()}),
          flush=True)


def reuse(a) -> None:
    """The rule's effect, in one process on the real model: the first m rows of a 300-token
    prompt in the cache, then the whole prompt; against a cold prefill of it. With the rule (the
    engine as it is) and without it (the reused prefix not cut back: `Engine._aligned` replaced
    for this measurement only), for unaligned m."""
    from edge_llm.engine import Engine

    eng = load_runtime(Settings(model=a.model, backend=a.backend, disk_kv=None, max_seq=512))
    ids = eng.tokenizer.encode(" ".join(f"Line {i}: the crate labelled {i * 11 % 97} holds {i * 7 % 13} green "
                                        "pears." for i in range(80)))[:300]
    eng.cache.reset()
    cold = eng.prefill_prompt(ids)[0].copy()
    keep = Engine._aligned
    for rule in (True, False):
        if not rule:
            Engine._aligned = lambda self, plan, m, spans, ram=False: m  # noqa: E731
        for m in a.ms:
            eng.cache.reset()
            eng.prefill_prompt(ids[:m])
            got, t = eng.prefill_prompt(ids)
            print(json.dumps({"what": "reuse", "model": eng.model_dir.name, "backend": a.backend, "rule": rule,
                              "m": m, "reused": t.ram_cached_tokens, "chunk": eng.align,
                              "bitwise": bool(np.array_equal(got.view(np.uint32), cold.view(np.uint32))),
                              "max_abs_logit_diff": float(np.abs(got - cold).max()), "blas": blas(),
                              "isa": isa()}), flush=True)
    Engine._aligned = keep


def chunks(a) -> None:
    eng = load_runtime(Settings(model=a.model, backend=a.backend, disk_kv=None, max_seq=a.rows + 8))
    ids = np.random.default_rng(0).integers(100, min(eng.model.args.vocab_size, 20000), size=a.rows).tolist()
    for c in a.chunks:
        times = []
        for _ in range(a.repeats):
            eng.cache.truncate(0)
            t0 = time.perf_counter()
            eng.model.prefill(ids, eng.cache, chunk=c, logits=False)
            times.append(time.perf_counter() - t0)
        print(json.dumps({"what": "chunks", "model": eng.model_dir.name, "backend": a.backend, "rows": a.rows,
                          "chunk": c, "rows_per_s": round(a.rows / min(times), 1), "blas": blas(), "isa": isa()}),
              flush=True)


def speed(a) -> None:
    """The hot paths the restore rule and the backend seam run: prefill rows/s at each --chunks and
    decode tok/s of --tokens one-row steps after it (cpu-q: its decode graph, or with
    --no-decode-graph the per-layer path whose post fuses the next qkv). Best of --repeats."""
    eng = load_runtime(Settings(model=a.model, backend=a.backend, disk_kv=None, max_seq=a.rows + a.tokens + 8,
                                decode_graph=a.decode_graph))
    ids = np.random.default_rng(0).integers(100, min(eng.model.args.vocab_size, 20000), size=a.rows).tolist()
    for c in a.chunks:
        pre, dec = [], []
        for _ in range(a.repeats):
            eng.cache.truncate(0)
            t0 = time.perf_counter()
            logits = eng.model.prefill(ids, eng.cache, chunk=c)
            t1 = time.perf_counter()
            for _ in range(a.tokens):
                logits = eng.model.forward([int(np.argmax(logits))], eng.cache)
            pre.append(t1 - t0)
            dec.append(time.perf_counter() - t1)
        print(json.dumps({"what": "speed", "model": eng.model_dir.name, "backend": a.backend,
                          "decode_graph": a.decode_graph, "rows": a.rows, "chunk": c,
                          "prefill_rows_per_s": round(a.rows / min(pre), 1),
                          "decode_tok_per_s": round(a.tokens / min(dec), 1), "blas": blas(), "isa": isa()}),
              flush=True)


def decode(a) -> None:
    """Turn 1 answered greedily (decode rows), turn 2 = turn 1 + answer + follow-up from RAM vs cold."""
    from edge_llm.checkpoints.default import resolve_model_dir
    from edge_llm.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model_dir(a.model))
    text = " ".join(f"Line {i}: the crate labelled {i * 11 % 97} holds {i * 7 % 13} green pears." for i in range(60))
    p1 = tok.encode(text)[:a.prompt]
    eng = load_runtime(Settings(model=a.model, backend=a.backend, disk_kv=None, max_seq=2048))
    answer = list(eng.generate(GenerationRequest(p1, max_tokens=a.tokens)))[-1].completion_ids
    x = p1 + answer + tok.encode(" Which crate holds the most pears?")

    def continue_(logits):
        toks = []
        for _ in range(a.tokens):
            toks.append(int(np.argmax(logits)))
            logits = eng.model.forward([toks[-1]], eng.cache)
        return toks

    warm, t = eng.prefill_prompt(x)
    warm = warm.copy()
    warm_toks = continue_(warm)
    reused = t.ram_cached_tokens
    eng.cache.reset()
    cold, _ = eng.prefill_prompt(x)
    cold = cold.copy()
    cold_toks = continue_(cold)
    agree = next((i for i, (p, q) in enumerate(zip(warm_toks, cold_toks)) if p != q), len(cold_toks))
    decoded = max(0, reused - (len(p1) - 1))  # reused rows that decode steps (or the last prompt token) wrote
    print(json.dumps({"what": "decode", "model": eng.model_dir.name, "backend": a.backend, "prompt": len(x),
                      "reused": reused, "decode_rows_reused": decoded, "chunk": eng.align,
                      "max_abs_logit_diff": float(np.abs(warm - cold).max()), "logit_scale": float(np.abs(cold).max()),
                      "bitwise": bool(np.array_equal(warm.view(np.uint32), cold.view(np.uint32))),
                      "greedy_agree": agree, "greedy_n": len(cold_toks), "blas": blas(), "isa": isa()}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["rows", "reuse", "chunks", "align", "decode", "speed"])
    ap.add_argument("--model", default="default")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--contexts", type=lambda v: [int(x) for x in v.split(",")], default=[2048, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=2048, help="chunks: prompt rows")
    ap.add_argument("--ms", type=lambda v: [int(x) for x in v.split(",")], default=[37, 161, 250],
                    help="reuse: rows in the cache before the whole prompt")
    ap.add_argument("--chunks", type=lambda v: [int(x) for x in v.split(",")], default=[32, 64, 128])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=200, help="decode: turn 1's prompt tokens")
    ap.add_argument("--no-decode-graph", dest="decode_graph", action="store_false",
                    help="speed, cpu-q: decode through the per-layer graphs, not the one-row decode graph")
    a = ap.parse_args()
    {"rows": rows, "reuse": reuse, "chunks": chunks, "align": align, "decode": decode, "speed": speed}[a.what](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
