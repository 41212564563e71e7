"""The emulated sources of cpu-q's error (`bench quant-variants`, docs/quantization.md "Where the
error comes from"): the F32 CPU backend with one `Variant`'s rounding switched on.

- Activations: the input rows of chosen kinds of linear (`qkv`, `o`, `gu`, `down`, `head`)
  rounded per row and block of 32 to int8 as `MatMulQ` / `MatMulNBits` (accuracy level 4) do
  (`act_q8`), or in two passes (`act_q8x2`), optionally after a rotation of the input (`x R`
  rounded, then `R^T`: what a rotation folded into the weights does to the activations).
- Weights: chosen kinds re-quantized from F32 in blocks of 32 along K (`nbits`), round to nearest
  or by GPTQ (+ MSE clip) on cpu-q's own calibration rows (convert/gptq.py `CpuqInputs`), optionally
  rotated first (`wrotate`): W' = R^T W quantized against the rotated Hessian R^T H R, and the
  backend computes x @ (R W'~), which equals (x R) @ W'~, the rotated weights an online rotation of
  the input reads. The residual rotation R (a random orthogonal matrix of the hidden size) on the
  inputs of q/k/v, gate/up and the head, and the int8 path's Hadamard on down_proj's input
  (convert/npu_mm.py) are QuaRot's; o_proj keeps its weights unrotated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edge_llm.backends.cpu.backend import CPUBackend, rms_norm, swiglu

KINDS = ("qkv", "o", "gu", "down", "head")
# the rows GPTQ reads in a re-quantized variant: the weight kinds' names in convert/gptq.py's capture
_HESSIAN_KIND = {"qkv": "qkv", "o": "o", "gu": "gate_up", "down": "down", "head": "head"}


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
    whose weights are re-quantized from F32 (`requant`, to `bits` by `method`: "rtn", "gptq" or
    "gptq-mse"), per kind a rotation of the input before its rounding (`rotate`), and whether the
    re-quantized weights are rotated first (`wrotate`, module docstring)."""

    name: str
    act: frozenset[str] = frozenset()
    requant: frozenset[str] = frozenset()
    rotate: dict[str, np.ndarray] = field(default_factory=dict)
    passes: int = 1  # 2: the activations rounded in two passes (act_q8x2)
    bits: int = 4  # of the re-quantized weights
    method: str = "rtn"
    wrotate: dict[str, np.ndarray] = field(default_factory=dict)


class EmulatedBackend(CPUBackend):
    """The F32 CPU backend with a `Variant`'s rounding applied (module docstring); `model_dir`:
    where GPTQ's calibration rows come from (a GPTQ variant only)."""

    def __init__(self, v: Variant, model_dir: str | Path | None = None) -> None:
        super().__init__()
        self.v, self.model_dir = v, model_dir

    def load(self, args, weights) -> None:
        super().load(args, weights)
        if not self.v.requant:
            return
        cal = None
        if self.v.method != "rtn":
            from edge_llm.convert.gptq import CpuqInputs

            cal = CpuqInputs(self.model_dir)
        for i, L in enumerate(self.layers):
            for kind, attr in (("qkv", "w_qkv"), ("o", "w_o"), ("gu", "w_gu"), ("down", "w_down")):
                if kind in self.v.requant:
                    h = None if cal is None else cal.hessian(_HESSIAN_KIND[kind], i)
                    setattr(L, attr, self._requantized(getattr(L, attr), kind, h))
        if "head" in self.v.requant:
            h = None if cal is None else cal.hessian("head", -1)
            self.lm_head = np.ascontiguousarray(self._requantized(np.ascontiguousarray(self.lm_head.T), "head", h).T)

    def _requantized(self, w: np.ndarray, kind: str, h: np.ndarray | None) -> np.ndarray:
        """W (K, N) as the variant's blocks give it back (rotated: R times the rotated blocks)."""
        from edge_llm.backends.cpuq.nbits import dequantize, quantize, quantize_gptq

        r = self.v.wrotate.get(kind)
        if r is not None:
            w = np.ascontiguousarray(r.T @ w, dtype=np.float32)
            h = None if h is None else r.T.astype(np.float64) @ h @ r.astype(np.float64)
        if h is None or w.shape[0] % 32:
            qw = quantize(w, self.v.bits, 32)
        else:
            qw = quantize_gptq(w, h, self.v.bits, 32, clip=self.v.method == "gptq-mse")
        d = dequantize(qw)
        return d if r is None else np.ascontiguousarray(r @ d, dtype=np.float32)

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
    """The activation rows: each source alone, then all of them, then rotations against it; and
    the 4-bit weights re-quantized from F32 alone (float activations)."""
    every = frozenset(KINDS)
    r, h_down = rotations(hidden, inter)
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


def weight_variants(hidden: int, inter: int) -> list[Variant]:
    """Every weight (the head too) re-quantized from F32, float activations (what `q4`'s prompt
    rows compute; its decode's two int8 passes are within KL 0.00001 of float): round to nearest,
    GPTQ + MSE clip, each plain and rotated (QuaRot's rotations, module docstring), and 8 bits."""
    every = frozenset(KINDS)
    r, h_down = rotations(hidden, inter)
    rot = {"qkv": r, "gu": r, "head": r, **({"down": h_down} if h_down is not None else {})}
    return [Variant("4-bit RTN weights from F32, all linears and the head", requant=every),
            Variant("4-bit GPTQ + MSE clip from F32, all linears and the head", requant=every, method="gptq-mse"),
            Variant("4-bit RTN from F32, rotated (R on qkv/gu/head inputs, Hadamard on down's)", requant=every,
                    wrotate=rot),
            Variant("4-bit GPTQ + MSE clip from F32, rotated (as above)", requant=every, method="gptq-mse",
                    wrotate=rot),
            Variant("8-bit RTN weights from F32, all linears and the head", requant=every, bits=8)]


def rotations(hidden: int, inter: int) -> tuple[np.ndarray, np.ndarray | None]:
    """QuaRot's residual rotation (hidden, hidden) and down_proj's input Hadamard (or None)."""
    from edge_llm.convert.hadamard import orthogonal

    return orthogonal(hidden), down_hadamard(inter)


def down_hadamard(inter: int) -> np.ndarray | None:
    """The int8 NPU path's online Hadamard of down_proj's input (convert/npu_mm.py), or None."""
    from edge_llm.convert.hadamard import dense_hadamard
    from edge_llm.convert.npu_mm import down_block
    from edge_llm.errors import ConfigError

    try:
        return dense_hadamard(down_block(inter), inter).astype(np.float32)
    except ConfigError:
        return None
