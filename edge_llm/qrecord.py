"""Measuring a conversion's accuracy record against the F32 model (the record's file, key and bar:
edge_llm/backends/record.py; docs/quantization.md, "Accuracy record").

Two measures, both against the `cpu` backend on the same checkpoint: teacher-forced top-1
agreement and mean KL(F32 || quantized) per token over TEACHER_TOKENS tokens of QUALITY_TEXT
(fixed English text that is not the GPTQ calibration text of convert/calibration_text.py), and
the greedy chat answer to each ACCEPTANCE prompt, token for token, for ANSWER_TOKENS tokens or up
to the first end token (quality_text.ACCEPTANCE). `bench accuracy` and `bench quant` use the same functions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edge_llm.backends.record import ANSWER_TOKENS, TEACHER_TOKENS, write_record
from edge_llm.quality_text import ACCEPTANCE, QUALITY_TEXT
from edge_llm.safetext import printable

log = logging.getLogger(__name__)



def teacher_logits(model, ids: list[int], chunk: int = 128) -> np.ndarray:
    cache = model.new_cache(len(ids) + 8, check_memory=False)
    return np.concatenate([model.forward(ids[a:a + chunk], cache, all_logits=True)
                           for a in range(0, len(ids), chunk)])


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def quality(ref: np.ndarray, other: np.ndarray, ids: list[int]) -> dict:
    """Perplexity of `other` on ids, KL(ref || other) per position, top-1 agreement with ref."""
    lr, lo = log_softmax(ref[:-1]), log_softmax(other[:-1])
    nxt = np.asarray(ids[1:])
    return {"ppl": float(np.exp(-lo[np.arange(len(nxt)), nxt].mean())),
            "kl": float((np.exp(lr) * (lr - lo)).sum(axis=1).mean()),
            "top1": float((lr.argmax(1) == lo.argmax(1)).mean())}


def greedy(model, ids: list[int], steps: int, stop: frozenset[int] = frozenset()) -> list[int]:
    """Greedy tokens after `ids`: `steps` of them, or up to and including the first in `stop`."""
    cache = model.new_cache(len(ids) + steps + 8, check_memory=False)
    logits, out = model.prefill(ids, cache), []
    for _ in range(steps):
        out.append(int(np.argmax(logits)))
        if out[-1] in stop:
            break
        logits = model.forward([out[-1]], cache)
    return out


def measure(ref, other, tok, step: Callable[[str], None] = lambda _m: None) -> dict:
    """`ref` (the F32 model) and `other` (the same checkpoint on the quantized backend) -> the
    record's measures (without its key)."""
    t0 = time.perf_counter()
    ids = tok.encode(QUALITY_TEXT)[:TEACHER_TOKENS]
    step(f"teacher-forced over {len(ids)} tokens")
    q = quality(teacher_logits(ref, ids), teacher_logits(other, ids), ids)
    answers = []
    for p in ACCEPTANCE:
        step(f"greedy answer to {p[:40]!r}")
        chat = tok.apply_chat_template_ids([{"role": "user", "content": p}])
        stop = frozenset(tok.stop_token_ids)
        a, b = greedy(ref, chat, ANSWER_TOKENS, stop), greedy(other, chat, ANSWER_TOKENS, stop)
        answers.append({"prompt": p, "ref": tok.decode(a, skip_special_tokens=True),
                        "other": tok.decode(b, skip_special_tokens=True), "same": a == b, "tokens": len(a)})
    return {"teacher": {"tokens": len(ids), "top1": q["top1"], "kl": q["kl"], "ppl": q["ppl"]},
            "answers": answers, "answer_tokens": ANSWER_TOKENS, "seconds": round(time.perf_counter() - t0, 2)}


def record_backend(root: str | Path, key: str, model_dir: str | Path, backend, name: str,
                   say: Callable[[str], None] = lambda _m: None) -> dict:
    """Measure `backend` (loaded on `model_dir`) against F32 and write the record of the weights
    `key` into `root`; the record."""
    from edge_llm.models.qwen3 import Model
    from edge_llm.tokenizer import Tokenizer

    log.info("measuring the accuracy record of %s against F32 (docs/quantization.md)", printable(str(root)))
    say(f"measuring {name}'s accuracy record against F32")
    other = Model.load(model_dir, backend=backend)
    rec = measure(Model.load(model_dir), other, Tokenizer.from_dir(model_dir),
                  lambda m: say(f"accuracy record: {m}"))
    rec = {"key": key, "backend": name, "numerics": other.numerics, "model": Path(model_dir).name, **rec}
    write_record(root, rec)
    return rec


def record_mm(model_dir: str | Path, mm_dir: str | Path, say: Callable[[str], None] = lambda _m: None) -> dict:
    """The record of an `edge-llm convert npu-mm` directory, measured in the host emulation of the
    int8 matmuls (exact integer products: the bits the board's NPU gives, docs/npu.md)."""
    from edge_llm.backends.npu.backend import open_rknn
    from edge_llm.backends.npu.matmul.decoder import MmManifest

    be = open_rknn(mm_dir, "host", model_dir=model_dir)
    try:
        return record_backend(mm_dir, MmManifest.read(mm_dir).identity(), model_dir, be, "npu-mm", say)
    finally:
        be.close()
