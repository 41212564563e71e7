"""One engine process of the restore == recompute tests (tests/test_restore_recompute.py).

mode save:    request prompt[:m] with one token to generate: its m rows (prefilled in chunks, the
              last one as a one-row step) are saved to --kv-dir
mode restore: a fresh process: the whole prompt, restored from that snapshot + tail
mode cold:    the whole prompt computed from scratch, no store
restore and cold write the prompt's last logits, a greedy continuation and the timings to --out.
"""

import argparse
import json
import sys

import numpy as np

from edge_llm.engine import GenerationRequest
from edge_llm.runtime import load_runtime
from edge_llm.settings import Settings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--kv-dir", default=None)
    ap.add_argument("--mode", choices=["save", "restore", "cold"], required=True)
    ap.add_argument("--prompt", required=True, help="json file: the prompt's token ids")
    ap.add_argument("--m", type=int, default=0, help="save: rows of the snapshot")
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--rknn-dir", default=None)
    ap.add_argument("--rknn-runner", default="auto")
    ap.add_argument("--chunk", type=int, default=None)
    a = ap.parse_args()

    prompt = json.load(open(a.prompt))
    extra = {} if a.chunk is None else {"prefill_chunk": a.chunk}
    eng = load_runtime(Settings(model=a.model, disk_kv=a.kv_dir if a.mode != "cold" else None, max_seq=2048,
                                kv_bs=16, backend=a.backend, rknn_dir=a.rknn_dir, rknn_runner=a.rknn_runner,
                                **extra))
    try:
        if a.mode == "save":
            list(eng.generate(GenerationRequest(prompt[:a.m], max_tokens=1)))
            eng.store.flush()
            return
        logits, t = eng.prefill_prompt(prompt)
        first = logits.copy()
        toks = []
        for _ in range(a.steps):  # greedy continuation
            toks.append(int(np.argmax(logits)))
            logits = eng.model.forward([toks[-1]], eng.cache)
        np.savez(a.out, logits=first, tokens=np.array(toks), source=t.cache_source, disk=t.disk_cached_tokens,
                 align=t.align_rows, prefill=t.prefill_tokens, chunk=eng.align)
    finally:
        if eng.store is not None:
            eng.store.close()
        eng.model.backend.close()


if __name__ == "__main__":
    sys.exit(main())
