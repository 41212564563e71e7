"""Run by tests/test_warm_up.py in a fresh process, so the BLAS kernel family can be forced
(OPENBLAS_CORETYPE is read when numpy loads): the same prompt through an engine that never warmed
up and through one after `warm_up`, each on its own fresh load of the model.

usage: warm_up_bits.py MODEL_DIR BACKEND
Prints one JSON line: {"blas": kernel family, "runs": {"cold"|"warmed": {"tokens": 8 greedy ids,
"logits": sha256 of the last logits' bytes, "rows": sha256 of the prompt's K and V rows of every
layer, "numerics": the backend's}}}.
"""

import hashlib
import json
import sys

import numpy as np
from threadpoolctl import threadpool_info

from edge_llm.runtime import load_runtime
from edge_llm.server.state import warm_up
from edge_llm.settings import Settings

PROMPT = list(range(100, 400))  # 300 tokens: two full chunks, a short one and the last token alone


def run(settings: Settings, warmed: bool) -> dict:
    engine = load_runtime(settings)
    try:
        if warmed:
            assert warm_up(engine) > 1
        logits, _ = engine.prefill_prompt(PROMPT)
        rows = hashlib.sha256()
        for layer in range(engine.model.args.num_hidden_layers):
            for kv in (0, 1):
                rows.update(np.ascontiguousarray(engine.cache.rows(layer, kv, 0, len(PROMPT))).tobytes())
        tokens = []
        for _ in range(8):
            tokens.append(int(np.argmax(logits)))
            logits = engine.model.forward(tokens[-1:], engine.cache, decode=True)
        return {"tokens": tokens, "logits": hashlib.sha256(np.ascontiguousarray(logits).tobytes()).hexdigest(),
                "rows": rows.hexdigest(), "numerics": engine.model.numerics}
    finally:
        engine.close()


def main() -> int:
    settings = Settings(model=sys.argv[1], backend=sys.argv[2], disk_kv=None, max_seq=512)
    runs = {"cold": run(settings, False), "warmed": run(settings, True)}
    blas = [i.get("architecture") for i in threadpool_info() if i.get("user_api") == "blas"]
    print(json.dumps({"blas": blas[0] if blas else None, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
