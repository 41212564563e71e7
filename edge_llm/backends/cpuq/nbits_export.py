"""The quantized `linear` of the ONNX exporter: `MatMulNBits` nodes from GGUF blocks or F32.

`QuantLinear` is passed to `onnx_export.export_graph_set(linear=...)`. For every weight the
exporter writes (a `WeightKey`: a layer's fused qkv, o, gate, up (or fused gate_up), down, or a head part) it looks
for the tensors' original blocks in the GGUF the model was imported from (a `nbits.BlockSource`
the caller passes: checkpoints/gguf_blocks.py). When every part has a
type `nbits.from_gguf` holds exactly, and the blocks dequantize bitwise to the F32 tensor the
model directory holds, the blocks are written as they are ("exact"; parts of one fused weight in
4 and 8 bits all in 8); otherwise the F32 values are quantized ("re-quantized") to the mode's bit
width, or to 8 bits when the file stored them in more than 4 (`WIDE_TYPES`: Q6_K, ...), by `requant`: "rtn" (round to nearest,
min/max per block), "gptq" (GPTQ on the caller's `nbits.Calibration`, backends/gptq.py) or
"gptq-mse" (GPTQ with each block's range by the MSE clip); without a calibration, round to
nearest (`rounded` in the report: what a weight got, "rtn" where GPTQ cannot run: K not whole
blocks, no rows). `report` lists the decision per weight.

Graph form of one weight: `MatMulNBits(x, B, scales[, zero_points])`, plus
`ReduceSum(Reshape(x, (T, K/block, block))) @ mins` when the blocks carry a float minimum (Q4_1).
The decode graph's linears (`QuantLinear(row_op=True)`) are instead one node of our own,
`ai.edge_llm.MatMulQ` (backends/kernels/_qmatmul.c), when the weight is 4- or 8-bit in 32-blocks: the same
blocks, regrouped into its records (`qmatmul_records`), the minimum included. It is faster for the
few rows of a decode step and gives the same bits on every CPU; prefill keeps `MatMulNBits`
(docs/quantization.md, "The weight operator").
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from edge_llm.backends.kernels import OPS_DOMAIN, QMATMUL_OP
from edge_llm.backends.graph.onnx_export import MS_DOMAIN, GraphBuilder, WeightKey
from edge_llm.backends.cpuq.nbits import (
    BlockSource,
    Calibration,
    QuantWeight,
    SourceTensor,
    center,
    concat,
    dequantize,
    from_gguf,
    permute_rows,
    quantize,
    quantize_gptq,
    rows,
    widen,
)
from edge_llm.config import ModelArgs
from edge_llm.settings import CPUQ_REQUANTS

log = logging.getLogger(__name__)

REQUANT = CPUQ_REQUANTS  # how a weight without exact blocks is quantized (module docstring)
# GGUF block types of more than 4 bits: re-quantized (where not held exactly) to 8 bits, not 4
WIDE_TYPES = frozenset({"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"})
_PARTS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
          "gate": ("mlp.gate_proj",), "up": ("mlp.up_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
          "down": ("mlp.down_proj",)}


class QuantLinear:
    """`onnx_export.Linear` writing `MatMulNBits`; see the module docstring. `source`: the
    blocks of the file the model was imported from (None: every weight is quantized here)."""

    def __init__(self, args: ModelArgs, source: BlockSource | None, bits: int, block: int, accuracy_level: int,
                 row_op: bool = False, passes: int = 1, requant: str = "rtn", calibration: Calibration | None = None,
                 done: dict[tuple, tuple[QuantWeight, str]] | None = None):
        self.args, self.bits, self.block, self.accuracy_level = args, bits, block, accuracy_level
        self.passes = passes  # MatMulQ's activation passes (row_op)
        self.row_op = row_op  # MatMulQ where it holds the weight (the decode graph)
        self.report: list[dict[str, Any]] = []
        self.source = source
        if requant not in REQUANT:
            raise ValueError(f"requant {requant!r}: one of {REQUANT}")
        self.requant = requant if calibration is not None else "rtn"
        self.calibration = calibration
        # re-quantized weights by (tensors, columns), shared by the linears of one build (the
        # per-layer graphs and the decode graph hold the same weights; GPTQ runs once per weight)
        self.done = {} if done is None else done

    # ---- the Linear protocol ----------------------------------------------------------------
    def __call__(self, g: GraphBuilder, x: str, w: np.ndarray, bias: np.ndarray | None, out: str | None,
                 key: WeightKey) -> str:
        qw = center(self.weight(w, key))
        o = out if bias is None else None
        if self.row_op and qmatmul_holds(qw):
            y = write_qmatmul(g, x, qw, o, self.passes)
        else:
            y = write_nbits(g, x, qw, self.accuracy_level, o)
        return y if bias is None else g.op("Add", [y, g.const("b", bias)], out=out)

    # ---- choosing the blocks ----------------------------------------------------------------
    def names(self, key: WeightKey) -> list[str]:
        p = self.args.weight_prefix
        if key.kind == "head":
            return [f"{p}embed_tokens.weight" if self.args.tie_word_embeddings else self.args.lm_head_name]
        return [f"{p}layers.{key.index}.{part}.weight" for part in _PARTS[key.kind]]

    def weight(self, w: np.ndarray, key: WeightKey) -> QuantWeight:
        """Exact GGUF blocks when they reproduce `w` (K, N) bitwise, else `w` quantized."""
        names = self.names(key)
        qw = self._from_gguf(names, key)
        if qw is not None and not np.array_equal(dequantize(qw).view(np.uint32), w.view(np.uint32)):
            log.warning("%s: GGUF blocks of %s differ from the model's F32 weights; re-quantizing",
                        self.source.path if self.source else None, names[0])
            qw = None
        method = None
        if qw is None:
            qw, method = self._requantize(w, key, names)
        self.report.append({"weight": f"{key.kind}{'' if key.kind == 'head' else key.index}",
                            "tensors": names, "bits": qw.bits, "origin": qw.origin, "exact": qw.exact,
                            "bytes": qw.nbytes, **({} if method is None else {"requant": self.requant,
                                                                              "rounded": method})})
        return qw

    def method(self, w: np.ndarray) -> str:
        """How a weight W (K, N) without exact blocks is quantized: GPTQ needs K in whole blocks."""
        return self.requant if w.shape[0] % self.block == 0 else "rtn"

    def _requantize(self, w: np.ndarray, key: WeightKey, names: list[str]) -> tuple[QuantWeight, str]:
        done_key = (tuple(names), key.vocab)
        if done_key not in self.done and len(names) > 1 and all(((n,), key.vocab) in self.done for n in names):
            parts = [self.done[((n,), key.vocab)] for n in names]  # e.g. gate and up, asked alone before
            if len({m for _, m in parts}) == 1:
                self.done[done_key] = concat([q for q, _ in parts]), parts[0][1]
        if done_key in self.done:
            return self.done[done_key]
        types = {t.type_name for t in map(self._stored, names) if t is not None}
        src = "+".join(sorted(types) or ["F32"])
        # a GGUF's blocks of more than 4 bits that cannot be held exactly (Q6_K, ...) keep 8 bits:
        # the file's author chose that precision for them (docs/quantization.md, "The weight format")
        bits = 8 if types & WIDE_TYPES else self.bits
        method = self.method(w)
        h = None if method == "rtn" else self.calibration.hessian(key.kind, key.index)
        if h is None:
            if method != "rtn":
                log.info("no calibration rows for %s %d: rounding it to nearest", key.kind, key.index)
                method = "rtn"
            qw = quantize(w, bits, self.block, origin=src)
        else:
            qw = quantize_gptq(w, h, bits, self.block, origin=src, clip=method == "gptq-mse")
        self.done[done_key] = qw, method
        if key.kind == "gate_up":  # the columns are independent: gate and up alone are its halves
            half = qw.N // 2
            for n, (lo, hi) in zip(names, ((0, half), (half, qw.N))):
                self.done[((n,), key.vocab)] = rows(qw, lo, hi), method
        return qw, method

    def _stored(self, name: str) -> SourceTensor | None:
        return None if self.source is None else self.source.tensor(name)

    def _from_gguf(self, names: list[str], key: WeightKey) -> QuantWeight | None:
        stored = [self._stored(n) for n in names]
        if any(t is None for t in stored):
            return None
        parts = []
        for t in stored:
            qw = from_gguf(t.type_name, t.data, t.K, t.N)
            if qw is None:
                return None
            if t.order is not None:  # e.g. llama.cpp's Q/K row permutation, undone
                qw = permute_rows(qw, t.order)
            parts.append(qw)
        if len({p.block for p in parts}) != 1:
            return None
        bits = max(p.bits for p in parts)  # e.g. q in Q4_K and v in Q8_0: one MatMulNBits holds one width
        qw = concat([widen(p, bits) for p in parts])
        return rows(qw, *key.vocab) if key.kind == "head" and key.vocab != (0, qw.N) else qw


def write_nbits(g: GraphBuilder, x: str, qw: QuantWeight, accuracy_level: int, out: str | None) -> str:
    """x (T, K) @ W as MatMulNBits (+ the block-sum term of a float minimum)."""
    b, scales, zp = qw.packed()
    ins = [x, g.const("B", b), g.const("scales", scales)]
    if zp is not None:
        ins.append(g.const("zp", zp))
    y = g.op("MatMulNBits", ins, out=out if qw.mins is None else None, domain=MS_DOMAIN, K=qw.K, N=qw.N,
             bits=qw.bits, block_size=qw.block, accuracy_level=accuracy_level)
    if qw.mins is None:
        return y
    if qw.K != qw.n_blocks * qw.block:
        raise ValueError("a float block minimum needs K to be a multiple of the block size")
    xb = g.op("Reshape", [x, g.const("blocks", np.array([0, qw.n_blocks, qw.block], np.int64))])
    sums = g.op("ReduceSum", [xb, g.const("axes", np.array([-1], np.int64))], keepdims=0)
    return g.op("Add", [y, g.op("MatMul", [sums, g.const("mins", qw.mins)])], out=out)


# ---- MatMulQ's records (the layout is described at the top of backends/kernels/_qmatmul.c) -----------------
QMATMUL_TILE = 16  # columns per record


def qmatmul_holds(qw: QuantWeight) -> bool:
    return qw.bits in (4, 8) and qw.block == 32 and qw.K % 32 == 0


def qmatmul_records(qw: QuantWeight) -> np.ndarray:
    """(ceil(N / 16), K / 32, 64 bits + 80 [+ 64 with mins]) uint8: per 16 columns and block, the
    columns' levels (4-bit: byte 64 i + 4 c + u = column c's q[4 i + u] | q[16 + 4 i + u] << 4;
    8-bit: q[4 i + u]), d (float32), z (uint8) and, if any, m (float32); columns past N are zero.
    Little-endian floats, as on x86-64 and aarch64."""
    if not qmatmul_holds(qw):
        raise ValueError("MatMulQ holds 4- or 8-bit weights in 32-blocks along K")
    N, nb, T = qw.N, qw.n_blocks, QMATMUL_TILE
    tiles, pad = -(-N // T), -N % T

    def per_tile(a: np.ndarray) -> np.ndarray:  # (N, nb, ...) -> (tiles, nb, 16 columns, ...) as bytes
        a = np.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        a = a.reshape(tiles, T, nb, -1).transpose(0, 2, 1, 3)
        return np.ascontiguousarray(a).view(np.uint8).reshape(tiles, nb, -1)

    if qw.bits == 4:
        lv = (qw.q[..., :16] | (qw.q[..., 16:] << 4)).astype(np.uint8).reshape(N, nb, 4, 4)  # (n, b, i, u)
    else:
        lv = qw.q.astype(np.uint8).reshape(N, nb, 8, 4)
    i = lv.shape[2]
    lv = np.pad(lv, ((0, pad), (0, 0), (0, 0), (0, 0))).reshape(tiles, T, nb, i, 4).transpose(0, 2, 3, 1, 4)
    parts = [np.ascontiguousarray(lv).reshape(tiles, nb, 64 * qw.bits),  # byte 64 i + 4 c + u
             per_tile(qw.scales.astype("<f4")[..., None]), per_tile(qw.zp[..., None])]
    if qw.mins is not None:
        parts.append(per_tile(np.ascontiguousarray(qw.mins.T).astype("<f4")[..., None]))
    return np.concatenate(parts, axis=-1)


def write_qmatmul(g: GraphBuilder, x: str, qw: QuantWeight, out: str | None, passes: int = 1) -> str:
    """x (T, K) @ W as one MatMulQ node; `passes` 2: the activations rounded in two int8 passes."""
    extra = {"passes": passes} if passes != 1 else {}
    return g.op(QMATMUL_OP, [x, g.const("qblocks", qmatmul_records(qw))], out=out, domain=OPS_DOMAIN, N=qw.N,
                K=qw.K, bits=qw.bits, mins=int(qw.mins is not None), **extra)


def summarize(report: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts of exact / re-quantized weights and their bytes, for the manifest and `model info`."""
    exact = [r for r in report if r["exact"]]
    req = [r for r in report if not r["exact"]]
    return {"exact": len(exact), "requantized": len(req),
            "requant": sorted({r["requant"] for r in req}),
            "rounded": {m: sum(r["rounded"] == m for r in req) for m in sorted({r["rounded"] for r in req})},
            "exact_origins": sorted({r["origin"] for r in exact}),
            "requantized_origins": sorted({r["origin"] for r in req}),
            "bytes": sum(r["bytes"] for r in report)}
