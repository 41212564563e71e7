"""`edge-llm bench quant-variants`: where cpu-q's distance from F32 comes from, one source at a time.

cpu-q's decode path (`MatMulQ`, backends/kernels/_qmatmul.c) and its prefill path (`MatMulNBits`
at accuracy level 4) compute `x @ W` with W in 4- or 8-bit blocks of 32 and x rounded per row and
block of 32 to int8 (dx = max|x| / 127, round half to even). Both errors are emulated here in
numpy on the F32 CPU backend, each switched on alone, so the table says which one costs what:

- the weights: the F32 weights as the GGUF's blocks give them (for a GGUF-imported model they ARE
  the blocks dequantized, so this costs nothing), or re-quantized to 4 bits (round to nearest,
  min/max per block, `nbits.quantize`) for chosen kinds;
- the activations: per block int8 rounding of the input of chosen kinds of matmul (`qkv`, `o`,
  `gu`, `down`, `head`);
- rotations: the input of a kind times an orthogonal matrix before its rounding and times its
  transpose after (`x R` rounded, then `R^T`), which is what a rotation folded into the weights
  does to the activations (the rotated weights' own 4-bit error is the `weights` part).

Each variant is measured as `bench accuracy` measures a backend: teacher-forced top-1 and KL on
the fixed text, and the greedy answers to every acceptance prompt (bench/accuracy.py `PROMPTS`).
cpu-q's real graphs (every quant mode: `q4`, the default, and `q4-int8`) are measured in the same run,
with the two figures the board's choice weighs them by: the weight bytes a decode step streams
(the built directory's manifest; F32: the matmul weights as F32) and the decode rate, timed in this
process next to the F32 backend's (`decode_rate`, best of `DECODE_REPEATS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import os
import time

import numpy as np

from edge_llm.backends.cpu.backend import CPUBackend, rms_norm, swiglu
from edge_llm.bench.accuracy import ANSWER_TOKENS, PROMPTS, TEACHER_TOKENS
from edge_llm.bench.procstat import kernels
from edge_llm.bench.quant import greedy, quality, teacher_logits
from edge_llm.footprint import ModelSizes
from edge_llm.quality_text import QUALITY_TEXT

KINDS = ("qkv", "o", "gu", "down", "head")
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


def act_q8(x: np.ndarray, block: int = 32) -> np.ndarray:
    """x (T, K) rounded per row and block of `block` to int8 as MatMulQ / MatMulNBits(acc 4) do."""
    T, K = x.shape
    xb = x.reshape(T, K // block, block)
    d = np.abs(xb).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0)
    return (np.rint(xb * inv).astype(np.float32) * d).reshape(T, K).astype(np.float32)


def act_q8x2(x: np.ndarray, block: int = 32) -> np.ndarray:
    """Two passes: x rounded as `act_q8`, plus its remainder rounded the same way (what MatMulQ's
    `passes = 2` computes: about 15 bits per activation instead of 8)."""
    x1 = act_q8(x, block)
    return (x1 + act_q8((x - x1).astype(np.float32), block)).astype(np.float32)


@dataclass
class Variant:
    """One emulated source of error: the kinds whose input rows are int8-rounded (`act`), those
    whose weights are re-quantized to 4 bits from F32 (`requant`), and per kind a rotation of the
    input before its rounding (`rotate`: kind -> orthogonal (K, K))."""

    name: str
    act: frozenset[str] = frozenset()
    requant: frozenset[str] = frozenset()
    rotate: dict[str, np.ndarray] = field(default_factory=dict)
    passes: int = 1  # 2: the activations rounded in two passes (act_q8x2)
    bits: int = 4  # of the re-quantized weights


class EmulatedBackend(CPUBackend):
    """The F32 CPU backend with a `Variant`'s rounding applied (module docstring)."""

    def __init__(self, v: Variant) -> None:
        super().__init__()
        self.v = v

    def load(self, args, weights) -> None:
        super().load(args, weights)
        if self.v.requant:
            from edge_llm.backends.cpuq.nbits import dequantize, quantize

            def rq(w: np.ndarray) -> np.ndarray:
                return dequantize(quantize(w, self.v.bits, 32))
            for L in self.layers:
                for kind, attr in (("qkv", "w_qkv"), ("o", "w_o"), ("gu", "w_gu"), ("down", "w_down")):
                    if kind in self.v.requant:
                        setattr(L, attr, rq(getattr(L, attr)))
            if "head" in self.v.requant:
                self.lm_head = np.ascontiguousarray(rq(np.ascontiguousarray(self.lm_head.T)).T)

    def _x(self, kind: str, x: np.ndarray) -> np.ndarray:
        if kind not in self.v.act:
            return x
        r = self.v.rotate.get(kind)
        q = act_q8 if self.v.passes == 1 else act_q8x2
        if r is None:
            return q(np.asarray(x, np.float32))
        return (q((x @ r).astype(np.float32)) @ r.T).astype(np.float32)

    def qkv_fused(self, layer: int, x: np.ndarray) -> np.ndarray:
        L = self.layers[layer]
        y = self._x("qkv", rms_norm(x, L.in_norm, self.eps)) @ L.w_qkv
        return y if L.b_qkv is None else y + L.b_qkv

    def attn_out(self, layer: int, attn: np.ndarray, x: np.ndarray) -> np.ndarray:
        return self._x("o", attn) @ self.layers[layer].w_o + x

    def post_deltas(self, layer: int, attn: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        o = self._x("o", attn) @ self.layers[layer].w_o
        return o, self.mlp_delta(layer, x + o)

    def mlp_delta(self, layer: int, x: np.ndarray) -> np.ndarray:
        L = self.layers[layer]
        gu = self._x("gu", rms_norm(x, L.post_norm, self.eps)) @ L.w_gu
        return self._x("down", swiglu(gu, self.inter)) @ L.w_down

    def logits(self, x: np.ndarray) -> np.ndarray:
        return self._x("head", rms_norm(x, self.final_norm, self.eps)) @ self.lm_head.T


def variants(hidden: int, inter: int) -> list[Variant]:
    """The table's rows: each source alone, then all of them, then rotations against it."""
    from edge_llm.convert.hadamard import orthogonal

    every = frozenset(KINDS)
    r = orthogonal(hidden)
    h_down = _down_hadamard(inter)
    rows = [Variant("int8 activations, all linears (what cpu-q computes)", act=every)]
    rows += [Variant(f"int8 activations, {k} only", act=frozenset({k})) for k in KINDS]
    rows += [Variant(f"int8 activations, all but {k}", act=every - {k}) for k in ("down", "head")]
    rows.append(Variant("int8 activations, all; residual rotation (qkv, gu, head inputs x R)", act=every,
                        rotate={"qkv": r, "gu": r, "head": r}))
    if h_down is not None:
        rows.append(Variant("int8 activations, all; residual rotation + online Hadamard of down's input",
                            act=every, rotate={"qkv": r, "gu": r, "head": r, "down": h_down}))
    rows.append(Variant("two-pass int8 activations (int8 + int8 of the remainder), all linears", act=every, passes=2))
    rows.append(Variant("4-bit RTN weights from F32 (all linears), float activations",
                        requant=frozenset(KINDS) - {"head"}))
    rows.append(Variant("4-bit RTN head from F32, float activations", requant=frozenset({"head"})))
    rows.append(Variant("8-bit RTN weights from F32 (all linears and head), int8 activations", act=every,
                        requant=every, bits=8))
    return rows


def _down_hadamard(inter: int) -> np.ndarray | None:
    """The int8 NPU path's online Hadamard of down_proj's input (convert/npu_mm.py), or None."""
    from edge_llm.convert.hadamard import dense_hadamard
    from edge_llm.convert.npu_mm import down_block
    from edge_llm.errors import ConfigError

    try:
        return dense_hadamard(down_block(inter), inter).astype(np.float32)
    except ConfigError:
        return None


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
        requantized: tuple[str, ...] = (), calibration_tokens: int | None = None) -> dict:
    """The table's rows (`emulate`: the numpy emulations; `cpu_q`: cpu-q's real graphs in every
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
    for v in variants(args.hidden_size, args.intermediate_size) if emulate else ():
        step(v.name)
        m = Model.load(model_dir, backend=EmulatedBackend(v))
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
