"""One engine process for the bit-exact restore tests (tests/test_restore_exact.py,
tests/test_restore_recompute.py, test_rknn_sim.py, test_board_emulated.py).

mode warm:     request 1 (saved to disk), then request X continued from the RAM cache
mode save:     request 1's first --m ids, one token generated: its m rows saved to disk
mode restored: a fresh process: request X restored from the disk snapshot
mode oneshot:  request X computed from scratch with no cache at all
X is "ext" (request 1 + its answer + a follow-up), "partial" (request 1's first k ids + others)
or "whole" (request 1 itself). Writes logits, greedy continuation, cache rows and timings of X
to --out (npz).
"""

import argparse
import json
import sys

import numpy as np

from edge_llm.engine import GenerationRequest
from edge_llm.runtime import load_runtime
from edge_llm.settings import Settings

FOLLOW_UP = [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1100]


def build_x(spec: str, prompt: list[int], completion: list[int]) -> list[int]:
    if spec == "whole":
        return prompt
    if spec == "ext":
        return prompt + completion + FOLLOW_UP
    k = len(prompt) * 2 // 3  # partial: diverge inside the snapshot
    return prompt[:k] + FOLLOW_UP


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--kv-dir", required=True)
    ap.add_argument("--mode", choices=["warm", "save", "restored", "oneshot"], required=True)
    ap.add_argument("--x", choices=["ext", "partial", "whole"], required=True)
    ap.add_argument("--m", type=int, default=0, help="save: rows of the snapshot")
    ap.add_argument("--chunk", type=int, default=None, help="prefill_chunk (default: the setting's)")
    ap.add_argument("--state", required=True, help="json: request-1 prompt ids (in), completion (warm out)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--rknn-dir", default=None)
    ap.add_argument("--rknn-runner", default="auto")
    a = ap.parse_args()

    state = json.load(open(a.state))
    disk = a.kv_dir if a.mode != "oneshot" else None
    extra = {} if a.chunk is None else {"prefill_chunk": a.chunk}
    eng = load_runtime(Settings(model=a.model, disk_kv=disk, max_seq=1024, kv_bs=16, backend=a.backend,
                                rknn_dir=a.rknn_dir, rknn_runner=a.rknn_runner, **extra))
    if a.mode == "save":
        list(eng.generate(GenerationRequest(state["prompt"][:a.m], max_tokens=1)))
        eng.store.close()  # flushes the save
        return
    if a.mode == "warm":
        last = list(eng.generate(GenerationRequest(state["prompt"], max_tokens=6)))[-1]
        state["completion"] = last.completion_ids
        eng.store.flush()
        json.dump(state, open(a.state, "w"))
    x = build_x(a.x, state["prompt"], state.get("completion", []))
    steps = {"n": 0}
    real_step = eng.model.backend.row_step
    if real_step is not None:  # count the one-row calls the continuation makes through it
        def counted(*args, **kw):
            steps["n"] += 1
            return real_step(*args, **kw)
        eng.model.backend.row_step = counted
    logits, t = eng.prefill_prompt(x)
    first_logits = logits.copy()
    toks = []
    for _ in range(a.steps):  # greedy continuation, no snapshot saved for X
        toks.append(int(np.argmax(logits)))
        logits = eng.model.forward([toks[-1]], eng.cache)
    n = len(x)
    np.savez(a.out, logits=first_logits, last_logits=logits, tokens=np.array(toks),
             k=eng.cache.data[:, 0, :n].copy(), v=eng.cache.data[:, 1, :n].copy(),
             source=t.cache_source, cached=t.ram_cached_tokens + t.disk_cached_tokens,
             prefill_tokens=t.prefill_tokens, n=n, row_steps=steps["n"], disk=t.disk_cached_tokens,
             align=t.align_rows, chunk=eng.align)
    if eng.store is not None:
        eng.store.close()


if __name__ == "__main__":
    sys.exit(main())
