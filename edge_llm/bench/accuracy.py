"""`edge-llm bench accuracy`: a backend against the exact CPU backend (F32 numpy) end to end, on
real text and the real model: what a user of `--backend rknn` or `cpu-q` gets, not per-graph
numbers on synthetic inputs.

Four measures (docs/npu.md "Accuracy on real weights", docs/quantization.md):
- last-token logits of several chat prompts (short questions and a ~200-token one): cosine,
  max |difference|, same argmax;
- teacher-forced over a fixed English text: top-1 agreement with the CPU backend, mean
  KL(cpu || backend) per position, both perplexities;
- the greedy chat answer to a factual question, token for token (until the first end token);
- greedy agreement: `greedy_tokens` greedy tokens after a longer chat prompt (end tokens do not
  stop it), and how many of them the backend produces before its first different token.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from edge_llm.qrecord import greedy, quality, teacher_logits
from edge_llm.quality_text import FACT, QUALITY_TEXT

PROMPTS: tuple[str, ...] = (
    FACT,  # the first of the accuracy record's acceptance prompts (quality_text.ACCEPTANCE)
    "Write one sentence about the sea.",
    "Name three prime numbers and explain why each one is prime.",
    "Summarize the following text in two sentences.\n\n" + QUALITY_TEXT.split("\n\n")[0],
)
TEACHER_TOKENS = 320
ANSWER_TOKENS = 24
GREEDY_TOKENS = 100
GREEDY_PROMPT = "Name three prime numbers and explain why each one is prime."


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def last_logits(model, ids: list[int]) -> np.ndarray:
    cache = model.new_cache(len(ids) + 1, check_memory=False)
    return model.prefill(ids, cache)


def compare(ref, other, tok, step: Callable[[str], None] = lambda _m: None,
            teacher_tokens: int = TEACHER_TOKENS, answer_tokens: int = ANSWER_TOKENS,
            greedy_tokens: int = GREEDY_TOKENS) -> dict:
    """`ref` (the CPU backend) and `other` (two loaded `Model`s of one checkpoint), `tok` its
    tokenizer -> the three measures of the module docstring."""
    res: dict = {"prompts": []}
    for p in PROMPTS:
        step(f"last-token logits: {p[:40]!r}")
        ids = tok.apply_chat_template_ids([{"role": "user", "content": p}])
        a, b = last_logits(ref, ids), last_logits(other, ids)
        top2 = np.argsort(a)[-2:]  # the reference's second and first choice
        res["prompts"].append({"prompt": p[:60], "tokens": len(ids), "cosine": cosine(a, b),
                               "max_abs": float(np.abs(a - b).max()),
                               "argmax_equal": int(a.argmax()) == int(b.argmax()),
                               # how near the reference's own choice was: a flip to its second
                               # choice by less than this is a near tie, not a wrong graph
                               "ref_margin": float(a[top2[1]] - a[top2[0]]),
                               "other_is_ref_second": int(b.argmax()) == int(top2[0])})
    step(f"teacher-forced over {teacher_tokens} tokens")
    ids = tok.encode(QUALITY_TEXT)[:teacher_tokens]
    lr, lo = teacher_logits(ref, ids), teacher_logits(other, ids)
    q = quality(lr, lo, ids)
    res["teacher"] = {"tokens": len(ids), "top1": q["top1"], "kl": q["kl"], "ppl": q["ppl"],
                      "ppl_ref": quality(lr, lr, ids)["ppl"]}
    step("greedy chat answer")
    ids = tok.apply_chat_template_ids([{"role": "user", "content": FACT}])
    ends = (tok.eos_token, "<|im_end|>", "<|endoftext|>")
    stop = frozenset(i for i in (tok.token_to_id(t) for t in ends if t) if i is not None)
    ta, tb = greedy(ref, ids, answer_tokens, stop), greedy(other, ids, answer_tokens, stop)
    res["answer"] = {"question": FACT, "ref": tok.decode(ta, skip_special_tokens=True),
                     "other": tok.decode(tb, skip_special_tokens=True), "same_tokens": ta == tb}
    if greedy_tokens:
        step(f"greedy agreement over {greedy_tokens} tokens")
        ids = tok.apply_chat_template_ids([{"role": "user", "content": GREEDY_PROMPT}])
        ta, tb = greedy(ref, ids, greedy_tokens), greedy(other, ids, greedy_tokens)
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        res["greedy"] = {"prompt": GREEDY_PROMPT, "tokens": len(ta), "same_prefix": same}
    res["min_cosine"] = min(p["cosine"] for p in res["prompts"])
    return res


def markdown(res: dict) -> str:
    lines = [f"# Accuracy of backend {res.get('backend')} vs cpu (F32), {res.get('model')}", "",
             f"numerics: `{res.get('numerics')}`", "",
             "| prompt | tokens | logit cosine | max abs diff | same argmax |", "|---|---|---|---|---|"]
    for p in res["prompts"]:
        lines.append(f"| {p['prompt']!r} | {p['tokens']} | {p['cosine']:.6f} | {p['max_abs']:.3g} | "
                     f"{'yes' if p['argmax_equal'] else '**no**'} |")
    t, a = res["teacher"], res["answer"]
    lines += ["", f"Teacher-forced over {t['tokens']} tokens of fixed English text: top-1 agreement "
              f"{t['top1'] * 100:.1f} %, KL(cpu || backend) {t['kl']:.5f} per token, perplexity {t['ppl']:.3f} "
              f"(cpu {t['ppl_ref']:.3f}).", "",
              f"Greedy answer to {a['question']!r}: cpu {a['ref']!r}; backend {a['other']!r} "
              f"({'the same tokens' if a['same_tokens'] else '**different tokens**'}).", ""]
    if "greedy" in res:
        g = res["greedy"]
        lines += [f"Greedy agreement after {g['prompt']!r}: the first {g['same_prefix']} of {g['tokens']} tokens "
                  "are the CPU's.", ""]
    return "\n".join(lines)


def run(model: str, backend: str, rknn_dir: str | None = None, runner: str = "sim",
        teacher_tokens: int = TEACHER_TOKENS, step: Callable[[str], None] = lambda _m: None,
        quant: str = "q4", greedy_tokens: int = GREEDY_TOKENS) -> dict:
    """Load the model twice (cpu, and `backend`: "rknn" over `rknn_dir` with `runner`, or
    "cpu-q" in mode `quant`) and `compare` them."""
    from edge_llm.checkpoints.default import resolve_model_dir
    from edge_llm.errors import ConfigError
    from edge_llm.models.qwen3 import Model
    from edge_llm.tokenizer import Tokenizer

    model_dir = resolve_model_dir(model)
    if backend == "rknn":
        if not rknn_dir:
            raise ConfigError("backend rknn needs --rknn-dir (an `edge-llm convert rknn` output directory)")
        from edge_llm.backends.npu.backend import open_rknn

        step(f"starting the {runner} runner")
        be = open_rknn(rknn_dir, runner, model_dir=model_dir, progress=lambda s: step(f"loading graph {s.name}"))
    elif backend == "cpu-q":
        from edge_llm.backends.cpuq.backend import open_cpu_q
        from edge_llm.checkpoints.gguf_blocks import gguf_blocks
        from edge_llm.convert.gptq import CpuqInputs

        be = open_cpu_q(model_dir, quant, progress=step, blocks=gguf_blocks(model_dir), calibration=CpuqInputs(model_dir))
    else:
        raise ConfigError(f"bench accuracy compares rknn or cpu-q with cpu, not {backend!r}")
    try:
        other, ref = Model.load(model_dir, backend=be), Model.load(model_dir)
        res = compare(ref, other, Tokenizer.from_dir(model_dir), step, teacher_tokens, greedy_tokens=greedy_tokens)
    finally:
        be.close()
    res.update(backend=backend if backend != "rknn" else f"rknn ({runner})", model=str(model_dir.name),
               numerics=other.numerics)
    return res
