"""Greedy token ids of fixed prompts, one process per kernel choice (tests/test_golden.py).

A subprocess, because numpy's BLAS picks its kernel family (OPENBLAS_CORETYPE) once at import.
Each prompt is prefilled into a fresh cache, then N tokens are taken by argmax one row at a time
(no sampling, no stop token: the model's raw greedy continuation, as llama2.c's test pins it).

usage: golden_ids.py MODEL_DIR BACKEND THREADS N PROMPTS_JSON
PROMPTS_JSON: {"name": ["chat" | "raw", text], ...}; "chat" renders text as one user message
through the model's chat template. Prints one JSON line: {"blas": kernel family, "numerics": the
backend's `numerics` (its snapshot identity), "key": what outside the code decides the bits (cpu-q:
onnxruntime's release, MLAS's kernel family, numpy's kernels, AttnRow's path), "ids": {name: [...]}}.
"""

import json
import sys

import numpy as np
from threadpoolctl import threadpool_info

from edge_llm.models.qwen3 import Model
from edge_llm.tokenizer import Tokenizer


def main() -> int:
    model_dir, backend, threads, n, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
        json.loads(sys.argv[5])
    if backend == "cpu-q":
        from edge_llm.backends.cpuq.backend import open_cpu_q
        from edge_llm.checkpoints.gguf_blocks import gguf_blocks

        model = Model.load(model_dir, open_cpu_q(model_dir, "q4", threads=threads, blocks=gguf_blocks(model_dir)))
    else:
        model = Model.load(model_dir, backend)
    tok = Tokenizer.from_dir(model_dir)
    out = {}
    for name, (kind, text) in prompts.items():
        ids = tok.apply_chat_template_ids([{"role": "user", "content": text}]) if kind == "chat" else tok.encode(text)
        cache = model.new_cache(len(ids) + n, check_memory=False)
        logits = model.prefill(ids, cache)
        got = []
        for _ in range(n):
            got.append(int(np.argmax(logits)))
            logits = model.forward([got[-1]], cache)
        out[name] = got
    blas = [i.get("architecture") for i in threadpool_info() if i.get("user_api") == "blas"]
    if backend == "cpu-q":
        import onnxruntime

        from edge_llm.backends import kernels
        from edge_llm.backends.cpuq.backend import kernel_key

        key = f"{kernel_key(onnxruntime.__version__)}:attn-{kernels.isa()}"
    else:
        from edge_llm.backends.cpu.backend import numpy_kernels

        key = numpy_kernels()
    print(json.dumps({"blas": blas[0] if blas else None, "numerics": model.numerics, "key": key, "ids": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
