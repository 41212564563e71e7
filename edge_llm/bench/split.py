"""`edge-llm bench split`: how far split mode (docs/store.md) is from the bitwise path.

Per model and context n: a conversation history of about n tokens is prefilled and saved through a
real SnapshotStore; the request is history + a follow-up question. It is answered (the prompt's
logits, then greedy decoding of `max_tokens` tokens) along

- the bitwise path: every matched row restored (what a server that kept its RAM cache computes,
  bitwise: docs/architecture.md), the reference;
- split paths: only the first k rows loaded (k = a quarter, a half, three quarters of the match,
  cut back to a multiple of the prefill chunk and of the block, as the engine and the split-mode
  gate do), rows [k, n) recomputed behind them;
- recompute: no row loaded (k = 0), the whole prompt computed from scratch.

Reported per path: the largest absolute logit difference from the reference at the prompt's last
token, the same relative to the reference's largest |logit|, whether the argmax (the first greedy
token) agrees, and the greedy agreement: tokens equal to the reference's before the first
difference, out of `max_tokens`. The history's rows are all prefill rows, so every path is
expected to be bitwise the reference (docs/store.md, "Restore and recompute"): a difference
means a batch that differs from the cold run's.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edge_llm.bench.prompts import FOLLOW_UP, sized_history
from edge_llm.bench.ttft import ForcedGate, Runner
from edge_llm.costgate import PIPELINED, CostGate
from edge_llm.engine import GenerationRequest
from edge_llm.kvcache import KVCache
from edge_llm.settings import DEFAULTS
from edge_llm.snapshot.identity import Identity
from edge_llm.snapshot.store import SnapshotStore

log = logging.getLogger(__name__)

FRACTIONS = (0.25, 0.5, 0.75)


def _greedy(runner: Runner, prompt: list[int], gate: CostGate, n: int) -> list[int]:
    eng = runner.engine
    eng.cache.reset()
    eng.gate, eng.restore_mode = gate, PIPELINED
    last = list(eng.generate(GenerationRequest(prompt, max_tokens=n, save_snapshot=False)))[-1]
    return last.completion_ids


def agreement(ref: list[int], other: list[int]) -> int:
    """Tokens equal before the first difference."""
    n = 0
    for a, b in zip(ref, other):
        if a != b:
            break
        n += 1
    return n


def run_model(model_dir: Path, label: str, contexts: list[int], max_tokens: int, kv_bs: int = DEFAULTS.kv_bs,
              step: Callable[[str], None] = lambda _m: None) -> list[dict]:
    from edge_llm.models.qwen3 import Model
    from edge_llm.tokenizer import Tokenizer

    step(f"{label}: loading the model")
    model = Model.load(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    g = model.args.geometry
    rows = []
    with tempfile.TemporaryDirectory(prefix="edge-llm-split-") as kv:
        store = SnapshotStore(kv, Identity.for_model(model_dir, model.args, model.backend.numerics), g, kv_bs=kv_bs,
                              max_files=len(contexts) + 1, max_tokens=max(contexts), compact_idle=None)
        store.scan()
        cache = KVCache(g, max_seq=max(contexts) + 64 + max_tokens + kv_bs, kv_bs=kv_bs)
        runner = Runner(model, tok, cache, store)
        live = CostGate(g.kv_bytes_per_token)
        try:
            for n in contexts:
                history = tok.encode(sized_history(tok.encode, n, f"Split {n}"))
                prompt = history + tok.encode(FOLLOW_UP)
                step(f"{label}, {n}: the history's snapshot")
                runner.run(history, ForcedGate(live, 0), PIPELINED)  # the cold run of turn 1, saved
                store.save_async(cache)
                store.flush()
                m = len(history)
                unit = math.lcm(kv_bs, runner.engine.align)
                loads = [None] + sorted({int(m * f) // unit * unit for f in FRACTIONS} - {0}) + [0]
                step(f"{label}, {n}: the bitwise path")
                _, ref = runner.run(prompt, ForcedGate(live, None), PIPELINED)
                ref_ids = _greedy(runner, prompt, ForcedGate(live, None), max_tokens)
                scale = float(np.max(np.abs(ref)))
                for k in loads[1:]:
                    step(f"{label}, {n}: load {k} of {m} rows")
                    r, logits = runner.run(prompt, ForcedGate(live, k), PIPELINED)
                    ids = _greedy(runner, prompt, ForcedGate(live, k), max_tokens)
                    diff = float(np.max(np.abs(logits.astype(np.float64) - ref)))
                    rows.append({"model": label, "context": n, "prompt": len(prompt), "matched": m, "loaded": r["loaded"],
                                 "recomputed": r["computed"], "max_abs": diff, "max_rel": diff / scale,
                                 "logit_scale": scale, "argmax_same": int(np.argmax(logits)) == int(np.argmax(ref)),
                                 "bitwise": bool(np.array_equal(logits.view(np.uint32), ref.view(np.uint32))),
                                 "greedy_agree": agreement(ref_ids, ids), "greedy_n": len(ref_ids),
                                 "text_ref": tok.decode(ref_ids), "text": tok.decode(ids)})
                    log.info("split %s %d k=%d: max abs %.3g rel %.3g greedy %d/%d", label, n, k, diff,
                             diff / scale, rows[-1]["greedy_agree"], len(ref_ids))
        finally:
            store.close()
    return rows


def run(models: list[tuple[str, Path]], contexts: list[int], max_tokens: int, kv_bs: int = DEFAULTS.kv_bs,
        step: Callable[[str], None] = lambda _m: None) -> dict:
    out = {"contexts": contexts, "max_tokens": max_tokens, "kv_bs": kv_bs, "load_before": os.getloadavg(), "rows": []}
    for label, model_dir in models:
        out["rows"] += run_model(model_dir, label, contexts, max_tokens, kv_bs, step)
    out["load_after"] = os.getloadavg()
    return out


def markdown(res: dict) -> str:
    lines = ["| model | prompt tokens | rows loaded / matched | max abs logit diff | relative to max abs logit "
             "| same first token | greedy tokens equal before the first difference |",
             "|---|---:|---:|---:|---:|:---:|---:|"]
    for r in res["rows"]:
        what = "recompute all" if r["loaded"] == 0 else f"{r['loaded']} / {r['matched']}"
        lines.append(f"| {r['model']} | {r['prompt']} | {what} | {r['max_abs']:.3g} | {r['max_rel']:.2e} "
                     f"| {'yes' if r['argmax_same'] else 'no'} | {r['greedy_agree']} / {r['greedy_n']} |")
    lines += ["", "Reference: every matched row restored (bitwise the RAM path). Split rows load the first k rows "
              "and recompute the rest behind them (pipelined), as split mode does; 'recompute all' loads none. "
              "Greedy decoding (temperature 0)."]
    return "\n".join(lines) + "\n"
