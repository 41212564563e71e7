"""`edge-llm bench quant-variants`: where cpu-q's distance from F32 comes from, one source at a time.

cpu-q's decode path (`MatMulQ`, backends/kernels/_qmatmul.c) and its prefill path (`MatMulNBits`)
compute `x @ W` with W in 4- or 8-bit blocks of 32 and x float (`q4`'s prompt rows), rounded in two
int8 passes (`q4`'s decode) or once per row and block of 32 to int8 (`q4-int8`). Each source of
error is emulated alone in numpy on the F32 CPU backend (bench/quant_emulate.py), so the table says
which one costs what: the activations' rounding per kind of linear, rotations against it, and
(`from_f32`) every weight re-quantized from F32 by round to nearest or GPTQ, plain or rotated, in
4 or 8 bits.

Each variant is measured as `bench accuracy` measures a backend: teacher-forced top-1 and KL on
the fixed text, and the greedy answers to every acceptance prompt (bench/accuracy.py `PROMPTS`).
cpu-q's real graphs (every quant mode: `q4`, the default, and `q4-int8`) are measured in the same run,
with the two figures the board's choice weighs them by: the weight bytes a decode step streams
(the built directory's manifest; F32: the matmul weights as F32) and the decode rate, timed in this
process next to the F32 backend's (`decode_rate`, best of `DECODE_REPEATS`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

from edge_llm.bench.accuracy import ANSWER_TOKENS, PROMPTS, TEACHER_TOKENS
from edge_llm.bench.procstat import kernels
from edge_llm.bench.quant_emulate import EmulatedBackend, variants, weight_variants
from edge_llm.bench.quant import greedy, quality, teacher_logits
from edge_llm.footprint import ModelSizes
from edge_llm.quality_text import QUALITY_TEXT

# the decode rate: DECODE_STEPS one-token forwards after a DECODE_CONTEXT-token prefix of the fixed text
DECODE_CONTEXT, DECODE_STEPS, DECODE_REPEATS = 128, 32, 3


def decode_rate(model, ids: list[int]) -> float:
    """Tokens per second of one-token forwards (cpu-q: its decode graph) after a prefix of `ids`,
    the best of DECODE_REPEATS (the machine may be shared: the fastest run is the model's)."""
    cache = model.new_cache(DECODE_CONTEXT + DECODE_STEPS + 1, check_memory=False)
    best = float("inf")
    for _ in range(DECODE_REPEATS):
        cache.reset()
        model.prefill(ids[:DECODE_CONTEXT], cache)
        t0 = time.perf_counter()
        for i in range(DECODE_STEPS):
            model.forward([ids[DECODE_CONTEXT + i]], cache)
        best = min(best, time.perf_counter() - t0)
    return DECODE_STEPS / best


def measure(ref_logits: np.ndarray, ref_answers: list[list[int]], model, tok, ids: list[int],
            prompts: list[list[int]], stop: frozenset[int]) -> dict:
    """Teacher-forced top-1/KL against the reference's logits, and which greedy answers equal its."""
    q = quality(ref_logits, teacher_logits(model, ids), ids)
    answers = [greedy(model, p, ANSWER_TOKENS, stop) for p in prompts]
    return {"top1": q["top1"], "kl": q["kl"], "ppl": q["ppl"],
            "same_answers": [a == r for a, r in zip(answers, ref_answers)],
            "france": tok.decode(answers[0], skip_special_tokens=True)}


def run(model: str = "default", teacher_tokens: int = TEACHER_TOKENS, cpu_q: bool = True,
        step: Callable[[str], None] = lambda _m: None, emulate: bool = True,
        requantized: tuple[str, ...] = (), calibration_tokens: int | None = None, from_f32: bool = False) -> dict:
    """The table's rows (`emulate`: the numpy emulations of the activations' rounding; `from_f32`:
    those of every weight re-quantized from F32, plain, by GPTQ, rotated, 8 bits (quant_emulate.py
    `weight_variants`); `cpu_q`: cpu-q's real graphs in every
    quant mode, built in $EDGE_LLM_HOME/quant if needed; `requantized`: cpu-q `q4`'s real graphs
    with every weight re-quantized from F32, the GGUF blocks ignored, once per method of
    nbits_export.REQUANT, each in its own directory; GPTQ on `calibration_tokens` tokens, default
    convert/gptq.py CPUQ_TOKENS) against the F32 backend."""
    from edge_llm.backends.cpuq.backend import MODES, built_weight_bytes
    from edge_llm.checkpoints.default import resolve_model_dir
    from edge_llm.config import ModelArgs
    from edge_llm.models.qwen3 import Model
    from edge_llm.tokenizer import Tokenizer

    model_dir = resolve_model_dir(model)
    args = ModelArgs.from_dir(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(QUALITY_TEXT)[:teacher_tokens]
    prompts = [tok.apply_chat_template_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    ends = (tok.eos_token, "<|im_end|>", "<|endoftext|>")
    stop = frozenset(i for i in (tok.token_to_id(t) for t in ends if t) if i is not None)
    step("F32 reference")
    ref = Model.load(model_dir)
    ref_logits = teacher_logits(ref, ids)
    ref_answers = [greedy(ref, p, ANSWER_TOKENS, stop) for p in prompts]
    sizes = ModelSizes.of_dir(model_dir)
    res = {"model": model_dir.name, "teacher_tokens": len(ids), "prompts": [p[:60] for p in PROMPTS],
           "f32_france": tok.decode(ref_answers[0], skip_special_tokens=True), "rows": [],
           "kernels": kernels(), "load": [round(x, 1) for x in os.getloadavg()],
           "decode": {"context": DECODE_CONTEXT, "steps": DECODE_STEPS, "repeats": DECODE_REPEATS},
           "f32": {"weight_bytes": sizes.matmul_f32 + (sizes.embed_f32 if sizes.tied else 0),
                   "decode_tok_s": round(decode_rate(ref, ids), 2)}}
    del ref
    emulated = [*(variants(args.hidden_size, args.intermediate_size) if emulate else ()),
                *(weight_variants(args.hidden_size, args.intermediate_size) if from_f32 else ())]
    for v in emulated:
        step(v.name)
        m = Model.load(model_dir, backend=EmulatedBackend(v, model_dir))
        res["rows"].append({"variant": v.name, **measure(ref_logits, ref_answers, m, tok, ids, prompts, stop)})
    for i, quant in enumerate(MODES if cpu_q else ()):
        from edge_llm.backends.cpuq.backend import open_cpu_q
        from edge_llm.checkpoints.gguf_blocks import gguf_blocks
        from edge_llm.convert.gptq import CpuqInputs

        step(f"cpu-q {quant} (the real graphs)")
        be = open_cpu_q(model_dir, quant, progress=step, blocks=gguf_blocks(model_dir), calibration=CpuqInputs(model_dir))
        try:
            m = Model.load(model_dir, backend=be)
            res["rows"].insert(i, {"variant": f"cpu-q --quant {quant} ({MODES[quant].label}, the real graphs)",
                                   **measure(ref_logits, ref_answers, m, tok, ids, prompts, stop),
                                   "weight_bytes": built_weight_bytes(model_dir, quant),
                                   "decode_tok_s": round(decode_rate(m, ids), 2)})
        finally:
            be.close()
    for method in requantized:
        res["rows"].append({"variant": f"cpu-q --quant q4, every weight re-quantized from F32 by {method}",
                            **_requantized(model_dir, method, calibration_tokens, step,
                                           lambda m: measure(ref_logits, ref_answers, m, tok, ids, prompts, stop),
                                           ids)})
    return res


def _requantized(model_dir, method: str, tokens: int | None, step: Callable[[str], None],
                 measure_model: Callable, ids: list[int]) -> dict:
    """cpu-q q4 built with the GGUF blocks ignored (`Recipe(from_f32=True)`), GPTQ on the calibration
    text of convert/gptq.py: the row's measures and the build's seconds."""
    import time

    from edge_llm.backends.cpuq.backend import Recipe, mode, open_cpu_q, quant_dir, weight_bytes
    from edge_llm.convert.gptq import CPUQ_TOKENS, CpuqInputs
    from edge_llm.models.qwen3 import Model

    step(f"cpu-q q4 from F32 by {method}")
    cal = None if method == "rtn" else CpuqInputs(model_dir, tokens or CPUQ_TOKENS)
    recipe = Recipe(method, from_f32=True)
    t0 = time.perf_counter()
    be = open_cpu_q(model_dir, "q4", progress=step, blocks=None, calibration=cal, recipe=recipe)
    ready = time.perf_counter() - t0
    try:
        m = Model.load(model_dir, backend=be)
        return {**measure_model(m), "open_seconds": round(ready, 1),
                "weight_bytes": weight_bytes(quant_dir(model_dir, mode("q4"), recipe.suffix(cal))),
                "decode_tok_s": round(decode_rate(m, ids), 2)}
    finally:
        be.close()


def markdown(res: dict) -> str:
    lines = [f"# Where cpu-q's error comes from, {res['model']}", "",
             f"Teacher-forced over {res['teacher_tokens']} tokens; greedy answers ({ANSWER_TOKENS} tokens) to "
             f"{len(res['prompts'])} prompts compared with F32's. F32 answers the France question "
             f"{res['f32_france']!r}.", "",
             "| variant | top-1 % | KL | same greedy answers | France answer | weight MB per token | decode tok/s |",
             "|---|---|---|---|---|---|---|"]
    f32 = res["f32"]
    lines.append(f"| F32 (backend cpu, the reference) | 100.0 | 0 | all | {res['f32_france'][:48]!r} | "
                 f"{f32['weight_bytes'] / 1e6:.1f} | {f32['decode_tok_s']:.1f} |")
    for r in res["rows"]:
        same = "".join("y" if s else "n" for s in r["same_answers"])
        mb = f"{r['weight_bytes'] / 1e6:.1f}" if r.get("weight_bytes") else ""
        rate = f"{r['decode_tok_s']:.1f}" if "decode_tok_s" in r else ""
        lines.append(f"| {r['variant']} | {r['top1'] * 100:.1f} | {r['kl']:.5f} | "
                     f"{sum(r['same_answers'])}/{len(r['same_answers'])} ({same}) | {r['france'][:48]!r} | {mb} | {rate} |")
    d, k = res["decode"], res["kernels"]
    lines += ["", f"Decode: {d['steps']} one-token forwards after {d['context']} tokens, best of {d['repeats']}, "
                  f"in this process; numpy BLAS {'; '.join(k['blas'])}; onnxruntime MLAS {k['mlas']}; "
                  f"load average at the start {res['load']}. Weight MB: what one decode step streams "
                  "(emulated rows: none built)."]
    return "\n".join(lines) + "\n"
