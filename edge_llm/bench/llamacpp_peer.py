"""The llama.cpp peer of `edge-llm bench quant`, run by the python of its own venv
(tools/setup-bench-llamacpp.sh). Imports numpy and llama_cpp only, nothing of edge_llm.

    <llama venv>/bin/python llamacpp_peer.py GGUF THREADS N_CTX

Reads one JSON request per stdin line, answers one JSON line on stdout:
  {"op": "speed", "ids": [...], "decode": 32, "tail": 32, "state": PATH}
      -> prefill_s (all ids), decode_s (`decode` one-token steps after them, fed ids cyclically), save_bytes,
         restore_s (state file of ids[:-tail] read cold + tail evaluated + logits)
  {"op": "logits", "ids": [...], "out": PATH}  -> float32 logits of every position saved to PATH
  {"op": "info"} -> llama-cpp-python version, system info;  {"op": "quit"}
Token ids come from the caller (the same ids edge-llm computes on: the GGUF's vocabulary).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> int:
    import llama_cpp
    from llama_cpp import Llama, LlamaState

    gguf, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    kw = dict(n_threads=threads, n_threads_batch=threads, n_batch=512, n_ubatch=512, verbose=False)
    llm = Llama(model_path=gguf, n_ctx=n_ctx, **kw)
    scorer = None
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        if op == "quit":
            break
        if op == "info":
            out = {"version": llama_cpp.__version__, "system": llama_cpp.llama_print_system_info().decode()}
        elif op == "speed":
            ids, tail = req["ids"], req["tail"]
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(req["decode"]):
                llm.eval([ids[i % len(ids)]])  # any ids: the speed of one-token steps
            decode = time.perf_counter() - t0
            # restore: the state of ids[:-tail] on disk, read back cold, then the tail
            llm.reset()
            llm.eval(ids[:-tail])
            st = llm.save_state()
            with open(req["state"], "wb") as f:
                f.write(st.llama_state)
            _drop_cache(req["state"])
            llm.reset()
            t0 = time.perf_counter()
            with open(req["state"], "rb") as f:
                data = f.read()
            llm.load_state(LlamaState(input_ids=st.input_ids, scores=st.scores, n_tokens=st.n_tokens,
                                      llama_state=data, llama_state_size=len(data), seed=st.seed))
            llm.eval(ids[-tail:])  # computes the last position's logits, as our prefill does
            restore = time.perf_counter() - t0
            os.unlink(req["state"])
            out = {"prefill_s": prefill, "decode_s": decode, "restore_s": restore, "state_bytes": len(data)}
        elif op == "logits":
            ids = req["ids"]
            if scorer is None or scorer.n_ctx() < len(ids):
                scorer = Llama(model_path=gguf, n_ctx=max(512, len(ids)), logits_all=True, **kw)
            scorer.reset()
            scorer.eval(ids)
            np.save(req["out"], np.asarray(scorer.scores[:len(ids)], dtype=np.float32))
            out = {"ok": True}
        else:
            out = {"error": f"unknown op {op!r}"}
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
